"""Serving: requests/s, time to first token (TTFT) and inter-token latency (ITL) through
`dflash-native serve` at 1, 4 and 16 concurrent clients, speculative against AR (the `speculative`
request extension, same server), and a multi-turn chat with and without the prompt cache.

    python bench/serve.py [--target T --drafter D] [--slots 1] [--requests 16] [--max-tokens 64]
                          [--turns 8] [--turn-tokens 256] [--jsonl bench/results/serve.jsonl]

The server runs as a subprocess on a free loopback port (the embedded default pair unless given);
clients are threads using the `openai` package, streaming, so TTFT is the first content chunk's
arrival and ITL the gaps between later chunks. Multi-turn (one slot): each turn appends about
--turn-tokens of code as a user message to the conversation and asks for --turn-max-tokens; with
the cache, each turn continues the slot's held sequence; without it, an unrelated request runs on
the slot before each turn, so the same prompt starts cold. Figures from a shared machine are smoke.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, resolve_pair, write_jsonl  # noqa: E402



def start_server(target, drafter, slots: int, n_ctx: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dflash_native", "serve", "--target", str(target), "--drafter", str(drafter),
           "--port", str(port), "--slots", str(slots), "--n-ctx", str(n_ctx), "--queue", "256",
           "--model-name", "bench"]
    if threads:
        cmd += ["--threads", str(threads)]
    import dflash_native  # the server imports the package this process imports (installed, or a dev build)

    pkg_root = str(Path(dflash_native.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return proc, base
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the server did not start")
            time.sleep(0.2)


def stream_one(client, messages=None, prompt=None, **kw) -> dict:
    """One streamed request: TTFT, the inter-token gaps, tokens, cached prompt tokens."""
    t0 = time.perf_counter()
    times, usage, ext = [], None, {}
    if messages is not None:
        s = client.chat.completions.create(model="bench", messages=messages, stream=True,
                                           stream_options={"include_usage": True}, **kw)
        get = lambda ch: ch.choices[0].delta.content if ch.choices else None  # noqa: E731
    else:
        s = client.completions.create(model="bench", prompt=prompt, stream=True,
                                      stream_options={"include_usage": True}, **kw)
        get = lambda ch: ch.choices[0].text if ch.choices else None  # noqa: E731
    text = []
    for ch in s:
        piece = get(ch)
        if piece:
            times.append(time.perf_counter())
            text.append(piece)
        if ch.usage is not None:
            usage = ch.usage
        if ch.model_extra and "dflash" in ch.model_extra:
            ext = ch.model_extra["dflash"]
    t1 = time.perf_counter()
    return dict(ttft=(times[0] - t0) if times else t1 - t0, itl=[b - a for a, b in zip(times, times[1:])],
                wall=t1 - t0, tokens=usage.completion_tokens if usage else 0,
                cached=ext.get("n_cached_tokens", 0), prompt_tokens=usage.prompt_tokens if usage else 0,
                text="".join(text))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def load_run(base, prompts, clients: int, n_requests: int, max_tokens: int, speculative: bool) -> dict:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    jobs = [prompts[i % len(prompts)] for i in range(n_requests)]
    lock, out = threading.Lock(), []

    def worker(k):
        while True:
            with lock:
                if not jobs:
                    return
                p = jobs.pop()
            r = stream_one(client, prompt=p, max_tokens=max_tokens, extra_body={"speculative": speculative})
            with lock:
                out.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(worker, range(clients)))
    wall = time.perf_counter() - t0
    itl = [g for r in out for g in r["itl"]]
    toks = sum(r["tokens"] for r in out)
    return dict(clients=clients, speculative=speculative, requests=len(out), wall_s=wall, req_s=len(out) / wall,
                tok_s=toks / wall, ttft_p50=pct([r["ttft"] for r in out], 0.5),
                ttft_p95=pct([r["ttft"] for r in out], 0.95), itl_p50=pct(itl, 0.5), itl_p95=pct(itl, 0.95))


def multi_turn(base, turns: int, turn_text: str, max_tokens: int, cache: bool) -> list[dict]:
    """A conversation of `turns` user turns; without the cache an unrelated request runs on the
    (single) slot before each turn, so the turn's prompt starts cold."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    msgs, rows = [], []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"# part {t}\n{turn_text}"})
        if not cache:
            stream_one(client, prompt="import sys\n", max_tokens=1)
        r = stream_one(client, messages=msgs, max_tokens=max_tokens)
        msgs.append({"role": "assistant", "content": r["text"]})
        rows.append(dict(turn=t, cache=cache, ttft=r["ttft"], prompt_tokens=r["prompt_tokens"], cached=r["cached"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="threads per slot (default: cores / slots)")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per (clients, mode) cell")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=256, help="approximate user tokens added per turn")
    ap.add_argument("--turn-max-tokens", type=int, default=32)
    ap.add_argument("--jsonl", type=Path, default=None)
    a = ap.parse_args()

    target, drafter = resolve_pair(a.target, a.drafter)
    import dflash_native as dn
    from dflash_native.train import corpus

    mach, rev = machine(), git_rev()
    print(f"machine: {mach}\nrev: {rev}")
    with dn.Engine(target, n_ctx=8192) as eng:
        prompts = [p.text for p in corpus.heldout_prompts(16, 96, eng, seed=0)]
        turn_text = eng.detokenize(eng.tokenize("\n".join(p.text for p in corpus.heldout_prompts(
            max(1, a.turn_tokens // 96 + 1), 96, eng, seed=1)))[:a.turn_tokens])
    n_ctx = max(2048, a.turns * (a.turn_tokens + a.turn_max_tokens + 32) + 256)
    rows = []
    proc, base = start_server(target, drafter, a.slots, n_ctx, a.threads)
    try:
        stream_one(__import__("openai").OpenAI(base_url=base + "/v1", api_key="none"), prompt=prompts[0],
                   max_tokens=8)  # warm-up: graph plans
        print("\n| clients | mode | requests | req/s | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for c in [int(x) for x in a.clients.split(",")]:
            for spec in (True, False):
                r = load_run(base, prompts, c, a.requests, a.max_tokens, spec)
                rows.append(dict(bench="serve_load", **r))
                print(f"| {c} | {'DFlash' if spec else 'AR'} | {r['requests']} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
                      f"{1e3 * r['ttft_p50']:.0f} | {1e3 * r['ttft_p95']:.0f} | {1e3 * r['itl_p50']:.1f} | "
                      f"{1e3 * r['itl_p95']:.1f} |")
        print("\n| turn | prompt tokens | cache on: cached | TTFT on ms | TTFT off ms | off / on |")
        print("|---:|---:|---:|---:|---:|---:|")
        on = multi_turn(base, a.turns, turn_text, a.turn_max_tokens, cache=True) if a.slots == 1 else None
        off = multi_turn(base, a.turns, turn_text, a.turn_max_tokens, cache=False)
        if on is None:
            raise SystemExit("the multi-turn run needs --slots 1")
        for x, y in zip(on, off):
            print(f"| {x['turn']} | {x['prompt_tokens']} | {x['cached']} | {1e3 * x['ttft']:.0f} | "
                  f"{1e3 * y['ttft']:.0f} | {y['ttft'] / x['ttft']:.1f}x |")
            rows.append(dict(bench="serve_multi_turn", turn=x["turn"], prompt_tokens=x["prompt_tokens"],
                             cached=x["cached"], ttft_cache_s=x["ttft"], ttft_cold_s=y["ttft"]))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for r in rows:
        r.update(machine=mach, rev=rev, target=Path(target).name, drafter=Path(drafter).name, slots=a.slots,
                 max_tokens=a.max_tokens, note="smoke, shared machine" if os.environ.get("DFLASH_SMOKE") else "")
    write_jsonl(a.jsonl, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
