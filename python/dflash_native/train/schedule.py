"""The learning-rate schedule of both trainers (target and drafter)."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine_lr"]


def warmup_cosine_lr(step: int, *, lr: float, warmup: int, steps: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps to `lr`, then cosine decay to `min_lr_ratio * lr` at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
