"""python -m tests.fuzz [--n N] [--seed S] [--probes a,b] [--roles target,drafter] [--jobs J]

Draws N mutants per role, spread over the probe classes, runs them and prints the table
(probe class | tries | clean error | ran | other exc | hang | crash) and every finding."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .pair import build_pair
from .probes import PROBES, STRICT_PROBES
from .runner import FAILURES, Files, draw_mutants, run_mutants, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz")
    ap.add_argument("--n", type=int, default=500, help="mutants per role (target, drafter)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probes", default=",".join(PROBES))
    ap.add_argument("--roles", default="target,drafter")
    ap.add_argument("--jobs", type=int, default=2, help="child processes at once")
    ap.add_argument("--batch", type=int, default=16, help="mutants per child process")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per mutant before it counts as a hang")
    ap.add_argument("--workdir", default=None, help="where the base files are built (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write every mutant and its outcome here (JSON lines)")
    a = ap.parse_args(argv)

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="dflash-fuzz-base-"))
    target, drafter = build_pair(work)
    files = Files(target, drafter)
    probes = [p for p in a.probes.split(",") if p]
    mutants = []
    for role in a.roles.split(","):
        per = max(1, a.n // len(probes))
        for i, probe in enumerate(probes):
            mutants += draw_mutants(files, role, probe, per, a.seed * 1000 + i)
    t0 = time.monotonic()
    print(f"{len(mutants)} mutants of {target.name} / {drafter.name} (seed {a.seed})", flush=True)
    run_mutants(files, mutants, batch=a.batch, timeout=a.timeout, jobs=a.jobs, log=lambda s: print(s, flush=True))
    print(f"\n{table(mutants)}\n({time.monotonic() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            for m in mutants:
                f.write(json.dumps(m.__dict__) + "\n")
    loaded = [m for m in mutants if m.probe in STRICT_PROBES and m.outcome == "ran"]  # must be refused
    for m in loaded:
        print(f"  LOADED {m.id}: {m.desc}")
    return 1 if loaded or any(m.outcome in FAILURES for m in mutants) else 0


if __name__ == "__main__":
    sys.exit(main())
