"""RoPE scaling (linear, YaRN) in the target and drafter graphs, and the drafter's logit keys.

Tiny random checkpoints with `rope_parameters` of rope_type "linear" or "yarn" (a small
original_max_position_embeddings, so the prompt's positions run far past it) are converted by
our converter; the engine's logits are checked against HF transformers on the checkpoint and
llama.cpp on the same GGUF, speculative output against AR output, and the drafter's logits
against the PyTorch reference with the same scaling, logit_scale and soft cap. Keys the engine
does not apply fail at load with a ValueError naming them.
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from dflash_native.random_models import target_config
from fixtures import make_random_checkpoint, make_random_drafter_gguf
from reference.gguf_edit import rewrite_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from reference.dflash_ref import DFlashRef, target_taps  # noqa: E402

# As test_engine.py: HF and ggml sum in different orders (max |diff| measured ~1e-4 here).
TOL_HF = 2e-3
TOL_LLAMA = 1e-4
N_TOKENS = 72  # positions 0..71, against an original context of 16

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    # llama.cpp's converter reads HF's attention_factor (or attn_factor) into yarn_attn_factor
    "yarn-attn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                  "attention_factor": 0.9, "beta_fast": 16.0, "beta_slow": 2.0},
}
ARCHS = {"qwen3": "qwen3", "qwen35": "qwen3_5"}


def rope_parameters(arch: str, scaling: dict) -> dict:
    """The arch's default rope_parameters (theta, Qwen3.5's partial rotary and sections) plus `scaling`."""
    return {**target_config(arch, {})["rope_parameters"], **scaling}


def tokens(n, seed=0, hi=600):
    return [int(t) for t in np.random.default_rng(seed).integers(3, hi, n)]


def hf_model(ckpt, **config_overrides):
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                             attn_implementation="eager", **config_overrides).eval()


def hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor([toks])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=[(a, s) for a in sorted(ARCHS) for s in sorted(SCALINGS)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def scaled(request, tmp_path_factory):
    name, scaling = request.param
    arch = ARCHS[name]
    d = tmp_path_factory.mktemp(f"rope-{name}-{scaling}")
    ckpt = make_random_checkpoint(d / "hf", arch, seed=3, rope_parameters=rope_parameters(arch, SCALINGS[scaling]))
    return {"name": f"{name}-{scaling}", "arch": arch, "ckpt": ckpt, "scaling": SCALINGS[scaling],
            "gguf": convert_hf_to_gguf(ckpt, d / "m.gguf", outtype="f32")}


def test_converter_writes_llamacpps_keys(scaled):
    a = "qwen35" if scaled["arch"] == "qwen3_5" else "qwen3"
    f = {k: v.contents() for k, v in gguf.GGUFReader(scaled["gguf"]).fields.items()}
    sc = scaled["scaling"]
    assert f[f"{a}.rope.scaling.type"] == sc["rope_type"]
    assert f[f"{a}.rope.scaling.factor"] == pytest.approx(sc["factor"])
    got = {k.removeprefix(f"{a}.rope.scaling."): v for k, v in f.items() if k.startswith(f"{a}.rope.scaling.")}
    want = {"type", "factor"}
    if sc["rope_type"] == "yarn":
        want |= {"original_context_length"} | {f"yarn_{k}" for k in ("attn_factor", "beta_fast", "beta_slow")
                                                if {"attn_factor": "attention_factor"}.get(k, k) in sc}
        assert got["original_context_length"] == sc["original_max_position_embeddings"]
    assert set(got) == want


def test_logits_match_hf_past_the_original_context(scaled):
    toks = tokens(N_TOKENS)
    eng = dn.Engine(scaled["gguf"], n_ctx=128, kv_type="f32", n_threads=2)
    ours = eng.eval(toks)
    ref = hf_logits(hf_model(scaled["ckpt"]), toks)
    diff = np.abs(ours - ref).max()
    # the same weights without the scaling: the scaling is what the comparison checks
    unscaled = hf_logits(hf_model(scaled["ckpt"], rope_parameters=rope_parameters(scaled["arch"], {})), toks)
    moved = np.abs(unscaled - ref).max()
    print(f"{scaled['name']}: max |ours - HF| = {diff:.2e} (unscaled HF differs by {moved:.2e})")
    assert diff < TOL_HF
    assert moved > 20 * TOL_HF


def test_decode_steps_match_prefill(scaled):
    """Token-by-token decode (one position per graph) equals the batch at every position."""
    toks = tokens(40, seed=1)
    eng = dn.Engine(scaled["gguf"], n_ctx=64, kv_type="f32", n_threads=2)
    batch = eng.eval(toks)
    core = eng._core
    core.reset()
    steps = np.concatenate([core.decode([t]) for t in toks])
    np.testing.assert_array_equal(steps, batch)


def test_logits_match_llamacpp(scaled, tmp_path):
    """Equal to llama.cpp on the same file. With an explicit HF attention_factor (our
    rope.scaling.yarn_attn_factor) llama.cpp recomputes the YaRN magnitude from the factor and
    ignores the key (llama-context.cpp), where we apply it as HF does (checked above): there
    llama.cpp equals our engine on the file without the key."""
    import llama_cpp

    toks = tokens(N_TOKENS, seed=2)
    path = scaled["gguf"]
    ll = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2,
                         type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        ll.eval(toks)
        ref = np.asarray(ll.scores[: len(toks)])
    finally:
        ll.close()
    a = "qwen35" if scaled["arch"] == "qwen3_5" else "qwen3"
    if "attention_factor" in scaled["scaling"]:
        path = rewrite_gguf(path, tmp_path / "no-attn.gguf", drop_keys=(f"{a}.rope.scaling.yarn_attn_factor",))
    ours = dn.Engine(path, n_ctx=128, kv_type="f32", n_threads=2).eval(toks)
    diff = np.abs(ours - ref).max()
    print(f"{scaled['name']}: max |ours - llama.cpp| = {diff:.2e}")
    assert diff < TOL_LLAMA


# ---- the drafter: rope scaling, logit_scale and the soft cap, against the reference ----

DRAFTER_KEYS = {
    "plain": {},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 8}},
    "linear-capped": {"rope_parameters": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
                      "dflash_config": {"output_multiplier": 1.7, "final_logit_softcapping": 3.0}},
}


@pytest.fixture(scope="module", params=sorted(DRAFTER_KEYS))
def drafter_pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"rope-drafter-{request.param}")
    ckpt = make_random_checkpoint(d / "target", "qwen3", seed=11, num_hidden_layers=3,
                                  rope_parameters=rope_parameters("qwen3", SCALINGS["yarn"]))
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "drafter.gguf", ckpt, outtype="f32", seed=12, block_size=8, target_gguf=tg,
                                  ckpt_dir=d / "drafter", num_hidden_layers=1, target_layer_ids=[0, 1],
                                  **DRAFTER_KEYS[request.param])
    return {"name": request.param, "ckpt": ckpt, "target": tg, "drafter": dg, "drafter_ckpt": d / "drafter",
            "taps": [0, 1]}


def test_drafter_matches_reference(drafter_pair):
    """Draft logits (past the drafter's original context) equal the reference drafter's with the
    same rope scaling, output_multiplier and final_logit_softcapping."""
    prompt = tokens(30, seed=4)
    t = _core.Target(str(drafter_pair["target"]), n_ctx=128, kv_type="f32", max_verify=16, n_threads=2)
    s = _core.Spec(t, str(drafter_pair["drafter"]), block_size=8, ring_capacity=64, window=0)
    last = s.prefill(prompt)
    ours = _core.testing.draft_logits(s, last, 8, t)
    hf = hf_model(drafter_pair["ckpt"])
    ref = DFlashRef.from_dirs(drafter_pair["drafter_ckpt"], drafter_pair["ckpt"])
    ref_logits = ref.forward([last] + [s.mask_token_id] * 7, target_taps(hf, prompt, drafter_pair["taps"]))[1:]
    diff = np.abs(ours - ref_logits).max()
    print(f"{drafter_pair['name']}: max |draft logits - reference| = {diff:.2e}")
    assert diff < 1e-3
    if drafter_pair["name"] == "linear-capped":
        assert np.abs(ours).max() < 3.0  # the cap holds
    assert s.draft(last, 8) == [int(i) for i in ours.argmax(-1)]


def test_speculative_equals_ar(drafter_pair):
    """Lossless on a YaRN target (positions past its original context) with each drafter."""
    eng = dn.Engine(drafter_pair["target"], drafter=drafter_pair["drafter"], gate=False, block_size=8, n_ctx=256,
                    kv_type="f32", n_threads=2, draft_cutoff=0.2)
    prompt = tokens(20, seed=5)
    ar = eng.generate(prompt, max_tokens=60, speculative=False)
    sp = eng.generate(prompt, max_tokens=60)
    assert sp.stats.speculative and sp.stats.rounds > 0
    assert sp.tokens == ar.tokens


# ---- what the engine refuses ----

@pytest.fixture(scope="module")
def plain_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("rope-bad")
    return convert_hf_to_gguf(make_random_checkpoint(d / "hf", "qwen3", seed=3, num_hidden_layers=1), d / "m.gguf",
                              outtype="f32")


S = gguf.GGUFValueType.STRING
F = gguf.GGUFValueType.FLOAT32
BAD_KEYS = {
    "longrope": ({"qwen3.rope.scaling.type": ("longrope", S)}, "type 'longrope' is not supported"),
    "dynamic": ({"qwen3.rope.scaling.type": ("dynamic", S), "qwen3.rope.scaling.factor": (2.0, F)},
                "type 'dynamic' is not supported"),
    "alpha": ({"qwen3.rope.scaling.type": ("yarn", S), "qwen3.rope.scaling.factor": (2.0, F),
               "qwen3.rope.scaling.alpha": (1000.0, F)}, "'qwen3.rope.scaling.alpha' is not supported"),
    "log_mul": ({"qwen3.rope.scaling.type": ("yarn", S), "qwen3.rope.scaling.factor": (2.0, F),
                 "qwen3.rope.scaling.yarn_log_multiplier": (0.1, F)}, "yarn_log_multiplier"),
    "yarn key on linear": ({"qwen3.rope.scaling.type": ("linear", S), "qwen3.rope.scaling.factor": (2.0, F),
                            "qwen3.rope.scaling.yarn_beta_fast": (8.0, F)}, "needs qwen3.rope.scaling.type 'yarn'"),
    "negative factor": ({"qwen3.rope.scaling.type": ("linear", S), "qwen3.rope.scaling.factor": (-2.0, F)},
                        "factor -2 must be > 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_KEYS))
def test_unsupported_scaling_is_refused_at_load(plain_gguf, tmp_path, case):
    kv, message = BAD_KEYS[case]
    bad = rewrite_gguf(plain_gguf, tmp_path / "bad.gguf", kv=kv)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dn.Engine(bad, n_ctx=32, n_threads=1)


def test_factor_without_type_is_linear_as_in_llamacpp(plain_gguf, tmp_path):
    """llama.cpp reads an absent type as linear (by `factor`): so do we."""
    toks = tokens(20)
    implicit = rewrite_gguf(plain_gguf, tmp_path / "implicit.gguf", kv={"qwen3.rope.scaling.factor": (2.0, F)})
    explicit = rewrite_gguf(plain_gguf, tmp_path / "explicit.gguf",
                            kv={"qwen3.rope.scaling.factor": (2.0, F), "qwen3.rope.scaling.type": ("linear", S)})
    a = dn.Engine(implicit, n_ctx=32, n_threads=1).eval(toks)
    b = dn.Engine(explicit, n_ctx=32, n_threads=1).eval(toks)
    c = dn.Engine(plain_gguf, n_ctx=32, n_threads=1).eval(toks)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_type 'dynamic'"),
    ({"rope_type": "longrope", "factor": 2.0}, "unsupported rope_type 'longrope'"),
    ({"rope_type": "yarn", "factor": 2.0, "truncate": False}, "truncate=false"),
    ({"rope_type": "yarn", "factor": 2.0, "mscale": 0.7, "mscale_all_dim": 1.0}, "mscale_all_dim"),
    ({"rope_type": "linear"}, "needs a factor"),
])
def test_converter_refuses_what_the_keys_cannot_state(tmp_path, rope, message):
    ckpt = make_random_checkpoint(tmp_path / "hf", "qwen3", seed=3, num_hidden_layers=1,
                                  rope_parameters=rope_parameters("qwen3", rope))
    with pytest.raises(ValueError, match=message):
        convert_hf_to_gguf(ckpt, tmp_path / "m.gguf", outtype="f32")


def test_converter_reads_attn_factor_as_llamacpp_does(tmp_path):
    ckpt = make_random_checkpoint(tmp_path / "hf", "qwen3", seed=3, num_hidden_layers=1,
                                  rope_parameters=rope_parameters("qwen3", {"rope_type": "yarn", "factor": 2.0,
                                                                            "attn_factor": 0.8}))
    f = gguf.GGUFReader(convert_hf_to_gguf(ckpt, tmp_path / "m.gguf", outtype="f32")).fields
    assert f["qwen3.rope.scaling.yarn_attn_factor"].contents() == pytest.approx(0.8)
    assert f["qwen3.rope.scaling.original_context_length"].contents() == 4096  # HF's default: max_position_embeddings
