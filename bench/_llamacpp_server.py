"""llama.cpp's own llama-server as the benchmarks' peer: built once from the llama.cpp source tree
the pinned llama-cpp-python 0.3.36 sdist vendors, run as a real process on 127.0.0.1.

- `llama_server_binary()` builds `llama-server` (CPU only: GGML_NATIVE, no CUDA, static, no web
  UI, no network features) with cmake into CACHE/llama.cpp-<key>, key = a hash of the source tree,
  the build flags, the compiler and the CPU's flags; ccache is used when present. The source tree
  is $DFLASH_LLAMACPP_SRC when set, else the sdist's vendor/llama.cpp, which pip downloads and
  which is extracted once under CACHE (tests/llamacpp_tools.llamacpp_tree). A second call, or a
  second process, finds the built binary. A missing cmake or C/C++ compiler is a clear error.
- On a CPU with AMX the build leaves AMX out (-mno-amx-*): llama.cpp's AMX buffer type crashes on
  batched quantized matmuls in this llama.cpp (tests/llamacpp_tools.py), so llama-server runs as
  on an x86 CPU without AMX, weights repacked by its CPU_REPACK kernels: the "repack (no AMX)"
  mode the llama-cpp-python rows of the benches use (_common.llama_bufts).
- `LlamaServer(model, ...)` starts llama-server (`--parallel`, `--threads`, `--ctx-size`; with a
  drafter, `-md DRAFTER --spec-type draft-dflash` (draft-dspark for a DSpark file), llama.cpp's
  DFlash speculative decoding), waits for /health and serves `complete(tokens, n_predict)`:
  /completion on a token-id prompt, temperature 0, no prompt cache, returning the generated token
  ids and the server's timings; `spec_counters()` reads its speculation counters (/metrics).
- `run_clients(server, per_client, n_predict)`: client thread i sends its prompts one after
  another; every request's result and the wall time.

`python bench/_llamacpp_server.py` builds (or finds) the binary and prints its path.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, concurrent_clients  # noqa: E402  (also puts tests/ on sys.path)

_HASHED = ("CMakeLists.txt", "cmake", "common", "ggml", "include", "src", "tools", "vendor")
_TARGETS = ("llama-server",)


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cmake_args(src: Path, build: Path) -> list[str]:
    args = ["-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_OPENMP=ON",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"]
    if "amx_int8" in _cpu_flags():  # -march=native without AMX: see the module's docstring
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        args += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if shutil.which("ccache"):
        args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    return args


def _tool_versions() -> str:
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cc is None:
        missing.append("a C compiler (cc, gcc or clang)")
    if cxx is None:
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise RuntimeError("building llama.cpp's llama-server needs " + " and ".join(missing) +
                           " on PATH (Debian: apt-get install cmake g++)")
    out = []
    for tool in ("cmake", cxx):
        r = subprocess.run([tool, "--version"], capture_output=True, text=True)
        out.append(r.stdout.splitlines()[0] if r.stdout else tool)
    return " | ".join(out)


def _source_key(src: Path, cmake_args: list[str], tools: str) -> str:
    """A hash of every file cmake builds from (path and contents), the cmake flags (less the
    paths), the toolchain's versions and the CPU's flags (GGML_NATIVE builds for this CPU)."""
    h = hashlib.sha256()
    for top in _HASHED:
        p = src / top
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        for f in files:
            h.update(str(f.relative_to(src)).encode() + b"\0")
            h.update(f.read_bytes())
    h.update(json.dumps([a for a in cmake_args if not a.startswith(("-S", "-B", str(src)))]).encode())
    h.update(tools.encode())
    h.update(" ".join(sorted(_cpu_flags())).encode())
    return h.hexdigest()[:16]


def llamacpp_source_tree() -> Path:
    """llama.cpp's full source tree of the pinned llama-cpp-python sdist ($DFLASH_LLAMACPP_SRC or
    extracted under CACHE)."""
    from llamacpp_tools import llamacpp_tree

    return llamacpp_tree(CACHE / "llama-cpp-python-0.3.36-sdist")


def llama_server_binary(jobs: int | None = None, quiet: bool = False) -> Path:
    """The path of llama.cpp's llama-server built from the pinned sources (built on first use:
    minutes; `jobs` parallel compiles, default $DFLASH_LLAMACPP_JOBS or the CPU count)."""
    tools = _tool_versions()
    src = llamacpp_source_tree()
    probe = _cmake_args(src, Path("BUILD"))
    key = _source_key(src, probe, tools)
    build = CACHE / f"llama.cpp-{key}"
    exe = build / "bin" / "llama-server"
    if exe.is_file():
        return exe
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"llama.cpp-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if exe.is_file():
            return exe
        jobs = jobs or int(os.environ.get("DFLASH_LLAMACPP_JOBS", 0)) or os.cpu_count() or 1
        log = CACHE / f"llama.cpp-{key}.log"
        if not quiet:
            print(f"building llama.cpp's llama-server from {src} into {build} ({jobs} jobs; log {log})",
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as out:
            for cmd in (["cmake", *_cmake_args(src, build)],
                        ["cmake", "--build", str(build), "--target", *_TARGETS, "-j", str(jobs)]):
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
                if r.returncode != 0:
                    tail = log.read_text(errors="replace")[-4000:]
                    raise RuntimeError(f"llama.cpp build failed ({' '.join(cmd[:3])} ..., exit {r.returncode}); "
                                       f"log {log}:\n{tail}")
        if not exe.is_file():
            raise RuntimeError(f"llama.cpp's build finished without {exe} (log {log})")
        if not quiet:
            print(f"built {exe} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return exe


def built_llama_server() -> Path | None:
    """The llama-server binary if it is already built for these sources, else None (no build)."""
    try:
        tools = _tool_versions()
        src = llamacpp_source_tree() if os.environ.get("DFLASH_LLAMACPP_SRC") or \
            (CACHE / "llama-cpp-python-0.3.36-sdist").is_dir() else None
    except (RuntimeError, FileNotFoundError):
        return None
    if src is None:
        return None
    exe = CACHE / f"llama.cpp-{_source_key(src, _cmake_args(src, Path('BUILD')), tools)}" / "bin" / "llama-server"
    return exe if exe.is_file() else None


def llama_bufts() -> str:
    """Where the built llama-server puts its weights (the benches' `llama_bufts` field): "repack
    (no AMX)" on a CPU with AMX (the build leaves AMX out), else "default" (llama.cpp's own
    extra buffer types)."""
    return "repack (no AMX)" if "amx_int8" in _cpu_flags() else "default"


def spec_type(drafter) -> str:
    """llama.cpp's speculative type for a drafter GGUF, as llama.cpp itself infers it
    (common_speculative_types_from_gguf): architecture "dflash", draft-dspark when it carries the
    Markov head (markov_w1), else draft-dflash (DFlash and DFlash 2: the selector is read from the
    file by the same implementation)."""
    import gguf

    r = gguf.GGUFReader(str(drafter))
    f = r.fields.get("general.architecture")
    arch = bytes(f.parts[f.data[0]]).decode() if f is not None else None
    if arch != "dflash":
        raise ValueError(f"{drafter}: general.architecture is {arch!r}, not a DFlash drafter (\"dflash\")")
    return "draft-dspark" if any(t.name == "markov_w1.weight" for t in r.tensors) else "draft-dflash"


def accept_length(before: dict, after: dict) -> float | None:
    """llama.cpp's mean acceptance length between two spec_counters(): 1 + accepted draft tokens
    per verification round (None: no round)."""
    rounds = after["rounds"] - before["rounds"]
    return 1.0 + (after["accepted"] - before["accepted"]) / rounds if rounds else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server as a child process on 127.0.0.1 (a free port), until close() / the `with`
    block ends. drafter: a DFlash drafter GGUF, run as llama.cpp's draft-dflash speculative type
    (draft_max: the most draft tokens per round, default llama.cpp's own)."""

    def __init__(self, model, *, parallel: int = 1, threads: int = 2, ctx_per_slot: int = 512,
                 drafter=None, draft_max: int | None = None, binary: Path | None = None,
                 extra: list[str] | None = None, timeout: float = 600.0):
        self.exe = binary or llama_server_binary()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.parallel = parallel
        cmd = [str(self.exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--parallel", str(parallel), "--threads", str(threads), "--threads-batch", str(threads),
               "--ctx-size", str(ctx_per_slot * parallel), "--no-webui", "--no-warmup",
               "--cache-ram", "0", "--cont-batching", "--metrics"]
        self.spec_type = spec_type(drafter) if drafter is not None else None
        if drafter is not None:
            cmd += ["-md", str(drafter), "--spec-type", self.spec_type, "--spec-draft-threads", str(threads),
                    "--spec-draft-threads-batch", str(threads)]
            if draft_max is not None:
                cmd += ["--spec-draft-n-max", str(draft_max)]
        cmd += extra or []
        self.cmd = cmd
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        atexit.register(self.close)  # never left running after the bench, whatever ends it
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.close()
            raise

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def _wait_healthy(self, timeout: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) before it was ready: "
                                   f"{' '.join(self.cmd)}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s: {' '.join(self.cmd)}\n{self.log_tail()}")

    def complete(self, tokens: list[int], n_predict: int, ignore_eos: bool = False, timeout: float = 3600.0) -> dict:
        """One /completion request on a token-id prompt, greedy (temperature 0), no prompt cache,
        stopping at an end-of-generation token unless ignore_eos (as Engine.generate does):
        {"tokens": generated ids, "timings": the server's (predicted_n, predicted_ms: from the
        first generated token to the last; draft_n, draft_n_accepted when it speculated),
        "latency_s": the request's wall seconds}."""
        body = {"prompt": [int(t) for t in tokens], "n_predict": n_predict, "temperature": 0.0,
                "cache_prompt": False, "ignore_eos": ignore_eos, "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server /completion failed: {e.code} {e.read()[:2000]!r}") from e
        dt = time.perf_counter() - t0
        return {"tokens": list(out.get("tokens", [])), "timings": out.get("timings", {}), "latency_s": dt}

    def spec_counters(self) -> dict:
        """The server's cumulative speculation counters (/metrics, counted as each request ends):
        drafts (verification rounds), draft tokens, accepted draft tokens."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        want = {"spec_decode_num_drafts_total": "rounds", "spec_decode_num_draft_tokens_total": "drafted",
                "spec_decode_num_accepted_tokens_total": "accepted"}
        out = dict.fromkeys(want.values(), 0)
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split(":")[-1].split("{")[0]
                if name in want:
                    out[want[name]] = int(float(value))
        return out

    def close(self) -> None:
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_clients(server: LlamaServer, per_client: list[list[list[int]]], n_predict: int,
                shared: bool = False) -> tuple[list[dict], float]:
    """len(per_client) client threads, thread i sending its prompts per_client[i] one after
    another, or (shared) all prompts from one queue (as bench/batch.py's run_cell does with engines;
    _common.concurrent_clients); returns every request's complete() result (client by client, each
    in its prompts' order) and the wall seconds from the common start to the last reply."""
    try:
        wall, done = concurrent_clients(per_client, lambda i, p: server.complete(p, n_predict), shared)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"llama-server request failed: {e}\n{server.log_tail()}") from e
    return [r for _, r in done], wall


if __name__ == "__main__":
    print(llama_server_binary())
