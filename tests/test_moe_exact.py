"""MoE targets with quantized experts are batch-invariant (docs/architecture.md, "Target
architectures": the routed FFN's "moe_experts" op).

Random Qwen3-MoE, Qwen3.5-MoE and Qwen3-Next targets whose every matmul row is 256 wide (hidden
256, expert and shared-expert FFN 256, 2 x 128 attention and GDN heads; 8 experts, top-2), quantized
by llama.cpp's quantizer (dflash_native.quantize) to Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K and IQ4_XS,
so that the K- and IQ-quant super-blocks really apply to the experts:

- a batch of 2..64 tokens gives, bit for bit, the logits of that token's one-token step (1 and 2
  threads). ggml_mul_mat_id, which the experts went through before, fails this for the K-quants and
  IQ4_XS: from 8 tokens routed to one expert it takes ggml's tiled K-quant kernel, whose sums are
  ordered otherwise than its one-token dot products;
- the op alone ("moe_experts", _core.testing.moe_experts): every output is, bit for bit, the rows
  kernel (matmul_rows) on its expert's weights and its one column, whatever the batch, the sharing
  of experts and the thread split;
- speculative decoding with forced drafts (the AR continuation with injected errors) commits
  exactly the AR tokens with the AR steps' logprobs bit for bit (read off the verify rows), with
  rounds that commit more than one token.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from fixtures import check_batch_equals_steps, check_cycled_rounds, cycling_drafts, make_random_checkpoint, make_random_drafter_gguf

# type asked for -> the ggml type the routed experts' up projections must hold
TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "iq4_xs": "IQ4_XS"}
BLOCK = 16
PROMPT = [int(x) for x in np.random.default_rng(13).integers(3, 500, 10)]

_HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128)
_EXPERTS = dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)
# arch -> make_random_checkpoint overrides
ARCHS = {
    "qwen3moe": ("qwen3_moe", dict(_EXPERTS, intermediate_size=512, num_hidden_layers=3, **_HEADS)),
    "qwen35moe": ("qwen3_5_moe", dict(_EXPERTS, shared_expert_intermediate_size=256, num_hidden_layers=3,
                                      layer_types=["linear_attention", "full_attention", "linear_attention"],
                                      **_HEADS, **_GDN)),
    "qwen3next": ("qwen3_next", dict(_EXPERTS, shared_expert_intermediate_size=256, num_hidden_layers=3,
                                     layer_types=["linear_attention", "full_attention", "linear_attention"],
                                     **_HEADS, **_GDN)),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def f32_moe(request, tmp_path_factory) -> dict:
    """The arch's F32 target (our converter) and an F32 drafter for it."""
    arch, over = ARCHS[request.param]
    d = tmp_path_factory.mktemp("moe-" + request.param)
    ckpt = make_random_checkpoint(d / "t", arch, seed=41, **over)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f32", seed=42, block_size=BLOCK, target_gguf=tg,
                                  target_layer_ids=[0, 1], num_hidden_layers=1, intermediate_size=512, **_HEADS)
    return {"name": request.param, "dir": d, "target": tg, "drafter": dg}


@pytest.fixture(scope="module", params=sorted(TYPES))
def moe_file(request, f32_moe) -> dict:
    """The target quantized to one type by llama.cpp's quantizer; its experts hold that type."""
    t = request.param
    path = dn.quantize(f32_moe["target"], f32_moe["dir"] / f"t-{t}.gguf", t, n_threads=2, progress=False)
    types = {x.name: x.tensor_type.name for x in GGUFReader(path).tensors}
    ups = [n for n in types if n.endswith("ffn_up_exps.weight")]
    assert ups and all(types[n] == TYPES[t] for n in ups), (t, {n: types[n] for n in types if "_exps" in n})
    return {**f32_moe, "type": t, "target": path, "what": f"{f32_moe['name']}-{t}"}


def test_batch_equals_steps_bitwise(moe_file):
    """Batches of 2..64 tokens after a 4-token prefix: every row is, bit for bit, the logits of
    that token's one-token step."""
    check_batch_equals_steps(moe_file["target"], moe_file['what'])


def test_forced_speculation_equals_ar(moe_file):
    """Rounds whose drafts are the AR continuation with an error now and then: the speculative
    output is the AR output token for token, its logprobs (from the verify rows) the AR steps' bit
    for bit, and rounds commit more than one token."""
    eng = dn.Engine(moe_file["target"], drafter=moe_file["drafter"], block_size=BLOCK, feature_ring_capacity=48,
                    n_ctx=192, kv_type="f32", n_threads=2, gate=False)
    for i, prompt in enumerate((PROMPT, PROMPT[:4] + [7, 9, 11])):
        ar_r = eng.generate(prompt, max_tokens=64, speculative=False, logprobs=3)
        ar = ar_r.tokens
        rng = np.random.default_rng(i)

        def forced(_prompt, out, Bc, ar=ar, rng=rng):
            good = (ar + [0] * BLOCK)[len(out): len(out) + Bc - 1]
            return [t if rng.random() > 0.12 else (t + 1) % 500 for t in good]

        eng._draft_override = forced
        sp = eng.generate(prompt, max_tokens=64, logprobs=3)
        eng._draft_override = None
        assert sp.tokens == ar, f"{moe_file['what']} prompt {i}"
        assert sp.logprobs == ar_r.logprobs, f"{moe_file['what']} prompt {i}"
        hist = sp.stats.acceptance_histogram
        assert sp.stats.mean_acceptance_length > 1.5, (moe_file["what"], i, hist)
        assert sum(c for k, c in enumerate(hist) if k > 1) > 0, hist


def test_forced_tree_speculation_equals_ar(moe_file):
    """Tree rounds (budget 16) whose best path is the AR continuation with its first miss cycling over
    the block (cycling_drafts): the output is the AR output token for token, the rounds commit what
    the schedule says (every length 1..B unless an end-of-generation token comes first)."""
    eng = dn.Engine(moe_file["target"], drafter=moe_file["drafter"], block_size=BLOCK, feature_ring_capacity=48,
                    n_ctx=192, kv_type="f32", n_threads=2, gate=False, verify="tree", tree_budget=16)
    n = 1 + BLOCK * (BLOCK + 1) // 2  # the prefill's token and B rounds of lengths 1..B
    ar = eng.generate(PROMPT, max_tokens=n, speculative=False).tokens
    eng._draft_override = cycling_drafts(ar + [0] * BLOCK, every=3)
    sp = eng.generate(PROMPT, max_tokens=n)
    eng._draft_override = None
    assert sp.tokens == ar, moe_file["what"]
    check_cycled_rounds(sp.stats, BLOCK, 3, complete=len(ar) == n)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_op_is_the_rows_kernel_per_column(qtype):
    """The op alone: each output y[t, j] is, bit for bit, the rows kernel on expert ids[t, j]'s weight
    rows and that one column (x[t], or x[t, j] per slot as the down projection has it) -- for 1 to
    64 tokens, experts shared unevenly (one takes about half the columns, from 8 on the tiled
    kernel's territory in ggml), 1 to 3 threads, 100 rows (units of 48 with a partial one). An id
    outside [0, n_expert) gives NaN in its slot and leaves the others alone."""
    from gguf import GGMLQuantizationType as Q

    from reference.ggml_quant import ggml_quantize

    E, M, K, U = 6, 100, 512, 2
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((E * M, K)) * rng.uniform(0.2, 3.0, (E * M, 1))).astype(np.float32)
    if qtype == "F16":
        raw, ty = W.astype(np.float16).reshape(E, M, K), ""
    else:
        raw, ty = ggml_quantize(W, Q[qtype]).reshape(E, M, -1), qtype
    p = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    T = 64
    ids = np.stack([rng.choice(E, U, replace=False, p=p) for _ in range(T)]).astype(np.int32)  # [T, U]
    for n_x in (1, U):
        x = rng.standard_normal((T, n_x, K)).astype(np.float32)
        want = np.stack([np.stack([_core.testing.matmul(raw[ids[t, j]], x[t, j % n_x][None], type=ty)[0]
                                   for j in range(U)]) for t in range(T)])  # [T, U, M]
        for n in (1, 5, 17, 64):
            for n_threads in (1, 2, 3):
                got = _core.testing.moe_experts(raw, x[:n], ids[:n], type=ty, n_threads=n_threads)
                np.testing.assert_array_equal(got, want[:n], err_msg=f"{qtype} n_x={n_x} n={n} threads={n_threads}")
        bad = ids[:17].copy()
        bad[3, 1] = E
        got = _core.testing.moe_experts(raw, x[:17], bad, type=ty, n_threads=2)
        assert np.isnan(got[3, 1]).all()
        keep = np.ones((17, U), bool)
        keep[3, 1] = False
        np.testing.assert_array_equal(got[keep], want[:17][keep])
