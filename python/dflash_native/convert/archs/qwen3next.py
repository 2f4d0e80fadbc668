"""Qwen3-Next (`Qwen3NextForCausalLM`, GGUF arch `qwen3next`): fused GDN projections split as
llama.cpp's Qwen3NextModel does, routed experts plus a gated shared expert in every layer."""

from __future__ import annotations

import numpy as np
import gguf
from gguf import MODEL_TENSOR

from .common import (
    check_unused, copy, embedding_and_head, gated_attention_tensors, moe_expert_tensors,
    moe_shared_expert_tensors, plus_one, shared_expert_moe_kv, text_prefix,
)
from .gdn import GdnDims, gdn_dims, gdn_kv, neg_exp, qwen35_layer_types
from ..checkpoint import Checkpoint
from ..hparams import ModelSpec, add_rope_scaling, common_kv, rope_parameters
from ..writer import SourceTensor, tensor_name


# ---------------------------------------------------------------------------
# Qwen3-Next (Qwen3.5's hybrid layout with fused GDN projections, NeoX partial RoPE, and routed
# experts plus a gated shared expert in every layer)
# ---------------------------------------------------------------------------

def qwen3next_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """llama.cpp's Qwen3NextModel keys (Qwen2MoeModel's expert keys, the ssm keys, the layer pattern,
    `rope.dimension_count` = head_dim x partial_rotary_factor), plus `expert_weights_norm` (HF
    norm_topk_prob; llama.cpp's qwen3next graph always renormalises and does not read it)."""
    common_kv(writer, spec)
    where = spec.src_dir / "config.json"
    rp = rope_parameters(spec)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    add_rope_scaling(writer, spec, rp)
    head_dim = int(spec.get("head_dim"))
    n_rot = int(head_dim * float(rp["partial_rotary_factor"]))
    if n_rot <= 0 or n_rot % 2 != 0:
        raise ValueError(f"[convert] {where}: head_dim x partial_rotary_factor = {n_rot} must be even and > 0")
    writer.add_rope_dimension_count(n_rot)

    gdn_kv(writer, spec)

    if int(spec.get("decoder_sparse_step")) != 1 or spec.get("mlp_only_layers"):
        raise ValueError(f"[convert] {where}: dense layers among the MoE ones (decoder_sparse_step "
                         f"{spec.get('decoder_sparse_step')}, mlp_only_layers {spec.get('mlp_only_layers')}) "
                         f"are not supported (llama.cpp's qwen3next has experts in every layer)")
    shared_expert_moe_kv(writer, spec)
    writer.add_expert_weights_norm(bool(spec.get("norm_topk_prob")))


def qwen3next_split_qkvz(x: np.ndarray, d: GdnDims) -> tuple[np.ndarray, np.ndarray]:
    """HF's in_proj_qkvz [(2 d_k + 2 r d_v) n_k, n_embd], rows per key head [q | k | v x r | z x r],
    -> (attn_qkv rows [q all heads | k all heads | v all heads], attn_gate rows [z all heads]) as
    llama.cpp's Qwen3NextModel splits it; value heads keep their grouped order."""
    h = x.shape[-1]
    per_head = 2 * d.head_k_dim + 2 * d.v_per_k * d.head_v_dim
    y = x.reshape(d.n_k_heads, per_head, h)
    q, k, v, z = np.split(y, np.cumsum([d.head_k_dim, d.head_k_dim, d.v_per_k * d.head_v_dim])[:3], axis=1)
    flat = [np.ascontiguousarray(t).reshape(-1, h) for t in (q, k, v, z)]
    return np.concatenate(flat[:3], axis=0), flat[3]


def qwen3next_tensors(spec: ModelSpec, ckpt: Checkpoint) -> list[SourceTensor]:
    prefix = text_prefix(ckpt)
    out = embedding_and_head(spec, ckpt, prefix, plus_one)
    d = gdn_dims(spec)
    h = int(spec.require("hidden_size"))

    for il, layer_type in enumerate(qwen35_layer_types(spec)):
        p = f"{prefix}layers.{il}."
        out.append(copy(ckpt, p + "input_layernorm.weight", tensor_name(MODEL_TENSOR.ATTN_NORM, il), plus_one))
        if layer_type == "full_attention":
            out += gated_attention_tensors(ckpt, p, il)
        else:
            a = p + "linear_attn."
            want = {"in_proj_qkvz.weight": (2 * d.key_dim + 2 * d.value_dim, h),
                    "in_proj_ba.weight": (2 * d.n_v_heads, h),
                    "conv1d.weight": (d.conv_dim, 1, d.conv_kernel)}
            for name, shape in want.items():
                t = ckpt.get(a + name)
                if t.shape != shape:
                    raise ValueError(f"[convert] {ckpt.src_dir}: {t.name} has shape {list(t.shape)}, expected "
                                     f"{list(shape)} from config.json")
            out += [
                copy(ckpt, a + "in_proj_qkvz.weight", tensor_name(MODEL_TENSOR.ATTN_QKV, il),
                      lambda x: qwen3next_split_qkvz(x, d)[0], shape=(d.conv_dim, h)),
                copy(ckpt, a + "in_proj_qkvz.weight", tensor_name(MODEL_TENSOR.ATTN_GATE, il),
                      lambda x: qwen3next_split_qkvz(x, d)[1], shape=(d.value_dim, h)),
                # per key head [b x r | a x r]: the engine splits it, as llama.cpp's graph does
                copy(ckpt, a + "in_proj_ba.weight", tensor_name(MODEL_TENSOR.SSM_BETA_ALPHA, il)),
                copy(ckpt, a + "conv1d.weight", tensor_name(MODEL_TENSOR.SSM_CONV1D, il),
                      lambda x: x.reshape(x.shape[0], x.shape[-1]), shape=(d.conv_dim, d.conv_kernel), keep_f32=True),
                copy(ckpt, a + "dt_bias", tensor_name(MODEL_TENSOR.SSM_DT, il, ".bias")),
                copy(ckpt, a + "A_log", tensor_name(MODEL_TENSOR.SSM_A, il, ""), neg_exp),
                copy(ckpt, a + "norm.weight", tensor_name(MODEL_TENSOR.SSM_NORM, il)),
                copy(ckpt, a + "out_proj.weight", tensor_name(MODEL_TENSOR.SSM_OUT, il)),
            ]
        out.append(copy(ckpt, p + "post_attention_layernorm.weight",
                         tensor_name(MODEL_TENSOR.ATTN_POST_NORM, il), plus_one))
        out += moe_expert_tensors(spec, ckpt, p, il) + moe_shared_expert_tensors(spec, ckpt, p, il)
    check_unused(ckpt, prefix, out)
    return out
