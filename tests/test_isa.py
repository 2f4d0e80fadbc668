"""The instruction-set cap (csrc/base/cpu_isa.h): DFLASH_NATIVE_ISA=avx512|avx2|portable, or
dflash_native.set_isa, holds every runtime-dispatched kernel of ours (matmul, attention, conv, GDN,
top-1, sampler) at that level, so one machine runs what an AVX2-only or a baseline x86-64 CPU runs.

- With each level this CPU has, a tiny dense (Qwen3) and a tiny hybrid (Qwen3.5: GDN + attention)
  pair at F16 and llama.cpp's quantized types (the integer path's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, and
  IQ4_XS through the dequantizing path) compute the same bits as at the CPU's best: prompt logits,
  draft logits, greedy and sampled tokens (AR and speculative) and sampled log-probabilities. The
  env var is read once, so each level runs in a subprocess (tests/isa_worker.py).
- An unknown name, or a level the CPU lacks, raises ValueError at Engine creation (not an abort);
  the ISA in use is in the generation stats ("avx2 (capped)").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from fixtures import make_random_checkpoint, make_random_drafter_gguf

HERE = Path(__file__).resolve().parent
TYPES = ["f16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "iq4_xs"]
BLOCK = 8
# matmul_isas() names -> DFLASH_NATIVE_ISA values
ENV_NAME = {"avx512f": "avx512", "avx2": "avx2", "portable": "portable"}


def worker_env(isa: str | None) -> dict:
    """The environment of a worker: this test run's package first on the path, the cap or none."""
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_NATIVE_ISA"}
    pkg_root = str(Path(dn.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, str(HERE), env.get("PYTHONPATH", "")])
    if isa is not None:
        env["DFLASH_NATIVE_ISA"] = isa
    return env


def run_py(code: str, isa: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=worker_env(isa), capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> list[dict]:
    """Dense and hybrid targets with drafters, every matmul row 256 wide or a multiple (so the
    K-quants apply), F32 from our converters, then quantized by llama.cpp's quantizer to TYPES."""
    d = tmp_path_factory.mktemp("isa")
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    archs = {
        "dense": ("qwen3", dict(num_hidden_layers=2)),
        "hybrid": ("qwen3_5", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                   linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                                   linear_value_head_dim=128)),
    }
    out = []
    for name, (arch, kw) in archs.items():
        ckpt = make_random_checkpoint(d / name, arch, seed=41, hidden_size=256, intermediate_size=512, **heads, **kw)
        tg = convert_hf_to_gguf(ckpt, d / f"{name}-t.gguf", outtype="f32")
        dg = make_random_drafter_gguf(d / f"{name}-d.gguf", ckpt, outtype="f32", seed=42, block_size=BLOCK,
                                      target_gguf=tg, target_layer_ids=[0], num_hidden_layers=1,
                                      intermediate_size=512, **heads)
        for t in TYPES:
            q = {role: dn.quantize(src, d / f"{name}-{role}-{t}.gguf", t, n_threads=2, progress=False)
                 for role, src in (("target", tg), ("drafter", dg))}
            out.append({"name": f"{name}-{t}", "target": str(q["target"]), "drafter": str(q["drafter"])})
    return out


@pytest.fixture(scope="module")
def runs(pairs, tmp_path_factory) -> dict:
    """Every pair's outputs at the CPU's best ISA (no cap) and under each cap this CPU runs."""
    d = tmp_path_factory.mktemp("isa-runs")
    cases = d / "cases.json"
    cases.write_text(json.dumps(pairs))
    res = {}
    for isa in [None] + [ENV_NAME[i] for i in _core.testing.matmul_isas()]:
        npz = d / f"{isa or 'default'}.npz"
        p = subprocess.run([sys.executable, str(HERE / "isa_worker.py"), str(cases), str(npz)], env=worker_env(isa),
                           capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"worker under DFLASH_NATIVE_ISA={isa}:\n{p.stdout}\n{p.stderr}"
        with np.load(npz) as z:
            res[isa] = {k: z[k] for k in z.files}
    return res


def test_worker_runs_the_isa_asked(runs):
    best = _core.testing.matmul_isas()[0]
    assert str(runs[None]["isa"]) == best == str(runs[None]["matmul_isa"])
    for isa, r in runs.items():
        if isa is None:
            continue
        level = {v: k for k, v in ENV_NAME.items()}[isa]
        assert str(r["matmul_isa"]) == level
        want = level if level == best else f"{level} (capped)"
        assert str(r["isa"]) == want
        stats = {str(v) for k, v in r.items() if k.endswith("/stats_isa")}
        assert stats == {want}, stats


def test_every_isa_computes_the_same_bits(runs, pairs):
    """Under each cap every pair computes exactly what it computes at the CPU's best; and the
    runs really speculate and really are lossless (so the comparison covers the verify path)."""
    ref = runs[None]
    keys = [k for k in ref if "/" in k and not k.endswith("/stats_isa")]
    assert len(keys) == len(pairs) * 11, len(keys)
    for p in pairs:
        n = p["name"]
        assert (ref[f"{n}/spec_rounds"] > 0).all(), n
        np.testing.assert_array_equal(ref[f"{n}/spec_greedy"], ref[f"{n}/ar_greedy"], err_msg=n)
        np.testing.assert_array_equal(ref[f"{n}/spec_sampled"], ref[f"{n}/ar_sampled"], err_msg=n)
        assert np.isfinite(ref[f"{n}/eval"]).all() and np.isfinite(ref[f"{n}/draft"]).all(), n
    for isa, r in runs.items():
        if isa is None:
            continue
        bad = []
        for k in keys:
            a, b = ref[k], r[k]
            same = a.shape == b.shape and a.dtype == b.dtype and (
                np.array_equal(a.view(np.uint32), b.view(np.uint32)) if a.dtype == np.float32 else np.array_equal(a, b))
            if not same:
                diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.shape == b.shape else None
                bad.append(f"{k} (max |diff| {diff})")
        assert not bad, f"DFLASH_NATIVE_ISA={isa} differs from the CPU's best in: {bad}"


def test_bad_isa_raises_at_engine_creation(pairs):
    """An unknown DFLASH_NATIVE_ISA, or a level this CPU lacks (pretended: testing.pretend_cpu_isa
    lowers the CPU's best before the variable is first read), raises ValueError at Engine creation,
    naming the variable; the process goes on (no abort)."""
    target = pairs[0]["target"]
    code = f"""
import dflash_native as dn
from dflash_native import _core
PRETEND
try:
    dn.Engine({target!r}, n_ctx=32, n_threads=1)
except ValueError as e:
    print('ValueError:', e)
else:
    print('no error')
print('alive')
"""
    cases = [("avx9", "", "is not an instruction set"), ("sse", "", "is not an instruction set"),
             ("avx512", "_core.testing.pretend_cpu_isa('avx2')", "this CPU has no AVX-512F"),
             ("avx2", "_core.testing.pretend_cpu_isa('portable')", "this CPU has no AVX2")]
    for value, pretend, msg in cases:
        if pretend and pretend.split("'")[1] not in _core.testing.matmul_isas():
            continue  # this CPU cannot pretend to that level (it lacks it: the error is real there)
        p = run_py(code.replace("PRETEND", pretend), value)
        assert p.returncode == 0, p.stderr
        assert "alive" in p.stdout, p.stdout
        assert f"ValueError: [isa] DFLASH_NATIVE_ISA = '{value}'" in p.stdout and msg in p.stdout, p.stdout


def test_set_isa(pairs):
    """dflash_native.set_isa in-process: the description, the same tokens as uncapped, bad names."""
    levels = _core.testing.matmul_isas()  # this CPU's, best first (under a cap: those at or below it)
    best = levels[0]
    case = next(p for p in pairs if p["name"] == "hybrid-q4_k_m")
    eng = dn.Engine(case["target"], drafter=case["drafter"], block_size=BLOCK, n_ctx=96, n_threads=2, gate=False)
    prompt = [5, 17, 99, 3, 250, 41]
    try:
        want = eng.generate(prompt, max_tokens=16)
        # uncapped, the engine's own measured matmul choices may follow "; " (test_matmul_dispatch.py)
        assert want.stats.isa.split("; ")[0] == dn.isa() == best
        for isa in levels:
            dn.set_isa(ENV_NAME[isa].upper())  # names are case-insensitive
            got = eng.generate(prompt, max_tokens=16)
            assert got.tokens == want.tokens
            assert got.stats.isa == dn.isa() == (best if isa == best else f"{isa} (capped)")
        for bad, msg in (("avx1024", "is not an instruction set"), (3, "takes a str or None")):
            with pytest.raises(ValueError, match=msg):
                dn.set_isa(bad)
        assert dn.isa() == (best if len(levels) == 1 else "portable (capped)")  # the last one set
        assert _core.testing.matmul_isas() == ["portable"]  # the explicit-ISA kernels follow the cap
    finally:
        dn.set_isa(None)
    assert dn.isa() == best


def test_env_is_read_once_at_first_use():
    """DFLASH_NATIVE_ISA is read at the first kernel or engine, not at import, and only then."""
    if "avx2" not in _core.testing.matmul_isas():
        pytest.skip("this CPU has no AVX2 level to cap at")
    code = """
import os
import dflash_native as dn
os.environ['DFLASH_NATIVE_ISA'] = 'avx2'  # after the import: still read
first = dn.isa()
os.environ['DFLASH_NATIVE_ISA'] = 'portable'  # after the first use: not read again
print(first, '|', dn.isa())
"""
    p = run_py(code, None)
    assert p.returncode == 0, p.stderr
    best = _core.testing.matmul_isas()[0]
    want = "avx2" if best == "avx2" else "avx2 (capped)"
    assert p.stdout.strip() == f"{want} | {want}", p.stdout
