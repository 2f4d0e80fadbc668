"""The lossless rule (docs/architecture.md, "Exactness contract"): greedy speculative output equals AR output, except that
batched and single-token matmuls may round differently (F16/F32 weights), so a divergence is
allowed only where AR's own top-2 logits are a near-tie."""

from __future__ import annotations

from typing import Sequence

import numpy as np

NEAR_TIE = 1e-2  # top-2 logit gap below which a batched/single-token rounding difference may flip the argmax


def first_divergence_gap(engine, prompt, ar: Sequence[int], spec: Sequence[int]) -> float | None:
    """None when `spec` equals `ar`; else the top-2 gap of AR's logits at the first token where they
    differ (from a fresh `engine.eval` of prompt + AR's tokens up to there)."""
    k = next((i for i, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
    if k is None:
        if len(ar) == len(spec):
            return None
        k = min(len(ar), len(spec))  # one stopped earlier: compare at the first missing token
    ids = list(engine.tokenize(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
    top2 = np.sort(engine.eval(ids + list(ar[:k]))[-1])[-2:]
    return float(top2[1] - top2[0])


def verdict(gaps: Sequence[float | None]) -> tuple[bool, str]:
    """(lossless, description) over several prompts' `first_divergence_gap` results."""
    div = [g for g in gaps if g is not None]
    ok = all(g < NEAR_TIE for g in div)
    if not div:
        return True, f"yes ({len(gaps)}/{len(gaps)} identical)"
    return ok, (f"{'yes' if ok else 'NO'} ({len(gaps) - len(div)}/{len(gaps)} identical; the others first differ "
                f"where AR's top-2 logit gap is {', '.join(f'{g:.0e}' for g in div)}; near-tie < {NEAR_TIE:g})")
