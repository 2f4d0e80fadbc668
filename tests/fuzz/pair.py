"""The fuzzed base files: a tiny Qwen3.5 hybrid target and its DFlash drafter, both written by
the package's own converters from random checkpoints (tests/fixtures)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])  # tests/: the shared fixtures package


def build_pair(dst: Path, outtype: str = "f16") -> tuple[Path, Path]:
    from dflash_native.convert import convert_hf_to_gguf
    if _TESTS not in sys.path:  # `python -m tests.fuzz` from the repository root
        sys.path.insert(0, _TESTS)
    from fixtures import make_random_checkpoint, make_random_drafter_gguf

    dst.mkdir(parents=True, exist_ok=True)
    target, drafter = dst / f"target-{outtype}.gguf", dst / f"drafter-{outtype}.gguf"
    if not (target.is_file() and drafter.is_file()):
        ckpt = make_random_checkpoint(dst / "hf-target", "qwen3_5", seed=11)
        convert_hf_to_gguf(ckpt, target, outtype=outtype)
        make_random_drafter_gguf(drafter, ckpt, outtype=outtype, seed=12, block_size=4, target_gguf=target)
    return target, drafter
