"""Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF arch `qwen3moe`): Qwen3's attention, routed experts
stacked per layer."""

from __future__ import annotations

import gguf

from .common import check_unused, copy, embedding_and_head, moe_dims, moe_expert_tensors, text_prefix
from .qwen3 import QWEN3_LAYER_TENSORS, qwen3_kv
from ..checkpoint import Checkpoint
from ..hparams import ModelSpec
from ..writer import SourceTensor, tensor_name


def qwen3moe_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """llama.cpp's Qwen3MoeModel keys, plus `expert_weights_norm` (HF norm_topk_prob; a llama.cpp key
    that its qwen3moe graph does not read: it always renormalises)."""
    qwen3_kv(writer, spec)
    where = spec.src_dir / "config.json"
    if int(spec.get("decoder_sparse_step")) != 1 or spec.get("mlp_only_layers"):
        raise ValueError(f"[convert] {where}: dense layers among the MoE ones (decoder_sparse_step "
                         f"{spec.get('decoder_sparse_step')}, mlp_only_layers {spec.get('mlp_only_layers')}) "
                         f"are not supported (llama.cpp's qwen3moe has experts in every layer)")
    n_expert, n_used, n_ff = moe_dims(spec)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    writer.add_expert_feed_forward_length(n_ff)
    writer.add_expert_weights_norm(bool(spec.get("norm_topk_prob")))


def qwen3moe_tensors(spec: ModelSpec, ckpt: Checkpoint) -> list[SourceTensor]:
    prefix = text_prefix(ckpt)
    out = embedding_and_head(spec, ckpt, prefix, None)
    for il in range(int(spec.require("num_hidden_layers"))):
        p = f"{prefix}layers.{il}."
        for hf_suffix, key in QWEN3_LAYER_TENSORS.items():
            if not hf_suffix.startswith("mlp."):
                out.append(copy(ckpt, p + hf_suffix, tensor_name(key, il)))
        out += moe_expert_tensors(spec, ckpt, p, il)
    check_unused(ckpt, prefix, out)
    return out
