"""Copy a GGUF with edits, to build broken files for the bad-input tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter


def rewrite_gguf(src: Path, dst: Path, *, kv: dict | None = None, drop_keys=(), tensor_fn=None,
                 add_tensors: dict | None = None, rename: dict | None = None) -> Path:
    """Copy a GGUF with some keys changed or dropped, tensors passed through tensor_fn(name, array),
    and the F32 arrays of add_tensors (name -> array) appended; rename (old -> new name) renames tensors.

    tensor_fn returns the new array (same type), None (drop the tensor), or (array, type) to store
    it as another GGMLQuantizationType (the array then holds that type's raw data, e.g.
    gguf.quants.quantize's bytes)."""
    r = GGUFReader(src)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    arch = (kv or {}).get("general.architecture", arch)
    w = GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in (kv or {}):
            continue
        val = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(name, val, vtype, sub_type=sub)
    for name, val in (kv or {}).items():
        if name != "general.architecture":
            w.add_key_value(name, val[0], val[1]) if isinstance(val, tuple) else w.add_uint32(name, val)
    for t in r.tensors:
        data = np.array(t.data)
        if tensor_fn is not None:
            data = tensor_fn(t.name, data)
            if data is None:
                continue
        data, ttype = data if isinstance(data, tuple) else (data, t.tensor_type)
        w.add_tensor((rename or {}).get(t.name, t.name), data, raw_dtype=ttype)
    for name, data in (add_tensors or {}).items():
        w.add_tensor(name, np.asarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
