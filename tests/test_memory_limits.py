"""Running out of memory never kills the process.

Each probe runs in its own process under an address-space limit (RLIMIT_AS, what `ulimit -v`
sets), with limits placed between the footprint of a process that has only imported the package
and the peak of one that built an Engine and generated. Every outcome must be success, or a
MemoryError / RuntimeError whose message says where and what ran out; never a signal (GGML_ASSERT,
abort, std::terminate) or an exit. An engine whose generate ran out of memory must generate the
right output (a fresh engine's) once the limit is raised again.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import dflash_native
from fixtures import make_random_drafter_gguf

MiB = 1 << 20
PROMPT = list(range(3, 40))  # token ids: the tokenizer is not under test here
MAX_TOKENS = 12

# The child: prints one JSON line per step. "vm" is VmSize / VmPeak in bytes.
CHILD = r"""
import json, resource, sys, traceback

def vm(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

def say(**kw):
    print(json.dumps(kw), flush=True)

def outcome(fn):
    try:
        return {"outcome": "ok", "value": fn()}
    except (MemoryError, RuntimeError) as e:
        return {"outcome": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()[-2000:]}

mode, target, drafter, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
import dflash_native as dn
# what Engine() imports on first use (the tokenizer's library, the GGUF reader) is part of the
# package's footprint: an import that runs out is the interpreter's MemoryError, not ours
import gguf, llama_cpp  # noqa: E401

def engine():
    return dn.Engine(target, drafter=drafter, n_threads=2)

def generate(eng, speculative=None):
    return eng.generate(prompt, max_tokens=max_tokens, speculative=speculative).tokens

if mode == "baseline":
    say(peak=vm("VmPeak"))
elif mode == "probe":  # the limit was set before exec
    r = outcome(engine)
    say(step="engine", **{k: v for k, v in r.items() if k != "value"})
    if r["outcome"] == "ok":
        eng = r["value"]
        say(step="generate", **outcome(lambda: generate(eng)))
        say(step="generate_ar", **outcome(lambda: generate(eng, speculative=False)))
    say(step="done", peak=vm("VmPeak"))
elif mode == "recover":
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    eng = engine()
    for delta_mib in json.loads(sys.argv[6]):
        resource.setrlimit(resource.RLIMIT_AS, (vm("VmSize") + delta_mib * 2**20, hard))
        r = outcome(lambda: generate(eng))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # memory is back
        say(step="limited", delta_mib=delta_mib, **r)
        say(step="after", delta_mib=delta_mib, spec=generate(eng), ar=generate(eng, speculative=False))
    say(step="fresh", tokens=generate(engine(), speculative=False))
"""


@pytest.fixture(scope="module")
def pair(hf_checkpoint, gguf_model, tmp_path_factory):
    target = gguf_model("qwen3_5", outtype="f16")
    d = tmp_path_factory.mktemp("memory")
    drafter = make_random_drafter_gguf(d / "drafter.gguf", hf_checkpoint("qwen3_5"), outtype="f16", seed=1,
                                       block_size=8, target_gguf=target)
    script = d / "child.py"
    script.write_text(CHILD)
    return script, target, drafter


def run_child(pair, mode, limit=None, extra=()):
    script, target, drafter = pair

    def set_limit():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    # the child imports the package this test imported
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dflash_native.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(script), mode, str(target), str(drafter), json.dumps(PROMPT),
                        str(MAX_TOKENS), *extra], capture_output=True, text=True, timeout=120, preexec_fn=set_limit,
                       env=env)
    assert p.returncode == 0, (f"{mode} under {limit and limit // MiB} MiB: exit status {p.returncode} "
                               f"(negative: killed by a signal)\n{p.stderr[-3000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def check_failure(step):
    """A failure must be MemoryError / RuntimeError saying where ("[where] ...") and what ran out."""
    assert step["outcome"] in ("MemoryError", "RuntimeError"), step
    assert re.match(r"\[[\w .]+\] \S", step["msg"]), step
    assert "memory" in step["msg"].lower(), step


def test_memory_limits_never_kill(pair):
    # the address space after the imports varies by a few pages from one process to the next
    # (library mappings): the largest of three, plus 4 MiB, so that the tightest limit below fails
    # in the engine and not in an import the baseline made
    base = max(run_child(pair, "baseline")[0]["peak"] for _ in range(3)) + 4 * MiB
    full = run_child(pair, "probe")
    assert [s["outcome"] for s in full if "outcome" in s] == ["ok"] * 3
    spec, ar = full[1]["value"], full[2]["value"]
    assert spec == ar and len(ar) == MAX_TOKENS
    peak = full[-1]["peak"]
    assert peak > base + 16 * MiB, (base, peak)

    # denser near the baseline, where the engine's own allocations start to fail one by one (above
    # about a third of the way the engine runs, evicting cached graph plans when it must)
    limits = [base + int((peak - base) * f) for f in (0.0, 0.06, 0.12, 0.2, 0.3, 0.5)] + [peak + 64 * MiB]
    results = {}
    for limit in limits:
        steps = run_child(pair, "probe", limit)
        assert steps[-1]["step"] == "done", steps
        for s in steps[:-1]:
            if s["outcome"] != "ok":
                check_failure(s)
            elif s["step"] != "engine":
                assert s["value"] == ar, (limit // MiB, s)  # what it generates is right
        results[limit // MiB] = [s["outcome"] for s in steps[:-1]]
    # the limits bite (some probe fails) and are not all too low (the largest succeeds)
    assert any(o != ["ok"] * 3 for o in results.values()), results
    assert results[limits[-1] // MiB] == ["ok"] * 3, results


def test_engine_recovers_after_out_of_memory(pair):
    # From no headroom at all to enough for some graphs but not others: each generate under the
    # limit fails somewhere else (a new plan, a compute buffer, room to compute) or succeeds.
    deltas = [0, 8, 24, 48, 64, 96]
    steps = run_child(pair, "recover", extra=(json.dumps(deltas),))
    fresh = steps[-1]["tokens"]
    assert len(fresh) == MAX_TOKENS
    limited = [s for s in steps if s["step"] == "limited"]
    assert len(limited) == len(deltas)
    assert limited[0]["outcome"] == "MemoryError", limited[0]  # no headroom: nothing new fits
    for s in limited:
        if s["outcome"] == "ok":
            assert s["value"] == fresh, s
        else:
            check_failure(s)
    for s in steps:
        if s["step"] == "after":  # the same engine, with memory back: a fresh engine's output
            assert s["spec"] == fresh and s["ar"] == fresh, s
