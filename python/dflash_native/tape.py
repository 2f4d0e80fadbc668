"""The GDN tape as a Python object: record a Gated DeltaNet pass, replay any prefix of it.

This is the hybrid-rollback primitive of the engine (csrc/kernels/cpu/gdn_tape.cpp), for embedding and tests.
Shapes (float32): q, k [T, H_k, d]; v [T, H_v, d]; g (log decay) and beta [T, H_v]; states
[H_v, d_k, d_v] (value head h reads key head h % H_k).
"""

from __future__ import annotations

import numpy as np

from . import _core


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


class GdnTape:
    """Per token per value head the tape keeps (k_t, u_t, g_t): d_k + d_v + 1 floats, against
    d_k * d_v for a state snapshot."""

    def __init__(self):
        self.k = self.u = self.g = None
        self._state0_t = None  # S^T per head, the core's layout

    def record(self, q, k, v, g, beta, state0) -> np.ndarray:
        """Runs T tokens from state0 (left untouched), keeps the tape; returns o [T, H_v, d]."""
        self._state0_t = _f32(np.swapaxes(_f32(state0), 1, 2))
        o, self.k, self.u, self.g = _core.gdn_tape_record(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta),
                                                          self._state0_t)
        return o

    @property
    def n_tokens(self) -> int:
        return 0 if self.g is None else int(self.g.shape[0])

    @property
    def nbytes(self) -> int:
        return 0 if self.g is None else self.k.nbytes + self.u.nbytes + self.g.nbytes

    def replay(self, n: int, state0=None) -> np.ndarray:
        """The state [H_v, d_k, d_v] after the first n recorded tokens, from state0 (default: the
        state the pass was recorded from). Bitwise the state the engine's forward pass reaches."""
        if self.g is None:
            raise ValueError("[gdn_tape] nothing recorded yet")
        if not 0 <= int(n) <= self.n_tokens:
            raise ValueError(f"[gdn_tape] n = {n} outside [0, {self.n_tokens}]")
        s0 = self._state0_t if state0 is None else _f32(np.swapaxes(_f32(state0), 1, 2))
        return np.swapaxes(_core.gdn_tape_replay(s0, self.k, self.u, self.g, int(n)), 1, 2)
