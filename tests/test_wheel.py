"""Packaging (issue 19): the runtime without llama-cpp-python, an installed package that carries its
own ggml and libllama, and a built wheel installed into a fresh venv running the demo.

The wheel test needs a built, repaired wheel (DFLASH_NATIVE_WHEEL=path): building one compiles
llama-cpp-python with portable ggml flags and the core (minutes on 2 cores), which does not fit the
suite, so the suite runs it only when given a wheel (`python bench/wheel_install.py` builds one and
times the same steps). Its install + demo half is the < 60 s goal of the issue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dflash_native as dn
from dflash_native.cli import default_pair

ROOT = Path(__file__).resolve().parents[1]
PKG_DIR = Path(dn.__file__).resolve().parent
# `import llama_cpp` raises ImportError in the child, as in an environment without llama-cpp-python
NO_LLAMA_CPP = "import sys\nsys.modules['llama_cpp'] = None\n"


def _child(code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter importing the package this test run imported."""
    env = dict(os.environ, PYTHONPATH=str(PKG_DIR.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", NO_LLAMA_CPP + code], env=env, capture_output=True, text=True,
                          timeout=300)


def test_runs_without_llama_cpp(tmp_path):
    """Nothing at run time imports llama_cpp: text (tokenizer in the core), generation and the
    quantizer work with `import llama_cpp` failing."""
    pair = default_pair()
    if pair is None:
        pytest.skip("no embedded default pair in this install")
    target, drafter = pair
    out = tmp_path / "drafter-q8_0.gguf"
    r = _child(f"""
import dflash_native as dn
eng = dn.Engine({str(target)!r}, drafter={str(drafter)!r}, n_ctx=256)
ar = eng.generate("def fibonacci(n):", max_tokens=16, speculative=False)
sp = eng.generate("def fibonacci(n):", max_tokens=16)
assert ar.tokens == sp.tokens and ar.text == sp.text and ar.tokens, (ar.tokens, sp.tokens)
text = "def f(x):\\n    return x"
assert eng.detokenize(eng.tokenize(text)) == text
dn.quantize({str(drafter)!r}, {str(out)!r}, "q8_0", progress=False)
print("ok")
""")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    assert out.read_bytes()[:4] == b"GGUF" and out.stat().st_size < drafter.stat().st_size


def _bundled() -> list[Path]:
    return sorted(p for p in PKG_DIR.iterdir() if p.name.startswith(("libggml", "libllama")))


def test_installed_package_loads_its_own_ggml():
    """An installed package (pip install ., a wheel) carries ggml and libllama beside the core and
    loads those copies, with llama-cpp-python out of the way; the dev tree (python/ + build/dev) runs
    on its build rpath."""
    if not _bundled():
        pytest.skip(f"{PKG_DIR} carries no ggml (the dev tree, or DFLASH_NATIVE_BUNDLE_GGML=OFF)")
    r = _child("""
import json
import dflash_native as dn, dflash_native.cli
eng = dn.Engine(dn.cli.default_pair()[0], n_ctx=64)  # tokenizes: libllama is loaded
print(json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libggml' in l or 'libllama' in l})))
""")
    assert r.returncode == 0, r.stderr
    loaded = [Path(p) for p in json.loads(r.stdout)]
    assert {p.name.split(".so")[0].split("-")[0] for p in loaded} >= {"libggml", "libllama"}, loaded
    for p in loaded:  # beside _core, or grafted by auditwheel into dflash_native.libs/
        assert p.parent in (PKG_DIR, PKG_DIR.parent / "dflash_native.libs"), p


@pytest.mark.wheel
def test_wheel_installs_alone_and_runs_the_demo():
    wheel = os.environ.get("DFLASH_NATIVE_WHEEL")
    if not wheel:
        pytest.skip("set DFLASH_NATIVE_WHEEL to a repaired wheel (python bench/wheel_install.py builds one)")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "wheel_install.py"), "--wheel", wheel],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]  # the demo exits 1 unless spec == AR
    assert "speculative output == AR output: yes" in r.stdout, r.stdout[-3000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert not row["llama_cpp_installed"]
    names = {Path(p).name.split(".so")[0].split("-")[0] for p in row["libs"]}
    assert names >= {"libggml", "libllama", "libdflash_native"}, row["libs"]
    assert all(p.startswith(("dflash_native/", "dflash_native.libs/")) for p in row["libs"]), row["libs"]
