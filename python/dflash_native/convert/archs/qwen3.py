"""Qwen3 (`Qwen3ForCausalLM`, GGUF arch `qwen3`)."""

from __future__ import annotations

from typing import Mapping

import gguf
from gguf import MODEL_TENSOR

from .common import check_unused, copy, embedding_and_head, text_prefix
from ..checkpoint import Checkpoint
from ..hparams import ModelSpec, add_rope_scaling, common_kv, rope_parameters
from ..writer import SourceTensor, tensor_name


# ---------------------------------------------------------------------------
# Qwen3
# ---------------------------------------------------------------------------

def qwen3_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    common_kv(writer, spec)
    rp = rope_parameters(spec)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    add_rope_scaling(writer, spec, rp)


# HF Qwen3 decoder-layer tensor suffix -> GGUF tensor (targets and DFlash drafters alike)
QWEN3_LAYER_TENSORS: Mapping[str, MODEL_TENSOR] = {
    "input_layernorm.weight": MODEL_TENSOR.ATTN_NORM,
    "self_attn.q_proj.weight": MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj.weight": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj.weight": MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj.weight": MODEL_TENSOR.ATTN_OUT,
    "self_attn.q_norm.weight": MODEL_TENSOR.ATTN_Q_NORM,
    "self_attn.k_norm.weight": MODEL_TENSOR.ATTN_K_NORM,
    "post_attention_layernorm.weight": MODEL_TENSOR.FFN_NORM,
    "mlp.gate_proj.weight": MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj.weight": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj.weight": MODEL_TENSOR.FFN_DOWN,
}


def qwen3_tensors(spec: ModelSpec, ckpt: Checkpoint) -> list[SourceTensor]:
    prefix = text_prefix(ckpt)
    out = embedding_and_head(spec, ckpt, prefix, None)
    for il in range(int(spec.require("num_hidden_layers"))):
        for hf_suffix, key in QWEN3_LAYER_TENSORS.items():
            out.append(copy(ckpt, f"{prefix}layers.{il}.{hf_suffix}", tensor_name(key, il)))
    check_unused(ckpt, prefix, out)
    return out
