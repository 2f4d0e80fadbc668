"""Runs mutants in child processes, several per child, and classifies every outcome.

Outcomes: "ran" (loaded and generated), "clean" (ValueError / RuntimeError / MemoryError),
"other" (any other exception: a finding), "hang" (no outcome within the timeout), "crash" (the
child died: signal, abort, exit). A child that crashes or hangs is killed; the mutant it was on is
re-run alone to confirm it is the culprit (and, if it then behaves, the batch's earlier mutants are
re-run one per process), and the rest of the batch goes on in a fresh child.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

from . import gguf_layout as G
from .probes import PROBES

WORKER = Path(__file__).resolve().parent / "worker.py"
OUTCOMES = ("clean", "ran", "other", "hang", "crash")
FAILURES = ("other", "hang", "crash")


@dataclass
class Mutant:
    id: str
    role: str      # "target" or "drafter": which file is mutated
    probe: str
    desc: str
    edits: list
    outcome: str = ""
    error: str = ""


@dataclass
class Files:
    target: Path
    drafter: Path


def draw_mutants(files: Files, role: str, probe: str, n: int, seed: int) -> list[Mutant]:
    """n mutants of `probe` on the role's file, chosen by hypothesis from `seed` (no database, no
    shrinking: the same seed draws the same mutants)."""
    base = (files.target if role == "target" else files.drafter).read_bytes()
    lay = G.parse(base)
    strat = PROBES[probe](lay, base)
    seen: dict[str, tuple] = {}

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(strat)
    def collect(m):
        seen.setdefault(json.dumps(m[1]), m)

    collect()
    return [Mutant(f"{role}/{probe}/{i}", role, probe, d, e) for i, (d, e) in enumerate(list(seen.values())[:n])]


def _child_env() -> dict:
    import dflash_native

    env = dict(os.environ)
    pkg_root = str(Path(dflash_native.__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GGML_NO_BACKTRACE"] = "1"  # the assert line, not a gdb session, in the crash report
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _run_child(files: Files, role: str, batch: list[Mutant], timeout: float, tmp: Path, n_threads: int):
    """Runs batch in one child. Returns (results {id: (outcome, error)}, failed id or None,
    failure outcome, stderr tail)."""
    job = {"role": role, "target": str(files.target), "drafter": str(files.drafter), "tmpdir": str(tmp),
           "n_threads": n_threads, "mutants": [[m.id, m.edits] for m in batch]}
    fd, job_path = tempfile.mkstemp(suffix=".json", dir=tmp)
    with os.fdopen(fd, "w") as f:
        json.dump(job, f)
    err = tempfile.TemporaryFile(dir=tmp)
    p = subprocess.Popen([sys.executable, str(WORKER), job_path], stdout=subprocess.PIPE, stderr=err,
                         env=_child_env(), start_new_session=True)
    results, current, failure = {}, None, None
    buf = b""
    deadline = time.monotonic() + timeout + 30  # interpreter start and imports
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                failure = "hang"
                os.killpg(p.pid, signal.SIGKILL)
                break
            r, _, _ = select.select([p.stdout], [], [], min(left, 1.0))
            if not r:
                continue
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if "start" in ev:
                    current = ev["start"]
                    deadline = time.monotonic() + timeout
                else:
                    results[ev["id"]] = (ev["outcome"], ev["error"])
                    current = None
        rc = p.wait()
        if failure is None and current is not None:
            failure = "crash"
        if failure is None and rc != 0:
            failure = "crash"  # died between mutants or before the first
        err.seek(0)
        tail = err.read()[-3000:].decode("utf-8", "replace")
        if failure == "crash":
            tail = f"exit status {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "") + "\n" + tail
        return results, current, failure, tail
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        err.close()
        os.unlink(job_path)


def run_mutants(files: Files, mutants: list[Mutant], *, batch: int = 16, timeout: float = 60.0, jobs: int = 1,
                n_threads: int = 1, log=None) -> list[Mutant]:
    """Fills in every mutant's outcome. Mutants of one role run in the same children."""
    by_id = {m.id: m for m in mutants}
    tmp = Path(tempfile.mkdtemp(prefix="dflash-fuzz-"))
    lock = threading.Lock()

    def record(m: Mutant, outcome: str, error: str) -> None:
        m.outcome, m.error = outcome, error
        if log and outcome in FAILURES:
            with lock:
                log(f"  {outcome.upper():5s} {m.id}: {m.desc}\n        {error.strip()[-600:]}")

    def solo(m: Mutant) -> tuple[str, str]:
        res, cur, failure, tail = _run_child(files, m.role, [m], timeout, tmp, n_threads)
        if m.id in res:
            return res[m.id]
        return failure or "crash", tail

    def run_batch(todo: list[Mutant]) -> None:
        while todo:
            res, cur, failure, tail = _run_child(files, todo[0].role, todo, timeout, tmp, n_threads)
            for mid, (o, e) in res.items():
                record(by_id[mid], o, e)
            if failure is None:
                return
            if cur is None:  # died outside a mutant (start-up): nothing to blame, retry the rest alone
                for m in todo:
                    if not m.outcome:
                        record(m, *solo(m))
                return
            culprit = by_id[cur]
            outcome, error = (failure, tail) if len(todo) == 1 else solo(culprit)
            if outcome not in ("hang", "crash") and len(todo) > 1:
                # It behaved alone: an earlier mutant of the batch may have left damage behind.
                for m in todo[: todo.index(culprit)]:
                    o, e = solo(m)
                    if o in ("hang", "crash"):
                        record(m, o, e)
            record(culprit, outcome, error)
            todo = [m for m in todo if not m.outcome]

    groups: list[list[Mutant]] = []
    for role in ("target", "drafter"):
        ms = [m for m in mutants if m.role == role]
        groups += [ms[i:i + batch] for i in range(0, len(ms), batch)]
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            list(ex.map(run_batch, groups))
    finally:
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()
    return mutants


def table(mutants: list[Mutant]) -> str:
    rows: dict[str, dict[str, int]] = {}
    for m in mutants:
        r = rows.setdefault(f"{m.role} {m.probe}", dict.fromkeys(OUTCOMES, 0))
        r[m.outcome] += 1
    head = f"| {'probe class':24s} | tries | clean error |  ran | other exc | hang | crash |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    tot = dict.fromkeys(OUTCOMES, 0)
    for name, r in rows.items():
        for k in OUTCOMES:
            tot[k] += r[k]
        lines.append(f"| {name:24s} | {sum(r.values()):5d} | {r['clean']:11d} | {r['ran']:4d} | {r['other']:9d} "
                     f"| {r['hang']:4d} | {r['crash']:5d} |")
    lines.append(f"| {'total':24s} | {sum(tot.values()):5d} | {tot['clean']:11d} | {tot['ran']:4d} | "
                 f"{tot['other']:9d} | {tot['hang']:4d} | {tot['crash']:5d} |")
    return "\n".join(lines)
