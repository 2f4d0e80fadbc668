"""The command line as a user meets it: Ctrl-C in a stream, a closed pipe, bad flags, flags that
must take effect (python -m dflash_native, or cli.main in this process)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
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
