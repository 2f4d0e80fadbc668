"""The local training corpus: the Python standard library's own sources.

Every machine with Python has it, so a model trained here can be retrained
anywhere without a download. By default the corpus is every `.py` file under
`sysconfig.get_paths()["stdlib"]` except test directories and site-packages;
`root=` replaces it with a directory (its files ending in `suffixes`) or an
explicit list of files, so users can train on their own text.

Files are split into train / held-out by a stable hash of their relative path
(SHA-1, not Python's salted `hash`), so the split is the same on every machine
and does not move when files are added elsewhere. `heldout_prompts` cuts
code-continuation prompts for benchmarks from held-out files only.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = [
    "HELDOUT_FRACTION",
    "HeldoutPrompt",
    "corpus_files",
    "heldout_prompts",
    "iter_files",
    "iter_texts",
    "load_text",
]

HELDOUT_FRACTION = 0.03

# Directory names never read from the default corpus: test suites (Lib/test,
# unittest/test, lib2to3/tests, idlelib/idle_test, ...) and installed packages.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})

SPLITS = ("train", "heldout")

Root = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Root = None, *, suffixes: Sequence[str] = (".py",)) -> list[tuple[str, Path]]:
    """All corpus files as (relative name, path), sorted by name.

    `root=None`: the standard library minus `EXCLUDED_DIRS`. A directory: its
    files ending in one of `suffixes`, recursively (excluded directories are
    skipped only for the standard library). A list of files: those files, named
    by the path as given. Raises ValueError for a path that does not exist or a
    corpus with no non-empty file."""
    out: list[tuple[str, Path]] = []
    if root is None or isinstance(root, (str, os.PathLike)):
        base = stdlib_root() if root is None else Path(root)
        if not base.exists():
            raise ValueError(f"[corpus] corpus path {str(base)!r} does not exist")
        if base.is_file():
            out.append((base.name, base))
        else:
            for dirpath, dirnames, filenames in os.walk(base):
                if root is None:
                    dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
                dirnames.sort()
                for name in filenames:
                    if name.endswith(tuple(suffixes)):
                        p = Path(dirpath) / name
                        out.append((p.relative_to(base).as_posix(), p))
        where = str(base)
    else:
        for item in root:
            p = Path(item)
            if not p.is_file():
                raise ValueError(f"[corpus] corpus file {str(p)!r} does not exist")
            out.append((Path(item).as_posix(), p))
        where = f"{len(out)} listed files"
    out = [(name, p) for name, p in out if p.stat().st_size > 0]
    if not out:
        raise ValueError(f"[corpus] corpus {where!r} is empty (no non-empty files ending in {list(suffixes)})")
    return sorted(set(out))


def _heldout_key(name: str) -> float:
    """Stable position of a file in [0, 1): SHA-1 of its relative name."""
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def split_files(root: Root = None, *, heldout_fraction: float = HELDOUT_FRACTION,
                suffixes: Sequence[str] = (".py",)) -> dict[str, list[tuple[str, Path]]]:
    """{"train": [...], "heldout": [...]}: a file is held out when its hash key
    is below `heldout_fraction`. With two or more files each split gets at least
    one (the lowest / highest key), so tiny explicit corpora still have both."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"[corpus] heldout_fraction must be in [0, 1), got {heldout_fraction}")
    files = corpus_files(root, suffixes=suffixes)
    keyed = sorted(files, key=lambda f: (_heldout_key(f[0]), f[0]))
    n_held = sum(_heldout_key(name) < heldout_fraction for name, _ in files)
    if len(files) >= 2:
        n_held = min(max(n_held, 1), len(files) - 1)
    return {"heldout": sorted(keyed[:n_held]), "train": sorted(keyed[n_held:])}


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"[corpus] unknown split {split!r}; expected one of {list(SPLITS)}")
    return split


def iter_files(split: str = "train", *, root: Root = None, heldout_fraction: float = HELDOUT_FRACTION,
               suffixes: Sequence[str] = (".py",)) -> Iterator[Path]:
    """Paths of the files of `split` ("train" or "heldout"), in name order."""
    _check_split(split)
    for _, p in split_files(root, heldout_fraction=heldout_fraction, suffixes=suffixes)[split]:
        yield p


def iter_texts(split: str = "train", *, root: Root = None, heldout_fraction: float = HELDOUT_FRACTION,
               suffixes: Sequence[str] = (".py",)) -> Iterator[tuple[str, str]]:
    """(relative name, text) of the files of `split`; undecodable bytes are replaced."""
    _check_split(split)
    for name, p in split_files(root, heldout_fraction=heldout_fraction, suffixes=suffixes)[split]:
        yield name, p.read_text(encoding="utf-8", errors="replace")


def load_text(split: str = "train", max_bytes: int | None = None, *, root: Root = None,
              heldout_fraction: float = HELDOUT_FRACTION, suffixes: Sequence[str] = (".py",),
              separator: str = "\n\n") -> str:
    """The files of `split` joined by `separator`, in name order; with `max_bytes`,
    whole files are taken until the UTF-8 size would pass it (at least one)."""
    parts: list[str] = []
    n_bytes = 0
    for _, text in iter_texts(split, root=root, heldout_fraction=heldout_fraction, suffixes=suffixes):
        size = len(text.encode("utf-8")) + len(separator)
        if max_bytes is not None and parts and n_bytes + size > max_bytes:
            break
        parts.append(text)
        n_bytes += size
    return separator.join(parts)


# ---------------------------------------------------------------------------
# held-out prompts
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class HeldoutPrompt:
    text: str       # whole lines from a def/class header on, ending with a newline
    n_tokens: int   # len(tokenizer's encoding of text), <= the requested prompt_tokens
    source: str     # relative name of the held-out file
    line: int       # 1-based line of the def/class header


_HEADER = re.compile(r"^(\s*)(?:async\s+def|def|class)\s+\w")


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids from a `tokenizers.Tokenizer`, a transformers tokenizer, a
    dflash_native Engine (`tokenize`), or a plain callable."""
    if hasattr(tokenizer, "tokenize") and hasattr(tokenizer, "detokenize"):
        return list(tokenizer.tokenize(text))
    if hasattr(tokenizer, "encode"):
        enc = tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)
    return list(tokenizer(text))


def heldout_prompts(n: int, prompt_tokens: int, tokenizer: Any, *, root: Root = None, seed: int = 0,
                    heldout_fraction: float = HELDOUT_FRACTION, min_lines: int = 2) -> list[HeldoutPrompt]:
    """`n` code-continuation prompts from held-out files only.

    Each starts at a def/class header and takes whole lines while the prompt
    stays within `prompt_tokens` tokens; it needs `min_lines` lines and half of
    `prompt_tokens` at least, and the definition must go on after it. The
    candidates of all held-out files are shuffled with `seed`, so the set is
    deterministic and spread over files. Raises ValueError when fewer than `n`
    candidates exist."""
    if n < 1 or prompt_tokens < 1:
        raise ValueError(f"[corpus] heldout_prompts needs n >= 1 and prompt_tokens >= 1, got {n}, {prompt_tokens}")
    candidates: list[tuple[str, int, list[str]]] = []
    for name, text in iter_texts("heldout", root=root, heldout_fraction=heldout_fraction):
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            m = _HEADER.match(line)
            if m is None:
                continue
            indent = len(m.group(1))
            end = i + 1  # the definition's last line + 1: up to the next line at or left of the header
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
            if end - i > min_lines:
                candidates.append((name, i, lines[i:end]))
    random.Random(seed).shuffle(candidates)

    prompts: list[HeldoutPrompt] = []
    for name, i, body in candidates:
        text, n_tok = "", 0
        for k in range(1, len(body)):  # k < len(body): at least one line is left to continue
            t = "".join(body[:k])
            n_t = len(_encode(tokenizer, t))
            if n_t > prompt_tokens:
                break
            text, n_tok = t, n_t
            if k >= min_lines and n_t == prompt_tokens:
                break
        if text.count("\n") >= min_lines and 2 * n_tok >= prompt_tokens:
            prompts.append(HeldoutPrompt(text=text, n_tokens=n_tok, source=name, line=i + 1))
            if len(prompts) == n:
                return prompts
    raise ValueError(f"[corpus] only {len(prompts)} held-out prompts of {(prompt_tokens + 1) // 2}..{prompt_tokens} "
                     f"tokens and >= {min_lines} lines exist; asked for {n}")
