"""The GGUF side every converter shares: the output types (`OUTTYPES`), the per-tensor dtype
policy (`pick_qtype`: what stays F32, what falls back from Q8_0), `SourceTensor` (a tensor to
write, loaded lazily), and `write_gguf` / `convert_tensors`, which write the general keys, the
architecture's keys and the tensors."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import gguf
from gguf import GGMLQuantizationType, LlamaFileType, MODEL_TENSOR


# outtype -> (type for tensors that are allowed to be narrowed, general.file_type)
OUTTYPES: Mapping[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


# progress(i, n, tensor name): tensor i of n (1-based) is written
Progress = Callable[[int, int, str], None]


def convert_tensors(src: Path, dst: Path, arch: str, tensors: Sequence["SourceTensor"], outtype: str,
                    write_arch_kv: Callable[[gguf.GGUFWriter], None], *, name: str | None = None,
                    progress: Progress | None = None) -> Path:
    """The part every converter shares: the per-tensor type plan for `outtype`, the general
    keys (`general.name`: `name`, else the source directory's name), the architecture's keys
    (write_arch_kv), then the tensors (`progress` called after each)."""
    qtype_out, file_type = OUTTYPES[outtype]
    planned = [_PlannedTensor(t.name, t.shape, _pick_qtype(t.name, t.shape, qtype_out, t.keep_f32), t.load)
               for t in tensors]

    def write_kv(writer: gguf.GGUFWriter) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name if name is not None else src.resolve().name)
        write_arch_kv(writer)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return _write_gguf(dst, arch, write_kv, planned, progress)


# ---------------------------------------------------------------------------
# tensor dtype policy and GGUF writing (shared with the drafter converter)
# ---------------------------------------------------------------------------

@dataclass
class SourceTensor:
    """A GGUF tensor before its storage type is chosen.

    `shape` is the numpy (row-major) shape; ggml's ne is its reverse, so the
    last entry is the row length that quantization blocks run along.
    """

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]  # float32 data in the final layout
    keep_f32: bool = False  # llama.cpp keeps it F32 whatever the outtype (e.g. ssm_conv1d)
    hf_name: str = ""  # the checkpoint tensor it comes from, for bookkeeping
    hf_names: tuple[str, ...] = ()  # or the tensors it is stacked from (MoE experts)


@dataclass
class _PlannedTensor:
    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    load: Callable[[], np.ndarray]


def _pick_qtype(name: str, shape: Sequence[int], qtype_out: GGMLQuantizationType,
                keep_f32: bool = False) -> GGMLQuantizationType:
    """llama.cpp's storage rule (ModelBase.prepare_tensors): 1-D tensors, norms,
    non-`.weight` tensors and the listed exceptions stay F32; everything else
    takes the outtype, with Q8_0 falling back to F16 when rows are not whole blocks."""
    if keep_f32 or len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return GGMLQuantizationType.F32
    if qtype_out == GGMLQuantizationType.Q8_0:
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype_out]
        if shape[-1] % block_size != 0:
            return GGMLQuantizationType.F16
    return qtype_out


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 data -> the bytes (or f32/f16 array) GGUF stores for `qtype`."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        return data
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _nbytes(shape: Sequence[int], qtype: GGMLQuantizationType) -> int:
    return math.prod(gguf.quants.quant_shape_to_byte_shape(tuple(shape), qtype))


def _write_gguf(dst_path: Path, arch: str, write_kv: Callable[[gguf.GGUFWriter], None],
                tensors: Sequence[_PlannedTensor], progress: Progress | None = None) -> Path:
    """Write a GGUF file, streaming one tensor at a time so that peak memory is
    one tensor, not the model. Writes to a temporary name and renames at the end."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"[convert] duplicate GGUF tensor names: {dup}")
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = dst_path.with_name(dst_path.name + ".tmp")
    writer = gguf.GGUFWriter(path=None, arch=arch)
    try:
        write_kv(writer)
        for t in tensors:
            # tensor_dtype float32 + raw_dtype keeps `shape` as the logical shape.
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(t.shape, t.qtype),
                                   raw_dtype=t.qtype)
        total, shared, expert, n_expert = writer.get_total_parameter_count()
        if total > 0:  # general.size_label, as llama.cpp's converter derives it ("115K", "8x120K")
            writer.add_size_label(gguf.size_label(total, shared, expert, n_expert))
        writer.write_header_to_file(path=tmp_path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            data = t.load()
            if tuple(data.shape) != tuple(t.shape):
                raise ValueError(f"[convert] tensor {t.name!r}: shape {list(data.shape)} != planned {list(t.shape)}")
            writer.write_tensor_data(_encode(data, t.qtype))
            if progress is not None:
                progress(i + 1, len(tensors), t.name)
        writer.close()
        os.replace(tmp_path, dst_path)
    except BaseException:
        writer.close()
        tmp_path.unlink(missing_ok=True)
        raise
    return dst_path


def tensor_name(key: MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    name = gguf.TENSOR_NAMES[key]
    if bid is not None:
        name = name.format(bid=bid)
    return name + suffix
