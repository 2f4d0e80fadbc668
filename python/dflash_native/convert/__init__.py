"""Hugging Face checkpoint -> GGUF conversion for DFlash target models.

Supported: Llama 3.x (`LlamaForCausalLM`, GGUF arch `llama`), Qwen3
(`Qwen3ForCausalLM`, GGUF arch `qwen3`), Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF arch
`qwen3moe`, experts stacked per layer), Qwen3.5-MoE (`Qwen3_5MoeForCausalLM` /
`qwen3_5_moe_text` and the multimodal layout, GGUF arch `qwen35moe`: Qwen3.5's
layers with routed experts and a gated shared expert) and Qwen3.5 text
models (`Qwen3_5ForCausalLM` / `qwen3_5_text`, and the multimodal
`Qwen3_5ForConditionalGeneration` / `qwen3_5`, whose text weights sit under
`model.language_model.` and whose hparams sit under `text_config`; GGUF arch
`qwen35`), and Qwen3-Next (`Qwen3NextForCausalLM` / `qwen3_next`, GGUF arch
`qwen3next`: the hybrid layout with fused GDN projections and routed experts plus
a gated shared expert in every layer).

The output follows llama.cpp's own converter (conversion/qwen.py in the
llama.cpp that llama-cpp-python 0.3.36 vendors) key for key and tensor for
tensor, so llama.cpp loads it and the native engine can share its loader
conventions. The transforms that are not plain renames:

- Qwen3.5 RMSNorms compute `x * (1 + w)`; we store `w + 1` for every norm but
  the GDN output norm `linear_attn.norm`, which is already multiplicative.
- `A_log` is stored as `ssm_a = -exp(A_log)`; `dt_bias` becomes `ssm_dt.bias`.
- `conv1d.weight` [C, 1, K] is squeezed to [C, K] (ggml ne = [K, C]) and kept F32.
- Qwen3.5's GDN value heads are reordered from grouped-by-key-head order to tiled order
  when n_v_heads != n_k_heads, so ggml can broadcast q/k heads by tiling.
- Qwen3-Next's `in_proj_qkvz` (rows per key head [q, k, v x r, z x r]) is split into
  `attn_qkv` [q all heads, k all heads, v all heads] and `attn_gate` [z], as llama.cpp's
  Qwen3NextModel does; its value heads stay grouped (no reorder) and `in_proj_ba` is kept
  fused (`ssm_ba`).
- Llama's W_q / W_k rows are permuted per head from HF's rotate-half order to the
  interleaved order of llama.cpp's NORM RoPE; `rope_type: llama3` becomes the
  `rope_freqs` tensor of per-frequency divisors.

Safetensors are read directly (header JSON + memmap), so no torch is needed.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf

from .archs import ARCH_WRITERS
from .checkpoint import Checkpoint
from .hparams import as_path, load_model_spec
from .tokenizer import add_tokenizer_kv
from .writer import OUTTYPES, Progress, convert_tensors


__all__ = ["OUTTYPES", "convert_hf_to_gguf"]


def convert_hf_to_gguf(src_dir: str | os.PathLike[str], dst_path: str | os.PathLike[str],
                       *, outtype: str = "f16", name: str | None = None, progress: Progress | None = None) -> Path:
    """Convert the HF checkpoint in `src_dir` to a GGUF file at `dst_path`.

    `outtype` is one of "f32", "f16", "bf16", "q8_0". As in llama.cpp, 1-D
    tensors, norms, biases, `ssm_a` and `ssm_conv1d` stay F32, and a tensor
    whose row length is not a multiple of 32 falls back from Q8_0 to F16.
    `name` is the file's `general.name` (default: the directory's name);
    `progress(i, n, tensor)` is called after each of the n tensors is written.
    Returns the path written. Raises ValueError for a missing directory or
    config.json, an unsupported architecture, missing tensors or an unknown
    outtype.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"[convert] unknown outtype {outtype!r}; expected one of {sorted(OUTTYPES)}")
    src = as_path("convert", "src_dir", src_dir)
    dst_path = as_path("convert", "dst_path", dst_path)
    if not src.is_dir():
        raise ValueError(f"[convert] checkpoint directory {str(src)!r} does not exist")
    spec = load_model_spec(src)
    ckpt = Checkpoint(src)

    arch_kv, arch_tensors = ARCH_WRITERS[spec.gguf_arch]
    tensors = arch_tensors(spec, ckpt)

    def write_kv(writer: gguf.GGUFWriter) -> None:
        arch_kv(writer, spec)
        add_tokenizer_kv(writer, src, spec.vocab_size, spec.config)

    return convert_tensors(src, Path(dst_path), spec.gguf_arch, tensors, outtype, write_kv, name=name,
                           progress=progress)
