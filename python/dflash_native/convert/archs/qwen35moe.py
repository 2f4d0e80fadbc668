"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, GGUF arch `qwen35moe`): Qwen3.5's layers with routed
experts and a gated shared expert (the tensors: qwen35.py)."""

from __future__ import annotations

import gguf

from .common import shared_expert_moe_kv
from .qwen35 import qwen35_kv
from ..hparams import ModelSpec


def qwen35moe_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """Qwen3.5's keys plus the experts' (llama.cpp's Qwen3_5MoeTextModel): HF's router always
    renormalises its top-k, as llama.cpp's qwen35moe graph does."""
    qwen35_kv(writer, spec)
    shared_expert_moe_kv(writer, spec)
