"""Measured matmul dispatch (csrc/kernels/cpu/matmul/dispatch.h): an engine times each weight type's matmul at
load, at one column and at 16, at the CPU's best level and at AVX2 below AVX-512, and runs each
type at the fastest (the CPU's best unless another beats it by more than 5%).

- Every matmul weight type of the target and the drafter is measured, at both column counts, on
  one of the engine's own matrices of that type; the level chosen follows the times.
- When a level is made slow (testing.slow_matmul spins in every matmul at it), the engine chooses
  the other, says so in its stats' `isa`, and computes the same bits as an engine that did not
  measure (every level computes the same bits: test_isa.py, test_matmul.py).
- Nothing is measured where nothing is to be chosen: a level the user picked (DFLASH_NATIVE_ISA,
  set_isa), DFLASH_NATIVE_TUNE=0, matmul="ggml"; a later set_isa holds the measured choices under
  its cap.
"""

from __future__ import annotations

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
BLOCK = 8
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300]
AVX512 = _core.testing.matmul_isas()[0] == "avx512f"
needs_avx512 = pytest.mark.skipif(not AVX512, reason="the CPU's best level is not AVX-512: only one level to run")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """A tiny hybrid pair quantized by llama.cpp's quantizer to Q4_K_M (Q4_K and Q6_K matrices),
    its drafter at Q8_0: three weight types to measure."""
    d = tmp_path_factory.mktemp("dispatch")
    ckpt = make_random_checkpoint(d / "ckpt", "qwen3_5", seed=11, hidden_size=256, intermediate_size=512,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_hidden_layers=2,
                                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                  linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128)
    tg = convert_hf_to_gguf(ckpt, d / "t-f32.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d-f32.gguf", ckpt, outtype="f32", seed=12, block_size=BLOCK, target_gguf=tg,
                                  target_layer_ids=[0], num_hidden_layers=1, intermediate_size=512,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    return {"target": str(dn.quantize(tg, d / "t.gguf", "q4_k_m", n_threads=2, progress=False)),
            "drafter": str(dn.quantize(dg, d / "d.gguf", "q8_0", n_threads=2, progress=False))}


def engine(pair, **kw) -> dn.Engine:
    return dn.Engine(pair["target"], drafter=pair["drafter"], block_size=BLOCK, n_ctx=96, n_threads=2, gate=False,
                     **kw)


def outputs(eng: dn.Engine) -> dict:
    """What the engine computes: prompt logits (a 8-column batch), greedy AR and speculative tokens."""
    spec = eng.generate(PROMPT, max_tokens=24)
    ar = eng.generate(PROMPT, max_tokens=24, speculative=False)
    assert spec.stats.rounds > 0
    return {"eval": eng.eval(PROMPT), "spec": spec.tokens, "ar": ar.tokens, "isa": spec.stats.isa}


def run_py(code: str, **env_extra) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_NATIVE_ISA", "DFLASH_NATIVE_TUNE")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(dn.__file__).resolve().parents[1]), str(HERE),
                                         env.get("PYTHONPATH", "")])
    env.update(env_extra)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_every_weight_type_is_measured(pair):
    eng = engine(pair)
    try:
        got = eng.matmul_dispatch()
        if not AVX512:
            assert got == []  # one level (AVX2 or portable): nothing to choose
            return
        assert {(c["type"], c["columns"]) for c in got} == {(t, n) for t in ("q4_K", "q6_K", "q8_0") for n in (1, 16)}
        for c in got:
            assert set(c["seconds"]) == {"avx512f", "avx2"}, c
            assert all(s > 0 for s in c["seconds"].values()), c
            assert c["rows"] >= 64 and c["K"] % 256 == 0 and c["tensor"], c
            t = c["seconds"]
            want = "avx2" if t["avx2"] < 0.95 * t["avx512f"] else "avx512f"
            assert c["chosen"] == c["in_use"] == want, c
        # the measured choices that differ from the CPU's best are named in the stats
        dev = [f"{c['type']} x{c['columns']} {c['chosen']}" for c in got if c["chosen"] != "avx512f"]
        isa = eng.generate(PROMPT, max_tokens=4).stats.isa
        assert isa == ("avx512f; matmul " + ", ".join(dev) if dev else "avx512f"), (isa, got)
    finally:
        eng.close()


SPIN = 20e-3


@needs_avx512
@pytest.mark.parametrize("slow, fast", [("avx512f", "avx2"), ("avx2", "avx512f")])
def test_a_slow_level_is_not_chosen(pair, slow, fast):
    """With every matmul at `slow` spinning 20 ms, each type runs at `fast`; the bits do not change.
    (20 ms: far above what these small matmuls take even on a loaded machine, so the choice cannot
    flip; the only time asserted is the spin's own lower bound.)"""
    base = engine(pair)
    want = outputs(base)
    base.close()
    _core.testing.slow_matmul(slow, SPIN)
    try:
        eng = engine(pair)
        got_dispatch = eng.matmul_dispatch()
        _core.testing.slow_matmul(slow, 0)  # the choices are made; the outputs below run at full speed
        got = outputs(eng)
        eng.close()
    finally:
        _core.testing.slow_matmul(slow, 0)
    assert len(got_dispatch) == 6
    for c in got_dispatch:
        assert c["chosen"] == c["in_use"] == fast, c
        assert c["seconds"][slow] >= SPIN, c  # the spin is in every timed run at `slow`
    if fast == "avx2":
        assert got["isa"] == "avx512f; matmul " + ", ".join(f"{t} x{n} avx2" for t in ("q4_K", "q6_K", "q8_0")
                                                            for n in (1, 16)), got["isa"]
    else:
        assert got["isa"] == "avx512f", got["isa"]
    assert got["spec"] == got["ar"] == want["spec"] == want["ar"]
    np.testing.assert_array_equal(got["eval"].view(np.uint32), want["eval"].view(np.uint32))


def test_nothing_measured_where_nothing_is_to_choose(pair):
    """A level the user chose, DFLASH_NATIVE_TUNE=0 and matmul="ggml" measure nothing."""
    code = f"""
import dflash_native as dn
e = dn.Engine.for_benchmark({pair['target']!r}, drafter={pair['drafter']!r}, block_size={BLOCK}, n_ctx=64,
                            n_threads=1, KW)
print(len(e.matmul_dispatch()), '|', e.generate({PROMPT!r}, max_tokens=4).stats.isa)
"""
    levels = _core.testing.matmul_isas()
    env_name = {"avx512f": "avx512", "avx2": "avx2", "portable": "portable"}
    for isa in levels:
        out = run_py(code.replace("KW", "gate=False"), DFLASH_NATIVE_ISA=env_name[isa]).strip()
        assert out == f"0 | {isa if isa == levels[0] else isa + ' (capped)'}", (isa, out)
    assert run_py(code.replace("KW", "gate=False"), DFLASH_NATIVE_TUNE="0").strip() == f"0 | {levels[0]}"
    assert run_py(code.replace("KW", "gate=False, matmul='ggml'")).split("|")[0].strip() == "0"


@needs_avx512
def test_set_isa_holds_the_measured_choices_under_its_cap(pair):
    """Measured at load, then capped by set_isa: every type runs at the cap (in_use), the stats name
    the cap alone; set_isa(None) gives the measured choices back."""
    code = f"""
import dflash_native as dn
from dflash_native import _core
_core.testing.slow_matmul('avx512f', 20e-3)
e = dn.Engine({pair['target']!r}, drafter={pair['drafter']!r}, block_size={BLOCK}, n_ctx=64, n_threads=1, gate=False)
_core.testing.slow_matmul('avx512f', 0)
for name in ('portable', 'avx512', None):
    dn.set_isa(name)
    d = e.matmul_dispatch()
    print(sorted({{c['chosen'] for c in d}}), sorted({{c['in_use'] for c in d}}), '|',
          e.generate({PROMPT!r}, max_tokens=4).stats.isa)
"""
    lines = run_py(code).strip().splitlines()
    dev = "avx512f; matmul " + ", ".join(f"{t} x{n} avx2" for t in ("q4_K", "q6_K", "q8_0") for n in (1, 16))
    assert lines == ["['avx2'] ['portable'] | portable (capped)",
                     "['avx2'] ['avx512f'] | avx512f",  # the user chose AVX-512: every kernel runs it
                     f"['avx2'] ['avx2'] | {dev}"], lines
