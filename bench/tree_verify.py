"""Tree verify vs chain verify on the embedded pair, side by side (issue 14).

Configurations, one engine each, fixed settings (gate=False: every step a round), same held-out
prompts, same run: AR; chain at B in {4, 8, 16}, with and without draft_cutoff 0.1; tree at
tree_budget in {4, 8, 16, 32, 63} (B = the drafter's 16), and at 8, 16, 32 with a minimum path score
0.1; then the defaults (gate on: the controller picks AR or a round and the block / tree size). Per configuration, pooled over the
prompts: tokens per round (mean acceptance length), tokens per verified token (committed /
tokens through the verify passes: chain `last` + drafts, tree nodes + root), verify ms per round,
end-to-end tok/s and speedup over AR, and the lossless check (dflash_native.lossless). Every JSON
line records the CPU, the ISA and the rev.

    python bench/tree_verify.py --json bench/results/tree_verify.jsonl

`--cost`: the cost of the tree machinery on the 0.65B-shaped hybrid: a tree verify of N nodes (a
best-first tree over a synthetic confident draft) against a chain verify of N tokens, each with the
commit of its root, interleaved reps, and the GDN memory of each (tape for N tokens + walk scratch).

    python bench/tree_verify.py --cost --json bench/results/tree_verify.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, isa, machine, resolve_pair, write_jsonl  # noqa: E402


def configs() -> dict[str, dict]:
    out = {}
    for B in (4, 8, 16):
        out[f"chain B{B}"] = dict(block_size=B)
        out[f"chain B{B} c0.1"] = dict(block_size=B, draft_cutoff=0.1)
    for n in (4, 8, 16, 32, 63):
        out[f"tree {n}"] = dict(verify="tree", tree_budget=n)
    for n in (8, 16, 32):  # the minimum path score (draft_cutoff in tree mode)
        out[f"tree {n} c0.1"] = dict(verify="tree", tree_budget=n, draft_cutoff=0.1)
    # the defaults: the controller chooses AR or a round, the block (chain) or the tree's size
    out["chain, controller"] = dict(gate=True)
    out["tree 63, controller"] = dict(verify="tree", tree_budget=63, gate=True)
    return out


def bushy_tree(n_nodes: int, depth: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """A best-first tree of n_nodes below the root (tree.h's build_tree) over a synthetic draft:
    at each of `depth` positions the top-4 probabilities 0.70 / 0.18 / 0.08 / 0.04, so the tree has
    a long spine with branches near the root, as confident drafters give. Returns (parents, tokens)
    with the root as node 0."""
    import numpy as np

    from dflash_native import _core

    rng = np.random.default_rng(seed)
    top_p = np.tile(np.array([0.70, 0.18, 0.08, 0.04], dtype=np.float32), (depth, 1))
    top_tok = rng.integers(10, 1000, size=(depth, 4)).astype(np.int64)
    parents, tokens, _, _ = _core.testing.build_tree(5, top_tok, top_p, n_nodes, 0.0)
    return list(parents), list(tokens)


def gdn_stack_bytes(parents: list[int], d_state: int) -> int:
    """Scratch of one thread's GDN tree walk (gdn_tape.h): (1 + b) states of d_state^2 floats, b the
    most pushes on a root-to-leaf path (a child that is not its parent's last pushes one)."""
    kids: dict[int, list[int]] = {}
    for t in range(1, len(parents)):
        kids.setdefault(parents[t], []).append(t)
    need = [0] * len(parents)
    for t in range(1, len(parents)):
        need[t] = need[parents[t]] + (kids[parents[t]][-1] != t)
    return (1 + max(need)) * d_state * d_state * 4


def cost_table(a, meta: dict) -> list[dict]:
    """Tree verify of N nodes against chain verify of N tokens on one target (the 0.65B-shaped
    hybrid by default): the verify pass plus its commit of the root alone (what a round that
    accepts nothing pays), interleaved reps, median ms; the GDN memory of each (tape + walk scratch)."""
    import statistics
    import time

    from dflash_native import _core
    from _common import QWEN35_05B, cached_gguf

    if a.target is not None:
        target, d_state = a.target, None
    else:
        target = cached_gguf("qwen35-0.5b", "qwen3_5", "f16", **QWEN35_05B)
        d_state = QWEN35_05B["linear_key_head_dim"]
    tgt = _core.Target(str(target), n_ctx=2048, n_threads=a.threads, max_verify=64, n_batch=64)
    tape_per_token = tgt.memory_report()["gdn_tape"] / 64  # the tape holds max_verify tokens
    prompt = list(range(100, 100 + 256))
    for i in range(0, len(prompt), 64):
        tgt.decode(prompt[i:i + 64])
    n_past = tgt.n_past
    print(f"\n# cost: {Path(target).name}, {n_past}-token context, threads {a.threads}, {a.cost_reps} interleaved reps; "
          f"load average {os.getloadavg()[0]:.2f}")
    max_verify = 64
    print("| N | chain verify ms | tree verify ms | tree / chain | tree depth | GDN tape for N, MB | "
          "GDN walk scratch MB (tree / chain) | GDN memory tree / chain |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for n in a.cost_n:
        parents, tokens = bushy_tree(n - 1, depth=15)
        depth = [0] * n
        for t in range(1, n):
            depth[t] = depth[parents[t]] + 1
        chain = tokens[:1] + list(range(200, 200 + n - 1))
        times = {"chain": [], "tree": []}
        for r in range(a.cost_reps + 1):
            for kind in ("chain", "tree") if r % 2 == 0 else ("tree", "chain"):
                t0 = time.perf_counter()
                if kind == "chain":
                    tgt.verify_greedy(chain)
                    tgt.commit(1)
                else:
                    _core.testing.target_verify_tree(tgt, tokens, parents)
                    _core.testing.commit_tree(tgt, [0])
                if r > 0:  # rep 0 warms the graph plans
                    times[kind].append(time.perf_counter() - t0)
                n_past += 1  # the root is kept: the context grows by one per pass
                assert tgt.n_past == n_past
        ch, tr = statistics.median(times["chain"]) * 1e3, statistics.median(times["tree"]) * 1e3
        tape = tape_per_token * n  # a chain of N and a tree of N nodes fill the same N tape slots
        row = dict(meta, section="cost", target=Path(target).name, n=n, chain_ms=ch, tree_ms=tr, ratio=tr / ch,
                   tree_depth=max(depth), gdn_tape_bytes=tape)
        scratch, mem_ratio = "-", "-"
        if d_state is not None:
            # per thread: the chain's record op holds one state, the tree walk 1 + b (gdn_tape.h)
            row["gdn_scratch_tree_bytes"] = gdn_stack_bytes(parents, d_state) * a.threads
            row["gdn_scratch_chain_bytes"] = d_state * d_state * 4 * a.threads
            row["gdn_memory_ratio"] = (tape + row["gdn_scratch_tree_bytes"]) / (tape + row["gdn_scratch_chain_bytes"])
            scratch = f"{row['gdn_scratch_tree_bytes'] / 2**20:.2f} / {row['gdn_scratch_chain_bytes'] / 2**20:.2f}"
            mem_ratio = f"{row['gdn_memory_ratio']:.3f}"
        rows.append(row)
        print(f"| {n} | {ch:.2f} | {tr:.2f} | {tr / ch:.3f} | {max(depth)} | {tape / 2**20:.2f} | {scratch} | {mem_ratio} |",
              flush=True)
    return rows


def main() -> None:
    import dflash_native as dn
    from dflash_native.lossless import first_divergence_gap, verdict
    from dflash_native.train import corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=Path, default=None, help="default: the embedded pair")
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cost", action="store_true",
                    help="only the cost table: tree verify of N nodes vs chain verify of N tokens (0.65B hybrid)")
    ap.add_argument("--cost-n", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--cost-reps", type=int, default=20)
    a = ap.parse_args()
    if a.cost:
        meta = dict(bench="tree_verify", threads=a.threads, machine=machine(), isa=isa(), rev=git_rev())
        write_jsonl(a.json, cost_table(a, meta))
        return
    target, drafter = resolve_pair(a.target, a.drafter)
    engines = {name: dn.Engine(target, drafter=drafter, n_ctx=a.gen + 256, n_threads=a.threads, **{"gate": False, **kw})
               for name, kw in configs().items()}
    ar_eng = next(iter(engines.values()))
    prompts = [p.text for p in corpus.heldout_prompts(a.prompts, 96, ar_eng, seed=0)]
    for eng in engines.values():  # warm-up: graph plans
        eng.generate(prompts[0], max_tokens=32)
    meta = dict(bench="tree_verify", gen=a.gen, prompts=len(prompts), threads=a.threads, machine=machine(), isa=isa(),
                target=Path(target).name, drafter=Path(drafter).name, rev=git_rev())
    print(f"# tree_verify: {meta['machine']}; {meta['target']} + {meta['drafter']}; {len(prompts)} held-out prompts, "
          f"{a.gen} tokens, threads {a.threads}; load average {os.getloadavg()[0]:.2f}; rev {meta['rev']}")
    ars = [ar_eng.generate(p, max_tokens=a.gen, speculative=False) for p in prompts]
    ar_tok_s = sum(r.stats.n_generated - 1 for r in ars) / sum(r.stats.decode_s for r in ars)
    print(f"AR: {ar_tok_s:.0f} tok/s\n")
    print("| config | tokens / round | tokens / verified token | verify ms / round | tok/s | x AR | spec == AR |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for name, eng in engines.items():
        runs = [eng.generate(p, max_tokens=a.gen) for p in prompts]
        rounds = sum(r.stats.rounds for r in runs)
        committed = sum(sum(k * c for k, c in enumerate(r.stats.acceptance_histogram)) for r in runs)
        verified = sum(r.stats.verified_tokens for r in runs)
        verify_s = sum(r.stats.verify_s for r in runs)
        tok_s = sum(r.stats.n_generated - 1 for r in runs) / sum(r.stats.decode_s for r in runs)
        ok, cell = verdict([first_divergence_gap(ar_eng, p, ar.tokens, r.tokens) for p, ar, r in zip(prompts, ars, runs)])
        row = dict(meta, config=name, tokens_per_round=committed / rounds, tokens_per_verified=committed / verified,
                   verify_ms_per_round=1e3 * verify_s / rounds, tok_s=tok_s, ar_tok_s=ar_tok_s, speedup=tok_s / ar_tok_s,
                   lossless=ok, rounds=rounds)
        rows.append(row)
        print(f"| {name} | {row['tokens_per_round']:.2f} | {row['tokens_per_verified']:.3f} | "
              f"{row['verify_ms_per_round']:.2f} | {tok_s:.0f} | {row['speedup']:.2f}x | {cell} |", flush=True)
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
