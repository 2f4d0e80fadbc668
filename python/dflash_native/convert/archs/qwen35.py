"""Qwen3.5 (`Qwen3_5ForCausalLM` / the multimodal layout, GGUF arch `qwen35`): Gated DeltaNet
layers and gated full attention, norms stored as 1 + w. Qwen3.5-MoE shares its tensor plan."""

from __future__ import annotations

from typing import Callable

import numpy as np
import gguf
from gguf import MODEL_TENSOR

from .common import (
    check_unused, copy, embedding_and_head, gated_attention_tensors, moe_expert_tensors,
    moe_shared_expert_tensors, plus_one, text_prefix,
)
from .gdn import gdn_dims, gdn_kv, neg_exp, qwen35_layer_types, text_mrope_sections, v_heads_grouped_to_tiled
from ..checkpoint import Checkpoint
from ..hparams import ModelSpec, add_rope_scaling, common_kv, rope_parameters
from ..writer import SourceTensor, tensor_name


def qwen35_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    common_kv(writer, spec)
    rp = rope_parameters(spec)
    head_dim = int(spec.get("head_dim"))
    n_rot = int(head_dim * float(rp["partial_rotary_factor"]))
    writer.add_rope_dimension_sections(text_mrope_sections(n_rot, head_dim, rp.get("mrope_section")))
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    add_rope_scaling(writer, spec, rp)
    writer.add_rope_dimension_count(n_rot)

    gdn_kv(writer, spec)


def qwen35_tensors(spec: ModelSpec, ckpt: Checkpoint) -> list[SourceTensor]:
    prefix = text_prefix(ckpt)
    out = embedding_and_head(spec, ckpt, prefix, plus_one)
    d = gdn_dims(spec)
    reorder = d.v_per_k > 1

    def tile(axis: int, head_dim: int, start: int = 0) -> Callable[[np.ndarray], np.ndarray]:
        """Reorder V heads along `axis`, leaving the first `start` entries (q and k) alone."""
        def f(x: np.ndarray) -> np.ndarray:
            if not reorder:
                return x
            head, tail = np.split(x, [start], axis=axis)
            tail = v_heads_grouped_to_tiled(tail, axis, d.n_k_heads, d.v_per_k, head_dim)
            return np.concatenate([head, tail], axis=axis)
        return f

    def conv1d(x: np.ndarray) -> np.ndarray:
        # [C, 1, K] -> [C, K]; ggml's ssm_conv1d has ne = [K, C]
        return tile(0, d.head_v_dim, 2 * d.key_dim)(x.reshape(x.shape[0], x.shape[-1]))

    for il, layer_type in enumerate(qwen35_layer_types(spec)):
        p = f"{prefix}layers.{il}."
        out.append(copy(ckpt, p + "input_layernorm.weight", tensor_name(MODEL_TENSOR.ATTN_NORM, il), plus_one))
        if layer_type == "full_attention":
            out += gated_attention_tensors(ckpt, p, il)
        else:
            conv = ckpt.get(p + "linear_attn.conv1d.weight")
            if conv.shape != (d.conv_dim, 1, d.conv_kernel):
                raise ValueError(f"[convert] {ckpt.src_dir}: {conv.name} has shape {list(conv.shape)}, expected "
                                 f"[{d.conv_dim}, 1, {d.conv_kernel}] from config.json")
            out += [
                copy(ckpt, p + "linear_attn.in_proj_qkv.weight", tensor_name(MODEL_TENSOR.ATTN_QKV, il),
                      tile(0, d.head_v_dim, 2 * d.key_dim)),
                copy(ckpt, p + "linear_attn.in_proj_z.weight", tensor_name(MODEL_TENSOR.ATTN_GATE, il),
                      tile(0, d.head_v_dim)),
                copy(ckpt, p + "linear_attn.in_proj_b.weight", tensor_name(MODEL_TENSOR.SSM_BETA, il), tile(0, 1)),
                copy(ckpt, p + "linear_attn.in_proj_a.weight", tensor_name(MODEL_TENSOR.SSM_ALPHA, il), tile(0, 1)),
                copy(ckpt, p + "linear_attn.conv1d.weight", tensor_name(MODEL_TENSOR.SSM_CONV1D, il), conv1d,
                      shape=(d.conv_dim, d.conv_kernel), keep_f32=True),
                copy(ckpt, p + "linear_attn.dt_bias", tensor_name(MODEL_TENSOR.SSM_DT, il, ".bias"), tile(0, 1)),
                copy(ckpt, p + "linear_attn.A_log", tensor_name(MODEL_TENSOR.SSM_A, il, ""),
                      lambda x, t=tile(0, 1): neg_exp(t(x))),
                copy(ckpt, p + "linear_attn.norm.weight", tensor_name(MODEL_TENSOR.SSM_NORM, il)),
                copy(ckpt, p + "linear_attn.out_proj.weight", tensor_name(MODEL_TENSOR.SSM_OUT, il),
                      tile(1, d.head_v_dim)),
            ]
        out.append(copy(ckpt, p + "post_attention_layernorm.weight",
                         tensor_name(MODEL_TENSOR.ATTN_POST_NORM, il), plus_one))
        if spec.gguf_arch == "qwen35moe":
            out += moe_expert_tensors(spec, ckpt, p, il) + moe_shared_expert_tensors(spec, ckpt, p, il)
            continue
        for hf_suffix, key in (("mlp.gate_proj.weight", MODEL_TENSOR.FFN_GATE),
                               ("mlp.up_proj.weight", MODEL_TENSOR.FFN_UP),
                               ("mlp.down_proj.weight", MODEL_TENSOR.FFN_DOWN)):
            out.append(copy(ckpt, p + hf_suffix, tensor_name(key, il)))
    check_unused(ckpt, prefix, out)
    return out
