"""The lossless rule of docs/architecture.md ("Exactness contract"): greedy speculative output equals AR output, except
that batched and single-token kernels may round differently, so the first divergence, if
any, must be at a near-tie of the reference (top-2 logit gap below a stated tolerance)."""

from __future__ import annotations

import numpy as np


def first_divergence_is_near_tie(ours, ref, ref_logits, tol: float) -> tuple[bool, str]:
    """ref_logits[i] are the reference's logits that chose ref[i]."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(np.asarray(ref_logits[i]))[-2:]
            gap = float(top2[1] - top2[0])
            return gap < tol, f"diverged at step {i}: ours {a} vs ref {b}, reference top-2 gap {gap:.2e} (tol {tol:g})"
    return True, "equal"
