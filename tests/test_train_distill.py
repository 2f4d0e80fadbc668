"""Drafter distillation (issue 15's speed goal): the KL term of train/drafter.py, sampled and
constrained (JSON grammar, issue 37) continuations (train/pipeline.py), the GGUF -> PyTorch readers (train/from_gguf.py) and a
fine-tune from a drafter GGUF through the pipeline, on tiny random Qwen3.5 targets."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dflash_native as dn  # noqa: E402
from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from dflash_native.convert_dflash import convert_dflash_to_gguf  # noqa: E402
from dflash_native.train import pipeline  # noqa: E402
from dflash_native.train.drafter import (IGNORE, DFlashDrafter, _Features, _target_hidden, block_batch,  # noqa: E402
                                         distill_kl, dflash_loss, greedy_continuations, position_weights,
                                         train_drafter)
from dflash_native.train.from_gguf import drafter_checkpoint_from_gguf, target_checkpoint_from_gguf  # noqa: E402
from fixtures import hf_training_target  # noqa: E402

B = 4
TAPS = [0, 2]
N_THREADS = 1


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = hf_training_target(tmp_path_factory.mktemp("distill"), seed=5, n_threads=N_THREADS)
    return e | {"target_gguf": convert_hf_to_gguf(e["ckpt"], e["dir"] / "target.gguf", outtype="f32")}


# ---------------------------------------------------------------------------
# the KL term
# ---------------------------------------------------------------------------

def test_kl_equals_a_hand_computation():
    t = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    d = torch.tensor([[0.5, 2.5, 0.0, 0.0], [1.0, -1.0, 2.0, 2.0]])

    def kl(a, b):
        p = np.exp(a) / np.exp(a).sum()
        q = np.exp(b) / np.exp(b).sum()
        return float((p * np.log(p / q)).sum())

    got = distill_kl(t, d).numpy()
    want = [kl(t[i].double().numpy(), d[i].double().numpy()) for i in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # restricted to a vocabulary: both distributions renormalised over those ids only
    vocab = torch.tensor([0, 2, 3])
    got = distill_kl(t, d, vocab).numpy()
    want = [kl(t[i, [0, 2, 3]].double().numpy(), d[i, [0, 2, 3]].double().numpy()) for i in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert (distill_kl(t, d) > 0).all()


def test_kl_is_zero_for_logits_equal_up_to_a_constant():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5, 50, generator=g) * 3
    shift = torch.randn(5, 1, generator=g) * 10
    assert distill_kl(t, t + shift).abs().max() < 1e-5
    assert distill_kl(t, t + shift, torch.tensor([1, 7, 9, 30])).abs().max() < 1e-5
    assert distill_kl(t, t + 0.5 * torch.randn(5, 50, generator=g)).min() > 1e-4


def _batch(env, seqs, anchors):
    return block_batch(seqs, anchors, B, env["mask"])


def test_loss_combines_ce_and_kl_with_the_position_weights(env):
    """dflash_loss = sum_rows w_i (w_ce CE + w_kl KL) / sum w_i; with the drafter's own final
    hidden states as the 'target' the KL is 0 and the loss is w_ce * the CE-only loss."""
    drafter = DFlashDrafter.for_target(env["hf"], target_layer_ids=TAPS, mask_token_id=env["mask"], block_size=B,
                                       init_std=0.1, seed=1)
    rng = np.random.default_rng(0)
    seqs = [[int(x) for x in rng.integers(3, 400, 14)] for _ in range(2)]
    feats = torch.stack([torch.randn(14, 2 * drafter.hidden_size, generator=torch.Generator().manual_seed(i))
                         for i in range(2)])
    batch = _batch(env, seqs, [[2, 6], [3, 11]])
    valid = batch["labels"] != IGNORE
    with torch.no_grad():
        rows = drafter.hidden(feats, batch["block_tokens"], batch["block_pos"], batch["mask"], batch["ctx_pos"])[valid]
        ce_only, st = dflash_loss(drafter, feats, batch, 3.0)
        same, st_same = dflash_loss(drafter, feats, batch, 3.0, target_hidden=rows, w_ce=0.5, w_kl=2.0)
    assert st_same["kl"] < 1e-5 and float(same) == pytest.approx(0.5 * float(ce_only), rel=1e-5)

    other = torch.randn(rows.shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        mixed, _ = dflash_loss(drafter, feats, batch, 3.0, target_hidden=other, w_ce=0.5, w_kl=2.0)
        logits = drafter.logits(rows)
        ce = torch.nn.functional.cross_entropy(logits, batch["labels"][valid], reduction="none")
        kl = distill_kl(other @ drafter.lm_head.T, logits)
    w = position_weights(B, 3.0).repeat(batch["labels"].shape[1] // B)[None].expand_as(valid)[valid]
    assert float(mixed) == pytest.approx(float((w * (0.5 * ce + 2.0 * kl)).sum() / w.sum()), rel=1e-5)
    with pytest.raises(ValueError, match="target_hidden"):
        dflash_loss(drafter, feats, batch, 3.0, w_kl=1.0)


def test_soft_labels_line_up_with_the_hard_labels(env):
    """The target's final hidden state that _target_hidden picks for a labelled row gives logits
    whose argmax is that row's label, on the target's own greedy continuations."""
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, 400, 6)] for _ in range(2)]
    seqs = greedy_continuations(env["hf"], prompts, 10)
    feats = _Features.of(env["hf"], seqs, [6, 6], TAPS, window=4, final=True)
    anchors = [[6, 9], [7, 12]]
    batch = block_batch(seqs, anchors, B, env["mask"], 4, [2, 3])
    hid = _target_hidden(feats, [0, 1], batch)
    head = env["hf"].get_output_embeddings().weight.detach()
    valid = batch["labels"] != IGNORE
    assert hid.shape[0] == int(valid.sum())
    assert (hid @ head.T).argmax(-1).tolist() == batch["labels"][valid].tolist()


# ---------------------------------------------------------------------------
# sampled continuations
# ---------------------------------------------------------------------------

def test_sampling_plan_spreads_the_sampled_share():
    plan = pipeline.sampling_plan(8, 0.5, [0.7, 1.0], 0.9, seed=2)
    assert [p is None for p in plan] == [True, False] * 4
    assert [p["temperature"] for p in plan if p] == [0.7, 1.0, 0.7, 1.0]
    assert len({p["seed"] for p in plan if p}) == 4 and all(p["top_p"] == 0.9 for p in plan if p)
    assert pipeline.sampling_plan(5, 0.0, []) == [None] * 5
    assert all(pipeline.sampling_plan(3, 1.0, [1.0]))
    for bad, msg in (((3, 1.5, [1.0]), "sampled_share"), ((3, 0.5, [0.0]), "sample_temperatures"),
                     ((3, 0.5, []), "sample_temperatures")):
        with pytest.raises(ValueError, match=msg):
            pipeline.sampling_plan(*bad)
    with pytest.raises(ValueError, match="sample_top_p"):
        pipeline.sampling_plan(3, 0.5, [1.0], 0.0)


def test_sampled_continuations_are_reproducible_and_not_greedy(env):
    rng = np.random.default_rng(4)
    prompts = [[int(x) for x in rng.integers(3, 400, 7)] for _ in range(4)]
    plan = pipeline.sampling_plan(4, 1.0, [0.7, 1.0], 0.95, seed=0)
    a = pipeline.engine_continuations(env["target_gguf"], prompts, 16, n_threads=N_THREADS, sampling=plan)
    b = pipeline.engine_continuations(env["target_gguf"], prompts, 16, n_threads=N_THREADS, sampling=plan)
    greedy = pipeline.engine_continuations(env["target_gguf"], prompts, 16, n_threads=N_THREADS)
    other = pipeline.engine_continuations(env["target_gguf"], prompts, 16, n_threads=N_THREADS,
                                          sampling=pipeline.sampling_plan(4, 1.0, [0.7, 1.0], 0.95, seed=1))
    assert a == b
    assert all(s[:len(p)] == p and len(s) == len(p) + 16 for s, p in zip(a, prompts))
    assert sum(x != g for x, g in zip(a, greedy)) >= 3
    assert sum(x != o for x, o in zip(a, other)) >= 3


def test_continuations_file_is_reused_and_continued(env, tmp_path):
    """A file of the same prompts and plan is read (a partial one continued); another plan is
    generated afresh."""
    rng = np.random.default_rng(6)
    prompts = [[int(x) for x in rng.integers(3, 400, 5)] for _ in range(4)]
    plan = pipeline.sampling_plan(4, 0.5, [1.0])
    f = tmp_path / "c.json"
    full = pipeline._cached_continuations(f, env["target_gguf"], prompts, 8, plan, N_THREADS, 0, save_every=2)
    saved = json.loads(f.read_text())
    assert saved["sequences"] == full and saved["plan"] == plan
    marked = full[0][:-1] + [0 if full[0][-1] else 1]  # a stopped run's first continuation, marked
    saved["sequences"] = [marked, full[1]]
    f.write_text(json.dumps(saved))
    again = pipeline._cached_continuations(f, env["target_gguf"], prompts, 8, plan, N_THREADS, 0, save_every=2)
    assert again == [marked] + full[1:]
    # another plan: the entries it shares (prompt and plan entry, greedy 0 and 2) are read, the rest generated
    greedy = pipeline._cached_continuations(f, env["target_gguf"], prompts, 8, [None] * 4, N_THREADS, 0)
    fresh = pipeline.engine_continuations(env["target_gguf"], prompts, 8, n_threads=N_THREADS)
    assert greedy == [marked] + fresh[1:] and fresh[2] == full[2] and fresh[1] != full[1]
    assert json.loads(f.read_text())["plan"] == [None] * 4
    # another max_new_tokens: nothing is read
    assert pipeline._cached_continuations(f, env["target_gguf"], prompts, 6, [None] * 4, N_THREADS, 0)[0] == \
        fresh[0][:len(prompts[0]) + 6]


# ---------------------------------------------------------------------------
# constrained continuations
# ---------------------------------------------------------------------------

def test_constraint_plan_spreads_the_constrained_share(tmp_path):
    base = pipeline.sampling_plan(8, 0.25, [1.0])
    plan = pipeline.constraint_plan(base, 0.5, "json")
    assert [bool(p and p.get("constraint")) for p in plan] == [False, True] * 4
    assert all(p["constraint"] == {"type": "json_object"} for p in plan if p and "constraint" in p)
    assert [p and p.get("temperature") for p in plan] == [p and p.get("temperature") for p in base]  # kept
    assert plan[3]["temperature"] == 1.0 and plan[3]["constraint"]  # a sampled one constrained too
    a = pipeline.constraint_plan([None] * 6, 1.0, "schemas", seed=3)
    assert a == pipeline.constraint_plan([None] * 6, 1.0, "schemas", seed=3)  # reproducible
    assert a != pipeline.constraint_plan([None] * 6, 1.0, "schemas", seed=4)
    schemas = [p["constraint"]["schema"] for p in a]
    assert all(p["constraint"]["type"] == "json_schema" for p in a) and len({json.dumps(x) for x in schemas}) == 6
    assert all(s["type"] == "object" and s["required"] == list(s["properties"]) for s in schemas)
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}))
    assert pipeline.constraint_plan([None] * 2, 1.0, str(f))[1]["constraint"]["schema"]["required"] == ["a"]
    assert pipeline.constraint_plan([None] * 3, 0.0, "nonsense") == [None] * 3  # no share: nothing to check
    for share, c, msg in ((1.5, "json", "constrained_share"), (0.5, "yaml", "json, schemas or a JSON schema file"),
                          (0.5, str(tmp_path / "missing.json"), "neither")):
        with pytest.raises(ValueError, match=msg):
            pipeline.constraint_plan([None] * 4, share, c)
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        pipeline.constraint_plan([None] * 4, 0.5, str(f))


def _grammar_check(target_gguf, prompts, seqs, plan, max_new):
    """Each constrained continuation: its tokens are accepted one by one by the grammar (a JSON
    prefix under its schema) and its text starts an object; one that ended before `max_new` tokens
    (the grammar complete: the engine stopped at end-of-generation, which it does not return)
    parses as JSON with the schema's required keys, and the grammar accepts the end-of-generation
    token there. Returns how many ended."""
    from dflash_native._tokenizer import Tokenizer
    from dflash_native.constraint import GrammarEngine

    tok = Tokenizer(target_gguf)
    ge = GrammarEngine(tok, tok.n_vocab)
    ended = 0
    for p, s, e in zip(prompts, seqs, plan):
        new = s[len(p):]
        m = ge.matcher(pipeline._constraint_of(e["constraint"]))
        assert all(m.accept(t) for t in new)
        text = tok.detokenize(new)
        assert text.startswith("{")
        assert not any(tok.is_eog(t) for t in new) and len(new) <= max_new
        if len(new) < max_new:
            ended += 1
            assert not m.terminated() and m.accept(tok.eos_token_id) and m.terminated()
            value = json.loads(text)
            schema = e["constraint"].get("schema")
            assert isinstance(value, dict) and (schema is None or set(value) == set(schema["required"]))
    return ended


def test_constrained_continuations_are_under_the_grammar(env, tmp_path):
    """Continuations under "json", "schemas" and a schema file: every token is the grammar's, a
    finished one parses as JSON; the unconstrained entries are the greedy continuations."""
    rng = np.random.default_rng(8)
    prompts = [[int(x) for x in rng.integers(3, 400, 6)] for _ in range(6)]
    greedy = pipeline.engine_continuations(env["target_gguf"], prompts, 24, n_threads=N_THREADS)
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    ended = 0
    for constraint in ("json", "schemas", str(f)):
        plan = pipeline.constraint_plan([None] * 6, 0.5, constraint, seed=1)
        seqs = pipeline.engine_continuations(env["target_gguf"], prompts, 24, n_threads=N_THREADS, sampling=plan)
        assert [s for s, e in zip(seqs, plan) if e is None] == [g for g, e in zip(greedy, plan) if e is None]
        on = [i for i, e in enumerate(plan) if e]
        assert len(on) == 3 and all(seqs[i] != greedy[i] for i in on)  # the random target alone writes no JSON
        ended += _grammar_check(env["target_gguf"], [prompts[i] for i in on], [seqs[i] for i in on],
                                [plan[i] for i in on], 24)
    assert ended >= 3  # the one-key schema's continuations end


def test_chat_prompts_ask_for_json(env, tmp_path):
    """constrained_prompts='chat': the constrained prompts become chat requests rendered with the
    GGUF's template; the others stay; a GGUF without a template is refused."""
    import shutil

    def gguf(name, template):
        ckpt = tmp_path / name
        shutil.copytree(env["ckpt"], ckpt)
        cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
        if template:
            (ckpt / "chat_template.jinja").write_text(template)
        return convert_hf_to_gguf(ckpt, tmp_path / f"{name}.gguf", outtype="f32")

    tg = gguf("chat", "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    prompts = [[10, 11, 12, 13], [20, 21, 22, 23]]
    plan = pipeline.constraint_plan([None] * 2, 0.5, "json")
    out = pipeline.as_chat_prompts(prompts, plan, tg)
    from dflash_native._tokenizer import Tokenizer

    tok = Tokenizer(tg)
    assert out[0] == prompts[0]
    text = tok.detokenize(out[1])
    assert text == (f"<|im_start|>user\n{tok.detokenize(prompts[1])}\n\nReply with one JSON object.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    seqs = pipeline.engine_continuations(tg, out, 12, n_threads=N_THREADS, sampling=plan)
    _grammar_check(tg, out[1:], seqs[1:], plan[1:], 12)
    with pytest.raises(ValueError, match="needs a chat template"):
        pipeline.as_chat_prompts(prompts, plan, gguf("plain", None))


def test_constrained_share_through_the_pipeline(env, tmp_path):
    """pipeline.run with a constrained share: the recipe counts the constrained continuations, the
    continuations file holds them under the grammar, and the drafter trained on them serves
    constrained speculative output equal to constrained AR output."""
    data = tmp_path / "text"
    data.mkdir()
    (data / "m.py").write_text("".join(f"def f{j}(x):\n    return x * {j}\n\n" for j in range(60)))
    recipe = pipeline.run(env["ckpt"], data, tmp_path / "d", n_prompts=4, prompt_tokens=10, max_new_tokens=16,
                          target_gguf=env["target_gguf"], out_gguf=tmp_path / "d.gguf", outtype="f32", steps=4,
                          constrained_share=0.5, constraint="schemas", continuations_file=tmp_path / "c.json",
                          target_layer_ids=TAPS, block_size=B, n_threads=N_THREADS, engine_threads=N_THREADS, seed=0)
    assert recipe["n_constrained"] == 2 and recipe["constraint"] == "schemas" and recipe["n_sampled"] == 0
    assert 0 < recipe["n_constrained_tokens"] <= 2 * 16
    saved = json.loads((tmp_path / "c.json").read_text())
    on = [i for i, e in enumerate(saved["plan"]) if e]
    assert on == [1, 3]
    _grammar_check(env["target_gguf"], [saved["prompts"][i] for i in on], [saved["sequences"][i] for i in on],
                   [saved["plan"][i] for i in on], 16)
    eng = dn.Engine(env["target_gguf"], drafter=tmp_path / "d.gguf", n_ctx=128, kv_type="f32", n_threads=2)
    c = dn.JsonSchema(saved["plan"][1]["constraint"]["schema"])
    prompt = saved["prompts"][0]
    assert eng.generate(prompt, max_tokens=16, constraint=c).tokens == \
        eng.generate(prompt, max_tokens=16, constraint=c, speculative=False).tokens


def test_constrained_extra_adds_to_the_set_and_keeps_its_cache(env, tmp_path):
    """pipeline.run with constrained_extra: the set's prompts, plan and cached continuations stay
    (a marked cached continuation is read back, not generated again), that many other prompts follow
    it, each continued under its random schema, the drafter trains on all of them and serves
    constrained speculative output equal to constrained AR output."""
    data = tmp_path / "text"
    data.mkdir()
    (data / "m.py").write_text("".join(f"def f{j}(x):\n    return x * {j} - {j % 7}\n\n" for j in range(80)))
    f = tmp_path / "c.json"
    kw = dict(n_prompts=4, prompt_tokens=10, max_new_tokens=16, target_gguf=env["target_gguf"], outtype="f32",
              steps=2, continuations_file=f, target_layer_ids=TAPS, block_size=B, n_threads=N_THREADS,
              engine_threads=N_THREADS, seed=0)
    pipeline.run(env["ckpt"], data, tmp_path / "d0", **kw)
    base = json.loads(f.read_text())
    assert base["plan"] == [None] * 4
    marked = base["sequences"][0][:-1] + [0 if base["sequences"][0][-1] else 1]
    f.write_text(json.dumps({**base, "sequences": [marked] + base["sequences"][1:]}))
    recipe = pipeline.run(env["ckpt"], data, tmp_path / "d", out_gguf=tmp_path / "d.gguf", constrained_extra=3,
                          constraint="schemas", **kw)
    assert recipe["n_prompts"] == 4 and recipe["constrained_extra"] == 3 and recipe["n_constrained"] == 3
    assert recipe["constrained_share"] == 0.0 and recipe["n_sequences"] == 7
    saved = json.loads(f.read_text())
    assert saved["prompts"][:4] == base["prompts"] and saved["plan"][:4] == [None] * 4
    assert saved["sequences"][:4] == [marked] + base["sequences"][1:]  # read from the cache
    assert saved["plan"][4:] == pipeline.constraint_plan([None] * 3, 1.0, "schemas", seed=1)
    extra = saved["prompts"][4:]
    assert len(extra) == 3 and all(len(p) == 10 and p not in base["prompts"] for p in extra)
    assert 0 < recipe["n_constrained_tokens"] <= 3 * 16
    _grammar_check(env["target_gguf"], extra, saved["sequences"][4:], saved["plan"][4:], 16)
    eng = dn.Engine(env["target_gguf"], drafter=tmp_path / "d.gguf", n_ctx=128, kv_type="f32", n_threads=2)
    c = dn.JsonSchema(saved["plan"][4]["constraint"]["schema"])
    prompt = saved["prompts"][1]
    assert eng.generate(prompt, max_tokens=16, constraint=c).tokens == \
        eng.generate(prompt, max_tokens=16, constraint=c, speculative=False).tokens
    for bad, msg in ((dict(constrained_extra=-1), "constrained_extra must be an integer >= 0"),
                     (dict(constrained_extra=2.0), "constrained_extra must be an integer >= 0"),
                     (dict(constrained_extra=2, target_gguf=None), "constrained_extra > 0\\) need")):
        with pytest.raises(ValueError, match=msg):
            pipeline.run(env["ckpt"], data, tmp_path / "bad", **{**kw, **bad})
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------
# GGUF -> PyTorch
# ---------------------------------------------------------------------------

def _tensors(path):
    from gguf import GGUFReader

    return {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_drafter_gguf_round_trip(env, tmp_path, outtype):
    """drafter GGUF -> checkpoint -> GGUF: the same tensors, bit for bit, and the same dflash keys."""
    from gguf import GGUFReader

    drafter = DFlashDrafter.for_target(env["hf"], target_layer_ids=TAPS, mask_token_id=env["mask"], block_size=B,
                                       init_std=0.1, seed=2)
    drafter.config["draft_vocab"] = [3, 5, 8, 13]
    drafter.config["dflash_config"]["trained_context_length"] = 77
    first = convert_dflash_to_gguf(drafter.save_pretrained(tmp_path / "a"), tmp_path / "a.gguf", outtype=outtype,
                                   target_gguf=env["target_gguf"])
    back = drafter_checkpoint_from_gguf(first, tmp_path / "b")
    second = convert_dflash_to_gguf(back, tmp_path / "b.gguf", outtype=outtype, target_gguf=env["target_gguf"])
    assert _tensors(first) == _tensors(second)
    r1, r2 = GGUFReader(str(first)), GGUFReader(str(second))
    for key in ("dflash.target_layers", "dflash.block_size", "dflash.draft_vocab", "dflash.trained_context_length",
                "tokenizer.ggml.mask_token_id", "dflash.rope.freq_base", "dflash.attention.layer_norm_rms_epsilon"):
        assert r1.fields[key].contents() == r2.fields[key].contents(), key
    # and the module loads it: the same weights (F32) as the one written
    loaded = DFlashDrafter.from_pretrained(back, env["hf"])
    if outtype == "f32":
        for (k, v), (k2, v2) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
            assert k == k2 and torch.equal(v, v2), k


def test_drafter_reader_refuses_a_target_file(env, tmp_path):
    with pytest.raises(ValueError, match="not a 'dflash' drafter"):
        drafter_checkpoint_from_gguf(env["target_gguf"], tmp_path / "x")
    with pytest.raises(ValueError, match="does not exist"):
        drafter_checkpoint_from_gguf(tmp_path / "missing.gguf", tmp_path / "x")


def test_target_gguf_round_trip(env, tmp_path):
    """qwen35 target GGUF -> HF checkpoint -> GGUF: the same tensors bit for bit, and the
    re-created model's logits are the original's."""
    from tokenizers import Tokenizer  # noqa: F401  (the tokenizer files travel with the checkpoint)

    back = target_checkpoint_from_gguf(env["target_gguf"], tmp_path / "t", tokenizer_dir=env["ckpt"])
    assert (back / "tokenizer.json").is_file()
    again = convert_hf_to_gguf(back, tmp_path / "t.gguf", outtype="f32")
    a, b = _tensors(env["target_gguf"]), _tensors(again)
    assert a.keys() == b.keys()
    for name in a:  # a file today's converter wrote: ssm_a too maps back exactly (from_gguf._a_log)
        assert a[name] == b[name], name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.tensor([[5, 9, 11, 30, 2, 7, 100, 3]])
    with torch.no_grad():
        np.testing.assert_allclose(hf(ids).logits.numpy(), env["hf"](ids).logits.numpy(), atol=1e-4)


# ---------------------------------------------------------------------------
# a fine-tune through the pipeline
# ---------------------------------------------------------------------------

def test_fine_tune_from_a_drafter_gguf_through_the_pipeline(env, tmp_path):
    """A drafter GGUF fine-tuned with CE + KL on greedy and sampled continuations (pipeline.run,
    init_from): it keeps the first drafter's shape and draft vocabulary, writes a GGUF the engine
    runs, and speculative output equals AR output, greedy and sampled."""
    data = tmp_path / "text"
    data.mkdir()
    for i in range(3):
        (data / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40)))
    rng = np.random.default_rng(1)
    prompts = [[int(x) for x in rng.integers(3, 400, 8)] for _ in range(4)]
    first = train_drafter(env["hf"], tmp_path / "d0", prompts=prompts, max_new_tokens=16, target_layer_ids=TAPS,
                          block_size=B, mask_token_id=env["mask"], steps=5, seed=0, n_threads=N_THREADS,
                          draft_vocab_size=32)
    g0 = convert_dflash_to_gguf(first.checkpoint, tmp_path / "d0.gguf", outtype="f32", target_gguf=env["target_gguf"])
    vocab0 = json.loads((first.checkpoint / "config.json").read_text())["draft_vocab"]

    recipe = pipeline.run(env["ckpt"], data, tmp_path / "d1", n_prompts=4, prompt_tokens=12, max_new_tokens=12,
                          target_gguf=env["target_gguf"], out_gguf=tmp_path / "d1.gguf", outtype="f32",
                          init_from=g0, steps=6, w_ce=1.0, w_kl=1.0, sampled_share=0.5,
                          sample_temperatures=[0.7, 1.0], continuations_file=tmp_path / "conts.json",
                          n_threads=N_THREADS, engine_threads=N_THREADS, seed=0, draft_vocab_size=0)
    assert recipe["w_kl"] == 1.0 and recipe["init_from"] == str(g0) and recipe["n_sampled"] == 2
    assert recipe["target_layer_ids"] == TAPS and recipe["block_size"] == B  # from the initial drafter
    assert "KL" in recipe["objective"] and all(np.isfinite(recipe["losses"]))
    cfg = json.loads((tmp_path / "d1" / "config.json").read_text())
    assert cfg["draft_vocab"] == vocab0
    saved = json.loads((tmp_path / "conts.json").read_text())
    assert sum(p is not None for p in saved["plan"]) == 2 and len(saved["sequences"]) == 4

    eng = dn.Engine(env["target_gguf"], drafter=tmp_path / "d1.gguf", n_ctx=128, kv_type="f32", n_threads=2)
    prompt = [5, 6, 7, 8]
    assert eng.generate(prompt, max_tokens=16).tokens == eng.generate(prompt, max_tokens=16, speculative=False).tokens
    kw = dict(max_tokens=16, temperature=0.7, top_p=0.95, seed=11)
    assert eng.generate(prompt, **kw).tokens == eng.generate(prompt, speculative=False, **kw).tokens


def test_train_drafter_rejects_bad_loss_weights(env, tmp_path):
    for w_ce, w_kl in ((0.0, 0.0), (-1.0, 1.0), (1.0, -0.5)):
        with pytest.raises(ValueError, match="w_ce and w_kl"):
            train_drafter(env["hf"], tmp_path / "x", prompts=[[1, 2, 3, 4]], target_layer_ids=TAPS,
                          mask_token_id=env["mask"], w_ce=w_ce, w_kl=w_kl)
    with pytest.raises(ValueError, match="init_from"):
        train_drafter(env["hf"], tmp_path / "x", prompts=[[1, 2, 3, 4]], target_layer_ids=TAPS,
                      mask_token_id=env["mask"], init_from=tmp_path / "missing.gguf")
