"""The OpenAI-compatible server: a real `dflash-native serve` process on a free loopback port, the
embedded default pair (it has a chat template), driven by the official `openai` client. Outputs are
compared with Engine.generate / Engine.chat on the same files and settings in this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import dflash_native as dn  # noqa: E402
from dflash_native.cli import default_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_CTX, N_BATCH = 1024, 64  # n_batch 64: cached and cold prefills run the same kernels (bitwise)
MODEL = "default-target-f16"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*args: str) -> tuple[subprocess.Popen, str]:
    """A `dflash-native serve` process of the embedded pair on a free port, once /health answers."""
    if default_pair() is None:
        pytest.skip("no embedded default pair in this install")
    port = _free_port()
    # the server imports the package this test run imported (the installed one, or python/ with a
    # dev-built _core), never the bare source tree
    pkg_root = str(Path(dn.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_native", "serve", "--port", str(port), "--n-batch",
                             str(N_BATCH), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.load(r)["status"] == "ok":
                    return proc, base
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start: {proc.stdout.read()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
    proc, base = _start_server("--parallel", "2", "--queue", "40", "--n-ctx", str(N_CTX))
    yield base
    _stop_server(proc)


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def offline():
    t, d = default_pair()
    with dn.Engine(t, drafter=d, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as eng:
        yield eng


def client(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def post_raw(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


PROMPTS = ["def fib(n):\n", "import os\n\nclass Path", "    for i in range(", "def _parse(self, text):\n    "]


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    h = get_json(server + "/health")
    assert h["status"] == "ok" and h["slots"] == 2


def test_completions_equal_engine(server, offline):
    c = client(server)
    for p in PROMPTS[:2]:
        want = offline.generate(p, max_tokens=24)
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=24)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == ("length" if want.stats.stop_reason == "length" else "stop")
        assert r.usage.prompt_tokens == len(offline.tokenize(p)) and r.usage.completion_tokens == len(want.tokens)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        ext = r.model_extra["dflash"]
        assert ext["speculative"] and ext["n_generated"] == len(want.tokens)
        # streamed: the pieces join to the same text, the last chunk says why it ended, usage at the end
        chunks = list(c.completions.create(model=MODEL, prompt=p, max_tokens=24, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] is not None
        assert chunks[-1].usage.completion_tokens == len(want.tokens)
    # AR on the same server (extension field) and sampling at a seed
    want = offline.generate(PROMPTS[2], max_tokens=16, speculative=False)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, extra_body={"speculative": False})
    assert r.choices[0].text == want.text and not r.model_extra["dflash"]["speculative"]
    want = offline.generate(PROMPTS[3], max_tokens=16, temperature=0.8, top_p=0.9, top_k=30, min_p=0.02, seed=7)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0.8, top_p=0.9, seed=7,
                             extra_body={"top_k": 30, "min_p": 0.02})
    assert r.choices[0].text == want.text


def test_stop_strings(server, offline):
    c = client(server)
    full = offline.generate(PROMPTS[0], max_tokens=32).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip()
    want = offline.generate(PROMPTS[0], max_tokens=32, stop=[stop])
    assert want.stats.stop_reason == "stop"
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, stop=[stop, "\x00never"])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    s = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in s) == want.text


def test_chat_equal_engine(server, offline):
    c = client(server)
    msgs = [{"role": "user", "content": "def fib(n):"}]
    want = offline.chat(msgs, max_tokens=24)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.tokens)
    s = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, stream=True))
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in s) == want.text


def test_prompt_cache_three_turns(server, offline):
    """Each later turn's prompt continues the slot's held sequence: only the new tokens are
    prefilled (usage's cached_tokens), and the reply equals a cold start's."""
    c = client(server)
    msgs = [{"role": "user", "content": "def fib(n):"}]
    cached = []
    for turn in range(3):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32)
        want = offline.chat(msgs, max_tokens=32)  # cold: no cache_prompt
        assert r.choices[0].message.content == want.text, turn
        n_cached = r.usage.prompt_tokens_details.cached_tokens
        assert r.model_extra["dflash"]["n_cached_tokens"] == n_cached
        assert r.usage.prompt_tokens == want.stats.n_prompt_tokens
        cached.append(n_cached)
        msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                       {"role": "user", "content": f"and turn {turn + 2}"}]
    assert cached[0] == 0
    # the later turns reuse at least the previous prompt and most of its reply
    assert cached[1] > 15 and cached[2] > cached[1] + 16, cached


def test_concurrent_clients(server, offline):
    """32 clients x 4 requests on 2 slots (a queue of 40): every response complete and equal to its
    offline output; the server healthy afterwards."""
    prompts = [f"{PROMPTS[i % 4]}{i}" for i in range(32)]
    want = {p: offline.generate(p, max_tokens=8).text for p in prompts}
    c = client(server)

    def one(i: int) -> list[bool]:
        out = []
        for k in range(4):
            p = prompts[(i + k) % 32]
            if k % 2:
                text = "".join(ch.choices[0].text for ch in
                               c.completions.create(model=MODEL, prompt=p, max_tokens=8, stream=True))
            else:
                text = c.completions.create(model=MODEL, prompt=p, max_tokens=8).choices[0].text
            out.append(text == want[p])
        return out

    with ThreadPoolExecutor(32) as ex:  # a hang is pytest-timeout's to catch, not a wall-clock bound's
        results = list(ex.map(one, range(32)))
    assert all(all(r) for r in results) and sum(map(len, results)) == 128
    h = get_json(server + "/health")
    assert h["status"] == "ok" and h["slots_busy"] == 0 and h["queued"] == 0


def test_cancelled_stream_frees_its_slot(server, offline):
    c = client(server)
    before = _metric(server, "dflash_requests_cancelled_total")
    s = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=800, stream=True)
    it = iter(s)
    next(it), next(it)
    s.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while get_json(server + "/health")["slots_busy"] != 0:
        assert time.monotonic() < deadline, "the cancelled request still holds its slot"
        time.sleep(0.1)
    assert _metric(server, "dflash_requests_cancelled_total") == before + 1
    gen = _metric(server, "dflash_generated_tokens_total")
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20)
    assert r.choices[0].text == offline.generate(PROMPTS[1], max_tokens=20).text
    assert _metric(server, "dflash_generated_tokens_total") == gen + r.usage.completion_tokens


def _post_and_drop(base: str, body: dict) -> socket.socket:
    """Sends a non-streamed request on a raw connection and returns the socket (to close unread)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _wait_health(base: str, pred, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred(get_json(base + "/health")):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_dropped_non_streamed_requests_are_cancelled(server, offline):
    """A client that goes away before its non-streamed answer stops its generation at the next round
    (running) or leaves the queue (waiting); the slots come free and later outputs are unaffected."""
    before = _metric(server, "dflash_requests_cancelled_total")
    long = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 900}
    # both slots busy with long requests (~2 s each), a third one queued behind them
    socks = [_post_and_drop(server, long) for _ in range(3)]
    _wait_health(server, lambda h: h["slots_busy"] == 2 and h["queued"] == 1, "the three requests never all arrived")
    gen0 = _metric(server, "dflash_generated_tokens_total")
    for s in socks:
        s.close()
    _wait_health(server, lambda h: h["slots_busy"] == 0 and h["queued"] == 0,
                 "a dropped non-streamed request still holds its slot or its place in the queue")
    assert _metric(server, "dflash_requests_cancelled_total") == before + 3
    # none of the three ran to its end (a cancelled request reports no tokens)
    assert _metric(server, "dflash_generated_tokens_total") == gen0
    r = client(server).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24)
    assert r.choices[0].text == offline.generate(PROMPTS[2], max_tokens=24).text


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(server):
    client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16)
    with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ("dflash_requests_total{", "dflash_generated_tokens_total", "dflash_decode_tokens_per_second",
                 "dflash_acceptance_length_bucket{le=\"+Inf\"}", "dflash_verify_seconds_total",
                 "dflash_draft_seconds_total", "dflash_rollback_seconds_total", "dflash_prompt_tokens_cached_total"):
        assert name in text, name
    assert _metric(server, "dflash_acceptance_length_count") > 0


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 99999999]}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x " * 2000}, 400, "prompt"),
    # values only the engine checked: a 400 before any generation (not a 200 stream with an error event)
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": 21, "stream": True}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**30, "stream": True}, 400, "max_tokens"),
    ({"prompt": "x", "top_k": 10**30, "stream": True}, 400, "top_k"),
    # text with no UTF-8 form (a lone surrogate escape in the JSON) was a 500
    ({"prompt": "\ud800 x"}, 400, "prompt"),
    # fields that change the output and are not implemented: refused, not silently ignored
    ({"prompt": "x", "frequency_penalty": 1.0}, 400, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": -0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"15": 100}}, 400, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
])
def test_bad_requests(server, body, status, param):
    code, err = post_raw(server + "/v1/completions", json.dumps(body).encode())
    assert code == status and err["error"]["param"] == param and err["error"]["message"], err


def test_bad_json_and_chat_errors(server):
    for data in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        code, err = post_raw(server + "/v1/completions", data)
        assert code == 400 and "JSON" in err["error"]["message"]
    code, err = post_raw(server + "/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode())
    assert code == 400 and err["error"]["param"] == "messages"
    if "logprobs" not in dn.Engine.generate.__code__.co_varnames:
        code, err = post_raw(server + "/v1/completions", json.dumps({"prompt": "x", "logprobs": 2}).encode())
        assert code == 400 and err["error"]["code"] == "not_supported"
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="x", max_tokens=2)
    # still serving
    assert client(server).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None
    assert get_json(server + "/health")["status"] == "ok"


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),  # was a 500
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),  # chat's is a bool
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
])
def test_bad_chat_requests(server, body, param):
    code, err = post_raw(server + "/v1/chat/completions", json.dumps(body).encode())
    assert code == 400 and err["error"]["param"] == param and err["error"]["message"], err


def test_unknown_paths_and_methods_are_json_errors(server):
    """404 and 405 in OpenAI's error shape (they were Starlette's plain-text pages), and
    GET /v1/models/{id} (the client's models.retrieve)."""
    for method, path, status in [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/chat/completions", 405), ("GET", "/v1/models/nope", 404)]:
        req = urllib.request.Request(server + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == status
        assert json.load(e.value)["error"]["message"], (method, path)
    assert client(server).models.retrieve(MODEL).id == MODEL


def test_logprobs_openai_shape(server, offline):
    """logprobs in OpenAI's shapes, equal to the engine's (they were a 500: the raw objects are not
    JSON); streamed, the last chunk carries them."""
    c = client(server)
    p = PROMPTS[0]
    want = offline.generate(p, max_tokens=12, logprobs=3)
    values = [lp.logprob for lp in want.logprobs]
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want.text and lp.token_logprobs == values
    assert lp.tokens == [offline.detokenize([t]) for t in want.tokens] and "".join(lp.tokens) == want.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert [list(d.values()) for d in lp.top_logprobs] == [[v for _, v in w.top] for w in want.logprobs]
    s = list(c.completions.create(model=MODEL, prompt=p, max_tokens=12, logprobs=3, stream=True))
    assert [v for ch in s if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs] == values

    msgs = [{"role": "user", "content": "def fib(n):"}]
    want = offline.chat(msgs, max_tokens=10, logprobs=2)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text
    assert [x.logprob for x in content] == [w.logprob for w in want.logprobs]
    assert [bytes(x.bytes) for x in content] == [offline.tokenizer.token_bytes(t) for t in want.tokens]
    assert [[t.logprob for t in x.top_logprobs] for x in content] == [[v for _, v in w.top] for w in want.logprobs]
    s = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, logprobs=True, stream=True))
    got = [x for ch in s if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.logprob for x in got] == [w.logprob for w in want.logprobs] and all(not x.top_logprobs for x in got)


def test_echo(server, offline):
    """echo: true puts the prompt before the completion (it was silently ignored)."""
    c = client(server)
    p = PROMPTS[1]
    gen = offline.generate(p, max_tokens=8)
    want = p + gen.text
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=8, echo=True)
    assert r.choices[0].text == want and r.usage.completion_tokens == len(gen.tokens)
    assert "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                                       echo=True, stream=True)) == want
    ids = offline.tokenize(p)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, echo=True)
    assert r.choices[0].text == offline.detokenize(ids) + offline.generate(ids, max_tokens=8).text


def test_chat_content_parts(server, offline):
    """Content as a list of text parts (what many clients send) reads as their text (was a 400)."""
    want = offline.chat([{"role": "user", "content": "def fib(n):\nreturn"}], max_tokens=12)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "def fib(n):"}, {"type": "text", "text": "return"}]}]
    r = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    assert r.choices[0].message.content == want.text


def test_finished_streams_are_not_counted_as_cancelled(server):
    """A stream that ran to its end is not a cancelled request when its response closes (it was,
    whenever the worker thread had not yet returned: about 1 in 30 short streams)."""
    c = client(server)
    before = _metric(server, "dflash_requests_cancelled_total")

    def one(i: int) -> str:
        return "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=f"x{i}", max_tokens=1,
                                                                         stream=True))

    with ThreadPoolExecutor(8) as ex:
        assert len(list(ex.map(one, range(200)))) == 200
    assert _metric(server, "dflash_requests_cancelled_total") == before


def test_client_gone_while_sending_the_body(server):
    """A client that closes its connection mid-body is a 499 in the metrics (it was an unhandled
    ClientDisconnect: a traceback in the server's log), and the server serves on."""
    name = 'dflash_requests_total{endpoint="completions",status="499"}'

    def count() -> float:
        try:
            return _metric(server, name)
        except AssertionError:  # no 499 yet
            return 0.0

    before = count()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(0.3)
    deadline = time.monotonic() + 20
    while count() != before + 1:
        assert time.monotonic() < deadline, "the dropped upload was not counted as a 499"
        time.sleep(0.05)
    assert client(server).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_slot_is_free_when_the_response_ends(server):
    """A slot is free once its response has ended (it came free a moment later, when the worker
    thread returned: a client's next turn could miss its prompt cache and go to a cold slot, and
    /health right after a response showed a busy slot about one time in three)."""
    c = client(server)
    for i in range(30):
        if i % 2:
            c.completions.create(model=MODEL, prompt=f"{PROMPTS[0]}{i}", max_tokens=2)
        else:
            list(c.completions.create(model=MODEL, prompt=f"{PROMPTS[0]}{i}", max_tokens=2, stream=True))
        assert get_json(server + "/health")["slots_busy"] == 0, i
    msgs = [{"role": "user", "content": "def fib(n):"}]
    for turn in range(8):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        assert turn == 0 or r.usage.prompt_tokens_details.cached_tokens > 0, turn
        msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                       {"role": "user", "content": f"turn {turn}"}]


def test_shutdown_cancels_running_requests():
    """Ctrl-C (SIGINT) while requests run: after --shutdown-timeout they are cancelled, the engines
    stop at their next step and the process exits. It waited for every running request to finish
    (the grace period had no end, and the shutdown then blocked the event loop that the cancelled
    requests needed): minutes for a long request."""
    proc, base = _start_server("--parallel", "2", "--n-ctx", "32768", "--shutdown-timeout", "0.5")
    try:
        s = client(base).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32000, stream=True)
        it = iter(s)
        next(it), next(it)
        with ThreadPoolExecutor(3) as ex:
            # one more running (non-streamed), and two queued behind them (streamed or not)
            body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 32000}
            plain = ex.submit(post_raw, base + "/v1/completions", json.dumps(body).encode())
            _wait_health(base, lambda h: h["slots_busy"] == 2, "the second request never started")
            queued = [ex.submit(post_raw, base + "/v1/completions", json.dumps({**body, "stream": st}).encode())
                      for st in (False, True)]
            _wait_health(base, lambda h: h["queued"] == 2, "the queued requests never arrived")
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
            answers = [f.result(timeout=10) for f in [plain, *queued]]
        out = proc.stdout.read()
        assert proc.returncode == 0, out
        # all three answered 503 in OpenAI's shape (the queued ones were plain-text 500s), no traceback
        assert all(code == 503 and err["error"]["code"] == "shutting_down" for code, err in answers), answers
        assert "Traceback" not in out, out
        finish = []
        with pytest.raises(Exception):  # the stream ends without its last chunk (the connection closes)
            for ch in it:
                finish.append(ch.choices[0].finish_reason)
        assert not any(finish)
    finally:
        proc.kill()


def test_ar_only_server_refuses_speculative():
    """A server without a drafter: 'speculative': true is a 400 naming the field, streamed or not
    (it was a 400 without a param, and a 200 stream carrying an error event); plain requests run."""
    proc, base = _start_server("--no-drafter", "--n-ctx", "256")
    try:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "speculative": True, "stream": stream}
            code, err = post_raw(base + "/v1/completions", json.dumps(body).encode())
            assert code == 400 and err["error"]["param"] == "speculative", err
        r = client(base).completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert not r.model_extra["dflash"]["speculative"]
    finally:
        proc.kill()


def _sse_chunks(base: str, path: str, body: dict) -> list[dict]:
    """A streamed request's chunks as parsed JSON, read raw (no client in between)."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = [ln.decode().strip() for ln in r]
    data = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPTS[0]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def fib(n):"}]}),
])
def test_stream_chunk_fields(server, path, body):
    """OpenAI's chunk fields: one id and one `created` for the whole stream (it took the time per
    chunk), and with include_usage a `usage` key in every chunk, null but in the extra last one
    (it was absent)."""
    chunks = _sse_chunks(server, path, {**body, "model": MODEL, "max_tokens": 300, "stream": True,
                                        "stream_options": {"include_usage": True}})
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


# ---- --parallel 4: one engine, its requests batched into shared target passes ------------------

@pytest.fixture(scope="module")
def server4():
    proc, base = _start_server("--parallel", "4", "--queue", "16", "--n-ctx", str(N_CTX))
    yield base
    _stop_server(proc)


def _metrics(base: str) -> dict[str, float]:
    """Every sample in /metrics, by its name with labels."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}


def test_parallel_streams_equal_solo(server4, offline):
    """8 streaming clients at once on 4 slots of one engine (greedy, sampled at a seed, AR, and a
    response_format): each one's text equals the same request run alone; /metrics shows target
    passes over more than one request, and requests on every slot."""
    sampled = dict(temperature=0.8, top_p=0.9, seed=11)
    reqs = [(f"{PROMPTS[i % 4]}{i}", {} if i % 2 == 0 else {**sampled, "seed": 11 + i}) for i in range(6)]
    reqs.append((PROMPTS[2], {"extra_body": {"speculative": False}}))
    want = [offline.generate(p, max_tokens=40, **{k: v for k, v in kw.items() if k != "extra_body"},
                             **({"speculative": False} if "extra_body" in kw else {})).text for p, kw in reqs]
    fmt_msgs = [{"role": "user", "content": "Give me a JSON object."}]
    want.append(offline.chat(fmt_msgs, max_tokens=40, constraint=dn.JsonSchema()).text)
    c = client(server4)
    before = _metrics(server4)
    go = threading.Barrier(len(want))

    def one(i: int) -> str:
        go.wait()
        if i < len(reqs):
            p, kw = reqs[i]
            return "".join(ch.choices[0].text for ch in
                           c.completions.create(model=MODEL, prompt=p, max_tokens=40, stream=True, **kw))
        s = c.chat.completions.create(model=MODEL, messages=fmt_msgs, max_tokens=40, stream=True,
                                      response_format={"type": "json_object"})
        return "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)

    with ThreadPoolExecutor(len(want)) as ex:
        got = list(ex.map(one, range(len(want))))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (i, g, w)
    after = _metrics(server4)
    assert after["dflash_slots"] == 4
    assert after["dflash_cpu_threads"] >= 1 and "dflash_cpu_thread_reductions_total" in after
    passes = after["dflash_batch_passes_total"] - before["dflash_batch_passes_total"]
    solo = after['dflash_batch_width_bucket{le="1"}'] - before.get('dflash_batch_width_bucket{le="1"}', 0.0)
    assert passes > 0 and passes - solo > 0, (passes, solo)  # passes over 2 or more requests
    assert after["dflash_batch_width_mean"] > 1.0
    # the batch's controller measured AR over the batch (a width's first step is AR for everybody)
    assert after["dflash_batch_controller_ar_steps_total"] > 0
    assert "dflash_batch_controller_switches_total" in after
    steps = after["dflash_batch_steps_total"] - before["dflash_batch_steps_total"]
    assert steps > 0 and after["dflash_batch_step_seconds_total"] > before["dflash_batch_step_seconds_total"]
    assert "dflash_batch_prefill_chunks_total" in after and "dflash_batch_tree_verifies_total" in after
    assert all(after[f'dflash_slot_requests_total{{slot="{k}"}}'] > 0 for k in range(4)), after
    assert sum(after[f'dflash_slot_rounds_total{{slot="{k}"}}'] for k in range(4)) \
        == after["dflash_acceptance_length_count"]
    h = get_json(server4 + "/health")
    assert h["slots"] == 4 and h["slots_busy"] == 0 and h["queued"] == 0


def test_parallel_disconnect_frees_its_slot(server4, offline):
    """A streaming client that goes away while 3 others run: its request is cancelled and its slot in
    the engine comes free (the core's scheduler ends the ticket at its next step). Then 4 requests
    at once all run, on all 4 slots together (passes 4 wide), with their solo outputs."""
    c = client(server4)
    before = _metrics(server4)
    others = [f"{PROMPTS[i]}x" for i in range(3)]
    with ThreadPoolExecutor(3) as ex:
        runs = [ex.submit(lambda p: "".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt=p, max_tokens=60, stream=True)), p) for p in others]
        s = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=800, stream=True)
        it = iter(s)
        next(it), next(it)
        s.close()  # the client goes away mid-stream
        got = [f.result() for f in runs]
    assert got == [offline.generate(p, max_tokens=60).text for p in others]
    _wait_health(server4, lambda h: h["slots_busy"] == 0, "the cancelled request still holds its slot")
    mid = _metrics(server4)
    assert mid["dflash_requests_cancelled_total"] == before["dflash_requests_cancelled_total"] + 1
    assert mid["dflash_generated_tokens_total"] == before["dflash_generated_tokens_total"] + sum(
        len(offline.generate(p, max_tokens=60).tokens) for p in others)  # the cancelled one counts none
    prompts = [f"{PROMPTS[3 - i]}y{i}" for i in range(4)]
    go = threading.Barrier(4)

    def one(p: str) -> str:
        go.wait()
        return "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=64,
                                                                          stream=True))

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(one, prompts))
    assert got == [offline.generate(p, max_tokens=64).text for p in prompts]
    after = _metrics(server4)
    four = [m['dflash_batch_width_bucket{le="4"}'] - m['dflash_batch_width_bucket{le="3"}'] for m in (mid, after)]
    assert four[1] > four[0], "no pass over 4 requests: a slot stayed taken"


def test_parallel_prompt_caches(server4, offline):
    """4 three-turn chats at once on 4 slots: the core puts each later turn in the slot holding its
    conversation (usage's cached_tokens past the previous prompt), and every reply equals a cold
    start's; the slots' held sequences are each conversation's own (a turn never continues another's)."""
    c = client(server4)
    go = threading.Barrier(4)

    def chat(i: int) -> list[tuple[int, int, bool]]:
        msgs = [{"role": "user", "content": f"{PROMPTS[i]} # conversation {i}"}]
        out, prev = [], 0
        go.wait()
        for turn in range(3):
            r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
            want = offline.chat(msgs, max_tokens=24)  # cold: no cache_prompt
            out.append((r.usage.prompt_tokens_details.cached_tokens, prev,
                        r.choices[0].message.content == want.text))
            prev = r.usage.prompt_tokens
            msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                           {"role": "user", "content": f"and turn {turn + 2}"}]
        return out

    with ThreadPoolExecutor(4) as ex:
        runs = list(ex.map(chat, range(4)))
    for i, turns in enumerate(runs):
        assert all(same for _, _, same in turns), (i, turns)
        assert turns[0][0] == 0, (i, turns)  # no slot holds a prefix of a first turn
        # the later turns reuse at least the previous turn's whole prompt
        assert all(cached >= prev > 0 for cached, prev, _ in turns[1:]), (i, turns)
