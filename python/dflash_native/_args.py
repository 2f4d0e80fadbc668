"""Engine's argument checks: types at the boundary, so that none reaches pybind11 as a raw TypeError
(a ValueError naming the call and the argument instead). What the values may be (ranges, files,
names) the C++ core checks."""

from __future__ import annotations

import numbers
import os
import secrets
from collections.abc import Mapping
from typing import Iterable

import numpy as np

from . import _core

__all__ = ["as_bool", "as_int", "as_opt_int", "as_path", "as_real", "as_sampling",
           "as_stop_strings", "as_str", "as_token_ids"]


def as_int(where: str, name: str, value, *, bits: int = 64) -> int:
    """An int or numpy integer (not a bool, not a float) that fits the core's `bits`-bit int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"[{where}] {name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    lim = 1 << (bits - 1)
    if not -lim <= v < lim:
        raise ValueError(f"[{where}] {name} = {v} is out of range (a {bits}-bit int)")
    return v


def as_opt_int(where: str, name: str, value, *, bits: int = 64) -> int | None:
    return None if value is None else as_int(where, name, value, bits=bits)


def as_bool(where: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"[{where}] {name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def as_real(where: str, name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"[{where}] {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def as_str(where: str, name: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"[{where}] {name} must be a str, got {type(value).__name__} {value!r}")
    return value


def as_path(where: str, name: str, value) -> str:
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise ValueError(f"[{where}] {name} must be a path (str, bytes or os.PathLike), got {type(value).__name__}")
    return os.fsdecode(os.fspath(value))


def as_token_ids(where: str, tokens) -> list[int]:
    """A sequence (or 1-D integer array) of ints as a list; bytes and floats are refused rather
    than read as ids."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raise ValueError(f"[{where}] got {type(tokens).__name__}: pass text as a str (decode the bytes first) "
                         f"or token ids as a sequence of ints")
    if isinstance(tokens, (set, frozenset, Mapping)):  # unordered, or keys: not a token sequence
        raise ValueError(f"[{where}] token ids must be a sequence (a list, tuple or 1-D integer array), got "
                         f"{type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"[{where}] token ids must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        return tokens.tolist()
    try:
        items = list(tokens)
    except TypeError:
        raise ValueError(f"[{where}] expected a str or a sequence of token ids, got {type(tokens).__name__}") from None
    for i, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"[{where}] token ids must be ints, got {type(t).__name__} {t!r} at index {i}")
    return [int(t) for t in items]


def as_sampling(temperature, top_k, top_p, min_p, seed, logprobs=None) -> "_core.Sampling | None":
    """generate()'s sampling arguments as a checked _core.Sampling (the core checks the ranges), or
    None for greedy (temperature 0) without logprobs. seed=None draws a fresh 64-bit seed."""
    w = "generate"
    temperature, top_p = as_real(w, "temperature", temperature), as_real(w, "top_p", top_p)
    min_p = as_real(w, "min_p", min_p)
    top_k = as_int(w, "top_k", top_k)
    if logprobs is not None:
        if isinstance(logprobs, (bool, np.bool_)) or not isinstance(logprobs, (int, np.integer)) \
                or not 0 <= int(logprobs) <= _core.MAX_LOGPROBS:
            raise ValueError(f"[generate] logprobs must be None or an int in [0, {_core.MAX_LOGPROBS}] (the "
                             f"alternatives reported per token), got {type(logprobs).__name__} {logprobs!r}")
        logprobs = int(logprobs)
    if seed is None:
        seed = secrets.randbits(64)
    elif isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 1 << 64:
        raise ValueError(f"[generate] seed must be None or an int in [0, 2**64), got {type(seed).__name__} {seed!r}")
    s = _core.Sampling(temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=int(seed),
                       logprobs=-1 if logprobs is None else logprobs)  # "[sampling] ..."
    return s if temperature > 0 or logprobs is not None else None


def as_stop_strings(stop) -> tuple[str, ...]:
    """None, a str, or a sequence of str -> the non-empty stop strings."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Iterable):
        raise ValueError(f"[generate] stop must be a str, a sequence of str or None, got {type(stop).__name__}")
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"[generate] stop strings must be str, got {type(s).__name__} {s!r}")
        if s:
            out.append(s)
    return tuple(out)
