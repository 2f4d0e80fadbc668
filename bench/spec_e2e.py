"""End-to-end speculative decoding vs AR on the same engine, with an acceptance-controlled mode.

Everything goes through Engine.generate. The real drafter forward runs every round; then its
tokens are replaced by the target's own greedy continuation with one error injected so that every
round commits exactly tau tokens (tau = 1 .. B; the last round may commit fewer at max_tokens). Throughput is then measured at chosen mean acceptance lengths. The
bound is tau * t_AR / (t_verify(B) + t_draft), from the same run's timings; "overhead" is the
share of a round that is neither the draft forward nor the verify forward (rollback, ring push,
sampling, Python, graph building).

    python bench/spec_e2e.py --json bench/results/spec_e2e.jsonl

--moe measures the ~1B Qwen3.5-MoE target (_common.QWEN35MOE_1B) instead of the 0.5B hybrid.

With --pair (the trained pair: the embedded default, or --target/--drafter), the real drafter
drafts and the measurement is on held-out code prompts (stdlib files the pair never trained on):
mean acceptance length, tok/s and speedup vs AR on the same engine, block sizes 4, 8, 16.

    python bench/spec_e2e.py --pair --json bench/results/spec_e2e.jsonl

With --sampling (the trained pair, as --pair): greedy and sampled settings side by side (T in
--temps, top_p --top-p, one fixed seed per prompt), each speculative run against AR at the same
settings and seed on the same engine: mean acceptance length, speedup, whether the tokens are
identical, and the sampler's cost per AR step (the draw alone on a real logits row, and the
sampled AR step against the greedy one).

    python bench/spec_e2e.py --sampling --json bench/results/spec_e2e_sampling.jsonl

--sampling --tree-budget N runs the speculative side with tree verify (Engine(verify="tree",
tree_budget=N)): sampled trees against sampled AR at the same seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (bench_target, cached_drafter, cached_gguf, git_rev, heldout_eval, machine,  # noqa: E402
                     resolve_pair, write_jsonl)
from dflash_native.convert_dflash import OUTTYPES as DRAFTER_OUTTYPES  # noqa: E402


def main_pair(a) -> None:
    target, drafter = resolve_pair(a.target, a.drafter)
    blocks = [int(b) for b in a.blocks.split(",")]
    gen = a.gen if a.gen != 48 else 128
    print(f"# spec_e2e --pair: {machine()}; {Path(target).name} + {Path(drafter).name}, threads={a.threads}, "
          f"{a.prompts} held-out prompts of ~96 tokens, {gen} generated, gate {'off' if a.no_gate else 'on'}; "
          f"rev {git_rev()}")
    cutoffs = [float(c) for c in a.cutoffs.split(",")]
    for mm in a.matmul.split(","):
        print(f"## matmul = {mm}")
        write_jsonl(a.json, heldout_eval(target, drafter, blocks, cutoffs=cutoffs, n_prompts=a.prompts, gen=gen,
                                         threads=a.threads, matmul=mm,
                                         draft_vocabs=[v == "on" for v in a.draft_vocab.split(",")], reps=a.reps,
                                         gate=not a.no_gate))


def _fastest(runs):
    return min(runs, key=lambda r: r.stats.decode_s)


def sampler_cost(eng, prompt_text: str, settings, n: int = 2000) -> dict:
    """Microseconds per draw of the sampler alone (_core.testing.sample_seeds over n seeds) on the
    prompt's last logits row, for each sampled setting."""
    import time

    from dflash_native import _core

    row = np.ascontiguousarray(eng.eval(prompt_text)[-1])
    seeds = np.arange(n, dtype=np.uint64)
    out = {}
    for name, kw in settings:
        if kw.get("temperature", 0) > 0:
            s = _core.Sampling(kw["temperature"], top_p=kw.get("top_p", 1.0))
            best = min(_timed(lambda: _core.testing.sample_seeds(row, s, seeds, 100), time) for _ in range(3))
            out[name] = best / n * 1e6
    return out


def _timed(f, time) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main_sampling(a) -> None:
    import dflash_native as dn
    from dflash_native.train import corpus

    target, drafter = resolve_pair(a.target, a.drafter)
    blocks = [int(b) for b in a.blocks.split(",")]
    gen = a.gen if a.gen != 48 else 128
    settings = [("greedy", {})] + [(f"T={float(t):g}", dict(temperature=float(t), top_p=a.top_p)) for t in a.temps.split(",")]
    tree = dict(verify="tree", tree_budget=a.tree_budget) if a.tree_budget else {}
    verify = f"tree {a.tree_budget}" if a.tree_budget else "chain"
    print(f"# spec_e2e --sampling: {machine()}; {Path(target).name} + {Path(drafter).name}, verify {verify}, "
          f"gate {'off' if a.no_gate else 'on'}, "
          f"threads={a.threads}, "
          f"{a.prompts} held-out prompts of ~96 tokens, {gen} generated, top_p={a.top_p}, reps={a.reps} "
          f"(fastest kept); rev {git_rev()}")
    rows = []
    for B in blocks:
        eng = dn.Engine(target, drafter=drafter, block_size=B, n_ctx=96 + gen + 2 * B + 8, n_threads=a.threads,
                        gate=not a.no_gate, **tree)
        prompts = corpus.heldout_prompts(a.prompts, 96, eng, seed=0)
        for _, kw in settings:  # warm-up: graph plans of every path
            eng.generate(prompts[0].text, max_tokens=16, speculative=False, seed=1, **kw)
            eng.generate(prompts[0].text, max_tokens=16, seed=1, **kw)
        acc = {name: dict(ar_s=0.0, n_ar=0, sp_s=0.0, n_sp=0, committed=0, rounds=0, same=0) for name, _ in settings}
        for i, p in enumerate(prompts):
            for name, kw in settings:
                ar_runs, sp_runs = [], []
                for _ in range(a.reps):
                    ar_runs.append(eng.generate(p.text, max_tokens=gen, speculative=False, seed=1000 + i, **kw))
                    sp_runs.append(eng.generate(p.text, max_tokens=gen, seed=1000 + i, **kw))
                ar, sp = _fastest(ar_runs), _fastest(sp_runs)
                t = acc[name]
                t["ar_s"] += ar.stats.decode_s
                t["n_ar"] += max(ar.stats.n_generated - 1, 0)
                t["sp_s"] += sp.stats.decode_s
                t["n_sp"] += max(sp.stats.n_generated - 1, 0)
                t["committed"] += sum(k * n for k, n in enumerate(sp.stats.acceptance_histogram))
                t["rounds"] += sp.stats.rounds
                t["same"] += sp.tokens == ar.tokens
        cost = sampler_cost(eng, prompts[0].text, settings)
        greedy_ar = acc["greedy"]["n_ar"] / acc["greedy"]["ar_s"]
        greedy_speedup = (acc["greedy"]["n_sp"] / acc["greedy"]["sp_s"]) / greedy_ar
        print(f"\nB={B}: greedy AR step {1e3 / greedy_ar:.3f} ms")
        print("| setting | mean acceptance length | AR tok/s | DFlash tok/s | speedup | speedup / greedy's "
              "| AR step vs greedy AR step | sampler alone per draw | spec == AR |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, kw in settings:
            t = acc[name]
            ar_tok_s, sp_tok_s = t["n_ar"] / t["ar_s"], t["n_sp"] / t["sp_s"]
            speedup = sp_tok_s / ar_tok_s
            step_ratio = greedy_ar / ar_tok_s  # sampled AR step time over the greedy one
            us = cost.get(name)
            print(f"| {name}{'' if not kw else f', top_p {a.top_p:g}'} | {t['committed'] / max(t['rounds'], 1):.2f} "
                  f"| {ar_tok_s:.1f} | {sp_tok_s:.1f} | {speedup:.2f}x | {speedup / greedy_speedup:.2f} "
                  f"| {step_ratio:.3f} | {'-' if us is None else f'{us:.1f} us ({us * 1e-6 * greedy_ar:.1%})'} "
                  f"| {t['same']}/{len(prompts)} |")
            rows.append({"bench": "spec_e2e_sampling", "B": B, "verify": verify, "gate": not a.no_gate,
                         "setting": name, **kw,
                         "mean_acceptance_length": t["committed"] / max(t["rounds"], 1), "ar_tok_s": ar_tok_s,
                         "spec_tok_s": sp_tok_s, "speedup": speedup, "speedup_over_greedy_speedup": speedup / greedy_speedup,
                         "ar_step_over_greedy_ar_step": step_ratio, "sampler_us_per_draw": us,
                         "sampler_share_of_greedy_ar_step": None if us is None else us * 1e-6 * greedy_ar,
                         "spec_identical_prompts": t["same"], "prompts": len(prompts), "gen": gen, "reps": a.reps,
                         "threads": a.threads, "target": Path(target).name, "drafter": Path(drafter).name,
                         "machine": machine(), "rev": git_rev()})
        eng.close()
    write_jsonl(a.json, rows)


def main():
    import dflash_native as dn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--taus", default="1,2,4,8,B", help="committed tokens per round; B = all accepted")
    ap.add_argument("--gen", type=int, default=48, help="tokens generated per measurement")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--drafter-outtype", default=None,
                    help="drafter weights (f32/f16/bf16/q8_0; default: --outtype when it is one of them, else q8_0)")
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke run)")
    ap.add_argument("--moe", action="store_true", help="the ~1B Qwen3.5-MoE target (_common.QWEN35MOE_1B)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--pair", action="store_true", help="the trained pair on held-out prompts (no forced drafts)")
    ap.add_argument("--target", type=Path, default=None, help="--pair: target GGUF (default: the embedded one)")
    ap.add_argument("--drafter", type=Path, default=None, help="--pair: drafter GGUF (default: the embedded one)")
    ap.add_argument("--prompts", type=int, default=16, help="--pair: held-out prompts")
    ap.add_argument("--cutoffs", default="0", help="--pair: Engine.draft_cutoff values, side by side")
    ap.add_argument("--matmul", default="own", help="--pair: Engine.for_benchmark(matmul=) values, one after the other (own,ggml)")
    ap.add_argument("--reps", type=int, default=1,
                    help="--pair: interleaved passes per prompt and setting; each one's fastest counts")
    ap.add_argument("--draft-vocab", default="on", help="--pair: Engine.draft_vocab settings, side by side (on,off)")
    ap.add_argument("--sampling", action="store_true", help="the trained pair: greedy vs sampled settings")
    ap.add_argument("--temps", default="0.3,0.7,1.0", help="--sampling: temperatures")
    ap.add_argument("--top-p", type=float, default=0.95, help="--sampling: top_p of the sampled settings")
    ap.add_argument("--no-gate", action="store_true",
                    help="--sampling / --pair: fixed settings (every step a round of B), so the acceptance lengths are the "
                         "drafter's and not the controller's load-dependent choices")
    ap.add_argument("--tree-budget", type=int, default=0, help="--sampling: tree verify with this budget (0: chain)")
    a = ap.parse_args()
    if a.sampling:
        return main_sampling(a)
    if a.pair:
        return main_pair(a)

    name, arch, shape = bench_target(a.moe, False)
    if a.tiny:
        name, _, tiny = bench_target(a.moe, True)
        shape.update(tiny, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
                     linear_num_value_heads=4)
    blocks = [int(b) for b in a.blocks.split(",")]
    target = cached_gguf(name, arch, a.outtype, **shape)
    # our drafter converter writes DRAFTER_OUTTYPES: a llama.cpp-quantized target (q4_k_m, ...) is paired with
    # a Q8_0 drafter, as users pair them
    drafter_outtype = a.drafter_outtype or (a.outtype if a.outtype in DRAFTER_OUTTYPES else "q8_0")
    drafter = cached_drafter(name, drafter_outtype, shape, max(blocks), a.drafter_layers)
    prompt = [int(x) for x in np.random.default_rng(0).integers(10, 600, a.prompt_len)]
    n_ctx = a.prompt_len + a.gen + 2 * max(blocks) + 8

    print(f"# spec_e2e: {machine()}; {name} {a.outtype}, drafter {a.drafter_layers} layer(s) {drafter_outtype}, threads={a.threads}, "
          f"prompt={a.prompt_len}, gen={a.gen}; rev {git_rev()}")
    rows = []
    for B in blocks:
        # gate=False: every step is a round of B (the controller would take AR steps where forced drafts
        # commit little, and those would not measure a round)
        eng = dn.Engine(target, drafter=drafter, block_size=B, n_ctx=n_ctx, n_threads=a.threads,
                        feature_ring_capacity=4096, gate=False)
        # AR on the same engine: the reference tokens and t_AR
        eng.generate(prompt, max_tokens=8, speculative=False)  # warm-up
        ar = eng.generate(prompt, max_tokens=a.gen + B + 1, speculative=False)
        ref = ar.tokens
        t_ar = ar.stats.decode_s / max(ar.stats.n_generated - 1, 1)
        print(f"\nB={B}: AR {1 / t_ar:.2f} tok/s")
        print(f"{'tau':>6}{'tok/s':>9}{'speedup':>9}{'bound':>8}{'meas/bound':>11}{'t_draft ms':>11}"
              f"{'t_verify ms':>12}{'rollback ms':>12}{'overhead':>9}")
        taus = sorted({B if t == "B" else int(t) for t in a.taus.split(",")} - set(range(B + 1, 10**6)))
        for tau in taus:
            def forced(prompt_, out, Bc, tau=tau):
                good = list(ref[len(out): len(out) + Bc - 1]) + [0] * Bc
                good = good[: Bc - 1]
                if tau < Bc:  # accept tau-1 drafts, then a wrong one: every round commits tau tokens
                    good[tau - 1] = (good[tau - 1] + 1) % 500
                return good

            eng._draft_override = forced
            eng.generate(prompt, max_tokens=B + 2)  # warm-up
            r = eng.generate(prompt, max_tokens=a.gen)
            st = r.stats
            assert r.tokens == ref[: a.gen], "speculative output differs from AR"
            tok_s = st.decode_tok_s  # tokens after the first (which comes from the prefill)
            t_draft, t_verify = st.draft_s / st.rounds, st.verify_s / st.rounds
            tau_m = st.mean_acceptance_length
            bound = tau_m * t_ar / (t_verify + t_draft)
            overhead = 1 - (st.draft_s + st.verify_s) / st.decode_s
            print(f"{tau_m:>6.2f}{tok_s:>9.2f}{tok_s * t_ar:>9.2f}{bound:>8.2f}{tok_s * t_ar / bound:>11.3f}"
                  f"{t_draft * 1e3:>11.1f}{t_verify * 1e3:>12.1f}{st.rollback_s / st.rounds * 1e3:>12.2f}"
                  f"{overhead:>9.1%}")
            rows.append({"bench": "spec_e2e", "model": name, "outtype": a.outtype, "drafter_outtype": drafter_outtype,
                         "B": B, "tau_target": tau,
                         "mean_acceptance_length": tau_m, "tok_s": tok_s, "ar_tok_s": 1 / t_ar,
                         "speedup": tok_s * t_ar, "bound": bound, "measured_over_bound": tok_s * t_ar / bound,
                         "t_draft_s": t_draft, "t_verify_s": t_verify, "rollback_s_per_round": st.rollback_s / st.rounds,
                         "overhead_share": overhead, "rounds": st.rounds, "gen": a.gen, "gate": False,
                         "threads": a.threads,
                         "machine": machine(), "rev": git_rev()})
        eng._draft_override = None
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
