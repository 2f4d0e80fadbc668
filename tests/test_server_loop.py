"""The server's event loop never does model work, and request bodies are bounded: the app from
create_app driven in this process through ASGI directly (no HTTP client needed), on the embedded
pair's target."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("starlette")

import dflash_native as dn  # noqa: E402
from dflash_native.cli import build_parser, default_pair  # noqa: E402
from dflash_native import server  # noqa: E402
from dflash_native.server import create_app  # noqa: E402


async def call(app, method: str, path: str, chunks: list[bytes] = (), headers: dict | None = None):
    """One ASGI request: the body in `chunks` (streamed, no Content-Length unless `headers` has
    one); returns (status, parsed JSON body)."""
    msgs = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]
    msgs = msgs or [{"type": "http.request", "body": b"", "more_body": False}]
    out: list[dict] = []

    async def receive():
        if msgs:
            return msgs.pop(0)
        await asyncio.Event().wait()  # the client stays connected

    async def send(m):
        out.append(m)

    hdrs = [(k.lower().encode(), str(v).encode()) for k, v in {"content-type": "application/json",
                                                              **(headers or {})}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": hdrs,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
    status = next(m["status"] for m in out if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")
    return status, json.loads(body) if body else None


@pytest.fixture(scope="module")
def engine():
    pair = default_pair()
    if pair is None:
        pytest.skip("no embedded default pair in this install")
    with dn.Engine(pair[0], n_ctx=256, n_threads=1) as eng:
        yield eng


def _close(app) -> None:
    app.state.pool.worker.shutdown(wait=True)


def test_tokenization_runs_off_the_event_loop(engine, monkeypatch):
    """/health answers while a prompt is being tokenized: the tokenizer call blocks here until
    /health has answered. It ran on the event loop (a 10 MB prompt stalled /health and every
    running stream for seconds): there the block held the loop and /health answered only after."""
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    threads = []
    tokenize = engine.tokenize

    def blocking_tokenize(text):
        threads.append(threading.current_thread())
        entered.set()
        release.wait(10)  # a bound, not a measurement: on the loop thread it just delays the failure
        done.set()
        return tokenize(text)

    monkeypatch.setattr(engine, "tokenize", blocking_tokenize)
    app = create_app(engine, model_name="m")

    async def main():
        body = json.dumps({"prompt": "def fib(n):\n" * 8, "max_tokens": 2}).encode()
        req = asyncio.ensure_future(call(app, "POST", "/v1/completions", [body]))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        status, h = await call(app, "GET", "/health")
        answered_while_tokenizing = not done.is_set()
        release.set()
        return status, h, answered_while_tokenizing, await req, threading.current_thread()

    try:
        status, h, answered_while_tokenizing, (code, r), loop_thread = asyncio.run(main())
    finally:
        release.set()
        _close(app)
    assert status == 200 and h["status"] == "ok"
    assert answered_while_tokenizing, "/health waited for the tokenizer: it ran on the event loop"
    assert threads and all(t is not loop_thread for t in threads)
    assert code == 200 and r["usage"]["completion_tokens"] == 2, r


def test_request_body_limit(engine):
    """Bodies over max_body_bytes are 413s, known from Content-Length before reading, or while a
    body without one streams in; at the limit they are served."""
    app = create_app(engine, model_name="m", max_body_bytes=1000)
    ok = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    big = json.dumps({"prompt": "x" * 2000, "max_tokens": 1}).encode()

    async def main():
        return [await call(app, "POST", "/v1/completions", [big], {"content-length": len(big)}),
                await call(app, "POST", "/v1/completions", [big[:600], big[600:1200], big[1200:]]),
                await call(app, "POST", "/v1/chat/completions", [b" " * 1001]),
                await call(app, "POST", "/v1/completions", [ok.ljust(1000)], {"content-length": 1000})]

    try:
        answers = asyncio.run(main())
    finally:
        _close(app)
    for code, err in answers[:3]:
        assert code == 413 and err["error"]["code"] == "request_too_large" and "1000" in err["error"]["message"], err
    assert answers[3][0] == 200, answers[3]
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(engine, model_name="m", max_body_bytes=0)


def test_parallel_flag_and_one_engine(engine):
    """--parallel N (--slots, its earlier name) is the engine's n_seq, at least 1; create_app takes
    one Engine (a list of engines, the earlier design, is a TypeError naming what it takes)."""
    assert build_parser().parse_args(["serve"]).parallel == 1
    assert build_parser().parse_args(["serve", "--parallel", "4"]).parallel == 4
    assert build_parser().parse_args(["serve", "--slots", "3"]).parallel == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--parallel", "0"])
    with pytest.raises(TypeError, match="one Engine"):
        create_app([engine], model_name="m")
    with pytest.raises(ValueError, match="parallel"):
        server.serve(default_pair()[0], parallel=0)


def test_max_body_bytes_flag():
    a = build_parser().parse_args(["serve", "--max-body-bytes", "1234"])
    assert a.max_body_bytes == 1234
    assert build_parser().parse_args(["serve"]).max_body_bytes is None  # serve()'s default
    assert server.DEFAULT_MAX_BODY_BYTES == 8 << 20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-body-bytes", "0"])


@pytest.mark.parametrize("data,param", [
    (b"[" * 100_000 + b"]" * 100_000, None),  # RecursionError: was a 500
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ""}).encode(), "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}).encode(), "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [1]}).encode(), "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800"]}).encode(), "stop"),
], ids=["nested-arrays", "unknown-role", "no-messages", "empty-stop", "empty-stop-in-list", "int-stop",
        "unencodable-stop"])
def test_client_errors_are_400(engine, data, param):
    app = create_app(engine, model_name="m")
    try:
        code, err = asyncio.run(call(app, "POST", "/v1/chat/completions", [data]))
    finally:
        _close(app)
    assert code == 400 and err["error"]["param"] == param and err["error"]["message"], err


def test_chat_roles(engine):
    """OpenAI's roles are taken ("developer" is the system role), others refused above."""
    app = create_app(engine, model_name="m")
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}],
            "max_tokens": 1}
    try:
        code, r = asyncio.run(call(app, "POST", "/v1/chat/completions", [json.dumps(body).encode()]))
    finally:
        _close(app)
    assert code == 200, r


def test_queue_full_is_503(engine):
    """Every slot busy and the queue at max_queue: the request is refused at once with a 503 in
    OpenAI's shape (code queue_full), and the server keeps serving once a slot is free."""
    app = create_app(engine, model_name="m", max_queue=0)
    pool = app.state.pool
    assert pool.n_slots == 1
    pool.n_busy = 1  # the only slot, taken by a request still running
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    try:
        code, err = asyncio.run(call(app, "POST", "/v1/completions", [body]))
        pool.release()  # that request ended
        code2, r = asyncio.run(call(app, "POST", "/v1/completions", [body]))
    finally:
        _close(app)
    assert code == 503 and err["error"]["code"] == "queue_full" and "busy" in err["error"]["message"], err
    assert code2 == 200 and r["usage"]["completion_tokens"] == 1, r


@pytest.fixture(scope="module")
def novocab_engine(tmp_path_factory):
    """A target whose GGUF has no vocabulary (what the converter writes without a tokenizer.json)."""
    from gguf import GGUFValueType

    from fixtures import make_random_gguf
    from reference.gguf_edit import rewrite_gguf

    d = tmp_path_factory.mktemp("novocab")
    good = make_random_gguf(d / "good.gguf", "qwen3_5", outtype="f16", seed=3)
    p = rewrite_gguf(good, d / "novocab.gguf",
                     kv={"tokenizer.ggml.model": ("none", GGUFValueType.STRING), "qwen35.vocab_size": 640},
                     drop_keys=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                                "tokenizer.ggml.pre"))
    with dn.Engine(p, n_ctx=64, n_threads=1) as eng:
        assert eng.tokenizer is None
        yield eng


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "text", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "stop": ["x"]}, "stop"),
], ids=["text-prompt", "chat", "stop"])
def test_no_tokenizer_needs_token_ids(novocab_engine, path, body, param):
    """A model without a vocabulary serves token ids; text prompts, chat and stop strings are 400s
    that say so. Token ids are served."""
    app = create_app(novocab_engine, model_name="m")
    try:
        code, err = asyncio.run(call(app, "POST", path, [json.dumps(body).encode()]))
        ok, r = asyncio.run(call(app, "POST", "/v1/completions",
                                 [json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()]))
    finally:
        _close(app)
    assert code == 400 and err["error"]["param"] == param and "tokenizer" in err["error"]["message"], err
    assert ok == 200 and r["usage"]["completion_tokens"] == 2, r
