"""Where everything lives in a GGUF file, parsed once, so that mutations can aim at fields.

Our own reader on purpose: it must describe the bytes exactly (offsets of every length, type and
value field), which gguf-py's reader does not expose, and it only ever reads the unmutated base.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# GGUF value types and their scalar formats (little endian).
SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
T_STRING, T_ARRAY = 8, 9
INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
FLOAT_TYPES = (6, 12)

# ggml types: (block size, bytes per block) of the ones the converter writes.
GGML_BLOCK = {0: (1, 4), 1: (1, 2), 8: (32, 34), 30: (1, 2)}  # F32, F16, Q8_0, BF16


@dataclass
class Str:
    len_off: int   # u64 length
    off: int       # first byte
    n: int         # bytes


@dataclass
class KV:
    key: str
    key_str: Str
    type_off: int
    vtype: int                      # GGUF type, T_ARRAY for arrays
    arr_type_off: int = -1          # arrays: element type field
    arr_type: int = -1
    count_off: int = -1             # arrays: u64 element count
    count: int = 0
    val_off: int = 0                # first byte of the value (scalar) or first element
    val_end: int = 0
    elems: list = field(default_factory=list)  # arrays: (offset, size) per element, or Str per string
    sval: Str | None = None         # scalar strings

    @property
    def end(self) -> int:
        return self.val_end


@dataclass
class TensorInfo:
    name: str
    name_str: Str
    n_dims_off: int
    n_dims: int
    dim_offs: list
    dims: list
    type_off: int
    ggml_type: int
    offset_off: int
    offset: int
    data_off: int = 0   # absolute
    nbytes: int = 0


@dataclass
class Layout:
    size: int
    version: int
    n_tensors: int
    n_kv: int
    kvs: list
    tensors: list
    kv_start: int
    infos_start: int
    infos_end: int
    alignment: int
    data_start: int

    def kv(self, key: str) -> KV | None:
        return next((k for k in self.kvs if k.key == key), None)


class _Cursor:
    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> Str:
        len_off = self.pos
        n = self.take("<Q")
        s = Str(len_off, self.pos, n)
        self.pos += n
        return s


def _value(c: _Cursor, vtype: int):
    if vtype == T_STRING:
        return c.string()
    off = c.pos
    c.take(SCALAR_FMT[vtype])
    return off, c.pos - off


def parse(buf: bytes) -> Layout:
    c = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    c.pos = 4
    version, n_tensors, n_kv = c.take("<I"), c.take("<q"), c.take("<q")
    kv_start = c.pos
    kvs = []
    for _ in range(n_kv):
        ks = c.string()
        key = buf[ks.off:ks.off + ks.n].decode("utf-8")
        type_off = c.pos
        vtype = c.take("<I")
        kv = KV(key, ks, type_off, vtype)
        if vtype == T_ARRAY:
            kv.arr_type_off, kv.arr_type = c.pos, c.take("<I")
            kv.count_off, kv.count = c.pos, c.take("<Q")
            kv.val_off = c.pos
            kv.elems = [_value(c, kv.arr_type) for _ in range(kv.count)]
        else:
            kv.val_off = c.pos
            v = _value(c, vtype)
            if vtype == T_STRING:
                kv.sval = v
        kv.val_end = c.pos
        kvs.append(kv)
    infos_start = c.pos
    tensors = []
    for _ in range(n_tensors):
        ns = c.string()
        name = buf[ns.off:ns.off + ns.n].decode("utf-8")
        n_dims_off = c.pos
        n_dims = c.take("<I")
        dim_offs, dims = [], []
        for _ in range(n_dims):
            dim_offs.append(c.pos)
            dims.append(c.take("<Q"))
        type_off = c.pos
        gt = c.take("<I")
        offset_off = c.pos
        tensors.append(TensorInfo(name, ns, n_dims_off, n_dims, dim_offs, dims, type_off, gt, offset_off,
                                  c.take("<Q")))
    infos_end = c.pos
    al = next((k for k in kvs if k.key == "general.alignment"), None)
    alignment = struct.unpack_from("<I", buf, al.val_off)[0] if al else 32
    data_start = (infos_end + alignment - 1) // alignment * alignment
    for t in tensors:
        t.data_off = data_start + t.offset
        blk, bpb = GGML_BLOCK.get(t.ggml_type, (1, 0))
        n = 1
        for d in t.dims:
            n *= d
        t.nbytes = n // blk * bpb
    return Layout(len(buf), version, n_tensors, n_kv, kvs, tensors, kv_start, infos_start, infos_end, alignment,
                  data_start)


def apply(base: bytes, lay: Layout, edits) -> bytes:
    """Apply edits (JSON-able lists) to the base file:
    ["write", off, hex]          overwrite bytes at off (never past the end)
    ["xor", off, x]              flip the bits x of the byte at off
    ["trunc", n]                 keep the first n bytes
    ["splice", start, end, hex]  replace header bytes [start, end) (before the tensor infos end);
                                 the data section is re-aligned, so the file stays well formed
                                 except for what the splice itself changes
    ["append", hex]              add bytes at the end (a new tensor's data)"""
    out = bytearray(base)
    splices = [e for e in edits if e[0] == "splice"]
    if splices:
        head = bytes(base[:lay.infos_end])
        for _, start, end, hx in sorted(splices, key=lambda e: -e[1]):
            head = head[:start] + bytes.fromhex(hx) + head[end:]
        pad = (-len(head)) % lay.alignment
        out = bytearray(head + b"\0" * pad + base[lay.data_start:])
    for e in edits:
        if e[0] == "write":
            off, data = e[1], bytes.fromhex(e[2])
            out[off:off + len(data)] = data[: max(0, len(out) - off)]
        elif e[0] == "xor":
            if e[1] < len(out):
                out[e[1]] ^= e[2]
        elif e[0] == "trunc":
            del out[e[1]:]
        elif e[0] == "append":
            out += bytes.fromhex(e[1])
    return bytes(out)


def str_bytes(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b
