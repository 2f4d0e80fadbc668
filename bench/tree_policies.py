"""Could another tree shape commit more tokens per verified token than the chain? (issue 14)

Offline, greedy, no timing: along the target's own continuations of held-out prompts, the drafter
drafts a block of 16 at every 4th step; a round starting there commits, for a tree of draft nodes,
the longest root path whose tokens are the target's continuation, plus the bonus token (a chain is
the tree of rank-0 children only). Per position the drafter gives one distribution (its block is
drafted in one parallel pass), so a node at depth d with rank r among that position's top-K draft
tokens stands for the same token whatever its parent: the tree is a set of rank paths. Best-first
trees of N nodes (N + 1 verified with the root) under three scores, summed along the path:

- raw: the drafter's log-probability of each node (the engine's tree, csrc/spec/tree.h);
- depth-rank: log q[d][r], q the measured rate at which the rank-r token at depth d is the
  target's, given the path to depth d was (fitted on half the rounds, evaluated on the other half);
- p-bin: log of the measured acceptance rate of drafts in the node's probability bin (20 bins), the
  controller's kind of calibration (same split).

Then two upper bounds, on all rounds (no fit): the "oracle" tree of rank width W holds every path of
ranks < W (W^15 nodes: no budget), so a round commits up to the first depth whose target token is
not among the drafter's top W there; and where the chain stops (its first rejected draft, depth j),
what the target's continuation does next: "substitution" (the drafts after j resume one position
on: a side branch at j with the spine under it would commit them), "insertion" / "deletion" (the
drafts resume shifted by one), or "diverge" (none of these for 2 tokens or more: a side branch at
j adds one token).

    python bench/tree_policies.py --json bench/results/tree_policies.jsonl
"""

from __future__ import annotations

import argparse
import heapq
from pathlib import Path

import numpy as np

from _common import git_rev, machine, write_jsonl

B, K = 16, 8  # block size (15 draft positions), children per node considered
D = B - 1


def truth_ranks(idx: np.ndarray, truth: np.ndarray) -> list[int]:
    """Per depth, the rank of the target's token among the drafter's top-K (K: not among them)."""
    out = []
    for d in range(D):
        w = np.where(idx[d] == truth[d])[0]
        out.append(int(w[0]) if len(w) else K)
    return out


def best_first(score, n: int) -> set[tuple[int, ...]]:
    """The n rank paths with the highest summed score (a tree: scores fall along a path)."""
    heap = [(-score(0, r), (r,)) for r in range(K)]
    heapq.heapify(heap)
    nodes: set[tuple[int, ...]] = set()
    while heap and len(nodes) < n:
        s, path = heapq.heappop(heap)
        nodes.add(path)
        if len(path) < D:
            for r in range(K):
                heapq.heappush(heap, (s - score(len(path), r), path + (r,)))
    return nodes


def committed(nodes: set[tuple[int, ...]], ranks: list[int]) -> int:
    path: tuple[int, ...] = ()
    for d in range(D):
        nxt = path + (ranks[d],)
        if ranks[d] == K or nxt not in nodes:
            break
        path = nxt
    return len(path) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=160)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import dflash_native as dn
    from dflash_native import _core
    from dflash_native.cli import default_pair
    from dflash_native.train import corpus

    tg, dg = (str(x) for x in default_pair())
    eng = dn.Engine(tg, drafter=dg, n_threads=2, n_ctx=1024)
    t = _core.Target(tg, n_ctx=1024, kv_type="f32", max_verify=B, n_threads=2)
    s = _core.Spec(t, dg, block_size=B, ring_capacity=1024, window=0)
    rounds = []  # (top-K ids [D, K], their log-probs [D, K], the target's tokens [D])
    for p in corpus.heldout_prompts(args.prompts, 96, eng, seed=0):
        gen = list(eng.generate(p.text, max_tokens=args.gen, speculative=False).tokens)
        prompt = eng.tokenize(p.text)
        for j in range(0, len(gen) - B, 4):
            s.reset()
            t.reset()
            s.prefill(prompt + gen[:j])
            lg = _core.testing.draft_logits(s, gen[j], B, t).astype(np.float64)  # [D, n_vocab], -inf off the draft vocabulary
            lp = lg - lg.max(1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(1, keepdims=True))
            idx = np.argsort(-lp, 1)[:, :K]
            rounds.append((idx, np.take_along_axis(lp, idx, 1), np.array(gen[j + 1: j + B])))
    order = np.random.default_rng(0).permutation(len(rounds))
    fit = [rounds[i] for i in order[: len(rounds) // 2]]
    held = [rounds[i] for i in order[len(rounds) // 2:]]

    # calibrations from `fit`, counted along each round's accepted path (the tree follows the truth)
    at = np.zeros((D, K + 1))
    hit, seen = np.zeros(20), np.zeros(20)
    for idx, lp, truth in fit:
        rk = truth_ranks(idx, truth)
        for d in range(D):
            at[d, rk[d]] += 1
            for r in range(K):
                b = min(int(np.exp(lp[d][r]) * 20), 19)
                seen[b] += 1
                hit[b] += rk[d] == r
            if rk[d] == K:
                break
    q_depth = (at[:, :K] + 0.5) / (at.sum(1, keepdims=True) + 0.5 * K)
    q_bin = (hit + 1) / (seen + 2)
    policies = {
        "raw": lambda lp: (lambda d, r: lp[d][r]),
        "depth-rank": lambda lp: (lambda d, r: np.log(q_depth[d][r])),
        "p-bin": lambda lp: (lambda d, r: np.log(q_bin[min(int(np.exp(lp[d][r]) * 20), 19)])),
    }
    print(f"# tree_policies: {machine()}; embedded pair, {len(rounds)} rounds ({len(held)} evaluated), "
          f"B={B}, K={K}; rev {git_rev()}\n")
    print("| nodes N (verified N + 1) | chain: tokens / round | per verified | "
          + " | ".join(f"{n}: tokens / round (x chain)" for n in policies) + " |")
    print("|---:|---:|---:|" + "---:|" * len(policies))
    rows = []
    for n in (4, 8, 15, 32):
        chain_nodes = {tuple([0] * k) for k in range(1, min(n, D) + 1)}
        chain = float(np.mean([committed(chain_nodes, truth_ranks(i, tr)) for i, _, tr in held]))
        got = {name: float(np.mean([committed(best_first(pol(lp), n), truth_ranks(i, tr)) for i, lp, tr in held]))
               for name, pol in policies.items()}
        print(f"| {n} | {chain:.2f} | {chain / (min(n, D) + 1):.3f} | "
              + " | ".join(f"{v:.2f} (x{v / chain:.2f})" for v in got.values()) + " |")
        rows.append(dict(bench="tree_policies", nodes=n, chain_tokens_per_round=chain,
                         tree_tokens_per_round=got, rounds=len(held), block=B, k=K, machine=machine(), rev=git_rev()))
    rows += bounds(rounds)
    write_jsonl(args.json, rows)


def run_len(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bounds(rounds) -> list[dict]:
    """The oracle trees of rank width W and the chain's stops by kind (module docstring)."""
    print("\n| oracle rank width W (W^15 nodes) | tokens / round | share of rounds committing all 16 |")
    print("|---:|---:|---:|")
    out = []
    for w in (1, 2, 4, 8):
        got = []
        for idx, _, truth in rounds:
            d = 0
            while d < D and truth[d] in idx[d, :w]:
                d += 1
            got.append(d + 1)
        print(f"| {w} | {np.mean(got):.2f} | {np.mean(np.array(got) == B):.2f} |")
        out.append(dict(bench="tree_policies_oracle", width=w, tokens_per_round=float(np.mean(got)),
                        all_accepted=float(np.mean(np.array(got) == B)), rounds=len(rounds), block=B,
                        machine=machine(), rev=git_rev()))
    kinds: dict[str, list[int]] = {k: [] for k in ("all accepted", "stop in the last 2", "substitution",
                                                  "insertion", "deletion", "diverge")}
    for idx, _, truth in rounds:
        d, full = idx[:, 0], truth[:D]
        j = run_len(d, full)
        if j == D:
            kinds["all accepted"].append(0)
            continue
        if j >= D - 2:
            kinds["stop in the last 2"].append(0)
            continue
        gains = {"substitution": run_len(d[j + 1:], full[j + 1:]), "insertion": run_len(d[j:], full[j + 1:]),
                 "deletion": run_len(d[j + 1:], full[j:])}
        kind, gain = max(gains.items(), key=lambda kv: kv[1])
        kinds[kind if gain >= 2 else "diverge"].append(gain if gain >= 2 else 0)
    print("\n| where the chain stops | share of rounds | drafts that resume after it (mean) |")
    print("|---|---:|---:|")
    for kind, g in kinds.items():
        print(f"| {kind} | {len(g) / len(rounds):.2f} | {np.mean(g) if g else 0:.1f} |")  # kinds that do not resume hold 0s
    out.append(dict(bench="tree_policies_stops", shares={k: len(g) / len(rounds) for k, g in kinds.items()},
                    resumed={k: float(np.mean(g)) if g else 0.0 for k, g in kinds.items()}, rounds=len(rounds),
                    block=B, machine=machine(), rev=git_rev()))
    return out


if __name__ == "__main__":
    main()
