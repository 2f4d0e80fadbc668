"""Quantized GGUFs as llama.cpp's quantizer writes them (dflash_native.quantize over
llama_model_quantize), target and DFlash drafter, in every common type:

- each file holds the type asked for (the tiny shapes have every matmul row a multiple of 256, so
  the K- and IQ-quants really apply), loads, and runs;
- exactness: a batch of 2..64 tokens gives, bit for bit, the logits of one-token steps (1 and 2
  threads), and speculative decoding commits exactly the AR tokens, greedy and sampled, with
  forced acceptance lengths 1..B;
- parity: our logits and llama.cpp's on the same file are within 5x the type's measured worst case
  (LLAMA_MEASURED), a bar a file that means something else is over; without integer-path weights
  ours are, bit for bit, those of the dequantized model (our F32 path over gguf-py's dequantization
  of the same file), and so is the drafter's draft;
- `dflash-native quantize`: its errors.
"""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGUFReader

import dflash_native as dn
from dflash_native import _core
from dflash_native.cli import main as cli_main
from dflash_native.convert import convert_hf_to_gguf
from fixtures import check_batch_equals_steps, make_random_checkpoint, make_random_drafter_gguf
from test_tensor_types import dequantized  # the F32 file holding what a quantized one stores

# type asked for -> the ggml type it must put in the file (a mix keeps others beside it)
FAMILIES = {
    "f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0",
    "q5_1": "Q5_1", "q2_k": "Q2_K", "q3_k_m": "Q3_K", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K",
    "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS",
}
BLOCK = 8
PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 12)]


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory) -> dict:
    """A Qwen3.5 hybrid (GDN, attention) and a drafter whose every matmul row is 256 wide or a
    multiple (hidden 256, FFN 512, 2 x 128 attention and GDN heads), F32 from our converters."""
    d = tmp_path_factory.mktemp("qpair")
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    ckpt = make_random_checkpoint(d / "t", "qwen3_5", seed=31, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                                  linear_value_head_dim=128, **heads)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f32", seed=32, block_size=BLOCK, target_gguf=tg,
                                  target_layer_ids=[0], num_hidden_layers=1, intermediate_size=512, **heads)
    return {"dir": d, "target": tg, "drafter": dg}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qpair(request, f32_pair) -> dict:
    """The pair quantized to one type by llama.cpp's quantizer (dflash_native.quantize)."""
    t = request.param
    out = {"type": t}
    for role in ("target", "drafter"):
        path = dn.quantize(f32_pair[role], f32_pair["dir"] / f"{role}-{t}.gguf", t, n_threads=2, progress=False)
        types = {x.tensor_type.name for x in GGUFReader(path).tensors}
        assert FAMILIES[t] in types, (role, t, types)
        if t != "f32":  # the matmul weights really are in the asked type (not all fallen back)
            w = [x for x in GGUFReader(path).tensors if x.name.endswith("ffn_up.weight")]
            assert w and all(x.tensor_type.name == FAMILIES[t] for x in w), (role, t, [x.tensor_type.name for x in w])
        out[role] = path
    return out


def test_batch_equals_steps_bitwise(qpair):
    """Batches of 2..64 tokens after a 4-token prefix: every row is, bit for bit, the logits of
    that token's one-token step (the verify pass computes what the AR step computes)."""
    check_batch_equals_steps(qpair["target"], qpair['type'])


def test_speculative_equals_ar(qpair):
    """The quantized pair: the Engine's speculative output is its AR output, greedy and sampled;
    and rounds whose drafts are the AR continuation with injected errors (acceptance lengths
    1..B, each followed by a commit and a ring push) commit exactly that continuation."""
    eng = dn.Engine(qpair["target"], drafter=qpair["drafter"], block_size=BLOCK, feature_ring_capacity=24, n_ctx=160,
                    kv_type="f32", n_threads=2, gate=False)
    ar = eng.generate(PROMPT, max_tokens=40, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=40)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens
    kw = dict(max_tokens=40, temperature=0.9, top_k=40, seed=7)
    assert eng.generate(PROMPT, speculative=False, **kw).tokens == eng.generate(PROMPT, **kw).tokens

    t = _core.Target(str(qpair["target"]), n_ctx=160, kv_type="f32", max_verify=BLOCK, n_threads=2)
    ref = [int(np.argmax(t.decode(PROMPT)[-1]))]
    while len(ref) < 40 + BLOCK:
        ref.append(int(np.argmax(t.decode([ref[-1]])[-1])))
    t.reset()
    s = _core.Spec(t, str(qpair["drafter"]), block_size=BLOCK, ring_capacity=24, window=0)
    rng = np.random.default_rng(1)
    forced, lengths = [s.prefill(PROMPT)], []
    while len(forced) < 40:
        drafts = [tok if rng.random() > 0.15 else (tok + 1) % 500 for tok in ref[len(forced): len(forced) + BLOCK - 1]]
        committed = _core.testing.round(s, forced[-1], BLOCK, drafts).committed
        lengths.append(len(committed))
        forced += committed
    assert forced[:40] == ref[:40]
    assert len(set(lengths)) > 2, lengths


def test_forced_tree_speculation_equals_ar(qpair):
    """Tree rounds (budget 12) whose best path is the AR continuation with its first miss cycling over
    the block (cycling_drafts), the drafter's tokens as siblings: the output is the AR output, the
    rounds commit what the schedule says (every length 1..B unless an end-of-generation token comes
    first)."""
    from fixtures import check_cycled_rounds, cycling_drafts

    eng = dn.Engine(qpair["target"], drafter=qpair["drafter"], block_size=BLOCK, feature_ring_capacity=24, n_ctx=160,
                    kv_type="f32", n_threads=2, gate=False, verify="tree", tree_budget=12)
    n = 1 + BLOCK * (BLOCK + 1) // 2  # the prefill's token and B rounds of lengths 1..B
    ar = eng.generate(PROMPT, max_tokens=n, speculative=False).tokens
    eng._draft_override = cycling_drafts(ar + [0] * BLOCK, every=3)
    sp = eng.generate(PROMPT, max_tokens=n)
    eng._draft_override = None
    assert sp.tokens == ar
    check_cycled_rounds(sp.stats, BLOCK, 3, complete=len(ar) == n)


# Weight types on the own kernel's integer path (csrc/kernels/cpu/matmul/matmul.h): their matmuls round the
# activations to Q8_0 / Q8_K, as llama.cpp's do.
INT_PATH = {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


def int_path(path) -> str:
    """'all' when every quantized 2-D tensor of the file is of an INT_PATH type, 'some' when some
    are (a mix: IQ4_NL with a Q6_K output), else ''."""
    types = {x.tensor_type.name for x in GGUFReader(path).tensors if len(x.shape) == 2 and x.tensor_type.name != "F32"}
    return "" if not types & INT_PATH else "all" if types <= INT_PATH else "some"


# The parity prompts: PROMPT and five more of 5..40 tokens.
PARITY_PROMPTS = [PROMPT] + [[int(x) for x in np.random.default_rng(100 + i).integers(3, 500, n)]
                             for i, n in enumerate([5, 17, 24, 33, 40])]
# |ours - llama.cpp| on the same quantized file, worst over PARITY_PROMPTS (2026-11-28, AVX-512 CPU, 2 threads,
# llama.cpp without its extra buffer types; logits up to ~8). The bar is 5x it.
# - F32: summation order only. F16 / BF16: llama.cpp rounds the activations to F16 / BF16, ours keep them F32.
# - Q2_K, Q3_K_M, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS (some or all matmuls on our F32 path): llama.cpp rounds
#   the activations to Q8_K / Q8_0 / Q8_1 there, ours do not (0.10..0.29 on every prompt).
# - Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0 (all on the integer path): both round the activations to the same Q8
#   codes, and most prompts agree to F32 noise (1e-6..3e-6); where an upstream value differs by an ulp (the
#   two sum in other orders) a code flips and moves that matmul by a quantization step, which the later
#   layers carry: the worst prompt is such a flip (e.g. Q4_0: 1.4e-6 on four prompts, 8.3e-2 and 6.8e-2 on two).
LLAMA_MEASURED = {
    "f32": 2.9e-6, "f16": 5.8e-3, "bf16": 7.4e-2, "q8_0": 4.4e-2, "q4_0": 8.3e-2, "q4_1": 1.91e-1, "q5_0": 1.63e-1,
    "q5_1": 1.87e-1, "q2_k": 2.31e-1, "q3_k_m": 2.18e-1, "q4_k_m": 4.7e-2, "q5_k_m": 8.7e-2, "q6_k": 3.6e-2,
    "iq4_nl": 1.89e-1, "iq4_xs": 2.90e-1,
}


def swapped_embedding_rows(src, dst, a: int, b: int):
    """src with the token embedding rows of tokens a and b exchanged (bytes, any type): a file that means
    something else."""
    dst.write_bytes(src.read_bytes())
    r = GGUFReader(dst, "r+")
    rows = next(t for t in r.tensors if t.name == "token_embd.weight").data  # [n_vocab, row bytes or values]
    rows[[a, b]] = rows[[b, a]]
    r.data.flush()
    del r
    return dst


def test_logits_match_llama_cpp_on_the_same_file(qpair, tmp_path, llama_logits):
    check_llama_parity(qpair["target"], LLAMA_MEASURED[qpair["type"]], tmp_path, llama_logits, qpair["type"])


def check_llama_parity(path, measured: float, tmp_path, llama_logits, what: str) -> None:
    """Our logits and llama.cpp's on the same file over PARITY_PROMPTS, within 5x the measured worst case;
    without integer-path weights ours are, bit for bit, those of the dequantized model (our F32 path over
    gguf-py's dequantization of the same file: our kernels convert the weights exactly and keep the
    activations F32). The bar can fail: llama.cpp on the file with two embedding rows exchanged is over it."""
    bar = 5 * measured
    eng = dn.Engine(path, n_ctx=64, kv_type="f32", n_threads=2)
    exact = not int_path(path)
    deq = dn.Engine(dequantized(path, tmp_path / "deq.gguf"), n_ctx=64, kv_type="f32", n_threads=2) if exact else None
    diffs = []
    for prompt in PARITY_PROMPTS:
        ours = eng.eval(prompt)
        diffs.append(float(np.abs(ours - llama_logits(path, prompt)).max()))
        if exact:
            assert np.array_equal(ours, deq.eval(prompt)), (what, len(prompt))
    print(f"{what}: |ours - llama.cpp| per prompt {' '.join(f'{x:.2e}' for x in diffs)} (bar {bar:.2e})")
    assert max(diffs) <= bar, (what, diffs)
    other = swapped_embedding_rows(path, tmp_path / "swapped.gguf", PROMPT[0], PROMPT[1])
    wrong = float(np.abs(eng.eval(PROMPT) - llama_logits(other, PROMPT)).max())
    print(f"{what}: |ours - llama.cpp on the swapped file| {wrong:.2e}")
    assert wrong > bar, (what, wrong, bar)


# |draft - dequantized drafter's draft| worst case measured (as LLAMA_MEASURED): 0 bit for bit where neither
# file holds integer-path weights (the drafter's matmuls keep the activations F32); else the rounding of the
# activations to Q8 codes in the drafter's integer-path matmuls (all of them, or Q3_K_M's Q4_K / Q5_K ones).
DRAFT_MEASURED = {"q8_0": 9.9e-2, "q4_0": 9.0e-2, "q3_k_m": 1.05e-1, "q4_k_m": 1.04e-1, "q5_k_m": 1.48e-1,
                  "q6_k": 1.02e-1}


def test_draft_logits_match_dequantized_drafter(qpair, f32_pair, tmp_path):
    """The quantized drafter drafts as its dequantized twin does: bit for bit, or with integer-path
    weights within 5x the measured worst case (DRAFT_MEASURED)."""
    def draft(drafter):
        t = _core.Target(str(qpair["target"]), n_ctx=64, kv_type="f32", max_verify=BLOCK, n_threads=2)
        s = _core.Spec(t, str(drafter), block_size=BLOCK, ring_capacity=32, window=0)
        return _core.testing.draft_logits(s, s.prefill(PROMPT), BLOCK, t)

    got, want = draft(qpair["drafter"]), draft(dequantized(qpair["drafter"], tmp_path / "dq.gguf"))
    diff = float(np.abs(got - want).max())
    print(f"{qpair['type']}: |draft - dequantized draft| {diff:.2e} (logits up to {float(np.abs(want).max()):.1f})")
    measured = DRAFT_MEASURED.get(qpair["type"], 0.0)
    assert bool(int_path(qpair["drafter"])) == (measured > 0)  # the table names the integer-path drafters
    assert diff <= 5 * measured, diff


# ---- dflash-native quantize -------------------------------------------------------------------

def test_quantize_errors(f32_pair, tmp_path):
    with pytest.raises(ValueError, match="unknown type 'q4_x'"):
        dn.quantize(f32_pair["target"], tmp_path / "o.gguf", "q4_x")
    with pytest.raises(ValueError, match="does not exist"):
        dn.quantize(tmp_path / "missing.gguf", tmp_path / "o.gguf", "q8_0")
    text = tmp_path / "not.gguf"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF"):
        dn.quantize(text, tmp_path / "o.gguf", "q8_0")
    with pytest.raises(ValueError, match="is the source"):
        dn.quantize(f32_pair["target"], f32_pair["target"], "q8_0")
    with pytest.raises(ValueError, match="directory"):
        dn.quantize(f32_pair["target"], tmp_path / "no" / "o.gguf", "q8_0")
    with pytest.raises(ValueError, match="n_threads"):
        dn.quantize(f32_pair["target"], tmp_path / "o.gguf", "q8_0", n_threads=0)
    # a GGUF llama.cpp cannot read (its error quoted, not an abort)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(f32_pair["target"].read_bytes()[:4096])
    with pytest.raises(ValueError, match="llama.cpp could not quantize"):
        dn.quantize(bad, tmp_path / "o.gguf", "q8_0", progress=False)


def test_quantize_cli(f32_pair, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    assert cli_main(["quantize", str(f32_pair["drafter"]), str(out), "--type", "Q4_K_M"]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "Q4_K" in captured.out
    n = len(GGUFReader(f32_pair["drafter"]).tensors)
    assert f"[{'#' * 30}] {n}/{n}" in captured.err, captured.err[-300:]  # the progress bar, completed
    assert {t.tensor_type.name for t in GGUFReader(out).tensors} >= {"Q4_K", "F32"}
    assert cli_main(["quantize", str(tmp_path / "none.gguf"), str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["quantize", str(f32_pair["drafter"]), str(out), "--type", "q9_z"])
