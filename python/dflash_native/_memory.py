"""Telling a failure caused by memory running out from one caused by bad input."""

from __future__ import annotations

import mmap

# What a load may still need beside what it failed on (llama.cpp's vocab-only load builds a context).
LOAD_HEADROOM = 128 << 20


def out_of_memory(error: BaseException | None = None, headroom: int = LOAD_HEADROOM) -> bool:
    """Whether a failure was (most likely) memory running out: a MemoryError, a shared library or
    file that cannot be mapped, or too little address space left for a load. Libraries that report
    a failed load only as NULL or as a generic error (llama.cpp, numpy's memmap) leave no other way
    to tell, and their logs may not get through when memory is short."""
    if isinstance(error, MemoryError):
        return True
    if error is not None and any(s in str(error).lower() for s in ("failed to map segment", "cannot allocate memory")):
        return True
    try:
        mmap.mmap(-1, headroom).close()  # address space only: the pages are never touched
    except (OSError, ValueError):
        return True
    return False
