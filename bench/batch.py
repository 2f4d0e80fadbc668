"""Concurrent requests on one batched engine against today's one-sequence engines (issue 35,
"Benchmarks"; docs/architecture.md, "Batched target").

For each concurrency C (--concurrency), C client threads each run R requests (--requests) of
--max-tokens tokens, greedy, every request its own prompt (--queue shared: the C x R requests from
one queue, C in flight until it is empty, as a serving benchmark's max concurrency; client: each
thread its own R, so the wall time is the slowest thread's list), on three setups, interleaved within
one run (their order rotates per rep):

- spec:   one Engine(n_seq=C) with the drafter: each engine step is one target pass over every
          active request's verify block (csrc/engine/scheduler.h);
- ar:     the same engine, generate(speculative=False): batched AR steps;
- oneseq: today's server (dflash_native/server: one engine per slot, each run by its own thread,
          n_threads = threads // C each, speculative): C Engine(n_seq=1), one per client thread;
- with --llama-server, llama.cpp's own llama-server (built from the pinned llama-cpp-python
  sdist's sources: bench/_llamacpp_server.py) as a real process on 127.0.0.1, `--parallel C`,
  the batched engine's threads, a context of C slots of the engines' n_ctx, the same prompts as
  token ids on /completion (temperature 0, no prompt cache, EOS stops as in Engine.generate) from
  the same C client threads:
  llama-srv:    without speculation;
  llama-dflash: with the same drafter GGUF as its DFlash drafter (`-md ... --spec-type
                draft-dflash`, at most B - 1 draft tokens a round: the same verify block). Its
                acceptance length is llama.cpp's own (/metrics: 1 + accepted drafts per round).
                Drafts cannot be forced into llama-server: under --tau it drafts with the random
                drafter as it is (acceptance near 1), which the table's note says; the llama-srv
                row is the fair comparison there.
  Their "same as solo" compares llama.cpp's tokens with our solo AR tokens (reported, not failed
  on: llama.cpp's kernels may round differently near ties).

Reported per (C, tau, setup): aggregate tok/s (every generated token over the cell's wall time),
per-request latency p50 / p95 (one generate() call, queueing included), the mean acceptance
length, the batched engine's mean requests and tokens per target pass (Scheduler.pass_stats), and
"same as solo": how many requests' tokens equal that request's tokens from a one-sequence engine
alone (AR; speculative output equals it bit for bit, in any batch). Then the ratios spec / ar and
spec / oneseq (and with --llama-server spec / the faster llama-server row). Only such
side-by-side ratios mean anything on a shared machine.

Targets: the default is the 0.5B-shaped Qwen3.5 hybrid (_common.QWEN35_05B) at --outtype (q8_0;
q4_k_m: llama.cpp's quantizer, with a Q8_0 drafter) and a random one-layer drafter, its drafts
forced to a fixed acceptance (--tau): the first tau - 1 drafts of every round are the AR
continuation (one AR run per prompt beforehand), the next one wrong, so each round commits tau
tokens whatever the drafter (tau = B: every draft right); the controller is off (every step a
round of B). --embedded: the shipped pair on held-out code prompts, its own drafts, the
controller on. --tiny: a smoke-run size.

--passes: also the target passes alone (target_session::decode_batch through _core.testing): one
pass over C sequences' AR tokens or verify blocks against the same work as C one-sequence passes.

    python bench/batch.py --tau 4 8 --json bench/results/batch.jsonl
    python bench/batch.py --outtype q4_k_m --tau 4 8 --json bench/results/batch.jsonl
    python bench/batch.py --embedded --json bench/results/batch.jsonl
    python bench/batch.py --llama-server --concurrency 1 2 4 8 16 32 --tau 4 8 --json bench/results/batch.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (QWEN35_05B, bench_target, cached_drafter, cached_typed_gguf, concurrent_clients,  # noqa: E402
                     git_rev, machine, resolve_pair, summarize, write_jsonl)
from serve import pct  # noqa: E402
from _llamacpp_server import llama_bufts as llama_server_bufts  # noqa: E402

LLAMA_SETUPS = ("llama-srv", "llama-dflash")


def forced_drafts(refs: dict, tau: int, n_vocab: int):
    """Engine._draft_override: per prompt (its token ids), the AR continuation `refs[prompt]` as the
    first tau - 1 drafts of a round, then a wrong token (tau >= B: all right)."""
    def override(prompt, out, B):
        ref, n = refs[tuple(prompt)], len(out)
        d = (list(ref[n: n + B - 1]) + [1] * B)[: B - 1]
        if tau < B:
            d[tau - 1] = (d[tau - 1] + 1) % n_vocab
        return d
    return override


def run_cell(engines, prompts, max_tokens: int, speculative: bool, shared: bool = False) -> dict:
    """len(engines) client threads, thread i running its prompts prompts[i] one after another on
    engines[i] (the same engine for every thread: the batched engine), or (shared) every prompt
    from one queue (_common.concurrent_clients). Wall time, per-request latencies and results."""
    wall, done = concurrent_clients(
        prompts, lambda i, p: engines[i].generate(p, max_tokens=max_tokens, speculative=speculative), shared)
    return dict(wall=wall, lat=[x[0] for x in done], results=[x[1] for x in done])


def run_llama(server, prompt_ids, max_tokens: int, shared: bool = False) -> dict:
    """run_cell for a llama-server: client thread i sends prompt_ids[i] one after another. The
    results are {"tokens", "timings", "latency_s"} dicts; "spec" holds the server's speculation
    counters over the cell (rounds, drafted, accepted)."""
    from _llamacpp_server import run_clients

    before = server.spec_counters()
    results, wall = run_clients(server, prompt_ids, max_tokens, shared)
    after = server.spec_counters()
    return dict(wall=wall, lat=[r["latency_s"] for r in results], results=results,
                spec={k: after[k] - before[k] for k in after})


def llama_servers(a, C: int, target: Path, drafter: Path, B: int) -> list:
    """The llama-server setups for C concurrent streams: [(name, LlamaServer)]."""
    from _llamacpp_server import LlamaServer

    ctx = a.prompt + a.max_tokens + 2 * B + 64  # the engines' n_ctx, per slot
    out = []
    try:
        out.append(("llama-srv", LlamaServer(target, parallel=C, threads=a.threads, ctx_per_slot=ctx)))
        out.append(("llama-dflash", LlamaServer(target, parallel=C, threads=a.threads, ctx_per_slot=ctx,
                                                drafter=drafter, draft_max=B - 1)))
    except BaseException:
        for _, srv in out:
            srv.close()
        raise
    return out


def private_gib() -> float | None:
    """This process's private (anonymous) resident memory, GiB (Linux): the engines' own buffers;
    weights are the GGUF files' pages, shared by every engine mapping them (VmRSS counts them once
    per mapping)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def pass_counts(sched) -> dict:
    """Scheduler.pass_stats as sums: batched passes, their tokens, the requests in them, solo steps,
    the steps the batch's controller made AR for every request (all 0 without a scheduler:
    Engine(n_seq=1) runs its one request without one)."""
    if sched is None:
        return dict(passes=0, tokens=0, requests=0, solo_steps=0, batch_ar_steps=0)
    p = sched.pass_stats
    return dict(passes=p["passes"], tokens=p["tokens"], requests=sum(n * w for n, w in enumerate(p["width"])),
                solo_steps=p["solo_steps"], batch_ar_steps=p["batch_ar_steps"])


def concurrency(a, target: Path, drafter: Path, prompts: list, prompt_ids: list, refs: list, taus: list, B: int,
                info: dict, gap_of=None) -> list[dict]:
    """The table. gap_of(prompt, solo tokens, other tokens): the top-2 logit gap of our AR at
    their first difference (dflash_native.lossless), for the llama-server requests that differ."""
    import dflash_native as dn

    rows = []
    print(f"\n{'C':>3} {'tau':>4} {'setup':12} {'requests':>8} {'tokens':>7} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} "
          f"{'acc len':>7} {'req/pass':>8} {'tok/pass':>8} {'same as solo':>12}")
    for C in a.concurrency:
        kw = dict(drafter=drafter, block_size=B, n_ctx=a.prompt + a.max_tokens + 2 * B + 64, gate=a.gate)
        batched = dn.Engine(target, n_seq=C, n_threads=a.threads, **kw)
        one_threads = max(1, a.threads // C)  # the server's split (dflash_native/server/app.py)
        singles, skipped = [], ""
        if C <= a.oneseq_max:
            try:
                for _ in range(C):
                    singles.append(dn.Engine(target, n_threads=one_threads, **kw))
            except MemoryError as e:
                skipped = f"MemoryError: {e}"
                for e_ in singles:
                    e_.close()
                singles = []
        else:
            skipped = f"C > --oneseq-max {a.oneseq_max}"
        mine = [[prompts[i * a.requests + k] for k in range(a.requests)] for i in range(C)]
        mine_ids = [[prompt_ids[i * a.requests + k] for k in range(a.requests)] for i in range(C)]
        servers = llama_servers(a, C, target, drafter, B) if a.llama_server else []
        solo = [[refs[i * a.requests + k][: a.max_tokens] for k in range(a.requests)] for i in range(C)]
        solo_flat = [t for s in solo for t in s]
        flat = [p for m in mine for p in m]
        setups = [("spec", [batched] * C, True), ("ar", [batched] * C, False)]
        if singles:
            setups.append(("oneseq", singles, True))
        setups += [(name, srv, None) for name, srv in servers]

        def run(setup, max_tokens, warm=False):
            name, engs, spec = setup
            shared = a.queue == "shared" and not warm
            if name in LLAMA_SETUPS:
                return run_llama(engs, [[p[0]] for p in mine_ids] if warm else mine_ids, max_tokens, shared)
            return run_cell(engs, [[p[0]] for p in mine] if warm else mine, max_tokens, spec, shared)

        for tau in taus:
            for e in [batched] + singles:
                e._draft_override = None if tau is None else forced_drafts(dict(zip(map(tuple, prompts), refs)), tau,
                                                                           batched.n_vocab)
            # warm-up (graph plans at every width): every setup once, short requests
            for setup in setups:
                run(setup, 2 * B, warm=True)
            acc = {name: dict(wall=0.0, lat=[], tokens=0, same=0, n=0, committed=0, rounds=0, gaps=[],
                             passes=dict(passes=0, tokens=0, requests=0, solo_steps=0, batch_ar_steps=0))
                   for name, _, _ in setups}
            for rep in range(a.reps):
                for setup in setups[rep % len(setups):] + setups[: rep % len(setups)]:
                    name, engs = setup[:2]
                    before = pass_counts(batched._sched)
                    r = run(setup, a.max_tokens)
                    s = acc[name]
                    s["wall"] += r["wall"]
                    s["lat"] += r["lat"]
                    s["n"] += len(r["results"])
                    toks = [x["tokens"] if name in LLAMA_SETUPS else x.tokens for x in r["results"]]
                    s["tokens"] += sum(len(t) for t in toks)
                    s["same"] += sum(t == want for t, want in zip(toks, solo_flat))
                    if name in LLAMA_SETUPS:  # llama.cpp's own count: 1 + accepted drafts per round
                        s["committed"] += r["spec"]["rounds"] + r["spec"]["accepted"]
                        s["rounds"] += r["spec"]["rounds"]
                        s["gaps"] += [gap_of(p, want, t) for p, t, want in zip(flat, toks, solo_flat)
                                      if t != want and gap_of is not None]
                    for x in r["results"] if name not in LLAMA_SETUPS else ():
                        h = x.stats.acceptance_histogram
                        s["committed"] += sum(k * n for k, n in enumerate(h))
                        s["rounds"] += sum(h)
                    if name in ("spec", "ar"):
                        for k, v in pass_counts(batched._sched).items():
                            s["passes"][k] += v - before[k]
            cell = {}
            for name, _, spec in setups:
                s = acc[name]
                p = s["passes"] if batched._sched is not None and name in ("spec", "ar") else \
                    dict(passes=None, solo_steps=None)
                if p["passes"] is not None:
                    n = max(p["passes"], 1)
                    p.update(req_per_pass=p["requests"] / n, tok_per_pass=p["tokens"] / n)
                row = dict(bench="batch_concurrency", setup=name, concurrency=C, tau=tau, block=B,
                           requests=s["n"], tokens=s["tokens"], wall_s=s["wall"], tok_s=s["tokens"] / s["wall"],
                           latency_p50_s=pct(s["lat"], 0.5), latency_p95_s=pct(s["lat"], 0.95),
                           latency_s=summarize(s["lat"]),
                           acceptance=s["committed"] / s["rounds"] if s["rounds"] else None,
                           passes=p.get("passes"), solo_steps=p.get("solo_steps"),
                           batch_ar_steps=p.get("batch_ar_steps"), req_per_pass=p.get("req_per_pass"),
                           tok_per_pass=p.get("tok_per_pass"), same_as_solo=s["same"], mismatches=s["n"] - s["same"],
                           n_threads=a.threads if name != "oneseq" else one_threads, reps=a.reps, **info)
                if name in ("spec", "ar"):  # the thread governor's count after the cell, and its reductions
                    row.update(threads_now=batched._core.threads_now, thread_reductions=batched._core.thread_reductions)
                if name in LLAMA_SETUPS:
                    srv = dict(servers)[name]
                    row.update(peer="llama.cpp llama-server", llama_bufts=llama_server_bufts(), parallel=C,
                               divergence_gaps=s["gaps"],
                               spec_type=srv.spec_type, draft_max=B - 1 if srv.spec_type else None,
                               note=("drafts not forced: llama-server's DFlash runs the random drafter as it is "
                                     "(--tau cannot be forced into llama-server)") if srv.spec_type and tau else None)
                cell[name] = row
                rows.append(row)
                fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
                print(f"{C:>3} {tau or 'pair':>4} {name:12} {s['n']:>8} {s['tokens']:>7} {row['tok_s']:>8.1f} "
                      f"{row['latency_p50_s']:>7.2f} {row['latency_p95_s']:>7.2f} {fmt(row['acceptance'], '.2f'):>7} "
                      f"{fmt(row['req_per_pass'], '.2f'):>8} {fmt(row['tok_per_pass'], '.1f'):>8} "
                      f"{s['same']:>5}/{s['n']:<6}"
                      + (f" (ours AR's top-2 gap where they differ: {', '.join(f'{g:.1e}' for g in s['gaps'])})"
                         if s["gaps"] else ""), flush=True)
            best = max((n for n in LLAMA_SETUPS if n in cell), key=lambda n: cell[n]["tok_s"], default=None)
            ratio = dict(bench="batch_concurrency_ratio", concurrency=C, tau=tau, block=B,
                         spec_over_ar=cell["spec"]["tok_s"] / cell["ar"]["tok_s"],
                         spec_over_oneseq=cell["spec"]["tok_s"] / cell["oneseq"]["tok_s"] if singles else None,
                         spec_over_llama_best=cell["spec"]["tok_s"] / cell[best]["tok_s"] if best else None,
                         llama_best=best, oneseq_skipped=skipped,
                         mismatches=sum(c["mismatches"] for n, c in cell.items() if n not in LLAMA_SETUPS),
                         llama_mismatches=sum(cell[n]["mismatches"] for n in LLAMA_SETUPS if n in cell) if best else None,
                         private_gib=private_gib(), **info)
            rows.append(ratio)
            print(f"{C:>3} {tau or 'pair':>4} ratios: spec/ar {ratio['spec_over_ar']:.2f}, spec/oneseq "
                  + (f"{ratio['spec_over_oneseq']:.2f}" if singles else f"- (one-sequence engines skipped: {skipped})")
                  + (f", spec/llama-server-best ({best}) {ratio['spec_over_llama_best']:.2f}" if best else "")
                  + (f"; private memory {ratio['private_gib']:.1f} GiB" if ratio["private_gib"] is not None else ""),
                  flush=True)
            if best and tau:
                print(f"{C:>3} {tau:>4} note: llama-dflash drafts with the random drafter as it is (drafts cannot "
                      f"be forced into llama-server); llama-srv is the fair comparison", flush=True)
        for e in [batched] + singles:
            e.close()
        for _, srv in servers:
            srv.close()
    return rows


def target_passes(a, target: Path, info: dict) -> list[dict]:
    """One target pass over N sequences' work against N one-sequence passes, alternating."""
    from dflash_native import _core

    T = _core.testing
    rng = np.random.default_rng(0)
    n_max, B = max(a.concurrency), a.block
    n_ctx = a.prompt + (a.reps + 2) * (B + 1) * n_max + 64
    common = dict(n_ctx=n_ctx, n_threads=a.threads, max_verify=B)
    batch_t = T.batch_target(str(target), n_max, **common)
    solo_t = _core.Target(str(target), **common)
    vocab = solo_t.n_vocab
    prompts = [list(map(int, rng.integers(3, vocab, a.prompt))) for _ in range(n_max)]

    def prefill():
        for s in range(n_max):
            T.reset_slot(batch_t, s)
        T.decode_batch(batch_t, [(s, prompts[s], "prefill") for s in range(n_max)])
        solo_t.reset()
        solo_t.decode(prompts[0])

    rows = []
    print(f"\ntarget passes: B = {B}, prompt {a.prompt}, side by side (alternating), median of {a.reps}")
    print(f"{'kind':7} {'N':>3} {'tokens':>6} {'batched ms':>11} {'N solo ms':>10} {'solo/batched':>12} "
          f"{'batched tok/s':>14} {'solo tok/s':>11}")
    for kind in ("ar", "verify"):
        for n in a.concurrency:
            prefill()
            width = 1 if kind == "ar" else B
            t_batch, t_solo = [], []
            for _ in range(a.reps + 1):  # the first of each is a warm-up
                work = [(s, list(map(int, rng.integers(3, vocab, width))), "decode" if kind == "ar" else "verify")
                        for s in range(n)]
                t0 = time.perf_counter()
                T.decode_batch(batch_t, work)
                if kind == "verify":
                    for s in range(n):
                        T.commit_slot(batch_t, s, 1)
                t_batch.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for _, toks, _ in work:
                    if kind == "ar":
                        solo_t.decode_greedy(toks)
                    else:
                        solo_t.verify(toks)
                        solo_t.commit(1)
                t_solo.append(time.perf_counter() - t0)
            sb, ss = summarize(t_batch[1:]), summarize(t_solo[1:])
            tok = n * width
            r = dict(bench="batch", kind=kind, n=n, block=width, tokens=tok, batched_s=sb, solo_s=ss,
                     ratio=ss["median"] / sb["median"], batched_tok_s=tok / sb["median"], solo_tok_s=tok / ss["median"],
                     **info)
            rows.append(r)
            print(f"{kind:7} {n:>3} {tok:>6} {sb['median'] * 1e3:>11.2f} {ss['median'] * 1e3:>10.2f} "
                  f"{r['ratio']:>12.2f} {r['batched_tok_s']:>14.1f} {r['solo_tok_s']:>11.1f}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outtype", default="q8_0", help="the random target's type: q8_0 or q4_k_m (any llama.cpp type)")
    ap.add_argument("--tiny", action="store_true", help="a small random target (smoke run)")
    ap.add_argument("--embedded", action="store_true", help="the shipped pair on held-out prompts, its own drafts")
    ap.add_argument("--target", help="with --drafter: these GGUF files instead (forced drafts unless --embedded)")
    ap.add_argument("--drafter")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="client threads (up to 32)")
    ap.add_argument("--requests", type=int, default=4, help="requests per client thread (R)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tau", type=int, nargs="+", default=[4, 8], help="forced acceptance lengths (not --embedded)")
    ap.add_argument("--block", type=int, default=8, help="verify block B")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random prompts; held-out: at most)")
    ap.add_argument("--reps", type=int, default=1, help="interleaved passes of every setup per cell")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="the batched engine's; one-sequence engines "
                                                                        "get threads // C each")
    ap.add_argument("--gate", choices=("auto", "on", "off"), default="auto",
                    help="the speculation controller: auto = off under forced drafts (every step a round of B), on "
                         "with --embedded")
    ap.add_argument("--oneseq-max", type=int, default=32, help="skip the one-sequence engines above this C")
    ap.add_argument("--passes", action="store_true", help="also the target passes alone (decode_batch)")
    ap.add_argument("--llama-server", action="store_true",
                    help="also llama.cpp's llama-server -np C, without and with its DFlash (built on first use: "
                         "bench/_llamacpp_server.py)")
    ap.add_argument("--queue", choices=("client", "shared"), default="client",
                    help="client: each client thread runs its own R requests (the wall time is the slowest "
                         "client's); shared: the C x R requests in one queue, C in flight until it is empty "
                         "(a serving benchmark's max concurrency)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if max(a.concurrency) > 32 or min(a.concurrency) < 1:
        ap.error("--concurrency: 1..32")
    a.gate = a.embedded if a.gate == "auto" else a.gate == "on"

    import dflash_native as dn
    from dflash_native.convert_dflash import OUTTYPES as DRAFTER_OUTTYPES

    B = a.block
    if a.embedded or a.target:
        target, drafter = resolve_pair(a.target, a.drafter)
        label = "embedded pair" if not a.target else "given pair"
    else:
        name, arch, shape = bench_target(moe=False, tiny=a.tiny)
        target = cached_typed_gguf(name, arch, a.outtype, **shape)
        drafter_type = a.outtype if a.outtype in DRAFTER_OUTTYPES else "q8_0"
        # with the target's vocabulary: llama-server's DFlash (--llama-server) reads its mask token
        drafter = cached_drafter(name, drafter_type, dict(QWEN35_05B, **shape), block_size=max(B, 16), n_layers=1,
                                 target_gguf=target)
        label = f"{name} {a.outtype}"
    taus = [None] if a.embedded else sorted({min(t, B) for t in a.tau})
    if any(t is not None and t < 1 for t in taus):
        ap.error("--tau: 1..B")

    n_prompts = max(a.concurrency) * a.requests
    ref_eng = dn.Engine(target, n_ctx=a.prompt + a.max_tokens + 2 * B + 64, n_threads=a.threads)
    if a.embedded:
        from dflash_native.train import corpus

        prompts = [p.text for p in corpus.heldout_prompts(n_prompts, a.prompt, ref_eng, seed=0)]
    else:
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(10, 600, a.prompt))) for _ in range(n_prompts)]
    # each prompt's AR output alone (the solo reference; under forced drafts also the drafts' source)
    t0 = time.perf_counter()
    refs = [ref_eng.generate(p, max_tokens=a.max_tokens + B, speculative=False).tokens for p in prompts]
    prompt_ids = [ref_eng.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]  # what generate() feeds
    if a.llama_server:
        from _llamacpp_server import llama_server_binary

        print(f"llama-server: {llama_server_binary()}", flush=True)  # built here (once) before any timing
    info = dict(target=Path(target).name, drafter=Path(drafter).name, model=label,
                outtype=None if (a.embedded or a.target) else a.outtype, max_tokens=a.max_tokens,
                prompt=a.prompt, gate=a.gate, threads=a.threads, queue=a.queue, machine=machine(), rev=git_rev())
    print(f"{info['machine']}\n{label}: {info['target']} + {info['drafter']}, B = {B}, {a.max_tokens} tokens per "
          f"request, {a.requests} per client, prompts {a.prompt} tokens{' (held-out, at most)' if a.embedded else ''}, "
          f"{a.threads} threads, controller {'on' if a.gate else 'off'}, queue {a.queue}, {a.reps} interleaved rep(s); "
          f"solo references {time.perf_counter() - t0:.0f} s; rev {info['rev']}")
    from dflash_native.lossless import first_divergence_gap

    rows = concurrency(a, target, drafter, prompts, prompt_ids, refs, taus, B, info,
                       gap_of=lambda p, solo, other: first_divergence_gap(ref_eng, p, solo, other))
    ref_eng.close()
    if a.passes:
        rows += target_passes(a, target, info)
    bad = sum(r["mismatches"] for r in rows if r["bench"] == "batch_concurrency" and r["setup"] not in LLAMA_SETUPS)
    print(f"\nrequests whose tokens differ from the same request run alone: {bad}")
    if a.llama_server:
        peer = sum(r["mismatches"] for r in rows if r["bench"] == "batch_concurrency" and r["setup"] in LLAMA_SETUPS)
        print(f"llama-server requests whose tokens differ from our solo AR tokens: {peer} (reported only: "
              f"llama.cpp's kernels may round differently near ties)")
    write_jsonl(a.json, rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
