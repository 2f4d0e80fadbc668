"""Rows quantized by ggml's own quantizer (ggml_quantize_chunk in the libggml-base that
llama-cpp-python installs, the code llama-quantize runs), for kernel tests: gguf-py quantizes only
the block-32 types, not the K- and IQ-quants."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q


def _lib() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).resolve().parents[1] / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def ggml_quantize(W: np.ndarray, qtype: Q) -> np.ndarray:
    """W F32 [M, K] -> uint8 [M, row bytes]: its rows in qtype, as llama.cpp's quantizer writes them."""
    lib = _lib()
    W = np.ascontiguousarray(W, np.float32)
    M, K = W.shape
    out = np.zeros((M, lib.ggml_row_size(int(qtype), K)), np.uint8)
    assert lib.ggml_quantize_chunk(int(qtype), W.ctypes.data, out.ctypes.data, 0, M, K, None) == out.size
    return out
