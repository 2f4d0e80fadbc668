"""Models by name (dflash_native/hub.py): the real huggingface_hub against a Hub served from local
directories on loopback (fixtures/hub_server.py, HF_ENDPOINT), and from a pre-populated cache with
HF_HUB_OFFLINE=1. Nothing is downloaded from outside. The models are the tests' tiny random ones,
published as a Hugging Face checkpoint repository, a DFlash drafter checkpoint repository and a
repository of GGUF files."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

import dflash_native as dn  # noqa: E402
from dflash_native import hub  # noqa: E402
from dflash_native.cli import default_pair, main  # noqa: E402
from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from dflash_native.convert_dflash import convert_dflash_to_gguf  # noqa: E402
from fixtures import drafter_overrides_for_target, make_random_checkpoint, make_random_drafter_checkpoint  # noqa: E402
from fixtures.hub_server import LocalHub  # noqa: E402

PROMPT = "def fib(n):\n    "
GATED_TOKEN = "hf_test_token_with_access"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The repositories, served for the whole module: org/tiny (a Qwen3.5 checkpoint; tag v2: another
    seed), org/tiny-dflash (its drafter), org/tiny-GGUF (llama.cpp-style file names), org/gated (the
    checkpoint, gated), org/gpt2 (an architecture the converter does not take)."""
    src = tmp_path_factory.mktemp("repos")
    tiny = make_random_checkpoint(src / "tiny", "qwen3_5", seed=0)
    tiny_v2 = make_random_checkpoint(src / "v2" / "tiny", "qwen3_5", seed=5)
    dflash = make_random_drafter_checkpoint(src / "tiny-dflash", seed=1, block_size=8,
                                            **drafter_overrides_for_target(tiny))
    ggufs = src / "tiny-GGUF"
    ggufs.mkdir()
    convert_hf_to_gguf(tiny, ggufs / "tiny-Q8_0.gguf", outtype="q8_0")
    convert_hf_to_gguf(tiny, ggufs / "tiny-F16.gguf", outtype="f16")
    (ggufs / "README.md").write_text("tiny, as GGUF\n")
    gpt2 = src / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    shutil.copy(tiny / "model.safetensors", gpt2 / "model.safetensors")
    with LocalHub() as h:
        commits = {"tiny": h.add("org/tiny", tiny), "tiny@v2": h.add("org/tiny", tiny_v2, ref="v2"),
                   "tiny-dflash": h.add("org/tiny-dflash", dflash), "tiny-GGUF": h.add("org/tiny-GGUF", ggufs),
                   "gated": h.add("org/gated", tiny, gated_token=GATED_TOKEN), "gpt2": h.add("org/gpt2", gpt2)}
        yield dict(hub=h, tiny=tiny, dflash=dflash, ggufs=ggufs, commits=commits)


@pytest.fixture
def env(published, tmp_path, monkeypatch):
    """Empty caches of our own and of huggingface_hub's, the loopback Hub as HF_ENDPOINT, no token,
    online."""
    monkeypatch.setenv("DFLASH_NATIVE_CACHE", str(tmp_path / "dflash-native"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", published["hub"].endpoint)
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored token either
    return published


def _tokens(target, drafter, **kw) -> tuple[list[int], list[int]]:
    """(speculative, AR) greedy tokens of PROMPT."""
    with dn.Engine(target, drafter=drafter, n_ctx=256, n_threads=1, **kw) as eng:
        return (eng.generate(PROMPT, max_tokens=24).tokens,
                eng.generate(PROMPT, max_tokens=24, speculative=False).tokens)


def _env_for_child() -> dict:
    pkg_root = str(Path(dn.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_native", *args], capture_output=True, text=True,
                          env=_env_for_child(), timeout=600)


# ---------------------------------------------------------------------------
# checkpoints: download, convert, quantize, cache
# ---------------------------------------------------------------------------

def test_checkpoint_pair_by_name_equals_the_pair_converted_by_hand(env, tmp_path):
    """Engine("hf://org/tiny", drafter="hf://org/tiny-dflash"): the files are the ones `convert` and
    `convert-drafter --target` write from the same checkpoints (byte for byte), and generation is
    the same, speculative and AR."""
    by_hand = tmp_path / "by-hand"
    t = convert_hf_to_gguf(env["tiny"], by_hand / "t.gguf")
    d = convert_dflash_to_gguf(env["dflash"], by_hand / "d.gguf", target_gguf=t)
    with dn.Engine("hf://org/tiny", drafter="hf://org/tiny-dflash", n_ctx=256, n_threads=1, quiet=True) as eng:
        t_hub, d_hub = eng.path, eng.drafter_path
        spec, ar = eng.generate(PROMPT, max_tokens=24).tokens, eng.generate(PROMPT, max_tokens=24,
                                                                            speculative=False).tokens
    assert t_hub.read_bytes() == t.read_bytes()
    assert d_hub.read_bytes() == d.read_bytes()
    assert t_hub.parent.name == env["commits"]["tiny"]  # keyed by the resolved commit
    assert (spec, ar) == _tokens(t, d)
    assert spec == ar
    # a drafter is cached per target: against the hand-made target file, another file, the same bytes
    d_local = hub.resolve("hf://org/tiny-dflash", role="drafter", target=t, quiet=True)
    assert d_local != d_hub and d_local.read_bytes() == d.read_bytes()
    assert hub.resolve("hf://org/tiny-dflash", role="drafter", target="hf://org/tiny", quiet=True) == d_hub


def test_quantized_by_name_equals_quantize_by_hand(env, tmp_path):
    """hf://org/tiny:q4_k_m is the checkpoint converted to F16, then llama.cpp's quantizer (what
    `convert` + `quantize` give); hf://org/tiny:q8_0 is the converter's own Q8_0."""
    f16 = convert_hf_to_gguf(env["tiny"], tmp_path / "t-f16.gguf")
    q4 = dn.quantize(f16, tmp_path / "t-q4_k_m.gguf", "q4_k_m", progress=False)
    q8 = convert_hf_to_gguf(env["tiny"], tmp_path / "t-q8_0.gguf", outtype="q8_0")
    got_q4 = hub.resolve("hf://org/tiny:Q4_K_M", quiet=True)
    got_q8 = hub.resolve("hf://org/tiny:q8_0", quiet=True)
    assert "q4_k_m" in got_q4.name and "q8_0" in got_q8.name
    assert got_q4.read_bytes() == q4.read_bytes()
    assert got_q8.read_bytes() == q8.read_bytes()
    assert _tokens(got_q4, None)[1] == _tokens(q4, None)[1]


def test_second_run_does_not_convert(env):
    """`generate --target hf://... --drafter hf://...` twice: the first run fetches and converts; the
    second says it uses the converted files, rewrites neither (mtimes), fetches no file from the Hub
    and prints the same tokens. stderr is no terminal here: status lines, no progress bars."""
    h = env["hub"]
    args = ["generate", "--target", "hf://org/tiny", "--drafter", "hf://org/tiny-dflash", "--prompt", PROMPT,
            "--max-tokens", "16", "--threads", "1", "--n-ctx", "256", "--json"]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("converting to GGUF f16") == 2, first.stderr
    assert "[####" not in first.stderr and "it/s]" not in first.stderr  # no bars: stderr is a pipe
    files = sorted(Path(os.environ["DFLASH_NATIVE_CACHE"]).rglob("*.gguf"))
    assert len(files) == 2
    mtimes = [f.stat().st_mtime_ns for f in files]
    n_downloads = len(h.downloads())

    second = _cli(*args)
    assert second.returncode == 0, second.stderr
    assert second.stderr.count("(converted before)") == 2, second.stderr
    assert "converting" not in second.stderr and "fetching" not in second.stderr
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    assert len(h.downloads()) == n_downloads  # only the revision was asked for
    out1, out2 = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, second))
    assert out1["tokens"] == out2["tokens"] and out1["stats"]["speculative"]

    quiet = _cli(*args, "--quiet")
    assert quiet.returncode == 0 and "[dflash-native hub]" not in quiet.stderr


def test_progress_bars_on_a_terminal(env):
    """With stderr a terminal the conversion draws its progress bar; --quiet draws nothing."""
    def run(*extra: str) -> str:
        master, slave = pty.openpty()
        p = subprocess.Popen([sys.executable, "-m", "dflash_native", "convert-drafter", str(env["dflash"]),
                              os.path.join(os.environ["DFLASH_NATIVE_CACHE"], "x.gguf"), "--target",
                              "hf://org/tiny:bf16", *extra], stdout=subprocess.DEVNULL, stderr=slave,
                             env=_env_for_child())
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            out += chunk
        os.close(master)
        assert p.wait(timeout=300) == 0, out
        return out.decode(errors="replace")

    loud = run()
    assert "[dflash-native convert] tiny [" in loud and "converting to GGUF bf16" in loud
    shutil.rmtree(os.environ["DFLASH_NATIVE_CACHE"])
    assert run("--quiet").strip() == ""


def test_dropped_download_resumes(env, tmp_path):
    """The connection drops halfway through the weights (32 MiB: past huggingface_hub's first 10 MiB
    chunk): it asks for the rest (a Range request from where it stopped), and the conversion is the
    same as by hand."""
    h = env["hub"]
    big = make_random_checkpoint(tmp_path / "big", "qwen3_5", seed=3, vocab_size=4096, hidden_size=384,
                                 intermediate_size=1024)
    commit = h.add("org/big", big)
    h.cut_once.add("model.safetensors")
    got = hub.resolve("hf://org/big", quiet=True)
    assert not h.cut_once  # the cut happened
    ranges = [r for m, p, r in h.requests if m == "GET" and p == f"/org/big/resolve/{commit}/model.safetensors" and r]
    assert len(ranges) == 1 and int(ranges[0].removeprefix("bytes=").rstrip("-")) > 0, ranges
    assert got.read_bytes() == convert_hf_to_gguf(big, tmp_path / "by-hand.gguf", name="big").read_bytes()


def test_revisions(env):
    """@TAG and @COMMIT name other commits, cached apart; the default branch stays what it was."""
    c = env["commits"]
    main_path = hub.resolve("hf://org/tiny", quiet=True)
    v2 = hub.resolve("hf://org/tiny@v2", quiet=True)
    by_sha = hub.resolve(f"hf://org/tiny@{c['tiny@v2']}", quiet=True)
    assert main_path.parent.name == c["tiny"] and v2.parent.name == c["tiny@v2"] == by_sha.parent.name
    assert v2.read_bytes() == by_sha.read_bytes() != main_path.read_bytes()


# ---------------------------------------------------------------------------
# GGUF repositories
# ---------------------------------------------------------------------------

def test_gguf_repo_picks_the_tagged_file(env):
    """hf://org/tiny-GGUF:Q8_0 (any case) is the repository's tiny-Q8_0.gguf, used from
    huggingface_hub's cache as it is; without a tag, llama.cpp's order (Q4_K_M, then Q8_0)."""
    path = hub.resolve("hf://org/tiny-GGUF:Q8_0", quiet=True)
    assert path.name == "tiny-Q8_0.gguf"
    assert path.read_bytes() == (env["ggufs"] / "tiny-Q8_0.gguf").read_bytes()
    assert str(path).startswith(os.environ["HF_HUB_CACHE"])
    assert hub.resolve("hf://org/tiny-GGUF:q8_0", quiet=True) == path
    assert hub.resolve("hf://org/tiny-GGUF", quiet=True) == path
    assert hub.resolve("hf://org/tiny-GGUF:f16", quiet=True).name == "tiny-F16.gguf"
    assert env["hub"].downloads(".gguf") and not list(Path(os.environ["DFLASH_NATIVE_CACHE"]).rglob("*.gguf"))
    assert _tokens("hf://org/tiny-GGUF:Q8_0", None, quiet=True) == _tokens(env["ggufs"] / "tiny-Q8_0.gguf", None)


def test_pick_gguf_rules():
    files = ["README.md", "m-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf",
             "m-Q6_K-00001-of-00002.gguf", "m-Q6_K-00002-of-00002.gguf", "dflash-m-Q8_0.gguf"]
    assert hub.pick_gguf(files, "q8_0") == "m-Q8_0.gguf"
    assert hub.pick_gguf(files, "UD-Q4_K_M") == "m-UD-Q4_K_M.gguf"
    assert hub.pick_gguf(files, "m-Q4_K_M.gguf") == "m-Q4_K_M.gguf"
    assert hub.pick_gguf(files, "Q8_0", drafter=True) == "dflash-m-Q8_0.gguf"
    with pytest.raises(ValueError, match=r"2 GGUF files match \(m-Q4_K_M.gguf, m-UD-Q4_K_M.gguf\)"):
        hub.pick_gguf(files, "Q4_K_M")
    with pytest.raises(ValueError, match="no GGUF file matches :IQ2_XS; its GGUF files: dflash-m-Q8_0.gguf, "):
        hub.pick_gguf(files, "IQ2_XS")
    with pytest.raises(ValueError, match="is part 1 of a model split in 2 files"):
        hub.pick_gguf(files, "Q6_K")
    with pytest.raises(ValueError, match="2 GGUF files match"):  # no tag: Q4_K_M first, as llama.cpp
        hub.pick_gguf(files, None)
    assert hub.pick_gguf(["a.gguf", "x.txt"], None) == "a.gguf"  # the only model file


# ---------------------------------------------------------------------------
# offline: a pre-populated cache
# ---------------------------------------------------------------------------

def test_offline_uses_the_cache_without_asking_the_hub(env, monkeypatch):
    """HF_HUB_OFFLINE=1 after one online run: converted files and GGUF picks come from the caches
    with no request to the Hub; a checkpoint only in huggingface_hub's cache is converted offline;
    an uncached name is a one-line error."""
    h = env["hub"]
    t = hub.resolve("hf://org/tiny", quiet=True)
    g = hub.resolve("hf://org/tiny-GGUF:Q8_0", quiet=True)
    n_requests = len(h.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve("hf://org/tiny", quiet=True) == t
    assert hub.resolve("hf://org/tiny-GGUF:Q8_0", quiet=True) == g
    q8 = hub.resolve("hf://org/tiny:q8_0", quiet=True)  # from the downloaded checkpoint
    assert q8.read_bytes() == convert_hf_to_gguf(env["tiny"], q8.with_name("by-hand.gguf"), outtype="q8_0").read_bytes()
    assert len(h.requests) == n_requests
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE is set and the model is not in the local cache") as e:
        hub.resolve("hf://org/tiny-dflash", role="drafter", target=t, quiet=True)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------
# errors: one line each, saying what to do
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, kind, words", [
    ("hf://org/missing", ValueError, "no model repository 'org/missing'"),
    ("hf://org/tiny@v9", ValueError, "has no revision 'v9'"),
    ("hf://org/gated", RuntimeError, "is a gated repository and no token is set"),
    ("hf://org/gpt2", ValueError, "architecture ['GPT2LMHeadModel'] (model_type 'gpt2') is not one dflash-native "
                                  "converts"),
    ("hf://org/tiny-dflash", ValueError, "is a DFlash drafter, not a target"),
    ("hf://org/tiny:q9_z", ValueError, "'q9_z' is not a type it can be converted to"),
    ("hf://org/tiny-GGUF:Q2_K", ValueError, "no GGUF file matches :Q2_K; its GGUF files: tiny-F16.gguf, "
                                            "tiny-Q8_0.gguf"),
    ("hf://just-a-name", ValueError, "is not a model name: expected hf://ORG/REPO[@REVISION][:TYPE]"),
])
def test_errors_are_one_line(env, capsys, name, kind, words):
    """In Python a ValueError / RuntimeError of one line; on the command line that line and exit 2."""
    with pytest.raises(kind) as e:
        dn.Engine(name, quiet=True)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert main(["generate", "--target", name, "--prompt", "x", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_unsupported_architecture_is_refused_before_the_weights(env):
    with pytest.raises(ValueError):
        hub.resolve("hf://org/gpt2", quiet=True)
    fetched = {p.rsplit("/", 1)[1] for p in env["hub"].downloads() if p.startswith("/org/gpt2/")}
    assert fetched == {"config.json"}  # never model.safetensors


def test_gated_repository_with_tokens(env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(RuntimeError, match="the token in HF_TOKEN has no access: accept its terms at"):
        hub.resolve("hf://org/gated", quiet=True)
    monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    gated = hub.resolve("hf://org/gated", quiet=True)  # the same checkpoint as org/tiny (general.name aside)
    assert _tokens(gated, None)[1] == _tokens(hub.resolve("hf://org/tiny", quiet=True), None)[1]


def test_hub_down(env):
    """The Hub answering 503: a model cached before still resolves; another is a one-line error."""
    t = hub.resolve("hf://org/tiny", quiet=True)
    env["hub"].down = True
    try:
        assert hub.resolve("hf://org/tiny", quiet=True) == t
        with pytest.raises(RuntimeError, match=r"cannot reach http://127.0.0.1:\d+ \(.*503.*\) and the model is "
                                               r"not in the local cache"):
            hub.resolve("hf://org/tiny-GGUF", quiet=True)
    finally:
        env["hub"].down = False


def test_no_network(env, monkeypatch, capsys):
    """The Hub unreachable (nothing listens at HF_ENDPOINT): a model cached before still resolves (its
    last known commit); another is a one-line error naming the endpoint."""
    t = hub.resolve("hf://org/tiny", quiet=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert hub.resolve("hf://org/tiny", quiet=True) == t
    with pytest.raises(RuntimeError, match=f"cannot reach http://127.0.0.1:{port} .* and the model is not in the "
                                           f"local cache: check the network connection"):
        hub.resolve("hf://org/tiny-GGUF", quiet=True)
    assert main(["generate", "--target", "hf://org/other", "--quiet", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"dflash-native {dn.__version__}"
    assert lines[1].startswith("ggml 0.") and "(commit " in lines[1]
    assert lines[2].startswith("backends: ") and "CPU" in lines[2]


def test_generate_without_target_runs_the_embedded_pair(capsys):
    pair = default_pair()
    if pair is None:
        pytest.skip("no embedded default pair in this install")
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "16", "--threads", "1", "--n-ctx", "256",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with dn.Engine(pair[0], drafter=pair[1], n_ctx=256, n_threads=1) as eng:
        assert out["tokens"] == eng.generate(PROMPT, max_tokens=16).tokens
    assert out["stats"]["speculative"]


def test_serve_by_name(env):
    """`dflash-native serve --target hf://... --drafter hf://...`: the model id is the repository's,
    and a completion is the Engine's on the files the names resolve to."""
    pytest.importorskip("uvicorn")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dflash_native", "serve", "--target", "hf://org/tiny:q8_0",
                             "--drafter", "hf://org/tiny-dflash", "--port", str(port), "--n-ctx", "256",
                             "--threads", "1", "--quiet"], env=_env_for_child(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    models = json.load(r)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    pytest.fail(f"server did not start: {proc.stdout.read()}")
                time.sleep(0.3)
        assert [m["id"] for m in models["data"]] == ["org/tiny:q8_0"]
        body = json.dumps({"model": "org/tiny:q8_0", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.load(r)["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    t, d = hub.resolve_pair("hf://org/tiny:q8_0", "hf://org/tiny-dflash", quiet=True)
    with dn.Engine(t, drafter=d, n_ctx=256, n_threads=1) as eng:
        assert text == eng.generate(PROMPT, max_tokens=16).text


def test_demo_by_name(env, capsys):
    """`dflash-native demo --target hf://... --drafter hf://...` runs its AR-vs-speculative check on
    the named pair; --target alone is a usage error."""
    assert main(["demo", "--target", "hf://org/tiny", "--drafter", "hf://org/tiny-dflash", "--prompt", PROMPT,
                 "--max-tokens", "16", "--threads", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "hf://org/tiny with the drafter hf://org/tiny-dflash" in out and "speculative output == AR output" in out
    assert main(["demo", "--target", "hf://org/tiny", "--quiet"]) == 2
    assert "--target and --drafter go together" in capsys.readouterr().err
