"""The command line as a user meets it: Ctrl-C in a stream, a closed pipe, bad flags, flags that
must take effect (python -m dflash_native, or cli.main in this process)."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dflash_native as dn
from dflash_native.cli import default_pair, main


def _pair():
    pair = default_pair()
    if pair is None:
        pytest.skip("no embedded default pair in this install")
    return pair


def _env() -> dict:
    """The environment for a child process that imports the package this test run imported."""
    pkg_root = str(Path(dn.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))


class _InterruptingStdout(io.StringIO):
    """stdout that raises KeyboardInterrupt (Ctrl-C) at its `after`-th write: inside the stream."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def write(self, s: str) -> int:
        self.after -= 1
        if self.after == 0:
            raise KeyboardInterrupt
        return super().write(s)


def test_generate_interrupted_mid_stream(monkeypatch, capsys):
    """Ctrl-C while tokens stream: exit status 130 and one line on stderr, no traceback (it was
    KeyboardInterrupt's traceback); the text so far stays on stdout."""
    target, drafter = _pair()
    out = _InterruptingStdout(after=4)
    monkeypatch.setattr(sys, "stdout", out)
    try:
        rc = main(["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "def fib(n):",
                   "--max-tokens", "200", "--n-ctx", "512", "--threads", "1"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main(): the user sees a traceback")
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    with dn.Engine(target, drafter=drafter, n_ctx=512, n_threads=1) as eng:
        assert eng.generate("def fib(n):", max_tokens=200).text.startswith(out.getvalue())
    assert out.getvalue()


def test_generate_into_a_closed_pipe_is_quiet():
    """`dflash-native generate ... | head -c 10`: the reader leaves; the command stops without an
    error message (it printed "error: [Errno 32] Broken pipe" and exited 2)."""
    target, _ = _pair()
    p = subprocess.Popen([sys.executable, "-m", "dflash_native", "generate", "--target", str(target), "--prompt",
                          "def fib(n):", "--max-tokens", "3000", "--n-ctx", "4096", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert p.stdout.read(10)
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 141, err
    assert b"Broken pipe" not in err and b"Traceback" not in err and b"Exception ignored" not in err, err


@pytest.mark.parametrize("port", ["99999", "-1", "0", "http"])
def test_serve_bad_port(port, capsys):
    """An impossible port is a usage error (it was an OverflowError traceback from bind())."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err


def test_demo_random_takes_the_speculation_flags(capsys):
    """demo --random honours --block-size, --draft-cutoff and --verify (it dropped them silently)."""
    rc = main(["demo", "--random", "--max-tokens", "8", "--threads", "1", "--block-size", "4", "--draft-cutoff", "0.25",
               "--verify", "tree", "--tree-budget", "6"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "block size: 4" in out and "draft cutoff: 0.25" in out and "verify: tree" in out, out
    assert "speculative output == AR output: yes" in out


@pytest.mark.parametrize("cmd,flag,value", [
    ("train-drafter", "--layers", "0"),  # was torch.cat()'s "expected a non-empty list of Tensors"
    ("train-drafter", "--seqs-per-step", "0"),  # was "max() arg is an empty sequence"
    ("train-drafter", "--anchors-per-seq", "0"),  # trained on nothing, silently
    ("train-drafter", "--steps", "-1"),  # trained no step, silently
    ("train-drafter", "--threads", "0"),
    ("demo", "--prompts", "0"),
])
def test_count_flags_refuse_impossible_values(cmd, flag, value, capsys):
    """Counts below their least meaningful value are usage errors naming the flag, before anything
    loads or trains."""
    extra = ["--target", "/nonexistent", "--out", "/nonexistent"] if cmd == "train-drafter" else []
    with pytest.raises(SystemExit) as e:
        main([cmd, *extra, flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_generate_prompt_and_prompt_file_exclude_each_other(tmp_path, capsys):
    """Both given: a usage error (--prompt-file silently won)."""
    (tmp_path / "p.txt").write_text("import os")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", "/nonexistent.gguf", "--prompt", "def f", "--prompt-file", str(tmp_path / "p.txt")])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def _command() -> str:
    """The `dflash-native` console script of this environment."""
    exe = Path(sys.executable).parent / "dflash-native"
    found = str(exe) if exe.is_file() else shutil.which("dflash-native")
    if found is None:
        pytest.fail("the dflash-native console script is not installed next to this Python")
    return found


def _import_done(lines: list[str], module: str) -> bool:
    """Whether PYTHONPROFILEIMPORTTIME's lines show `module`'s import finished."""
    return any(line.rsplit("|", 1)[-1].strip() == module for line in lines)


def test_ctrl_c_while_the_command_imports():
    """Ctrl-C while `dflash-native` is still importing its package printed a KeyboardInterrupt
    traceback and ended the process by SIGINT (-2). Now: exit 130, one line, no traceback. SIGINT
    is sent over and over, from the moment the package starts importing (PYTHONPROFILEIMPORTTIME
    prints each import as it finishes) until the process ends; a run counts only when the package's
    import had not finished, so the interrupt hit it (up to 5 tries)."""
    target, _ = _pair()
    env = dict(_env(), PYTHONPROFILEIMPORTTIME="1")
    hit_import = 0
    for _ in range(5):
        p = subprocess.Popen([_command(), "generate", "--target", str(target), "--prompt", "x", "--max-tokens", "2000",
                              "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
        lines: list[str] = []
        armed = threading.Event()

        def read():
            for line in p.stderr:
                lines.append(line)
                if _import_done([line], "dflash_native._interrupt"):
                    armed.set()
            armed.set()  # the process ended without it: the assertions below say so

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert armed.wait(120)
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline:
            p.send_signal(signal.SIGINT)
            time.sleep(0.02)
        rc = p.wait(timeout=10)
        reader.join(10)
        err = "".join(lines)
        assert _import_done(lines, "dflash_native._interrupt"), err[-3000:]
        assert rc == 130, err[-3000:]
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        assert "dflash-native: interrupted" in err
        hit_import += not _import_done(lines, "dflash_native")
        if hit_import:
            break
    assert hit_import, "SIGINT never arrived before the package finished importing"


def test_generate_with_stdout_closed_in_a_process():
    """`dflash-native generate ... >&-` as a shell runs it (fd 1 closed): a one-line error and exit 2
    (it was an AttributeError traceback and exit 1)."""
    target, _ = _pair()
    p = subprocess.run(["bash", "-c", 'exec "$@" >&-', "_", _command(), "generate", "--target", str(target),
                        "--prompt", "x", "--max-tokens", "2", "--threads", "1"],
                       stderr=subprocess.PIPE, text=True, env=_env(), timeout=300)
    assert p.returncode == 2, p.stderr
    assert "stdout is closed" in p.stderr and "Traceback" not in p.stderr, p.stderr
