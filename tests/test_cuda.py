"""CUDA GDN tape kernels: they compile here (nvcc, no GPU needed), and on a GPU they match the
CPU reference kernels (the consistency harness: every backend present against the CPU path)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from dflash_native import _core

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_compile(tmp_path):
    include = Path(sysconfig.get_paths()["purelib"]) / "include"  # ggml headers from llama-cpp-python
    p = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(ROOT / "csrc/cuda/gdn_tape.cu"),
                        "-I", str(ROOT / "csrc"), "-I", str(include), "-o", str(tmp_path / "gdn_tape.o")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "gdn_tape.o").stat().st_size > 0


def random_gdn(rng, T, H_k, H_v, d):
    def l2(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    return (l2(rng.standard_normal((T, H_k, d))), l2(rng.standard_normal((T, H_k, d))),
            rng.standard_normal((T, H_v, d)).astype(np.float32), -rng.uniform(0.01, 2, (T, H_v)).astype(np.float32),
            rng.uniform(0, 1, (T, H_v)).astype(np.float32), (0.3 * rng.standard_normal((H_v, d, d))).astype(np.float32))


@pytest.mark.skipif(not _core.cuda_available(), reason="no CUDA device, or built without DFLASH_NATIVE_CUDA")
@pytest.mark.parametrize("T,H_k,H_v,d", [(1, 1, 1, 16), (15, 2, 4, 33), (16, 16, 32, 128), (17, 3, 3, 127)])
def test_cuda_matches_cpu(T, H_k, H_v, d):
    rng = np.random.default_rng(T * 1000 + d)
    q, k, v, g, beta, S0 = random_gdn(rng, T, H_k, H_v, d)
    cpu = _core.gdn_tape_record(q, k, v, g, beta, S0)
    gpu = _core.testing.cuda_gdn_tape_record(q, k, v, g, beta, S0)
    for a, b in zip(gpu, cpu):  # F32: different summation order only
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    for n in (0, 1, T // 2, T):
        np.testing.assert_allclose(_core.testing.cuda_gdn_tape_replay(S0, *cpu[1:], n),
                                   _core.gdn_tape_replay(S0, *cpu[1:], n), atol=1e-4, rtol=1e-4)
