"""llama.cpp's DFlash-family drafter graph (llama-cpp-python 0.3.36's libllama through ctypes),
as common/speculative.cpp drives it: context features injected at their positions, one block
decoded, and what the drafter outputs read back: the logits of every block row and the rows of
llama_get_embeddings_nextn (DFlash 2's selector lattice, DSpark's confidences). Also: random
drafters of a target converted by both converters (`both_converters`), and a GGUF's keys and
tensors (`read_gguf`)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGUFReader

from test_convert_dflash import _LlamaDrafter, _cpp_fn

# keys where llama.cpp's drafter file and ours differ (test_llamacpp_files.EXPECTED_DRAFTER_KEY_DIFFS)
KEY_DIFFS = {"general.name", "dflash.attention.causal"}


def spec_with_context(target_gguf, drafter_gguf, block, n_ctx, seed):
    """Our Spec on `drafter_gguf`, with n_ctx random context features in its ring (the target
    decoded n_ctx prompt tokens so the positions line up): (target, spec, features [n_ctx, width])."""
    from dflash_native import _core

    t = _core.Target(str(target_gguf), n_ctx=256, kv_type="f32", max_verify=16, n_threads=2)
    s = _core.Spec(t, str(drafter_gguf), block_size=block, ring_capacity=64)
    feats = np.random.default_rng(seed).standard_normal((n_ctx, len(s.tap_layers), t.n_embd)).astype(np.float32)
    t.decode(list(range(3, 3 + n_ctx)))
    _core.testing.push_features(s, feats, 0)
    return t, s, feats.reshape(n_ctx, -1)


def read_gguf(path):
    """(keys -> values, tensor name -> ReaderTensor), GGUF.* keys left out."""
    r = GGUFReader(path)
    return ({k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")},
            {t.name: t for t in r.tensors})


def both_converters(d, target_ckpt, target_gguf, variants, llamacpp_converter, **common):
    """Per variant name -> make_random_drafter_gguf overrides: the random drafter's HF checkpoint
    (out[name, "hf"]), our convert_dflash's F32 file (out[name, "ours"]) and llama.cpp's
    convert_hf_to_gguf.py's (out[name, "llama.cpp"]) of it, for the target (seed 6, two layers
    tapping target layers 0 and 1, `common` overrides)."""
    from fixtures import make_random_drafter_gguf
    from llamacpp_tools import convert_with_llamacpp

    pre = read_gguf(target_gguf)[0]["tokenizer.ggml.pre"]
    out, jobs = {}, []
    for name, over in variants.items():
        out[name, "hf"] = d / f"{name}-hf"
        out[name, "ours"] = make_random_drafter_gguf(
            d / f"{name}-ours.gguf", target_ckpt, outtype="f32", seed=6, target_gguf=target_gguf,
            ckpt_dir=out[name, "hf"], **{"num_hidden_layers": 2, "target_layer_ids": [0, 1], **common, **over})
        out[name, "llama.cpp"] = d / f"{name}-lc.gguf"
        jobs.append(dict(model=out[name, "hf"], outfile=out[name, "llama.cpp"], outtype="f32", tokenizer_pre=pre,
                         args=["--target-model-dir", str(target_ckpt)]))
    convert_with_llamacpp(llamacpp_converter, jobs)
    return out


def assert_same_files(ours, theirs):
    """The same keys and values but KEY_DIFFS, the same tensor names, types, shapes and bytes;
    returns (keys, tensors) of ours."""
    (kv_o, t_o), (kv_l, t_l) = read_gguf(ours), read_gguf(theirs)
    assert {k: v for k, v in kv_o.items() if k not in KEY_DIFFS} == {k: v for k, v in kv_l.items() if k not in KEY_DIFFS}
    assert set(t_o) == set(t_l)
    for name, t in t_o.items():
        u = t_l[name]
        assert (t.tensor_type, list(t.shape)) == (u.tensor_type, list(u.shape)), name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(u.data), err_msg=name)
    return kv_o, t_o


@pytest.fixture(scope="module")
def llama_cpp():
    """llama_cpp's low-level module, backend up, llama.cpp's load logs off (errors only)."""
    mod = pytest.importorskip("llama_cpp")
    from llama_cpp import _logger

    mod.llama_backend_init()
    level = _logger.logger.level
    _logger.set_verbose(False)
    yield mod
    _logger.logger.setLevel(level)


class LlamaDrafter(_LlamaDrafter):
    """llama.cpp running a drafter with the target's context as ctx_other (flash attention off, F32
    KV cache: test_convert_dflash's settings), non-causal as common/speculative.cpp sets it."""

    def __init__(self, ll, target_gguf, drafter_gguf):
        super().__init__(ll, target_gguf, drafter_gguf)  # the target and drafter models and contexts; close()
        top_k = _cpp_fn(ll, "_Z33llama_model_dflash_selector_top_kPK11llama_model", ctypes.c_uint32, [ctypes.c_void_p])
        self.k = int(top_k(self.d_model))
        set_nextn = _cpp_fn(ll, "_Z26llama_set_embeddings_nextnP13llama_contextbb", None,
                            [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool])
        self.get_nextn = _cpp_fn(ll, "_Z26llama_get_embeddings_nextnP13llama_context", ctypes.POINTER(ctypes.c_float),
                                 [ctypes.c_void_p])
        set_nextn(self.d_ctx, True, False)  # as common/speculative.cpp sets it for DFlash 2
        ll.llama_set_causal_attn(self.d_ctx, False)  # and non-causal (no dflash.attention.causal: false)
        self.n_embd = ll.llama_model_n_embd(self.d_model)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.d_model))

    def run(self, block, features):
        """Decode `block` after `features` [n, width] (positions 0..n-1; the block after them);
        returns (logits [len(block), n_vocab], nextn [len(block), n_embd]) of every block row."""
        ll = self.ll
        assert ll.llama_memory_seq_rm(ll.llama_get_memory(self.d_ctx), 0, -1, -1)
        batch = ll.llama_batch_ext_init(self.d_ctx)
        try:
            rows = np.ascontiguousarray(features, dtype=np.float32)
            for i in range(rows.shape[0]):
                e = ll.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
                idx = ll.llama_batch_ext_add_embd(batch, 0, e)
                assert idx >= 0 and ll.llama_batch_ext_set_pos(batch, idx, (ll.llama_pos * 1)(i))
            assert ll.llama_process(self.d_ctx, ll.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            ll.llama_batch_ext_clear(batch)
            for i, tok in enumerate(block):
                idx = ll.llama_batch_ext_add_token(batch, 0, int(tok))
                assert idx >= 0
                ll.llama_batch_ext_set_pos(batch, idx, (ll.llama_pos * 1)(rows.shape[0] + i))
                ll.llama_batch_ext_set_output_logits(batch, idx, not self.k)  # DFlash 2 outputs no logits
            assert ll.llama_process(self.d_ctx, ll.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            nextn = self.get_nextn(self.d_ctx)
            packed = (np.ctypeslib.as_array(nextn, shape=(len(block), self.n_embd)).copy() if nextn
                      else np.zeros((len(block), self.n_embd), np.float32))
            logits = np.zeros((len(block), self.n_vocab), np.float32) if self.k else np.stack(
                [np.ctypeslib.as_array(ll.llama_get_logits_ith(self.d_ctx, i), shape=(self.n_vocab,)).copy()
                 for i in range(len(block))])
            return logits, packed
        finally:
            ll.llama_batch_ext_free(batch)

    def lattice(self, block, features):
        """DFlash 2: [len(block) - 1, k + k*k], the lattice rows of block positions 1.."""
        return self.run(block, features)[1][1:, : self.k * (self.k + 1)]


def walk(lattice: np.ndarray, k: int) -> list[int]:
    """common/speculative.cpp's DFlash 2 draft: from predecessor 0 (the anchor), each row's
    argmax (first on ties) of the scores given the previous choice; the token is its candidate."""
    out, pred = [], 0
    for row in lattice:
        scores = row[k + pred * k: k + (pred + 1) * k]
        pred = int(np.argmax(scores))
        out.append(int(row[pred]))
    return out


