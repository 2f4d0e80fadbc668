"""Structure-aware GGUF mutations as hypothesis strategies.

Each probe class maps a parsed base file (gguf_layout.Layout) to a strategy of mutants
(description, edits); gguf_layout.apply turns edits into the mutant's bytes. Hypothesis does the
choosing (seeded, so a run is reproducible); the probes know where the fields are.
"""

from __future__ import annotations

import struct

from hypothesis import strategies as st

from . import gguf_layout as G

# Integer values that break loaders: zero, one, off-by-one around the true value, sign flips,
# width limits and "huge but plausible".
def _interesting_ints(v: int):
    return st.sampled_from(sorted({0, 1, 2, 3, -1, -2, v - 1, v + 1, v * 2, v * 1000, 255, 256, 65535, 65536,
                                   2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, -(2**31),
                                   -(2**63)}))


def _pack_int(fmt: str, v: int) -> bytes:
    bits = struct.calcsize(fmt) * 8
    v &= (1 << bits) - 1
    if fmt[-1].islower():  # signed
        v = v - (1 << bits) if v >= 1 << (bits - 1) else v
    return struct.pack(fmt, v)


_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, 0.0, -0.0, 1e-45, 1e30, 1e38, -1e-6])
_U32 = "<I"
_U64 = "<Q"


def _write(off: int, data: bytes) -> list:
    return [["write", off, data.hex()]]


def _splice(start: int, end: int, data: bytes) -> list:
    return [["splice", start, end, data.hex()]]


def truncate(lay: G.Layout, base: bytes):
    regions = [(4, lay.kv_start), (lay.kv_start, lay.infos_start), (lay.infos_start, lay.infos_end),
               (lay.infos_end, lay.size)]
    return st.sampled_from(regions).flatmap(
        lambda r: st.integers(r[0], max(r[0], r[1] - 1)).map(lambda n: (f"truncate at {n}", [["trunc", n]])))


def header(lay: G.Layout, base: bytes):
    fields = [("version", 4, "<I", lay.version), ("n_tensors", 8, "<q", lay.n_tensors), ("n_kv", 16, "<q", lay.n_kv)]
    return st.sampled_from(fields).flatmap(lambda f: _interesting_ints(f[3]).map(
        lambda v: (f"header {f[0]} = {v}", _write(f[1], _pack_int(f[2], v)))))


def byte_flips(lo: int, hi: int, what: str):
    flip = st.tuples(st.integers(lo, hi - 1), st.integers(1, 255))
    return st.lists(flip, min_size=1, max_size=4).map(
        lambda fl: (f"{what} byte flips {[(o, x) for o, x in fl]}",
                    [e for o, x in fl for e in [["xor", o, x]]]))


def meta_flips(lay: G.Layout, base: bytes):
    return byte_flips(24, lay.infos_end, "metadata")


def kv_int(lay: G.Layout, base: bytes):
    kvs = [k for k in lay.kvs if k.vtype in G.INT_TYPES]

    def one(k: G.KV):
        fmt = G.SCALAR_FMT[k.vtype]
        cur = struct.unpack_from(fmt, base, k.val_off)[0]
        return _interesting_ints(cur).map(lambda v: (f"{k.key} = {v}", _write(k.val_off, _pack_int(fmt, v))))

    return st.sampled_from(kvs).flatmap(one)


def kv_float(lay: G.Layout, base: bytes):
    kvs = [k for k in lay.kvs if k.vtype in G.FLOAT_TYPES]
    return st.sampled_from(kvs).flatmap(lambda k: _FLOATS.map(
        lambda v: (f"{k.key} = {v}", _write(k.val_off, struct.pack(G.SCALAR_FMT[k.vtype], v)))))


def kv_type(lay: G.Layout, base: bytes):
    def one(k: G.KV):
        which = st.sampled_from([k.type_off] + ([k.arr_type_off] if k.arr_type_off >= 0 else []))
        return st.tuples(which, st.sampled_from(list(range(13)) + [13, 255, 2**31, 2**32 - 1])).map(
            lambda ov: (f"{k.key}: type field @{ov[0]} = {ov[1]}", _write(ov[0], struct.pack(_U32, ov[1]))))
    return st.sampled_from(lay.kvs).flatmap(one)


def kv_length(lay: G.Layout, base: bytes):
    """String lengths (keys, string values, string elements) and array counts."""
    def one(k: G.KV):
        fields = [("key length", k.key_str.len_off, k.key_str.n)]
        if k.sval is not None:
            fields.append(("string length", k.sval.len_off, k.sval.n))
        if k.count_off >= 0:
            fields.append(("array count", k.count_off, k.count))
        if k.arr_type == G.T_STRING and k.elems:
            fields.append(("element length", k.elems[0].len_off, k.elems[0].n))
            fields.append(("element length", k.elems[-1].len_off, k.elems[-1].n))
        return st.sampled_from(fields).flatmap(lambda f: _interesting_ints(f[2]).map(
            lambda v: (f"{k.key}: {f[0]} = {v}", _write(f[1], _pack_int(_U64, v)))))
    return st.sampled_from(lay.kvs).flatmap(one)


def kv_array(lay: G.Layout, base: bytes):
    """One element of an integer array (token types, tap layers, RoPE sections, draft vocabulary...)."""
    kvs = [k for k in lay.kvs if k.vtype == G.T_ARRAY and k.arr_type in G.INT_TYPES and k.count > 0]

    def one(k: G.KV):
        fmt = G.SCALAR_FMT[k.arr_type]
        return st.integers(0, k.count - 1).flatmap(lambda i: _interesting_ints(
            struct.unpack_from(fmt, base, k.elems[i][0])[0]).map(
            lambda v: (f"{k.key}[{i}] = {v}", _write(k.elems[i][0], _pack_int(fmt, v)))))
    return st.sampled_from(kvs).flatmap(one)


_STRINGS = ["", "x", "llama", "gpt2", "bert", "t5", "rwkv", "none", "no_vocab", "plamo2", "gemma4", "whitespace",
            "qwen2", "qwen35", "default", "qwen3", "qwen35", "dflash", "mamba", "\udcff", "A" * 300]


def kv_string(lay: G.Layout, base: bytes):
    """Replace a scalar string value (architecture, tokenizer model / pre-tokenizer, template...)."""
    kvs = [k for k in lay.kvs if k.sval is not None]
    val = st.one_of(st.sampled_from(_STRINGS).map(lambda s: s.encode("utf-8", "surrogateescape")),
                    st.binary(max_size=24))
    return st.tuples(st.sampled_from(kvs), val).map(
        lambda kv: (f"{kv[0].key} = {kv[1]!r}", _splice(kv[0].sval.len_off, kv[0].val_end, G.str_bytes(kv[1]))))


def vocab(lay: G.Layout, base: bytes):
    """The tokenizer's arrays: duplicate, empty, invalid UTF-8 or renamed tokens; broken merges."""
    toks, merges = lay.kv("tokenizer.ggml.tokens"), lay.kv("tokenizer.ggml.merges")
    if toks is None:
        return st.nothing()
    n = len(toks.elems)
    text = lambda s: base[s.off:s.off + s.n]  # noqa: E731
    tok_edit = st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).flatmap(lambda ij: st.sampled_from([
        (f"token {ij[1]} := token {ij[0]} (duplicate)", text(toks.elems[ij[0]])),
        (f"token {ij[1]} := '' (empty)", b""),
        (f"token {ij[1]} := invalid UTF-8", b"\xff\xfe"),
        (f"token {ij[1]} := 'zz{ij[1]}' (renamed)", f"zz{ij[1]}".encode()),
    ]).map(lambda d: (d[0], _splice(toks.elems[ij[1]].len_off, toks.elems[ij[1]].off + toks.elems[ij[1]].n,
                                    G.str_bytes(d[1])))))
    outs = [tok_edit]
    if merges is not None and merges.elems:
        m = len(merges.elems)
        bad = st.sampled_from([b"", b"ab", b" a", b"a ", b"a b c", b"\xff \xfe", "Ġ Ġ".encode(), b"zzz qqq"])
        outs.append(st.tuples(st.integers(0, m - 1), bad).map(lambda ib: (
            f"merge {ib[0]} := {ib[1]!r}",
            _splice(merges.elems[ib[0]].len_off, merges.elems[ib[0]].off + merges.elems[ib[0]].n, G.str_bytes(ib[1])))))
    return st.one_of(outs)


def tensor_dims(lay: G.Layout, base: bytes):
    def one(t: G.TensorInfo):
        fields = [("n_dims", t.n_dims_off, t.n_dims, _U32)] + [
            (f"ne[{i}]", o, d, "<q") for i, (o, d) in enumerate(zip(t.dim_offs, t.dims))]
        return st.sampled_from(fields).flatmap(lambda f: _interesting_ints(f[2]).map(
            lambda v: (f"{t.name}: {f[0]} = {v}", _write(f[1], _pack_int(f[3], v)))))
    return st.sampled_from(lay.tensors).flatmap(one)


def tensor_type(lay: G.Layout, base: bytes):
    types = st.sampled_from(list(range(0, 42)) + [-1, 2**31 - 1])
    return st.tuples(st.sampled_from(lay.tensors), types).map(lambda tv: (
        f"{tv[0].name}: type {tv[0].ggml_type} -> {tv[1]}", _write(tv[0].type_off, _pack_int("<i", tv[1]))))


def tensor_offset(lay: G.Layout, base: bytes):
    def one(t: G.TensorInfo):
        vals = st.sampled_from(sorted({0, 1, t.offset + 1, t.offset + lay.alignment, max(0, t.offset - lay.alignment),
                                       lay.size, 2**32, 2**63 - 1, 2**64 - 1, 2**64 - lay.alignment}))
        return vals.map(lambda v: (f"{t.name}: offset {t.offset} -> {v}", _write(t.offset_off, _pack_int(_U64, v))))
    return st.sampled_from(lay.tensors).flatmap(one)


def tensor_name(lay: G.Layout, base: bytes):
    names = [t.name for t in lay.tensors]
    return st.tuples(st.sampled_from(lay.tensors), st.sampled_from(["", "x", "blk.999.attn_q.weight", "A" * 80,
                                                                     "\udcff"] + names)).map(lambda tn: (
        f"{tn[0].name} renamed {tn[1]!r}",
        _splice(tn[0].name_str.len_off, tn[0].name_str.off + tn[0].name_str.n,
                G.str_bytes(tn[1].encode("utf-8", "surrogateescape")))))


_SPECIAL = {0: [struct.pack("<f", float("nan")), struct.pack("<f", float("inf")), struct.pack("<f", -3e38)],
            1: [b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\xff\x7b"],
            30: [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"]}


def data_special(lay: G.Layout, base: bytes):
    """NaN / Inf / huge values in the weights: a few elements, or a whole tensor."""
    ts = [t for t in lay.tensors if t.ggml_type in _SPECIAL and t.nbytes > 0]

    def one(t: G.TensorInfo):
        es = 4 if t.ggml_type == 0 else 2
        n = t.nbytes // es
        return st.tuples(st.sampled_from(_SPECIAL[t.ggml_type]), st.integers(0, n - 1), st.booleans()).map(
            lambda v: (f"{t.name}: {'all' if v[2] else f'element {v[1]}'} = {v[0].hex()}",
                       _write(t.data_off, v[0] * n) if v[2] else _write(t.data_off + v[1] * es, v[0])))
    return st.sampled_from(ts).flatmap(one)


def data_flips(lay: G.Layout, base: bytes):
    return byte_flips(lay.data_start, lay.size, "data")


def path(lay: G.Layout, base: bytes):
    """Paths that are not regular files, given where the file goes."""
    kinds = ["fifo", "symlink_to_fifo", "directory", "empty", "/dev/zero", "/dev/null", "/dev/urandom"]
    return st.sampled_from(kinds).map(lambda k: (f"path is {k}", [["path", k]]))


PROBES = {
    "path": path,
    "truncate": truncate,
    "header": header,
    "meta_flips": meta_flips,
    "kv_int": kv_int,
    "kv_float": kv_float,
    "kv_type": kv_type,
    "kv_length": kv_length,
    "kv_array": kv_array,
    "kv_string": kv_string,
    "vocab": vocab,
    "tensor_dims": tensor_dims,
    "tensor_type": tensor_type,
    "tensor_offset": tensor_offset,
    "tensor_name": tensor_name,
    "data_special": data_special,
    "data_flips": data_flips,
}


# ---- single named mutations (regression cases) ---------------------------------------------

def set_kv(lay: G.Layout, base: bytes, key: str, value) -> list:
    """Edits that give `key` a new value of its own type (numbers keep their width; strings and
    bytes are spliced in, the data section re-aligned)."""
    k = lay.kv(key)
    if k.sval is not None:
        data = value if isinstance(value, bytes) else value.encode("utf-8")
        return _splice(k.sval.len_off, k.val_end, G.str_bytes(data))
    fmt = G.SCALAR_FMT[k.vtype]
    return _write(k.val_off, struct.pack(fmt, value) if k.vtype in G.FLOAT_TYPES else _pack_int(fmt, value))


def set_tensor_type(lay: G.Layout, name: str, ggml_type: int) -> list:
    t = next(t for t in lay.tensors if t.name == name)
    return _write(t.type_off, _pack_int("<i", ggml_type))


def copy_token(lay: G.Layout, base: bytes, src: int, dst: int) -> list:
    """Token dst gets token src's text: a duplicate."""
    toks = lay.kv("tokenizer.ggml.tokens")
    s, d = toks.elems[src], toks.elems[dst]
    return _splice(d.len_off, d.off + d.n, G.str_bytes(base[s.off:s.off + s.n]))


# ---- things a loader must not silently ignore (issue 38) --------------------------------------
# Every mutant of these classes must end in a clear error naming what it added, renamed or
# duplicated: "ran" is a failure for them (STRICT_PROBES).

def _arch(lay: G.Layout, base: bytes) -> str:
    s = lay.kv("general.architecture").sval
    return base[s.off:s.off + s.n].decode("utf-8")


def _count(off: int, lay: G.Layout, base: bytes, delta: int) -> list:
    """The header's n_tensors (off 8) or n_kv (off 16), plus delta."""
    return _write(off, struct.pack("<q", struct.unpack_from("<q", base, off)[0] + delta))


def _tensor_info(name: str, dims: list, ggml_type: int, offset: int) -> bytes:
    return (G.str_bytes(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<I", ggml_type) + struct.pack("<Q", offset))


def _new_tensor(lay: G.Layout, base: bytes, name: str, dims: list, ggml_type: int = 0) -> list:
    """Edits that add tensor `name` (F32 zeros by default) after the others: its info after the last
    info, its data at the end of the file, where GGUF's contiguous-offset rule wants it."""
    end = lay.size - lay.data_start
    offset = (end + lay.alignment - 1) // lay.alignment * lay.alignment
    blk, bpb = G.GGML_BLOCK[ggml_type]
    n = 1
    for d in dims:
        n *= d
    data = b"\0" * (offset - end) + b"\0" * (n // blk * bpb)
    return (_count(8, lay, base, 1) + _splice(lay.infos_end, lay.infos_end, _tensor_info(name, dims, ggml_type, offset))
            + [["append", data.hex()]])


def _near_miss(name: str):
    """Names one edit away from `name` that no loader knows."""
    return st.sampled_from([name + "x", name[:-1] + ("x" if name[-1] != "x" else "y"), "x" + name, name.upper(),
                            name.replace(".", "_", 1), name + ".weight"])


def tensor_rename(lay: G.Layout, base: bytes):
    """A tensor renamed by one edit: the original is missing, or (optional tensors: the lm_head) the
    new name is one nobody reads. Either way an error naming a tensor, never a tied lm_head."""
    return st.sampled_from(lay.tensors).flatmap(lambda t: _near_miss(t.name).map(lambda new: (
        f"{t.name} renamed {new!r}",
        _splice(t.name_str.len_off, t.name_str.off + t.name_str.n, G.str_bytes(new)))))


# Tensors llama.cpp's architectures have and ours do not read: biases, post-norms, sinks, scales, the
# DFlash 2 / DSpark heads, llama.cpp's draft vocabulary map.
_EXTRA_TENSORS = ["blk.0.attn_q.bias", "blk.1.attn_output.bias", "blk.0.attn_post_norm.weight",
                  "blk.0.ffn_post_norm.weight", "blk.0.attn_sinks.weight", "blk.0.layer_output_scale.weight",
                  "blk.0.exp_probs_b.bias", "blk.0.ffn_gate_up_exps.weight", "blk.99.attn_norm.weight",
                  "output.bias", "token_embd_norm.weight", "fc.scale", "markov_w1.weight", "markov_w2.weight",
                  "conf_proj.weight", "selector_hidden.weight", "selector_predecessor.weight",
                  "blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight", "d2t", "zz.weight"]


def tensor_extra(lay: G.Layout, base: bytes):
    names = {t.name for t in lay.tensors}
    extra = [n for n in _EXTRA_TENSORS if n not in names]
    return st.tuples(st.sampled_from(extra), st.sampled_from([[4], [8, 2], [1]])).map(lambda nd: (
        f"extra tensor {nd[0]} {nd[1]}", _new_tensor(lay, base, nd[0], nd[1])))


def tensor_dup(lay: G.Layout, base: bytes):
    """A second tensor of an existing name (its data after the others')."""
    ts = [t for t in lay.tensors if t.ggml_type in G.GGML_BLOCK]
    return st.sampled_from(ts).map(lambda t: (f"duplicate tensor {t.name}",
                                              _new_tensor(lay, base, t.name, list(t.dims), t.ggml_type)))


def _kv_bytes(key: str, vtype: int, value) -> bytes:
    if vtype == G.T_STRING:
        return G.str_bytes(key) + struct.pack("<I", vtype) + G.str_bytes(value)
    return G.str_bytes(key) + struct.pack("<I", vtype) + struct.pack(G.SCALAR_FMT[vtype], value)


def _new_kv(lay: G.Layout, base: bytes, kv_bytes: bytes) -> list:
    return _count(16, lay, base, 1) + _splice(lay.infos_start, lay.infos_start, kv_bytes)


# Keys that change what llama.cpp computes and that we do not implement ("{a}": the file's arch),
# with a type and value as llama.cpp's converter writes them.
_EXTRA_KEYS = [("{a}.attention.sliding_window", 4, 128), ("{a}.attn_logit_softcapping", 6, 50.0),
               ("{a}.final_logit_softcapping", 6, 30.0), ("{a}.logit_scale", 6, 0.5), ("{a}.embedding_scale", 6, 8.0),
               ("{a}.attention.scale", 6, 0.125), ("{a}.attention.value_scale", 6, 0.5),
               ("{a}.expert_gating_func", 4, 2), ("{a}.expert_weights_scale", 6, 2.5), ("{a}.expert_shared_count", 4, 2),
               ("{a}.rope.scaling.type", G.T_STRING, "longrope"), ("{a}.rope.scaling.alpha", 6, 2.0),
               ("{a}.attention.layer_norm_epsilon", 6, 1e-5), ("{a}.hidden_activation", G.T_STRING, "gelu"),
               ("{a}.conv_kernel_size", 4, 4), ("{a}.conv_group_size", 4, 8), ("{a}.selector_rank", 4, 8),
               ("{a}.selector_top_k", 4, 4), ("{a}.sample_from_anchor", 7, True),
               ("{a}.has_confidence_head", 7, True), ("{a}.hyper_connection.count", 4, 4), ("{a}.zz", 4, 1),
               ("split.count", 2, 2)]


# What the drafter implements of them (drafter.h: sliding window layers, the draft head's scale and
# soft cap, the embedding scale, the attention scale and value scale): a file with them loads.
_IMPLEMENTED = {"dflash": {"dflash.attention.sliding_window", "dflash.final_logit_softcapping", "dflash.logit_scale",
                           "dflash.embedding_scale", "dflash.attention.scale", "dflash.attention.value_scale"}}


def kv_extra(lay: G.Layout, base: bytes):
    a = _arch(lay, base)
    keys = [(k.format(a=a), t, v) for k, t, v in _EXTRA_KEYS
            if lay.kv(k.format(a=a)) is None and k.format(a=a) not in _IMPLEMENTED.get(a, ())]
    return st.sampled_from(keys).map(lambda k: (f"extra key {k[0]} = {k[2]!r}", _new_kv(lay, base, _kv_bytes(*k))))


def kv_dup(lay: G.Layout, base: bytes):
    """A second copy of an existing key."""
    return st.sampled_from(lay.kvs).map(lambda k: (
        f"duplicate key {k.key}", _new_kv(lay, base, base[k.key_str.len_off:k.val_end])))


# Keys a loader may leave unread: what the file is, its tokenizer, how it was quantized.
_HARMLESS = ("general.", "tokenizer.", "quantize.")


def kv_rename(lay: G.Layout, base: bytes):
    """An architecture key renamed by one edit: the original is missing (or takes its default) and
    the new name is unknown; either way an error naming a key."""
    kvs = [k for k in lay.kvs if not k.key.startswith(_HARMLESS)]
    return st.sampled_from(kvs).flatmap(lambda k: _near_miss(k.key).map(lambda new: (
        f"key {k.key} renamed {new!r}", _splice(k.key_str.len_off, k.key_str.off + k.key_str.n, G.str_bytes(new)))))


STRICT_PROBES = {
    "tensor_rename": tensor_rename,
    "tensor_extra": tensor_extra,
    "tensor_dup": tensor_dup,
    "kv_extra": kv_extra,
    "kv_dup": kv_dup,
    "kv_rename": kv_rename,
}
PROBES.update(STRICT_PROBES)
