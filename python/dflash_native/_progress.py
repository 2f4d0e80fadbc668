"""A one-line text progress bar on stderr, redrawn in place: the converters' and the quantizer's."""

from __future__ import annotations

import sys


def draw_bar(label: str, i: int, n: int, detail: str = "", *, head: str = "") -> None:
    """Step i of n (1-based) of `label` ("[dflash-native LABEL] HEAD [####   ] i/n DETAIL"); a
    newline ends the line at i == n."""
    filled = "#" * (30 * i // max(n, 1))
    head = f"{head} " if head else ""
    sys.stderr.write(f"\r[dflash-native {label}] {head}[{filled:<30}] {i}/{n} {detail[:40]:<40}")
    if i >= n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (progress bars only there: a log file gets no redrawn lines)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False
