"""One module per architecture: its GGUF keys (`<arch>_kv`) and its tensor plan
(`<arch>_tensors`); `ARCH_WRITERS` maps each GGUF architecture to that pair. common.py and
gdn.py hold the blocks several architectures share."""

from __future__ import annotations

from typing import Callable, Mapping

import gguf

from .llama import llama_kv, llama_tensors
from .qwen3 import qwen3_kv, qwen3_tensors
from .qwen35 import qwen35_kv, qwen35_tensors
from .qwen35moe import qwen35moe_kv
from .qwen3moe import qwen3moe_kv, qwen3moe_tensors
from .qwen3next import qwen3next_kv, qwen3next_tensors
from ..checkpoint import Checkpoint
from ..hparams import ModelSpec
from ..writer import SourceTensor


# GGUF arch -> (hparam keys writer, tensor planner)
ARCH_WRITERS: Mapping[str, tuple[Callable[[gguf.GGUFWriter, ModelSpec], None],
                                 Callable[[ModelSpec, Checkpoint], list[SourceTensor]]]] = {
    "llama": (llama_kv, llama_tensors),
    "qwen3moe": (qwen3moe_kv, qwen3moe_tensors),
    "qwen3": (qwen3_kv, qwen3_tensors),
    "qwen35": (qwen35_kv, qwen35_tensors),
    "qwen35moe": (qwen35moe_kv, qwen35_tensors),
    "qwen3next": (qwen3next_kv, qwen3next_tensors),
}
