"""The C API (include/dflash_native.h) from real consumers built against the package: a C program
configured by CMake with find_package(dflash_native CONFIG) (tests/c_api/), and a Cython extension
built by setuptools from the package's .pxd declarations. Their tokens must equal
Engine.generate's on the embedded default pair; the error paths return the documented codes.

The header, library and CMake package are found only through dflash_native.get_include(),
get_library_dir() and get_cmake_dir(): in CI the installed package's, in a source checkout the
build tree's (tools/devbuild)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dflash_native
from dflash_native import Engine
from dflash_native.cli import default_pair
from reference.gguf_edit import rewrite_gguf

HERE = Path(__file__).resolve().parent
PROMPT = "def fibonacci(n):\n    "
N_TOKENS = 24


def _run(cmd, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _check(p: subprocess.CompletedProcess, what: str) -> str:
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    pair = default_pair()
    assert pair is not None, "the embedded default pair ships with the package (dflash_native/models)"
    return str(pair[0]), str(pair[1])


@pytest.fixture(scope="module")
def engines(pair):
    """Engine.generate's side: the pair with the drafter (chain and tree) and the target alone."""
    kw = dict(n_ctx=1024, n_threads=2)
    made = {"chain": Engine(pair[0], drafter=pair[1], **kw),
            "tree": Engine(pair[0], drafter=pair[1], verify="tree", **kw),
            "ar": Engine(pair[0], **kw)}
    yield made
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def consumer(tmp_path_factory) -> Path:
    """tests/c_api built by CMake against the package's CMake config."""
    if shutil.which("cmake") is None:
        pytest.fail("cmake is needed to build the C consumer (pip install cmake)")
    build = tmp_path_factory.mktemp("c_api_build")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _check(_run(["cmake", "-S", HERE / "c_api", "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={dflash_native.get_cmake_dir()}"]), "cmake configure")
    _check(_run(["cmake", "--build", build]), "cmake build")
    exe = build / "dfn_consumer"
    assert exe.is_file()
    return exe


@pytest.fixture(scope="module")
def cython_ext(tmp_path_factory):
    """tests/c_api/dfn_cy.pyx built by setuptools (cythonize) in a temporary directory, imported."""
    pytest.importorskip("Cython", reason="cython is in the test extra")
    d = tmp_path_factory.mktemp("cython_build")
    shutil.copy(HERE / "c_api" / "dfn_cy.pyx", d / "dfn_cy.pyx")
    pkg_parent = Path(dflash_native.__file__).resolve().parent.parent  # where `cimport dflash_native` finds it
    (d / "setup.py").write_text(textwrap.dedent(f"""
        from Cython.Build import cythonize
        from setuptools import Extension, setup
        ext = Extension("dfn_cy", ["dfn_cy.pyx"], include_dirs=[{dflash_native.get_include()!r}],
                        library_dirs=[{dflash_native.get_library_dir()!r}], libraries=["dflash_native"],
                        runtime_library_dirs=[{dflash_native.get_library_dir()!r}])
        setup(name="dfn_cy", ext_modules=cythonize([ext], include_path=[{str(pkg_parent)!r}]))
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg_parent), os.environ.get("PYTHONPATH", "")]))
    _check(_run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=d, env=env), "cython build")
    sys.path.insert(0, str(d))
    try:
        import dfn_cy
    finally:
        sys.path.remove(str(d))
    return dfn_cy


def _c_generate(exe: Path, pair, *, drafter=True, max_tokens=N_TOKENS, temperature=0.0, seed=0, stop_after=0,
                verify="chain") -> dict[str, list[int]]:
    out = _check(_run([exe, "generate", pair[0], pair[1] if drafter else "-", PROMPT, max_tokens, temperature, seed,
                       stop_after, verify]), "dfn_consumer generate")
    lines = dict(line.split(":", 1) for line in out.splitlines())
    return {k: [int(x) for x in v.split()] for k, v in lines.items()}


def _engine(engines, *, drafter=True, verify="chain", **kw):
    eng = engines[verify] if drafter else engines["ar"]
    return eng.generate(PROMPT, max_tokens=kw.pop("max_tokens", N_TOKENS), **kw)


# ---- the package's locations ---------------------------------------------------------------------------


def test_package_locations():
    inc, lib, cmake_dir = Path(dflash_native.get_include()), Path(dflash_native.get_library_dir()), \
        Path(dflash_native.get_cmake_dir())
    assert (inc / "dflash_native.h").is_file()
    assert any(p.name.startswith("libdflash_native.") for p in lib.iterdir())
    assert (cmake_dir / "dflash_nativeConfig.cmake").is_file()
    assert (cmake_dir / "dflash_nativeConfigVersion.cmake").is_file()
    pkg = Path(dflash_native.__file__).resolve().parent
    assert (pkg / "dflash_native.pxd").is_file() and (pkg / "__init__.pxd").is_file()
    # the library _core runs on is the one C API users link: one core
    assert dflash_native._core.c_api_version() == dflash_native.__version__


# ---- the C program ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter,verify", [(True, "chain"), (True, "tree"), (False, "chain")])
def test_c_program_greedy_equals_engine(consumer, pair, engines, drafter, verify):
    got = _c_generate(consumer, pair, drafter=drafter, verify=verify)
    want = _engine(engines, drafter=drafter, verify=verify)
    assert got["prompt"] == want.prompt_tokens
    assert got["tokens"] == want.tokens and len(want.tokens) > 0
    text = engines["ar"].detokenize(want.tokens)
    assert got["text_bytes"] == [len(text.encode("utf-8"))] or "\ufffd" in text
    stop, spec, n_gen, rounds, hist_rounds, ar_steps, block = got["stats"]
    assert n_gen == len(want.tokens) and spec == int(drafter)
    assert stop == {"eos": 1, "length": 2}[want.stats.stop_reason]
    # the controller's AR-or-round choices follow measured times, so rounds differ between processes
    assert rounds == hist_rounds and (rounds + ar_steps >= 1 if drafter else rounds == ar_steps == 0)
    if drafter:
        assert block == engines[verify].block_size and rounds + ar_steps >= 1


@pytest.mark.parametrize("drafter", [True, False])
def test_c_program_sampled_equals_engine(consumer, pair, engines, drafter):
    got = _c_generate(consumer, pair, drafter=drafter, temperature=0.8, seed=1234)
    want = _engine(engines, drafter=drafter, temperature=0.8, seed=1234)
    assert got["tokens"] == want.tokens and len(want.tokens) > 0
    other = _c_generate(consumer, pair, drafter=drafter, temperature=0.8, seed=99)
    assert other["tokens"] == _engine(engines, drafter=drafter, temperature=0.8, seed=99).tokens


def test_c_program_failed_drafter_falls_back_to_ar(consumer, pair, engines, tmp_path):
    """A drafter whose logits are NaN: dfn_generate decodes AR, with AR's tokens, where it failed every
    speculative request; dfn_stats.drafter_failed and dfn_engine_drafter_failure say so."""
    nan = rewrite_gguf(Path(pair[1]), tmp_path / "nan-drafter.gguf",
                       tensor_fn=lambda n, a: np.full_like(a, np.nan) if n == "output_norm.weight" else a)
    for temperature, seed in ((0.0, 0), (0.8, 1234)):
        got = _c_generate(consumer, (pair[0], str(nan)), temperature=temperature, seed=seed)
        want = _engine(engines, drafter=False, temperature=temperature, seed=seed)
        assert got["tokens"] == want.tokens and len(want.tokens) > 0
        stop, spec, n_gen, rounds, hist_rounds, ar_steps, block = got["stats"]
        assert spec == 1 and rounds == hist_rounds == 0 and ar_steps == n_gen - 1
        assert got["drafter_failed"] == [1, 1]
    assert _c_generate(consumer, pair)["drafter_failed"] == [0, 0]


def test_c_program_callback_stops(consumer, pair, engines):
    got = _c_generate(consumer, pair, stop_after=5)
    want = _engine(engines)
    assert len(want.tokens) > 5
    assert got["tokens"] == want.tokens[:5]
    assert got["stats"][0] == 4  # DFN_STOP_CALLBACK
    assert got["stats"][2] == 5


def test_c_program_error_paths(consumer, pair):
    out = _check(_run([consumer, "errors", pair[0]]), "dfn_consumer errors")
    r = {}
    for line in out.splitlines():
        key, rest = line.split(": ", 1)
        status, _, msg = rest.partition(" | ")
        r[key] = (status, msg)
    version = r["version"][0].split()
    assert version[0] == version[2] == dflash_native.__version__
    assert r["missing_file"][0] == "DFN_ERR_FILE" and "cannot open target '/nonexistent/dir/model.gguf'" in r["missing_file"][1]
    assert r["missing_file_handle"][0] == "null"
    assert r["bad_kv_type"] == ("DFN_ERR_INVALID_ARGUMENT", "[engine] kv_type must be DFN_KV_F16 or DFN_KV_F32, got 7")
    # the field that chose the ggml matmul baseline is reserved: the C ABI has no benchmark switch
    assert r["nonzero_reserved"] == ("DFN_ERR_INVALID_ARGUMENT", "[engine] reserved0 must be 0, got 1")
    assert r["bad_n_ctx"][0] == "DFN_ERR_INVALID_ARGUMENT" and "n_ctx must be >= 1" in r["bad_n_ctx"][1]
    assert r["huge_n_ctx"] == ("DFN_ERR_INVALID_ARGUMENT",
                               "[engine] n_ctx must be <= 2147483647 (positions are int32), got 4611686018427387904")
    assert r["tree_without_drafter"] == ("DFN_ERR_INVALID_ARGUMENT", "[engine] verify=tree needs a drafter")
    assert r["bad_struct_size"][0] == "DFN_ERR_INVALID_ARGUMENT" and "struct_size = 3" in r["bad_struct_size"][1]
    assert r["not_gguf"][0] == "DFN_ERR_FILE" and "/proc/self/cmdline" in r["not_gguf"][1]
    assert r["bad_device"][0] == "DFN_ERR_INVALID_ARGUMENT" and "no device 'tpu0'" in r["bad_device"][1]
    assert r["device_cpu"][0] == "DFN_OK"
    assert r["options_before_device_name"][0] == "DFN_OK"
    assert r["create"][0] == "DFN_OK"
    n_tok = int(r["tokenize_needed"][0])
    assert n_tok > 2
    assert r["tokenize_small"][0] == "DFN_ERR_BUFFER_TOO_SMALL" and f"has {n_tok} tokens" in r["tokenize_small"][1]
    assert r["tokenize"][0] == "DFN_OK"
    assert r["detokenize_small"][0] == "DFN_ERR_BUFFER_TOO_SMALL"
    assert int(r["detokenize_needed"][0]) == len("def fibonacci(n):\n    return n")
    assert r["detokenize_bad_id"][0] == "DFN_ERR_INVALID_ARGUMENT" and "outside the vocabulary" in r["detokenize_bad_id"][1]
    assert r["generate_bad_id"][0] == "DFN_ERR_INVALID_ARGUMENT" and "outside" in r["generate_bad_id"][1]
    assert r["generate_empty_prompt"][0] == "DFN_ERR_INVALID_ARGUMENT" and "empty" in r["generate_empty_prompt"][1]
    assert r["generate_bad_top_p"][0] == "DFN_ERR_INVALID_ARGUMENT" and "top_p" in r["generate_bad_top_p"][1]
    assert r["generate_spec_without_drafter"][0] == "DFN_ERR_INVALID_ARGUMENT"
    assert r["generate_defaults"][0] == "DFN_OK"
    assert r["generate_bad_temperature"][0] == "DFN_ERR_INVALID_ARGUMENT" and "temperature" in r["generate_bad_temperature"][1]
    assert r["stats_after_failure"][0] == "DFN_OK"
    assert r["stats_after_failure_values"][0].split() == ["0", "0", "0"]  # DFN_STOP_NONE, nothing generated
    assert r["prompt_over_n_ctx"][0] == "DFN_ERR_INVALID_ARGUMENT" and "context" in r["prompt_over_n_ctx"][1]
    assert r["null_out"][0] == "DFN_ERR_INVALID_ARGUMENT"
    # dfn_generate_params.constraint: its checks; a mask with nothing in it fails the request, not the engine
    assert r["constraint_allows_nothing"][0] == "DFN_ERR_RUNTIME"
    assert "the constraint allows no token at position" in r["constraint_allows_nothing"][1]
    assert r["generate_after_constraint_failure"][0] == "DFN_OK"
    assert r["constraint_null_callback"] == ("DFN_ERR_INVALID_ARGUMENT", "[dfn_generate] params->constraint's "
                                             "callbacks must not be NULL: accept, is_terminated")
    assert r["constraint_bad_struct_size"][0] == "DFN_ERR_INVALID_ARGUMENT"
    assert "constraint->struct_size = 3" in r["constraint_bad_struct_size"][1]
    # a caller compiled before the field: the bytes past its struct_size are not read as a pointer
    assert r["params_before_constraint"][0] == "DFN_OK"
    # issue 38: the C API guards its handles (double destroy and use after destroy were segfaults)
    assert r["destroy"][0] == "DFN_OK" and r["destroy_null"][0] == "DFN_OK"
    for case in ("destroy_again", "tokenize_after_destroy", "generate_after_destroy", "stats_after_destroy"):
        assert r[case][0] == "DFN_ERR_INVALID_ARGUMENT" and "not a live engine" in r[case][1], case
    assert r["n_vocab_after_destroy"][0] == "-1"
    assert r["null_accessors"][0].split() == ["-1", "-1", "-1", "-1"]


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_c_program_fifo_is_refused_before_it_is_opened(consumer, pair, tmp_path, which):
    """Was a hang: dfn_engine_create opened the path (fopen) to check it was readable, and opening a
    FIFO for reading blocks until a writer comes."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    args = [fifo, pair[1]] if which == "target" else [pair[0], fifo]
    try:
        p = subprocess.run([str(c) for c in (consumer, "create", *args)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("dfn_engine_create hung on a FIFO")
    out = _check(p, "dfn_consumer create")
    assert out.startswith("create: DFN_ERR_FILE | ") and "not a regular file" in out and str(fifo) in out, out


def test_c_program_second_generate_on_a_running_engine_is_refused(consumer, pair):
    """Was silently wrong tokens (a dfn_generate from the token callback reset the running call's
    sequence) or an abort (a second thread's call: GGML_ASSERT in ggml-backend)."""
    try:
        p = subprocess.run([str(c) for c in (consumer, "overlap", *pair)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("dfn_consumer overlap hung")
    r = dict(line.split(": ", 1) for line in _check(p, "dfn_consumer overlap").splitlines())
    for how in ("callback", "thread"):
        assert r[how].startswith("DFN_ERR_INVALID_ARGUMENT | [dfn_generate] this engine is running another dfn_generate"), r
        assert r[f"{how}_first"] == "DFN_OK 1", r  # the running call went on undisturbed


def test_c_program_engine_in_a_forked_child_is_refused(consumer, pair):
    """Was a hang: dfn_generate in a fork() of the process whose engine had run waited for ever on
    ggml's OpenMP worker threads, which fork() does not copy."""
    try:
        p = subprocess.run([str(c) for c in (consumer, "fork", *pair)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("dfn_consumer fork hung")
    r = dict(line.split(": ", 1) for line in _check(p, "dfn_consumer fork").splitlines())
    assert r.get("child_exit") == "0", r  # 142 (128 + SIGALRM): the child hung
    assert r["child"].startswith("DFN_ERR_RUNTIME | [dfn_generate] this engine was made in process "), r
    assert "is a fork() of it" in r["child"], r
    if dflash_native._core.cpu_uses_openmp():  # was a hang too: the new engine's first graph (its matmul timing) waited for ever
        assert r["child_create"].startswith("DFN_ERR_RUNTIME | [engine] this process is a fork() of process "), r
    else:  # ggml's own thread pool starts in the child
        assert r["child_create"] == "DFN_OK | ", r
    assert r["parent"] == "DFN_OK 1", r


# ---- structured output: a dfn_constraint written in C (consumer.c's automaton) ----------------------------

N_CONSTRAINED = 32  # max_tokens of the constrained requests
K_SET = 16          # "set" mode: exactly this many tokens of the set, then the end-of-generation token


def _c_constrained(exe, pair, *, drafter=True, verify="chain", gate=1, temperature=0.0, seed=0, mode="set",
                   budget=K_SET, stops="-", fail="-", fail_at=0, ids=()) -> dict:
    out = _check(_run([exe, "constrained", pair[0], pair[1] if drafter else "-", verify, gate, PROMPT, N_CONSTRAINED,
                       temperature, seed, mode, budget, stops, fail, fail_at, *ids]), "dfn_consumer constrained")
    r = {}
    for line in out.splitlines():
        key, v = line.split(":", 1)
        r[key] = tuple(v.strip().split(" | ", 1)) if key == "fail" else [int(x) for x in v.split()]
    return r


@pytest.fixture(scope="module")
def allowed_set(engines) -> list[int]:
    """The tokens of the pair's unconstrained greedy output but its most frequent one (and any
    end-of-generation token): the constrained output is not the unconstrained one, and the drafter
    still guesses much of it."""
    eng = engines["ar"]
    out = eng.generate(PROMPT, max_tokens=N_CONSTRAINED).tokens
    most = max(set(out), key=out.count)
    ids = sorted(t for t in set(out) if t != most and not eng.tokenizer.is_eog(t))
    assert len(ids) >= 5
    return ids


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1234)])
@pytest.mark.parametrize("verify,gate", [("chain", 0), ("chain", 1), ("tree", 0), ("tree", 1)])
def test_c_constraint_speculative_equals_ar(consumer, pair, allowed_set, verify, gate, temperature, seed):
    """A C program's constraint (only the tokens of a set, exactly K_SET of them, then the end-of-
    generation token) through dfn_generate: the speculative output equals the constrained AR output
    on the same engine, token for token, and every token is one the automaton allows."""
    r = _c_constrained(consumer, pair, verify=verify, gate=gate, temperature=temperature, seed=seed, ids=allowed_set)
    assert r["allowed"] == [len(allowed_set)]
    assert r["tokens"] == r["ar_tokens"]
    assert len(r["tokens"]) == K_SET and set(r["tokens"]) <= set(allowed_set)
    stop, spec, rounds, round_tokens, ar_steps = r["stats"]
    assert stop == 1 and spec == 1  # DFN_STOP_EOS: the automaton's end after K_SET tokens
    assert r["ar_stats"] == [1, 0]
    assert r["valid"] == [1] and r["ar_valid"] == [1]  # replayed through the automaton: each token allowed
    fill, accept, rollback, terminated, max_rollback = r["calls"]
    if gate == 0:  # fixed settings: every step after the prefill is a round (gate=1: the controller's choice),
        # committing the K_SET - 1 tokens after the prefill's and the end-of-generation token
        assert rounds >= 1 and ar_steps == 0 and round_tokens == K_SET
    if rounds:  # the drafts moved the constraint and a verify rolled it back
        assert rollback >= 1 and 1 <= max_rollback <= 64
    assert fill >= K_SET and accept >= K_SET and terminated >= 1
    assert r["constraint_stats"] == [fill, 1]  # dfn_stats.n_masks: every fill_mask call; constraint_s > 0


@pytest.mark.parametrize("drafter,verify,temperature,seed", [(True, "chain", 0.0, 0), (True, "tree", 0.8, 1234),
                                                             (True, "chain", 0.8, 7), (False, "chain", 0.8, 99)])
def test_c_constraint_equals_engine_regex(consumer, pair, engines, drafter, verify, temperature, seed):
    """The C automaton "tokens whose pieces are digits, 20 digits at most, then an end-of-generation
    token" is the regex [0-9]{1,20} over the GGUF's vocabulary: dfn_generate under it gives the tokens
    Engine.generate(constraint=Regex(...)) gives (xgrammar's matcher), with and without the drafter."""
    pytest.importorskip("xgrammar")
    from dflash_native.constraint import Regex

    tok = engines["ar"].tokenizer
    eog = [t for t in range(tok.n_vocab) if tok.is_eog(t)]
    r = _c_constrained(consumer, pair, drafter=drafter, verify=verify, temperature=temperature, seed=seed,
                       mode="digits", budget=20, stops=",".join(map(str, eog)))
    want = _engine(engines, drafter=drafter, verify=verify, max_tokens=N_CONSTRAINED, temperature=temperature,
                   seed=seed, constraint=Regex("[0-9]{1,20}"))
    assert r["allowed"][0] >= 10  # the ten digits at least
    assert r["tokens"] == want.tokens and len(want.tokens) > 0
    text = engines["ar"].detokenize(r["tokens"])
    assert text.isdigit() and len(text) <= 20
    assert r["stats"][0] == {"eos": 1, "length": 2}[want.stats.stop_reason] and r["valid"] == [1]
    if drafter:
        assert r["ar_tokens"] == want.tokens


@pytest.mark.parametrize("drafter,verify,callback,at", [
    (True, "chain", "fill_mask", 3), (True, "chain", "accept", 3), (True, "chain", "rollback", 2),
    (True, "chain", "is_terminated", 3), (True, "tree", "rollback", 5), (True, "tree", "accept", 20),
    (False, "chain", "accept", 6)])
def test_c_constraint_callback_error(consumer, pair, engines, allowed_set, drafter, verify, callback, at):
    """A constraint callback that returns an error (-7 at its at-th call): dfn_generate returns
    DFN_ERR_CONSTRAINT naming the callback, the tokens emitted before it are the clean run's, and the
    same engine then runs the constrained and an unconstrained request as a fresh one would (the
    drafter not marked failed)."""
    kw = dict(drafter=drafter, verify=verify, gate=0, temperature=0.8 if not drafter else 0.0, seed=5, ids=allowed_set)
    clean = _c_constrained(consumer, pair, **kw)
    r = _c_constrained(consumer, pair, fail=callback, fail_at=at, **kw)
    status, msg = r["fail"]
    assert status == "DFN_ERR_CONSTRAINT", r["fail"]
    assert msg.startswith(f"[dfn_generate] the constraint's {callback} callback returned -7"), msg
    assert r["fail_tokens"] == clean["tokens"][:len(r["fail_tokens"])]
    assert r["fail_stats"] == [0]  # DFN_STOP_NONE: the call failed
    assert r["after_tokens"] == clean["tokens"] and len(clean["tokens"]) == K_SET
    spec, rounds, drafter_failed, why = r["after_stats"]
    assert spec == int(drafter) and drafter_failed == 0 and why == 0
    if drafter:
        assert rounds >= 1  # still speculative: the error did not fail the drafter
    assert r["after_plain"] == _engine(engines, drafter=drafter, verify=verify, max_tokens=N_CONSTRAINED).tokens


# ---- the Cython extension --------------------------------------------------------------------------------


def test_cython_greedy_and_sampled_equal_engine(cython_ext, pair, engines):
    prompt, tokens, stop = cython_ext.generate(pair[0], pair[1], PROMPT, N_TOKENS)
    want = _engine(engines)
    assert prompt == want.prompt_tokens and tokens == want.tokens and len(tokens) > 0
    _, tokens, _ = cython_ext.generate(pair[0], None, PROMPT, N_TOKENS, temperature=0.8, seed=7)
    assert tokens == _engine(engines, drafter=False, temperature=0.8, seed=7).tokens
    _, tokens, stop = cython_ext.generate(pair[0], pair[1], PROMPT, N_TOKENS, stop_after=3)
    assert tokens == want.tokens[:3] and stop == 4


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1234)])
def test_cython_constraint_equals_c_program(cython_ext, consumer, pair, allowed_set, temperature, seed):
    """A dfn_constraint written in Cython through the package's .pxd (the "set" automaton of
    consumer.c): the tokens of the C program's."""
    _, tokens, stop = cython_ext.generate(pair[0], pair[1], PROMPT, N_CONSTRAINED, temperature=temperature, seed=seed,
                                          allowed=allowed_set, k=K_SET)
    assert stop == 1 and len(tokens) == K_SET and set(tokens) <= set(allowed_set)
    assert tokens == _c_constrained(consumer, pair, temperature=temperature, seed=seed, ids=allowed_set)["tokens"]


def test_cython_errors(cython_ext, pair):
    status, msg = cython_ext.create_error(pair[0], -3)
    assert status == "DFN_ERR_INVALID_ARGUMENT" and "block_size must be >= 2" in msg
    with pytest.raises(RuntimeError, match="DFN_ERR_FILE: .*cannot open target"):
        cython_ext.generate("/nonexistent.gguf", None, PROMPT, 4)
    assert cython_ext.version() == (dflash_native.__version__, dflash_native.__version__)


# ---- the statuses a request's input produces (issue 39) ------------------------------------------------


@pytest.fixture(scope="module")
def eos_pair(tmp_path_factory):
    """A random Qwen3.5 pair whose greedy output from EOS_PROMPT ends with its end-of-generation token
    after 18 tokens (test_spec.py::test_eos_inside_a_committed_block's)."""
    import numpy as np

    from dflash_native.convert import convert_hf_to_gguf
    from fixtures import make_random_checkpoint, make_random_drafter_gguf

    d = tmp_path_factory.mktemp("c_api_eos")
    ckpt = make_random_checkpoint(d / "t", "qwen3_5", seed=5)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f32", seed=6, block_size=8, target_gguf=tg)
    return str(tg), str(dg), [int(t) for t in np.random.default_rng(26).integers(3, 600, 11)]


def _c_ids(exe, target, drafter, n_ctx, max_tokens, prompt) -> dict[str, list[int]]:
    out = _check(_run([exe, "ids", target, drafter or "-", n_ctx, max_tokens, *prompt]), "dfn_consumer ids")
    return {k: [int(x) for x in v.split()] for k, v in (line.split(":", 1) for line in out.splitlines())}


@pytest.mark.parametrize("drafter", [True, False])
def test_c_program_stops_at_eos_and_at_the_context(consumer, eos_pair, drafter):
    """DFN_STOP_EOS: the end-of-generation token ends the request (not written); DFN_STOP_CONTEXT:
    n_ctx full before it. Tokens and stop reason as Engine.generate's on the same pair."""
    target, dg, prompt = eos_pair
    dg = dg if drafter else None
    with Engine(target, drafter=dg, n_ctx=256, kv_type="f32", n_threads=2) as eng:
        want = eng.generate(prompt, max_tokens=120)
        eos = eng.tokenizer.eos_token_id
    assert want.stats.stop_reason == "eos" and 0 < len(want.tokens) < 60 and eos not in want.tokens
    got = _c_ids(consumer, target, dg, 256, 120, prompt)
    assert got["tokens"] == want.tokens
    assert got["stats"] == [1, len(want.tokens), eos]  # DFN_STOP_EOS
    n_ctx = len(prompt) + len(want.tokens) // 2  # full before the EOS comes
    with Engine(target, drafter=dg, n_ctx=n_ctx, kv_type="f32", n_threads=2) as eng:
        short = eng.generate(prompt, max_tokens=120)
    assert short.stats.stop_reason == "context" and short.tokens == want.tokens[:len(short.tokens)]
    got = _c_ids(consumer, target, dg, n_ctx, 120, prompt)
    assert got["tokens"] == short.tokens
    assert got["stats"][:2] == [3, len(short.tokens)]  # DFN_STOP_CONTEXT
    # n_ctx positions: the prompt and every token but the last (computed, never fed back)
    assert len(prompt) + len(short.tokens) - 1 == n_ctx


def test_c_program_no_vocabulary(consumer, tmp_path):
    """A target whose GGUF has no vocabulary (what the converter writes without a tokenizer.json):
    dfn_tokenize and dfn_detokenize are DFN_ERR_NO_VOCABULARY, the eos token -1, and token ids
    still generate."""
    from gguf import GGUFValueType

    from fixtures import make_random_gguf
    from reference.gguf_edit import rewrite_gguf

    good = make_random_gguf(tmp_path / "good.gguf", "qwen3_5", outtype="f16", seed=3)
    p = rewrite_gguf(good, tmp_path / "novocab.gguf",
                     kv={"tokenizer.ggml.model": ("none", GGUFValueType.STRING), "qwen35.vocab_size": 640},
                     drop_keys=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                                "tokenizer.ggml.pre"))
    out = _check(_run([consumer, "novocab", p]), "dfn_consumer novocab")
    r = dict(line.split(": ", 1) for line in out.splitlines())
    assert r["create"] == "DFN_OK | "
    assert r["tokenize"] == "DFN_ERR_NO_VOCABULARY | [dfn_tokenize] the target GGUF has no tokenizer; pass token ids"
    assert r["tokenize_n"] == "0"
    assert r["detokenize"] == "DFN_ERR_NO_VOCABULARY | [dfn_detokenize] the target GGUF has no tokenizer"
    assert r["detokenize_n"] == "0"
    assert r["eos_token"] == "-1"
    assert r["generate_ids"] == "DFN_OK | "
    with Engine(p, n_ctx=64, n_threads=1) as eng:
        assert r["tokens"].split() == [str(t) for t in eng.generate([1, 2, 3], max_tokens=3).tokens]


def test_c_program_out_of_memory(consumer, pair):
    """DFN_ERR_OUT_OF_MEMORY, naming the buffer: a KV cache larger than the process may map (n_ctx
    2^31 - 1 at F32 under RLIMIT_AS = 1 TiB); no handle is returned, and the process goes on to
    create and run a small engine."""
    out = _check(_run([consumer, "oom", pair[0]]), "dfn_consumer oom")
    r = dict(line.split(": ", 1) for line in out.splitlines())
    status, _, msg = r["huge_cache"].partition(" | ")
    assert status == "DFN_ERR_OUT_OF_MEMORY", r
    assert msg.startswith("[cache] out of memory") and "KV/GDN cache" in msg and "n_ctx = 2147483647" in msg, msg
    assert r["huge_cache_handle"] == "null"
    assert r["small_after"] == "DFN_OK | " and r["generate_after"] == "DFN_OK | " and r["generated_after"] == "4"


# ---- one engine, several threads: n_seq > 1 (issue 35) --------------------------------------------------


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_c_program_concurrent_calls_on_an_n_seq_engine(consumer, pair, verify):
    """dfn_engine_options.n_seq = 4: 10 dfn_generate calls from 4 pthreads at once on one engine
    (greedy and seeded sampled, speculative and AR) run batched through the core's scheduler, each
    call's tokens and statistics those of the same call alone on an n_seq = 1 engine. A call with a
    token id outside the vocabulary fails with its own status and message (on its thread only)
    while the others succeed; a callback's stop ends its call alone; a call from a callback runs as
    one more request; dfn_engine_destroy is refused while calls run."""
    try:
        p = subprocess.run([str(c) for c in (consumer, "batched", *pair, verify)], capture_output=True, text=True,
                           timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail("dfn_consumer batched hung")
    out = _check(p, "dfn_consumer batched")
    r = dict(line.split(": ", 1) for line in out.splitlines())
    # the option: default 1, checked by the core, a caller compiled before it gets one slot
    assert r["default_n_seq"] == "1"
    assert r["n_seq_zero"] == "DFN_ERR_INVALID_ARGUMENT | [engine] n_seq must be >= 1, got 0"
    # n_seq > 1 runs on a device too (test_device.py): "gpu" is refused only for want of one here
    if not dflash_native.gpu_available():
        assert r["n_seq_gpu"].startswith("DFN_ERR_INVALID_ARGUMENT | [engine] device='gpu' asked for, but"), r["n_seq_gpu"]
    assert "n_seq" not in r["n_seq_gpu"]
    status, _, msg = r["n_seq_huge"].partition(" | ")
    assert status == "DFN_ERR_OUT_OF_MEMORY" and "n_seq = 4000 sequence slots" in msg and "lower n_seq or n_ctx" in msg
    assert r["n_seq_huge_handle"] == "null"
    assert r["before_n_seq"] == "DFN_OK | " and r["create_n_seq_4"] == "DFN_OK | "
    assert r["destroy_while_running"].startswith("DFN_ERR_INVALID_ARGUMENT | [dfn_engine_destroy] the engine is running")
    jobs = {}
    for i in range(10):
        fields, _, msg = r[f"job {i}"].partition(" | ")
        status, *nums = fields.split()
        n_got, n_want, equal, stop, want_stop, n_gen, spec, want_spec = map(int, nums)
        jobs[i] = dict(status=status, n_got=n_got, n_want=n_want, equal=equal, stop=stop, want_stop=want_stop,
                       n_gen=n_gen, spec=spec, want_spec=want_spec, msg=msg)
    for i in range(8):  # greedy / sampled, speculative / AR: the solo call's tokens and statistics
        j = jobs[i]
        assert j["status"] == "DFN_OK" and j["msg"] == "", (i, j)
        assert j["n_got"] == j["n_want"] > 0 and j["equal"] == 1, (i, j)
        assert j["stop"] == j["want_stop"] in (1, 2) and j["n_gen"] == j["n_got"], (i, j)
        assert j["spec"] == j["want_spec"], (i, j)
    assert [jobs[i]["spec"] for i in range(8)] == [1, 0, 1, 0, 1, 1, 1, 0]
    bad = jobs[8]
    assert bad["status"] == "DFN_ERR_INVALID_ARGUMENT" and "outside the vocabulary" in bad["msg"], bad
    assert bad["n_got"] == 0 and bad["stop"] == 0 and bad["n_gen"] == 0, bad  # DFN_STOP_NONE
    stopped = jobs[9]
    assert stopped["status"] == "DFN_OK" and stopped["n_want"] > 5, stopped
    assert stopped["n_got"] == stopped["n_gen"] == 5 and stopped["equal"] == 1, stopped  # the solo call's first 5
    assert stopped["stop"] == 4, stopped  # DFN_STOP_CALLBACK
    # the calls ran at once: tokens of several calls came between one call's first and last
    assert int(r["overlap"]) >= 2, r["overlap"]
    assert r["nested"] == "DFN_OK 1"
    # each thread's dfn_last_error is its own: only thread 0 ran the failing call
    assert "outside the vocabulary" in r["last_error 0"]
    assert [r.get(f"last_error {k}", "?").strip() for k in (1, 2, 3)] == ["", "", ""]
    assert r["empty_prompt"].startswith("DFN_ERR_INVALID_ARGUMENT | ") and "empty" in r["empty_prompt"]
    assert r["prompt_over_n_ctx"].startswith("DFN_ERR_INVALID_ARGUMENT | ") and "context" in r["prompt_over_n_ctx"]
    assert r["after_failures"] == "DFN_OK 1"  # the failed requests' slots serve the next request as before
    assert r["destroy_after"] == "DFN_OK | "
