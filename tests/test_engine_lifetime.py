"""An engine's lifetime under abandoned streams, threads and close(): no call hangs, a superseded
stream says so, and the engine's answers stay those of a fresh engine.

Probes whose old behaviour was a hang run in a subprocess with a timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import weakref

import pytest

import dflash_native as dn

PROMPT = [5, 6, 7]
N = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from fixtures import make_random_pair

    return make_random_pair(tmp_path_factory.mktemp("lifetime"), seed=11, block_size=4)


def new_engine(pair, **kw) -> dn.Engine:
    return dn.Engine(pair[0], drafter=pair[1], n_ctx=64, n_threads=1, **kw)


@pytest.fixture(scope="module")
def ref(pair):
    """Reference outputs of a fresh engine: speculative, AR, and eval logits."""
    with new_engine(pair) as eng:
        return {"spec": eng.generate(PROMPT, max_tokens=N).tokens,
                "ar": eng.generate(PROMPT, max_tokens=N, speculative=False).tokens,
                "eval": eng.eval(PROMPT)}


def probe(pair, body: str, timeout: int = 60) -> str:
    """Run `body` with `eng` (a fresh engine on the pair) in a new interpreter; a hang or a crash
    fails the test. Returns stdout."""
    code = "import numpy as np, threading, dflash_native as dn\n" + \
        f"eng = dn.Engine({str(pair[0])!r}, drafter={str(pair[1])!r}, n_ctx=64, n_threads=1)\n" + \
        textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the probe hung (> {timeout} s):\n{body}")
    assert p.returncode == 0, f"probe failed with {p.returncode}:\n{p.stderr[-3000:]}"
    return p.stdout


# ---- one thread: a new call supersedes an abandoned stream -------------------------------

@pytest.mark.parametrize("abandon", ["next(g)", "for _ in g: break"])
@pytest.mark.parametrize("call", ["eng.generate(P, max_tokens=N).tokens",
                                  "eng.generate(P, max_tokens=N, speculative=False).tokens",
                                  "list(eng.generate(P, max_tokens=N, stream=True))[-1].result.tokens",
                                  "eng.eval(P).tolist()",
                                  "eng.chat([{'role': 'user', 'content': 'hi'}], max_tokens=4).tokens"])
def test_new_call_supersedes_abandoned_stream(pair, abandon, call):
    """Was a deadlock: the paused generator held the engine's lock."""
    out = probe(pair, f"""
        P, N = {PROMPT}, {N}
        fresh = {call}
        g = eng.generate(P, max_tokens=N, stream=True)
        {abandon}
        print("same:", {call} == fresh)
        try:
            next(g)
            print("resumed")
        except RuntimeError as e:
            print("error:", e)
        print("after:", {call} == fresh)
    """)
    assert "same: True" in out and "after: True" in out, out
    assert "error: [generate] this stream was superseded by a later" in out, out


@pytest.mark.parametrize("setting", ["eng.draft_cutoff = 0.4", "eng.draft_vocab = False"])
def test_setting_during_a_paused_stream(pair, ref, setting):
    """Was a deadlock. A setting does not end the stream: it goes on, same output."""
    out = probe(pair, f"""
        g = eng.generate({PROMPT}, max_tokens={N}, stream=True)
        first = next(g)
        {setting}
        rest = list(g)
        print("tokens:", rest[-1].result.tokens)
    """)
    assert f"tokens: {ref['spec']}" in out, out


def test_close_ends_an_abandoned_stream_of_its_thread(pair):
    out = probe(pair, f"""
        g = eng.generate({PROMPT}, max_tokens={N}, stream=True)
        next(g)
        eng.close()
        try:
            next(g)
        except RuntimeError as e:
            print("error:", e)
    """)
    assert "error: [engine] this Engine is closed" in out, out


def test_stream_of_a_finished_thread_is_superseded(pair, ref):
    """A thread that ended with its stream unfinished holds nothing: other threads go on."""
    out = probe(pair, f"""
        keep = []
        def work():
            g = eng.generate({PROMPT}, max_tokens={N}, stream=True)
            next(g)
            keep.append(g)
        t = threading.Thread(target=work)
        t.start()
        t.join()
        print("tokens:", eng.generate({PROMPT}, max_tokens={N}).tokens)
    """)
    assert f"tokens: {ref['spec']}" in out, out


def test_superseded_stream_never_corrupts(pair, ref):
    """Interleaving two streams on one thread: the newer one is exact, the older one raises."""
    eng = new_engine(pair)
    g1 = eng.generate(PROMPT, max_tokens=N, stream=True)
    next(g1)
    g2 = eng.generate(PROMPT, max_tokens=N, stream=True, speculative=False)
    next(g2)
    with pytest.raises(RuntimeError, match="superseded by a later generate"):
        next(g1)
    assert list(g2)[-1].result.tokens == ref["ar"]
    g1.close()  # closing a superseded stream is harmless
    assert eng.generate(PROMPT, max_tokens=N).tokens == ref["spec"]


# ---- threads: calls from other threads wait ----------------------------------------------

def run_threads(fns, timeout=60):
    errors, threads = [], []
    for fn in fns:
        def target(fn=fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads.append(threading.Thread(target=target, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread hung"
    assert not errors, errors


def test_other_thread_waits_for_a_stream(pair, ref):
    eng = new_engine(pair)
    results = {}
    started = threading.Event()

    def streamer():
        g = eng.generate(PROMPT, max_tokens=N, stream=True)
        next(g)
        started.set()
        threading.Event().wait(0.3)  # the other thread's call arrives while this stream is paused
        results["stream"] = list(g)[-1].result.tokens  # not superseded: the other thread waited

    def caller():
        started.wait()
        results["call"] = eng.generate(PROMPT, max_tokens=N, speculative=False).tokens

    run_threads([streamer, caller])
    assert results == {"stream": ref["spec"], "call": ref["ar"]}


def test_close_waits_for_another_threads_stream(pair, ref):
    eng = new_engine(pair)
    started, results = threading.Event(), {}

    def streamer():
        g = eng.generate(PROMPT, max_tokens=N, stream=True)
        next(g)
        started.set()
        threading.Event().wait(0.3)
        results["stream"] = list(g)[-1].result.tokens

    def closer():
        started.wait()
        eng.close()  # had it not waited, the paused stream's next step would raise "closed"

    run_threads([streamer, closer])
    assert results == {"stream": ref["spec"]}
    assert eng.closed


def test_close_timeout_refuses_clearly(pair, ref):
    eng = new_engine(pair)
    paused, done = threading.Event(), threading.Event()
    results = {}

    def streamer():
        g = eng.generate(PROMPT, max_tokens=N, stream=True)
        next(g)
        paused.set()
        done.wait()
        results["stream"] = list(g)[-1].result.tokens

    t = threading.Thread(target=streamer, daemon=True)
    t.start()
    paused.wait(30)
    with pytest.raises(RuntimeError, match="another thread is still using this Engine"):
        eng.close(timeout=0.2)
    done.set()
    t.join(30)
    assert results["stream"] == ref["spec"]
    assert eng.generate(PROMPT, max_tokens=N).tokens == ref["spec"]  # still open, still exact
    eng.close()


@pytest.mark.parametrize("timeout", ["float('nan')", "-1.0"])
def test_close_timeout_must_be_a_duration(pair, timeout):
    """Was a hang: close(timeout=nan) computed a NaN deadline, which never passes, and waited for
    the other thread's stream for ever (a negative timeout refused at once, closing nothing)."""
    out = probe(pair, f"""
        g = None
        paused, done = threading.Event(), threading.Event()
        def streamer():
            global g
            g = eng.generate([5, 6, 7], max_tokens=4, stream=True)
            next(g)
            paused.set()
            done.wait()
        t = threading.Thread(target=streamer, daemon=True)
        t.start()
        paused.wait(30)
        try:
            eng.close(timeout={timeout})
            print("closed")
        except ValueError as e:
            print("error:", e)
        done.set()
        t.join(30)
        print("open:", not eng.closed)
    """, timeout=30)
    assert "error: [close] timeout must be None or a number of seconds >= 0, got" in out and "open: True" in out, out


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_forked_child_refuses_to_run_the_parents_engine(pair, ref):
    """Was a hang: in a fork() of a process whose engine had run, the engine's next graph waited for
    ever on ggml's OpenMP worker threads, which fork() does not copy."""
    out = probe(pair, f"""
        import os, signal
        eng2 = dn.Engine(eng.path, drafter=eng.drafter_path, n_ctx=64, n_threads=2)
        P, N = {PROMPT}, {N}
        want = eng2.generate(P, max_tokens=N).tokens
        before = eng2.generate(P, max_tokens=N, stream=True)  # made before the fork, started in the child
        paused = eng2.generate(P, max_tokens=N, stream=True)  # started before the fork, resumed in the child
        next(paused)
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child with SIGALRM
            for name, call in [("generate", lambda: eng2.generate(P, max_tokens=N)), ("eval", lambda: eng2.eval(P)),
                               ("stream", lambda: next(before)), ("paused", lambda: list(paused))]:
                try:
                    call()
                    print(name, "ran", flush=True)
                except RuntimeError as e:
                    print(name, "error:", e, flush=True)
            print("tokenize:", eng2.tokenize("hi") == eng.tokenize("hi"), flush=True)  # text needs no graph
            eng2.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status:", status)
        print("parent:", list(paused)[-1].result.tokens == want, eng2.generate(P, max_tokens=N).tokens == want)
    """, timeout=120)
    assert "child status: 0" in out and "parent: True True" in out and "tokenize: True" in out, out
    for name in ("generate", "eval", "stream", "paused"):
        assert f"{name} error: [engine] this Engine was made in process" in out, out
    assert "is a fork() of it" in out, out


@pytest.mark.skipif(not hasattr(__import__("os"), "fork") or not dn._core.cpu_uses_openmp(),
                    reason="needs os.fork and ggml's OpenMP thread pool")
def test_new_engine_in_a_forked_child_needs_one_thread(pair):
    """Was a hang: in a fork() of a process whose engine ran ggml's OpenMP pool, a new engine on more
    than one thread waited for ever at its first graph (GNU libgomp cannot start a pool again there)."""
    out = probe(pair, f"""
        import os, signal
        eng2 = dn.Engine(eng.path, drafter=eng.drafter_path, n_ctx=64, n_threads=2)
        want = eng.generate({PROMPT}, max_tokens={N}).tokens
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a hang ends the child with SIGALRM
            for n_threads in (2, None):
                try:
                    dn.Engine(eng.path, drafter=eng.drafter_path, n_ctx=64, n_threads=n_threads)
                    print(n_threads, "made", flush=True)
                except RuntimeError as e:
                    print(n_threads, "error:", e, flush=True)
            one = dn.Engine(eng.path, drafter=eng.drafter_path, n_ctx=64, n_threads=1)
            print("one thread:", one.generate({PROMPT}, max_tokens={N}).tokens == want, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status:", status)
    """, timeout=180)
    assert "child status: 0" in out and "one thread: True" in out, out
    for n_threads in (2, None):
        assert f"{n_threads} error: [engine] this process is a fork() of process" in out, out


# ---- close() -----------------------------------------------------------------------------

def test_close_frees_the_core_now(pair):
    eng = new_engine(pair)
    core, spec, tok = weakref.ref(eng._core), weakref.ref(eng._spec), weakref.ref(eng.tokenizer)
    eng.generate(PROMPT, max_tokens=4)
    eng.close()
    assert core() is None and spec() is None and tok() is None  # freed by close, not left to the GC
    eng.close()  # idempotent
    assert eng.closed


def test_context_manager_closes(pair, ref):
    with new_engine(pair) as eng:
        assert eng.generate(PROMPT, max_tokens=N).tokens == ref["spec"]
        core = weakref.ref(eng._core)
    assert eng.closed and core() is None
    with pytest.raises(RuntimeError, match="closed"):
        with eng:
            pass


USES = {
    "generate": lambda e: e.generate(PROMPT, max_tokens=2),
    "generate stream": lambda e: e.generate(PROMPT, max_tokens=2, stream=True),
    "chat": lambda e: e.chat([{"role": "user", "content": "hi"}], max_tokens=2),
    "eval": lambda e: e.eval(PROMPT),
    "tokenize": lambda e: e.tokenize("hi"),
    "detokenize": lambda e: e.detokenize([5]),
    "arch": lambda e: e.arch,
    "n_ctx": lambda e: e.n_ctx,
    "n_vocab": lambda e: e.n_vocab,
    "n_threads": lambda e: e.n_threads,
    "layer_types": lambda e: e.layer_types,
    "block_size": lambda e: e.block_size,
    "draft_cutoff": lambda e: e.draft_cutoff,
    "set draft_cutoff": lambda e: setattr(e, "draft_cutoff", 0.1),
    "draft_vocab": lambda e: e.draft_vocab,
    "set draft_vocab": lambda e: setattr(e, "draft_vocab", False),
}


@pytest.mark.parametrize("use", sorted(USES))
def test_closed_engine_raises(pair, use):
    eng = new_engine(pair)
    USES[use](eng)  # works while open
    eng.close()
    with pytest.raises(RuntimeError, match=r"\[engine\] this Engine is closed"):
        USES[use](eng)
