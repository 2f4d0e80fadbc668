"""Llama 3.x (`LlamaForCausalLM`, GGUF arch `llama`): W_q / W_k rows permuted to llama.cpp's
interleaved RoPE order; `rope_type: llama3` as the `rope_freqs` tensor."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import gguf
from gguf import MODEL_TENSOR

from .common import check_unused, copy, embedding_and_head, text_prefix
from .qwen3 import QWEN3_LAYER_TENSORS
from ..checkpoint import Checkpoint
from ..hparams import ModelSpec, common_kv, rope_parameters
from ..writer import SourceTensor, tensor_name


# ---------------------------------------------------------------------------
# Llama (Llama 3.x dense)
# ---------------------------------------------------------------------------

def llama_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """llama.cpp's LlamaModel keys: the common ones, vocab_size, rope.dimension_count = head_dim.
    Llama 3.1's `llama3` RoPE scaling is a tensor (rope_freqs), not a key."""
    common_kv(writer, spec)
    if spec.get("mlp_bias"):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: mlp_bias=true is not supported")
    rp = rope_parameters(spec)
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: partial_rotary_factor "
                         f"{rp['partial_rotary_factor']} is not supported for Llama (llama.cpp rotates the whole head)")
    if rp["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: unsupported rope_type {rp['rope_type']!r} "
                         f"for Llama (supported: default, llama3)")
    writer.add_vocab_size(spec.vocab_size)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    writer.add_rope_dimension_count(int(spec.get("head_dim")))


def llama3_rope_factors(spec: ModelSpec) -> np.ndarray | None:
    """F32 [head_dim / 2]: the divisors of each RoPE frequency under `rope_type: llama3` (None for
    other rope types), as llama.cpp's converter computes rope_freqs: 1 for wavelengths below
    original_max_position_embeddings / high_freq_factor, `factor` above ... / low_freq_factor,
    smoothly interpolated between (HF's _compute_llama3_parameters divides the frequencies alike).
    original_max_position_embeddings is read from the rope parameters as HF does (llama.cpp reads
    only a top-level key, default 8192: the same on every published Llama 3.x config)."""
    rp = rope_parameters(spec)
    if rp["rope_type"] != "llama3":
        return None
    dim = int(spec.get("head_dim"))
    base = float(rp["rope_theta"])
    where = spec.src_dir / "config.json"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if rp.get(key) is None:
            raise ValueError(f"[convert] {where}: llama3 rope scaling needs {key!r} in rope_parameters")
    factor = float(rp["factor"])
    low, high = float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    old_ctx = float(rp["original_max_position_embeddings"])
    if not (factor > 0 and high > low > 0 and old_ctx > 0):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: llama3 rope scaling needs factor > 0 and "
                         f"high_freq_factor > low_freq_factor > 0 (got {factor}, {high}, {low})")
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0,
                   np.where(wavelen > old_ctx / low, factor, 1.0 / ((1.0 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def llama_qk_permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of W_q / W_k [n_head * head_dim, n_in] from HF's rotate-half order (pairs (i, i + d/2)
    of a head) to the interleaved order (pairs (2i, 2i + 1)) of llama.cpp's NORM RoPE, as its
    LlamaModel.permute does."""
    if x.shape[0] % (2 * n_head) != 0:
        raise ValueError(f"[convert] Llama q/k permute: {x.shape[0]} rows are not {n_head} heads of even size")
    return np.ascontiguousarray(
        x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2)).reshape(x.shape)


# HF Llama decoder-layer tensor suffix -> GGUF tensor (q/k are permuted on the way)
LLAMA_LAYER_TENSORS: Mapping[str, MODEL_TENSOR] = {
    k: v for k, v in QWEN3_LAYER_TENSORS.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}


def llama_tensors(spec: ModelSpec, ckpt: Checkpoint) -> list[SourceTensor]:
    prefix = text_prefix(ckpt)
    out = embedding_and_head(spec, ckpt, prefix, None)
    n_head, n_kv = int(spec.require("num_attention_heads")), int(spec.get("num_key_value_heads"))
    factors = llama3_rope_factors(spec)
    if factors is not None:
        out.append(SourceTensor(tensor_name(MODEL_TENSOR.ROPE_FREQS), factors.shape, lambda: factors))
    for il in range(int(spec.require("num_hidden_layers"))):
        for hf_suffix, key in LLAMA_LAYER_TENSORS.items():
            fn = None
            if hf_suffix == "self_attn.q_proj.weight":
                fn = lambda x: llama_qk_permute(x, n_head)  # noqa: E731
            elif hf_suffix == "self_attn.k_proj.weight":
                fn = lambda x: llama_qk_permute(x, n_kv)  # noqa: E731
            out.append(copy(ckpt, f"{prefix}layers.{il}.{hf_suffix}", tensor_name(key, il), fn))
    check_unused(ckpt, prefix, out)
    return out
