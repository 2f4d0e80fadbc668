"""`train-drafter --kind dflash2|dspark` (train/drafter_kinds.py), smoke-sized.

On the tiny random Qwen3.5 target of test_train_drafter: a DFlash 2 and a DSpark drafter are
trained on the target's greedy continuations; training lowers the loss and raises the
acceptance length; the checkpoints convert to GGUF with their kind's keys and tensors; the
engine's draft logits and greedy drafts (selector path, Markov chain) equal the trainable
module's; and speculative output, greedy and seeded-sampled, chain and tree, equals AR output.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dflash_native as dn  # noqa: E402
from dflash_native import _core  # noqa: E402
from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from dflash_native.convert_dflash import convert_dflash_to_gguf  # noqa: E402
from dflash_native.train.drafter import (IGNORE, DFlashDrafter, block_batch, greedy_continuations,  # noqa: E402
                                         target_features, train_drafter)
from dflash_native.train.drafter_kinds import selector_loss  # noqa: E402
from fixtures import hf_training_target  # noqa: E402
from reference.dflash_ref import target_taps  # noqa: E402

B = 8
TAPS = [0, 2]
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]
N_THREADS = 1
# heads sized for the tiny target (hidden 64): the selector's lattice needs hidden >= k (k + 1)
OVERRIDES = {"dflash2": {"dflash_config": {"conv_group_size": 16, "selector_rank": 16, "selector_top_k": 4}},
             "dspark": {"markov_rank": 16}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = hf_training_target(tmp_path_factory.mktemp("train-kinds"), seed=0, n_threads=N_THREADS)
    env["target_gguf"] = convert_hf_to_gguf(env["ckpt"], env["dir"] / "target.gguf", outtype="f32")
    rng = np.random.default_rng(1)
    env["prompts"] = [PROMPT] + [[int(x) for x in rng.integers(3, 500, 8)] for _ in range(5)]
    return env


@pytest.fixture(scope="module", params=["dflash2", "dspark"])
def trained(request, env):
    kind = request.param
    res = train_drafter(env["hf"], env["dir"] / kind, prompts=env["prompts"], max_new_tokens=40,
                        target_layer_ids=TAPS, block_size=B, mask_token_id=env["mask"], anchors_per_seq=8,
                        seqs_per_step=4, steps=80, lr=3e-3, warmup=10, gamma=4.0, seed=0, n_threads=N_THREADS,
                        kind=kind, drafter_overrides=OVERRIDES[kind])
    gguf = convert_dflash_to_gguf(res.checkpoint, env["dir"] / f"{kind}.gguf", outtype="f32",
                                  target_gguf=env["target_gguf"])
    return {"kind": kind, "res": res, "gguf": gguf}


def test_training_lowers_loss_and_raises_acceptance(trained):
    res = trained["res"]
    assert np.mean(res.losses[-10:]) < 0.6 * np.mean(res.losses[:5])
    assert res.acceptance_after > res.acceptance_before + 0.5
    recipe = json.loads(res.recipe.read_text())
    assert recipe["kind"] == trained["kind"]
    assert ("selector" if trained["kind"] == "dflash2" else "Markov") in recipe["objective"]


def test_checkpoint_and_gguf_carry_the_kind(trained):
    from gguf import GGUFReader
    from safetensors import safe_open

    ckpt = trained["res"].checkpoint
    cfg = json.loads((ckpt / "config.json").read_text())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    r = GGUFReader(trained["gguf"])
    tensors = {t.name for t in r.tensors}
    if trained["kind"] == "dflash2":
        assert cfg["architectures"] == ["DFlash2DraftModel"]
        assert {"layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
                "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"} <= names
        assert r.fields["dflash.selector_top_k"].contents() == 4
        assert {"selector_hidden.weight", "blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight"} <= tensors
        # the convolutions trained away from their identity start
        k = torch.as_tensor(np.array(r.get_tensor([t.name for t in r.tensors].index("blk.0.ffn_conv_proj.weight")).data))
        assert float(k.abs().max()) > 1e-3
    else:
        assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["sample_from_anchor"] is True
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                "confidence_head.proj.bias"} <= names
        assert r.fields["dflash.has_confidence_head"].contents() is True
        assert {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight"} <= tensors


def test_engine_drafts_what_the_module_drafts(env, trained):
    """The engine's draft logits (the Markov-chained ones for DSpark) equal the trained module's
    on the HF target's taps, and its greedy drafts (the selector's path, the Markov chain) are
    the module's."""
    t = _core.Target(str(env["target_gguf"]), n_ctx=128, kv_type="f32", max_verify=B, n_threads=N_THREADS)
    s = _core.Spec(t, str(trained["gguf"]), block_size=B)
    last = s.prefill(PROMPT)
    logits = _core.testing.draft_logits(s, last, B, t)
    drafts = list(s.draft(last, B))
    m = DFlashDrafter.from_pretrained(trained["res"].checkpoint, env["hf"]).eval()
    taps = target_taps(env["hf"], PROMPT, TAPS)
    with torch.no_grad():
        rows = m.block_hidden([last] + [m.mask_token_id] * (m.block_rows - 1), taps)[m.first_draft_row:]
        want, want_logits = m.block_drafts(rows, last)
        assert m.draft(last, taps) == want
    assert logits.shape == tuple(want_logits.shape)
    assert np.abs(logits - want_logits.numpy()).max() < 1e-3
    assert drafts == want


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_speculative_equals_ar(env, trained, verify):
    # no gate: the controller times AR against speculation, which the shared machine's load moves
    eng = dn.Engine(env["target_gguf"], drafter=trained["gguf"], block_size=B, n_ctx=256, kv_type="f32", gate=False,
                    n_threads=N_THREADS, verify=verify, **({"tree_budget": 12} if verify == "tree" else {}))
    ar = eng.generate(PROMPT, max_tokens=40, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=40)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens
    assert sp.stats.mean_acceptance_length > 1.5
    kw = dict(max_tokens=32, temperature=0.7, top_p=0.95, seed=3)
    assert eng.generate(PROMPT, **kw).tokens == eng.generate(PROMPT, speculative=False, **kw).tokens


@pytest.mark.parametrize("trained", ["dspark"], indirect=True)
def test_confidence_head_separates_accepted_rows(env, trained):
    """DSpark's trained confidence is higher on the rows whose top-1 is the sequence's token."""
    m = DFlashDrafter.from_pretrained(trained["res"].checkpoint, env["hf"]).eval()
    seq = greedy_continuations(env["hf"], [PROMPT], 40)[0]
    batch = block_batch([seq], [list(range(len(PROMPT), len(seq) - 2, 2))], B, m.mask_token_id, first_draft_row=0)
    f = target_features(env["hf"], seq, TAPS)[None]
    with torch.no_grad():
        h = m.hidden(f, batch["block_tokens"], batch["block_pos"], batch["mask"], batch["ctx_pos"])
        valid = batch["labels"] != IGNORE
        prev = batch["prev"][valid]
        logits = m.logits(h[valid], prev)
        conf = torch.sigmoid(m.confidence_head(h[valid], m.markov_head.bias(prev)[1]))
    hit = logits.argmax(-1) == batch["labels"][valid]
    assert 0 < int(hit.sum()) < len(hit)
    auc = float((conf[hit][:, None] > conf[~hit][None, :]).float().mean())  # P(an accepted row ranks above a miss)
    print(f"confidence AUC {auc:.3f}, mean {float(conf[hit].mean()):.3f} (hit) / {float(conf[~hit].mean()):.3f} (miss)")
    assert auc > 0.6  # 80 steps: a weak but real ranking (0.5: none)


def test_dspark_batch_is_anchor_first():
    """DSpark blocks: B-1 rows at a .. a+B-2, row i labelled x_{a+i+1} after prev x_{a+i}."""
    seq = list(range(100, 130))
    b = block_batch([seq], [[5]], 4, 99, first_draft_row=0)
    assert b["block_tokens"][0].tolist() == [105, 99, 99]
    assert b["block_pos"][0].tolist() == [5, 6, 7]
    assert b["labels"][0].tolist() == [106, 107, 108]
    assert b["prev"][0].tolist() == [105, 106, 107]
    d = block_batch([seq], [[5]], 4, 99)
    assert d["labels"][0].tolist()[1:] == [106, 107, 108] and d["prev"][0].tolist()[1:] == [105, 106, 107]


def test_selector_loss_trains_only_the_selector(env):
    """The selector's loss moves its codebooks and projection, not the backbone it reranks."""
    m = DFlashDrafter.for_target(env["hf"], target_layer_ids=TAPS, mask_token_id=env["mask"], block_size=B,
                                 kind="dflash2", init_std=0.1, **OVERRIDES["dflash2"])
    seq = [int(x) for x in np.random.default_rng(5).integers(3, 500, 30)]
    batch = block_batch([seq], [[3, 9, 15]], B, m.mask_token_id)
    h = m.hidden(target_features(env["hf"], seq, TAPS)[None], batch["block_tokens"], batch["block_pos"],
                 batch["mask"], batch["ctx_pos"])[0, 1:B]
    logits = m.logits(h)
    labels = logits.detach().topk(4, -1).indices[:, 2]  # every row's label is a candidate
    loss, share = selector_loss(m.candidate_selector, h, logits, labels, batch["prev"][0, 1:B], torch.ones(B - 1))
    assert share == 1.0 and loss.item() > 0
    loss.backward()
    assert float(m.candidate_selector.successor_codebook.grad.abs().sum()) > 0
    assert float(m.candidate_selector.hidden_projection.weight.grad.abs().sum()) > 0
    assert m.fc.weight.grad is None and m.layers[0].mlp_conv.kernel_projection.weight.grad is None


@pytest.mark.parametrize("kw, msg", [({"kind": "eagle"}, "kind must be one of"),
                                     ({"kind": "dspark", "draft_vocab_size": 16}, "whole vocabulary")])
def test_bad_kind_arguments(env, tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        train_drafter(env["hf"], tmp_path / "d", prompts=[PROMPT], max_new_tokens=8, target_layer_ids=TAPS,
                      block_size=B, mask_token_id=env["mask"], steps=1, **kw)


def test_cli_kind(env, tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    (data / "m.py").write_text("".join(f"def f{j}(x):\n    return x * {j}\n\n" for j in range(60)))
    from fixtures import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "target", "qwen3_5", seed=3)
    tg = convert_hf_to_gguf(ckpt, tmp_path / "t.gguf", outtype="f32")
    p = subprocess.run([sys.executable, "-m", "dflash_native", "train-drafter", "--target", str(ckpt), "--data",
                        str(data), "--out", str(tmp_path / "d"), "--gguf", str(tmp_path / "d.gguf"), "--target-gguf",
                        str(tg), "--outtype", "f32", "--block-size", "4", "--steps", "6", "--prompts", "3",
                        "--prompt-tokens", "12", "--max-new-tokens", "10", "--threads", "1", "--kind", "dspark"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and "draft_vocab" not in cfg
    eng = dn.Engine(tg, drafter=tmp_path / "d.gguf", n_ctx=128, kv_type="f32", n_threads=1)
    assert eng.generate([5, 6, 7, 8], max_tokens=12).tokens == eng.generate([5, 6, 7, 8], max_tokens=12,
                                                                           speculative=False).tokens
