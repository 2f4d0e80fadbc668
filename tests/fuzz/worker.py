"""Child process of the fuzz runner: loads and runs mutants one after another.

    python worker.py JOB.json

JOB: {"role": "target" | "drafter", "target": path, "drafter": path | null, "tmpdir": dir,
      "n_threads": int, "mutants": [[id, edits], ...]}. The mutated file is the target or the
drafter, per role. Prints one JSON line per event on stdout: {"start": id} before a mutant,
then {"id": id, "outcome": "ran" | "clean" | "other", "error": text}. A crash or a hang shows
as a start line without its outcome; the runner kills, names and re-runs.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_layout as G  # noqa: E402

# A mutant's huge length field must fail as MemoryError, not take the shared machine's memory.
_AS_LIMIT = int(os.environ.get("DFLASH_FUZZ_AS_LIMIT", str(6 << 30)))
CLEAN = (ValueError, RuntimeError, MemoryError)


_events = None  # the original stdout; fd 1 itself goes to stderr, where library output belongs


def emit(obj) -> None:
    _events.write(json.dumps(obj) + "\n")
    _events.flush()


def run_one(dn, job: dict, path: str) -> None:
    n_threads = job.get("n_threads", 1)
    if job["role"] == "target":
        eng = dn.Engine(path, n_ctx=64, n_threads=n_threads)
    else:
        eng = dn.Engine(job["target"], drafter=path, n_ctx=64, n_threads=n_threads)
    r = eng.generate([1, 2, 3, 4], max_tokens=6)
    if eng.tokenizer is not None:
        r = eng.generate("def f(x):\n    return x", max_tokens=4)
        r.text.encode("utf-8")
        eng.tokenizer.detokenize(list(range(min(eng.tokenizer.n_vocab, 700))))
        if eng.tokenizer.chat_template:
            eng.chat([{"role": "user", "content": "hi"}], max_tokens=2)


def special_path(kind: str, tmp: Path) -> Path:
    """Not a regular file: something that must be refused before it is opened for reading."""
    if kind == "fifo":  # nobody ever writes: reading it would block forever
        p = tmp / f"fifo-{os.getpid()}"
        if not p.exists():
            os.mkfifo(p)
        return p
    if kind == "symlink_to_fifo":
        p = tmp / f"link-{os.getpid()}"
        if not p.is_symlink():
            p.symlink_to(special_path("fifo", tmp))
        return p
    if kind == "directory":
        return tmp
    if kind == "empty":
        p = tmp / f"empty-{os.getpid()}.gguf"
        p.write_bytes(b"")
        return p
    return Path(kind)  # a device: /dev/zero, /dev/null, /dev/urandom


def main() -> None:
    global _events
    job = json.loads(Path(sys.argv[1]).read_text())
    _events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (_AS_LIMIT, _AS_LIMIT))
    import dflash_native as dn

    base_path = job["target"] if job["role"] == "target" else job["drafter"]
    base = Path(base_path).read_bytes()
    lay = G.parse(base)
    out = Path(job["tmpdir"]) / f"mutant-{os.getpid()}.gguf"
    for mid, edits in job["mutants"]:
        emit({"start": mid})
        special = next((e[1] for e in edits if e[0] == "path"), None)
        if special is None:
            out.write_bytes(G.apply(base, lay, edits) if edits else base)
        try:
            run_one(dn, job, str(special_path(special, Path(job["tmpdir"])) if special else out))
        except CLEAN as e:
            # the project's form is "[where] what"; a UnicodeDecodeError (a ValueError) says nothing
            text = f"{type(e).__name__}: {e}"[:400]
            clear = not isinstance(e, UnicodeError) and (isinstance(e, MemoryError) or str(e).startswith("["))
            emit({"id": mid, "outcome": "clean" if clear else "other", "error": text})
        except BaseException as e:  # noqa: BLE001 - any other exception is a finding
            tb = traceback.format_exc(limit=4)
            emit({"id": mid, "outcome": "other", "error": f"{type(e).__name__}: {e}"[:400] + "\n" + tb[-1200:]})
        else:
            emit({"id": mid, "outcome": "ran", "error": ""})
    out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
