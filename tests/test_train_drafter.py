"""DFlash drafter training (python/dflash_native/train/drafter.py), smoke-sized.

On a tiny random Qwen3.5 target: the trainable module equals the PyTorch
reference drafter (tests/reference/dflash_ref.py) for one block and for the
batched many-anchor training forward; training on the target's greedy
continuations lowers the loss and raises the acceptance length; the saved
checkpoint converts to GGUF, the engine's drafter logits equal the module's,
and speculative output with the trained pair equals AR output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dflash_native as dn  # noqa: E402
from dflash_native import _core  # noqa: E402
from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from dflash_native.convert_dflash import convert_dflash_to_gguf  # noqa: E402
from fixtures import hf_training_target  # noqa: E402
from dflash_native.train.drafter import (DFlashDrafter, _AnchorSampler, _Features, block_batch,  # noqa: E402
                                         context_window_mask, dflash_loss, draft_vocabulary, greedy_continuations,
                                         target_features, train_drafter)
from reference.dflash_ref import DFlashRef, target_taps  # noqa: E402

B = 8
TAPS = [0, 2]
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]
# The machine's cores are shared: one torch thread avoids oversubscription stalls.
N_THREADS = 1


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return hf_training_target(tmp_path_factory.mktemp("train-drafter"), seed=0, n_threads=N_THREADS)


@pytest.fixture(scope="module")
def trained(env):
    """The target's greedy continuations of 6 prompts (PROMPT among them), 120 training steps."""
    rng = np.random.default_rng(1)
    prompts = [PROMPT] + [[int(x) for x in rng.integers(3, 500, 8)] for _ in range(5)]
    res = train_drafter(env["hf"], env["dir"] / "drafter", prompts=prompts, max_new_tokens=40,
                        target_layer_ids=TAPS, num_layers=1, block_size=B, mask_token_id=env["mask"],
                        anchors_per_seq=8, seqs_per_step=4, steps=120, lr=3e-3, warmup=10, gamma=4.0, seed=0,
                        n_threads=N_THREADS, draft_vocab_size=64)
    tg = convert_hf_to_gguf(env["ckpt"], env["dir"] / "target.gguf", outtype="f32")
    dg = convert_dflash_to_gguf(res.checkpoint, env["dir"] / "drafter.gguf", outtype="f32", target_gguf=tg)
    return {"res": res, "target_gguf": tg, "drafter_gguf": dg, "prompts": prompts}


def _random_drafter(env, **kw):
    return DFlashDrafter.for_target(env["hf"], target_layer_ids=TAPS, mask_token_id=env["mask"], block_size=B,
                                    init_std=0.1, seed=3, **kw)


def test_forward_matches_reference(env):
    """One block: the module's logits equal DFlashRef's on the saved weights (2 layers, GQA)."""
    drafter = _random_drafter(env, num_layers=2)
    ckpt = drafter.save_pretrained(env["dir"] / "random-drafter")
    ref = DFlashRef.from_dirs(ckpt, env["ckpt"])
    feats = target_taps(env["hf"], PROMPT, TAPS)
    block = [PROMPT[-1]] + [env["mask"]] * (B - 1)
    with torch.no_grad():
        for start in (0, 5):
            got = drafter.draft_logits(block, feats, ctx_start_pos=start).numpy()
            want = ref.forward(block, feats, ctx_start_pos=start)
            assert np.abs(got - want).max() < 1e-4


def test_batched_anchors_match_per_anchor_reference(env):
    """The many-anchor training forward (context-prefix + block-diagonal mask, 2 sequences of
    different lengths, one padded with a dummy block) equals one DFlashRef call per anchor."""
    drafter = _random_drafter(env, num_layers=1)
    ref = DFlashRef.from_dirs(drafter.save_pretrained(env["dir"] / "random-drafter-1"), env["ckpt"])
    seqs = [PROMPT + [7, 9, 11, 13, 15, 17, 19], PROMPT[:9]]
    anchors = [[1, 4, 10, 15], [3, 7]]  # last blocks run past the sequence end: labels cut short
    feats = [target_features(env["hf"], s, TAPS) for s in seqs]
    batch = block_batch(seqs, anchors, B, env["mask"])
    L = max(len(s) for s in seqs)
    f = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, L - x.shape[0])) for x in feats])
    with torch.no_grad():
        logits = drafter.logits(drafter.hidden(f, batch["block_tokens"], batch["block_pos"], batch["mask"]))
    for s, (seq, anc) in enumerate(zip(seqs, anchors)):
        for j, a in enumerate(anc):
            want = ref.forward([seq[a]] + [env["mask"]] * (B - 1), feats[s][:a].numpy())
            assert np.abs(logits[s, j * B:(j + 1) * B].numpy() - want).max() < 1e-4
            lab = batch["labels"][s, j * B:(j + 1) * B].tolist()
            n = min(B - 1, len(seq) - 1 - a)
            assert lab == [-100] + seq[a + 1:a + 1 + n] + [-100] * (B - 1 - n)
    assert (batch["labels"][1, 2 * B:] == -100).all()
    loss, stats = dflash_loss(drafter, f, batch, gamma=4.0)
    assert torch.isfinite(loss) and stats["n_rows"] == int((batch["labels"] != -100).sum())


def test_greedy_continuations_are_the_targets_argmax(env):
    """The cached greedy loop (GDN recurrent state + KV cache) equals the argmax of one full forward."""
    seq = greedy_continuations(env["hf"], [PROMPT], 12)[0]
    assert seq[:len(PROMPT)] == PROMPT and len(seq) == len(PROMPT) + 12
    with torch.no_grad():
        logits = env["hf"](torch.tensor([seq])).logits[0]
    assert logits[len(PROMPT) - 1:-1].argmax(-1).tolist() == seq[len(PROMPT):]


def test_engine_continuations_match_torch_greedy(env, trained):
    """The pipeline's default data source (our engine on the F32 GGUF) continues prompts as the
    PyTorch target does greedily; a divergence may only come at a near-tie of PyTorch's logits."""
    from dflash_native.train.pipeline import engine_continuations
    from reference.lossless import first_divergence_is_near_tie

    rng = np.random.default_rng(7)
    prompts = [PROMPT] + [[int(x) for x in rng.integers(3, 500, 9)] for _ in range(3)]
    ours = engine_continuations(trained["target_gguf"], prompts, 24)  # default threads
    ref = greedy_continuations(env["hf"], prompts, 24)
    n_equal = 0
    for p, a, b in zip(prompts, ours, ref):
        assert a[:len(p)] == p and len(a) == len(p) + 24
        with torch.no_grad():
            logits = env["hf"](torch.tensor([b])).logits[0, len(p) - 1:-1].numpy()
        ok, why = first_divergence_is_near_tie(a[len(p):], b[len(p):], logits, tol=1e-3)
        assert ok, why
        n_equal += a == b
    assert n_equal >= 3  # f32 against f32: a near-tie is rare


def test_training_lowers_loss_and_raises_acceptance(trained):
    res = trained["res"]
    first, last = np.mean(res.losses[:10]), np.mean(res.losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f}; acceptance on training anchors {res.acceptance_before:.2f} -> "
          f"{res.acceptance_after:.2f}; {res.steps_per_s:.1f} steps/s, {res.anchors_per_s:.0f} anchors/s")
    assert last < 0.75 * first
    assert res.acceptance_after > res.acceptance_before + 0.5
    recipe = json.loads(res.recipe.read_text())
    assert recipe["target_layer_ids"] == TAPS and recipe["block_size"] == B and len(recipe["losses"]) == 120
    cfg = json.loads((res.checkpoint / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    # without context_length the drafter attended to everything before its anchor: at most the
    # longest sequence (prompt + 40 tokens) less the 2 positions no anchor takes
    longest = max(len(p) for p in trained["prompts"]) + 40
    assert cfg["dflash_config"] == {"mask_token_id": recipe["mask_token_id"], "target_layer_ids": TAPS,
                                    "block_size": B, "trained_context_length": longest - 2}
    assert recipe["trained_context_length"] == longest - 2 and recipe["context_length"] is None
    ids = cfg["draft_vocab"]
    assert recipe["n_draft_vocab"] == len(ids) and 1 < len(ids) <= 64 and ids == sorted(set(ids))


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    seqs = [[7, 7, 7, 2, 9], [9, 9, 5, 1], [4, 2]]  # counts: 7:3, 9:3, 2:2, then 1, 4, 5 once each
    assert draft_vocabulary(seqs, 3) == [2, 7, 9]
    assert draft_vocabulary(seqs, 4) == [1, 2, 7, 9]  # ties go to the smaller id
    assert draft_vocabulary(seqs, 100) == [1, 2, 4, 5, 7, 9]


def test_engine_drafter_logits_match_module(env, trained):
    """Engine draft logits (context = the prompt's taps from the GGUF target) equal the trained
    module's on the HF target's taps of the same prompt."""
    t = _core.Target(str(trained["target_gguf"]), n_ctx=128, kv_type="f32", max_verify=B, n_threads=N_THREADS)
    s = _core.Spec(t, str(trained["drafter_gguf"]), block_size=B)
    assert s.draft_vocab == json.loads((trained["res"].checkpoint / "config.json").read_text())["draft_vocab"]
    last = s.prefill(PROMPT)
    ours = _core.testing.draft_logits(s, last, B, t)
    drafter = DFlashDrafter.from_pretrained(trained["res"].checkpoint, env["hf"]).eval()
    with torch.no_grad():
        want = drafter.draft_logits([last] + [s.mask_token_id] * (B - 1), target_taps(env["hf"], PROMPT, TAPS))
    want = want[1:].numpy()
    assert ours.shape == want.shape
    diff = np.abs(ours - want).max()
    print(f"max |engine draft logits - module's| = {diff:.2e}")
    assert diff < 7e-5  # about 5x the measured 1.3e-5: F32 summation order (ggml vs torch) only


def test_engine_with_trained_drafter_is_lossless(trained):
    eng = dn.Engine(trained["target_gguf"], drafter=trained["drafter_gguf"], block_size=B, n_ctx=256,
                    kv_type="f32", n_threads=N_THREADS)
    ar = eng.generate(PROMPT, max_tokens=40, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=40)
    print(f"engine mean acceptance length with the trained drafter: {sp.stats.mean_acceptance_length:.2f} "
          f"(B = {B}, {sp.stats.rounds} rounds)")
    assert sp.stats.speculative and sp.stats.rounds > 0
    assert sp.tokens == ar.tokens
    assert sp.stats.mean_acceptance_length > 1.5


# ---------------------------------------------------------------------------
# long contexts: a drafter window, the same in training and in the engine
# ---------------------------------------------------------------------------

WINDOW = 6


def test_windowed_batch_matches_reference_on_the_window(env):
    """With a window W the training forward of a block at anchor a equals DFlashRef given only
    the W context positions before a, at their positions: the engine's ring window."""
    drafter = _random_drafter(env, num_layers=1)
    ref = DFlashRef.from_dirs(drafter.save_pretrained(env["dir"] / "random-drafter-w"), env["ckpt"])
    seq = PROMPT + [7, 9, 11, 13, 15, 17, 19, 21]
    anchors = [2, WINDOW, WINDOW + 1, 14]  # shorter than, equal to, longer than the window
    feats = target_features(env["hf"], seq, TAPS)
    batch = block_batch([seq], [anchors], B, env["mask"], window=WINDOW)
    n_ctx = batch["mask"].shape[-1] - len(anchors) * B
    assert batch["mask"][0, ::B, :n_ctx].sum(-1).tolist() == [min(a, WINDOW) for a in anchors]
    with torch.no_grad():
        logits = drafter.logits(drafter.hidden(feats[None], batch["block_tokens"], batch["block_pos"], batch["mask"]))
    for j, a in enumerate(anchors):
        lo = max(0, a - WINDOW)
        want = ref.forward([seq[a]] + [env["mask"]] * (B - 1), feats[lo:a].numpy(), ctx_start_pos=lo)
        assert np.abs(logits[0, j * B:(j + 1) * B].numpy() - want).max() < 1e-4


def test_anchor_sampler_spans_long_contexts():
    """Anchors of long sequences fall anywhere in their continuation: contexts shorter than the
    window, and (truncated to it) far longer, both occur; none before the prompt's end."""
    gen = torch.Generator().manual_seed(0)
    data = [list(range(300)), list(range(40))]
    sampler = _AnchorSampler(data, [20, 8], 16, gen)
    got = [a for _ in range(20) for a in sampler.sample(0)]
    assert min(got) >= 20 and max(got) <= 298
    assert any(a < 64 for a in got) and any(a > 250 for a in got)
    assert sampler.longest_context() == 298
    short = [a for _ in range(20) for a in sampler.sample(1)]
    assert min(short) >= 8 and max(short) <= 38


def test_text_prompts_spread_up_to_the_context_length(tmp_path):
    """--context-length: the pipeline's prompts have lengths spread over [prompt_tokens, N - new]."""
    from tokenizers import Tokenizer

    from dflash_native.train.pipeline import text_prompts
    from fixtures import make_tokenizer_files

    (tmp_path / "tok").mkdir()
    make_tokenizer_files(tmp_path / "tok")
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    text = tmp_path / "t.py"
    text.write_text("".join(f"def f{j}(x):\n    return x * {j} + 1\n\n" for j in range(400)))
    lens = [len(p) for p in text_prompts([("t", text)], tok, 40, 16, seed=0, max_prompt_tokens=200)]
    assert min(lens) >= 16 and max(lens) <= 200
    assert min(lens) < 60 and max(lens) > 150
    assert {len(p) for p in text_prompts([("t", text)], tok, 5, 16, seed=0)} == {16}


@pytest.fixture(scope="module")
def windowed(env, trained):
    """A short run with context_length=WINDOW on long sequences, converted against the same target."""
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(3, 500, 20)] for _ in range(3)]
    res = train_drafter(env["hf"], env["dir"] / "drafter-w", prompts=prompts, max_new_tokens=16,
                        target_layer_ids=TAPS, num_layers=1, block_size=B, mask_token_id=env["mask"],
                        anchors_per_seq=4, seqs_per_step=2, steps=4, seed=0, n_threads=N_THREADS,
                        context_length=WINDOW)
    dg = convert_dflash_to_gguf(res.checkpoint, env["dir"] / "drafter-w.gguf", outtype="f32",
                                target_gguf=trained["target_gguf"])
    return {"res": res, "drafter_gguf": dg}


def test_context_length_travels_to_the_engine(env, trained, windowed):
    """config.json -> GGUF -> engine: the recorded window is the engine's default, and the
    engine's draft over a longer prompt equals the module's on the window's taps."""
    cfg = json.loads((windowed["res"].checkpoint / "config.json").read_text())
    assert cfg["dflash_config"]["trained_context_length"] == WINDOW
    t = _core.Target(str(trained["target_gguf"]), n_ctx=128, kv_type="f32", max_verify=B, n_threads=N_THREADS)
    s = _core.Spec(t, str(windowed["drafter_gguf"]), block_size=B)
    assert s.trained_context_length == WINDOW and s.window == WINDOW
    last = s.prefill(PROMPT)  # 11 positions > WINDOW
    ours = _core.testing.draft_logits(s, last, B, t)
    drafter = DFlashDrafter.from_pretrained(windowed["res"].checkpoint, env["hf"]).eval()
    lo = len(PROMPT) - WINDOW
    with torch.no_grad():
        want = drafter.draft_logits([last] + [s.mask_token_id] * (B - 1),
                                    target_taps(env["hf"], PROMPT, TAPS)[lo:], ctx_start_pos=lo)[1:].numpy()
    diff = np.abs(ours - want).max()
    print(f"max |engine draft logits - module's on the window| = {diff:.2e}")
    assert diff < 1.2e-5  # about 5x the measured 2.4e-6: F32 summation order only


def test_train_drafter_rejects_a_bad_context_length(env):
    for bad in (0, -3, 1 << 21, 2.5, True):
        with pytest.raises(ValueError, match="context_length"):
            train_drafter(env["hf"], env["dir"] / "bad", prompts=[PROMPT], max_new_tokens=4, target_layer_ids=TAPS,
                          mask_token_id=env["mask"], steps=1, context_length=bad)


# context length N != window W: anchors spread over long sequences, blocks see the last W positions
# ---------------------------------------------------------------------------

def test_window_mask_semantics():
    """p is visible to anchor a iff a - W <= p < a, whatever positions the features start at."""
    anchors = torch.tensor([[0, 3, 10, 40]])
    full = context_window_mask(anchors, 48, 6)[0]
    for j, a in enumerate(anchors[0].tolist()):
        assert full[j].nonzero().flatten().tolist() == list(range(max(0, a - 6), a))
    assert context_window_mask(anchors, 48, None)[0].sum(-1).tolist() == [0, 3, 10, 40]
    shifted = context_window_mask(anchors, torch.arange(30, 48)[None], 6)[0]  # positions 30..47 only
    assert torch.equal(shifted, full[:, 30:])


def test_cropped_context_batch_equals_the_full_one(env):
    """A batch whose features start at ctx_start (what training keeps of a long sequence) gives
    the logits of the batch over the whole sequence, and refuses a start some anchor's window
    reaches before."""
    drafter = _random_drafter(env, num_layers=1)
    seq = PROMPT + [7, 9, 11, 13, 15, 17, 19, 21, 23, 25]
    anchors = [[12, 14, 18]]
    feats = target_features(env["hf"], seq, TAPS)
    full = block_batch([seq], anchors, B, env["mask"], window=WINDOW)
    crop = block_batch([seq], anchors, B, env["mask"], window=WINDOW, ctx_start=[12 - WINDOW])
    assert crop["ctx_pos"][0].tolist() == list(range(12 - WINDOW, len(seq)))
    assert torch.equal(crop["mask"][..., :crop["ctx_pos"].shape[1]], full["mask"][..., 12 - WINDOW:len(seq)])
    with torch.no_grad():
        want = drafter.hidden(feats[None], full["block_tokens"], full["block_pos"], full["mask"], full["ctx_pos"])
        got = drafter.hidden(feats[None, 12 - WINDOW:], crop["block_tokens"], crop["block_pos"], crop["mask"],
                             crop["ctx_pos"])
    assert (got - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="ctx_start"):
        block_batch([seq], anchors, B, env["mask"], window=WINDOW, ctx_start=[12 - WINDOW + 1])
    with pytest.raises(ValueError, match="ctx_start"):
        block_batch([seq], anchors, B, env["mask"], ctx_start=[1])  # no window: every anchor sees position 0


def test_features_keep_only_what_windows_reach(env):
    """Taps of a sequence whose anchors start at m are kept from m - W on (all of them without W)."""
    seqs = [PROMPT + list(range(20, 40)), PROMPT[:6] + [3, 4, 5, 6]]
    feats = _Features.of(env["hf"], seqs, [len(PROMPT), 6], TAPS, WINDOW)
    assert feats.offsets == [len(PROMPT) - WINDOW, 0]
    assert [f.shape[0] for f in feats.rows] == [len(seqs[0]) - len(PROMPT) + WINDOW, len(seqs[1])]
    full = target_features(env["hf"], seqs[0], TAPS)
    start = len(PROMPT) - 2
    got = feats.window(0, start, 30)  # the sequence's rows from start on, then zeros to 30 rows
    n = len(seqs[0]) - start
    assert got.shape[0] == 30 and torch.equal(got[:n], full[start:]) and not got[n:].any()
    with pytest.raises(ValueError, match="start at"):
        feats.window(0, len(PROMPT) - WINDOW - 1, 4)
    assert _Features.of(env["hf"], seqs, [len(PROMPT), 6], TAPS, None).offsets == [0, 0]


def test_window_shorter_than_the_context_length_is_recorded(env, trained):
    """context_length N spans the sequences, window W is what blocks see and what the checkpoint
    records as the engine's default window; the recipe keeps both."""
    rng = np.random.default_rng(4)
    prompts = [[int(x) for x in rng.integers(3, 500, 20)] for _ in range(3)]
    res = train_drafter(env["hf"], env["dir"] / "drafter-nw", prompts=prompts, max_new_tokens=16,
                        target_layer_ids=TAPS, num_layers=1, block_size=B, mask_token_id=env["mask"],
                        anchors_per_seq=4, seqs_per_step=2, steps=3, seed=0, n_threads=N_THREADS,
                        context_length=64, window=WINDOW)
    cfg = json.loads((res.checkpoint / "config.json").read_text())
    recipe = json.loads(res.recipe.read_text())
    assert cfg["dflash_config"]["trained_context_length"] == WINDOW
    assert (recipe["context_length"], recipe["window"], recipe["trained_context_length"]) == (64, WINDOW, WINDOW)
    dg = convert_dflash_to_gguf(res.checkpoint, env["dir"] / "drafter-nw.gguf", outtype="f32",
                                target_gguf=trained["target_gguf"])
    from gguf import GGUFReader

    assert GGUFReader(dg).fields["dflash.trained_context_length"].contents() == WINDOW


@pytest.mark.parametrize("kw, msg", [({"window": 0}, "window must be"), ({"window": 2.5}, "window must be"),
                                     ({"window": True}, "window must be"),
                                     ({"context_length": 8, "window": 9}, "longer than context_length")])
def test_train_drafter_rejects_a_bad_window(env, kw, msg):
    with pytest.raises(ValueError, match=msg):
        train_drafter(env["hf"], env["dir"] / "bad-w", prompts=[PROMPT], max_new_tokens=4, target_layer_ids=TAPS,
                      mask_token_id=env["mask"], steps=1, **kw)
    assert not (env["dir"] / "bad-w").exists()


def test_prompt_mix_keeps_a_short_share(tmp_path):
    """--long-share: that share of the prompts spread up to N - new tokens, the rest short, and the
    short ones are the prompts the same seed draws without N."""
    from tokenizers import Tokenizer

    from dflash_native.train.pipeline import _prompt_mix
    from fixtures import make_tokenizer_files

    (tmp_path / "tok").mkdir()
    make_tokenizer_files(tmp_path / "tok")
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    text = tmp_path / "t.py"
    text.write_text("".join(f"def f{j}(x):\n    return x * {j} + 1\n\n" for j in range(400)))
    files = [("t", text)]
    mix = _prompt_mix(files, tok, 12, 16, 8, 208, 0.25, seed=0)
    short, long = mix[:9], mix[9:]
    assert {len(p) for p in short} == {16} and len(long) == 3
    assert all(16 <= len(p) <= 200 for p in long) and max(len(p) for p in long) > 16
    assert short == _prompt_mix(files, tok, 9, 16, 8, None, None, seed=0)
