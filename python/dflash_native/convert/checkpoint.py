"""Safetensors checkpoints read directly (header JSON + memmap; no torch): `Checkpoint`, the
sharded or single-file weights of a Hugging Face directory, and `StTensor`, one lazily read tensor."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np


# ---------------------------------------------------------------------------
# safetensors reading (no torch)
# ---------------------------------------------------------------------------

_ST_DTYPES: Mapping[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to F32 by a 16-bit shift on load
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class _StTensor:
    """One tensor inside a .safetensors file, loaded lazily through a memmap."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `path`

    def load(self) -> np.ndarray:
        """The tensor as a C-contiguous float32 array (a fresh copy)."""
        np_dtype = _ST_DTYPES.get(self.dtype)
        if np_dtype is None:
            raise ValueError(f"[convert] {self.path}: tensor {self.name!r} has dtype {self.dtype}; "
                             f"supported: {sorted(_ST_DTYPES)}")
        count = math.prod(self.shape)
        if count == 0:
            return np.zeros(self.shape, dtype=np.float32)
        raw = np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=(count,))
        if self.dtype == "BF16":
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out = raw.astype(np.float32)
        del raw
        return out.reshape(self.shape)


def _read_safetensors_header(path: Path) -> dict[str, _StTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"[convert] {path}: not a safetensors file (shorter than 8 bytes)")
        n_header = int.from_bytes(prefix, "little")
        if n_header <= 0 or 8 + n_header > size:
            raise ValueError(f"[convert] {path}: corrupt safetensors header length {n_header}")
        try:
            header = json.loads(f.read(n_header))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"[convert] {path}: corrupt safetensors header: {e}") from None
    base = 8 + n_header
    out: dict[str, _StTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        itemsize = _ST_ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise ValueError(f"[convert] {path}: tensor {name!r} has {end - begin} bytes, "
                             f"expected {math.prod(shape) * itemsize} for {dtype}{list(shape)}")
        if base + end > size:
            raise ValueError(f"[convert] {path}: tensor {name!r} runs past the end of the file")
        out[name] = _StTensor(path, name, dtype, shape, base + begin)
    return out


class Checkpoint:
    """All tensors of a HF checkpoint directory: model.safetensors, a sharded
    model.safetensors.index.json, or (without an index) every *.safetensors."""

    def __init__(self, src_dir: Path):
        self.src_dir = src_dir
        index_path = src_dir / "model.safetensors.index.json"
        if index_path.is_file():
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f).get("weight_map", {})
            if not weight_map:
                raise ValueError(f"[convert] {index_path}: empty or missing 'weight_map'")
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not (src_dir / fname).is_file():
                    raise ValueError(f"[convert] {index_path}: shard {fname!r} does not exist")
        elif (src_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in src_dir.glob("*.safetensors"))
            if not files:
                raise ValueError(f"[convert] no model.safetensors, model.safetensors.index.json "
                                 f"or *.safetensors in {str(src_dir)!r}")
        self.tensors: dict[str, _StTensor] = {}
        for fname in files:
            self.tensors.update(_read_safetensors_header(src_dir / fname))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> _StTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"[convert] {self.src_dir}: missing tensor {name!r}")
        return t
