"""How often the drafter's coupled draw is the target's draw, per block position (issue 15).

Sampled speculative decoding (csrc/spec/spec_sampled.cpp) accepts a draft when it equals the target's
draw at that position; both draw with the same Gumbel noise G(seed, position, token) over their own
filtered logits. So acceptance is bounded by how close the drafter's distribution is to the
target's, whatever the engine does. This measures it on the pair directly, with no timing.

Per held-out prompt and setting, the target samples a continuation (AR, one seed per prompt). At
every third step j of it, the drafter drafts one block from the context up to token j (its last
token as `last`), and for each block position i the rank of the target's actual token j + i among
the drafter's perturbed scores l_d / T + G (greedy: among its logits) is recorded: rank 0 is the
coupled draw agreeing (what a chain needs), rank < K means a tree with K children at that depth
would hold it. Also the mean entropy of the target's and the drafter's distributions at the
first position (T = 1, nats).

    python bench/sampled_coupling.py --json bench/results/sampled_coupling.jsonl

--oracle: the same question for a perfect DFlash drafter, one that proposes from the target's own
distributions. At block position 1 it agrees always (same distribution, same noise). At position 2
a parallel drafter does not know the token drawn at position 1, so the best it can propose from
is the target's marginal q2 = sum_x1 p1(x1) p2(. | x1) (the filtered, tempered distributions,
tests/reference/sampling_ref.kept_probs; x1 over the tokens holding 99.9% of p1, at most 64). Its
agreement a2 = P(argmax(log q2 + G) == argmax(log p2(. | x1) + G)), x1 ~ p1 and the Gumbel noise G
sampled in NumPy, averaged over contexts along the target's sampled continuations. If every later
position agreed as often as position 2, a round of B would commit 2 + a2 + ... + a2^(B-2) tokens.

    python bench/sampled_coupling.py --oracle --json bench/results/sampled_coupling.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from _common import git_rev, machine, write_jsonl

RANKS = (1, 4, 8, 32)


def entropy(logits: np.ndarray) -> float:
    x = logits[np.isfinite(logits)].astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=80)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--temps", default="0,0.7,1.0")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--oracle", action="store_true", help="a perfect parallel drafter's agreement at position 2")
    ap.add_argument("--contexts", type=int, default=24, help="--oracle: contexts (spread over the prompts)")
    args = ap.parse_args()
    if args.oracle:
        return oracle(args)

    import dflash_native as dn
    from dflash_native import _core
    from dflash_native.cli import default_pair
    from dflash_native.train import corpus

    tg, dg = (str(x) for x in default_pair())
    eng = dn.Engine(tg, drafter=dg, n_threads=2, n_ctx=512)
    t = _core.Target(tg, n_ctx=512, kv_type="f32", max_verify=args.block, n_threads=2)
    s = _core.Spec(t, dg, block_size=args.block, ring_capacity=512, window=0)
    prompts = corpus.heldout_prompts(args.prompts, 96, eng, seed=0)
    B = args.block
    print(f"# sampled_coupling: {machine()}; embedded pair, {args.prompts} held-out prompts, {args.gen} tokens, "
          f"B={B}, top_p={args.top_p}; rev {git_rev()}\n")
    print("| setting | position | P(rank 0): chain accepts | rank < 4 | rank < 8 | rank < 32 | samples |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for temp in [float(x) for x in args.temps.split(",")]:
        ranks = {i: [] for i in range(1, B)}
        h_target, h_draft = [], []
        for pi, p in enumerate(prompts):
            seed = 1000 + pi
            kw = dict(temperature=temp, top_p=args.top_p, seed=seed) if temp > 0 else {}
            r = eng.generate(p.text, max_tokens=args.gen, speculative=False, **kw)
            prompt, gen = eng.tokenize(p.text), list(r.tokens)
            target_rows = eng.eval(prompt + gen)
            for j in range(0, len(gen) - B, 3):
                s.reset()
                t.reset()
                s.prefill(prompt + gen[:j])
                d = _core.testing.draft_logits(s, gen[j], B, t).astype(np.float64)  # [B-1, n_vocab], -inf off the draft vocabulary
                h_draft.append(entropy(d[0]))
                h_target.append(entropy(target_rows[len(prompt) + j]))
                for i in range(1, B):
                    row = d[i - 1]
                    if temp > 0:
                        g = _core.testing.gumbel(seed, len(prompt) + j + i, np.arange(row.size, dtype=np.int32))
                        score = np.where(np.isfinite(row), row / temp + g, -np.inf)
                    else:
                        score = row
                    ranks[i].append(int((score > score[gen[j + i]]).sum()))
        setting = "greedy" if temp == 0 else f"T={temp:g}, top_p {args.top_p:g}"
        for i in (1, 2, 4, 8, B - 1):
            a = np.array(ranks[i])
            share = {k: float(np.mean(a < k)) for k in RANKS}
            print(f"| {setting} | {i} | {share[1]:.2f} | {share[4]:.2f} | {share[8]:.2f} | {share[32]:.2f} | {a.size} |")
            rows.append(dict(bench="sampled_coupling", setting=setting, temperature=temp, top_p=args.top_p, position=i,
                             share_rank_below={str(k): v for k, v in share.items()}, samples=int(a.size),
                             target_entropy_t1=float(np.mean(h_target)), drafter_entropy_t1=float(np.mean(h_draft)),
                             prompts=args.prompts, gen=args.gen, block=B, machine=machine(), rev=git_rev()))
        print(f"| {setting} | entropy at position 1 (T = 1): target {np.mean(h_target):.2f} nats, "
              f"drafter {np.mean(h_draft):.2f} | | | | | |")
    write_jsonl(args.json, rows)


def oracle(args) -> None:
    import dflash_native as dn
    from dflash_native.cli import default_pair
    from dflash_native.train import corpus
    from reference.sampling_ref import kept_probs

    tg, dg = (str(x) for x in default_pair())
    eng = dn.Engine(tg, drafter=dg, n_threads=2, n_ctx=512)
    prompts = corpus.heldout_prompts(args.prompts, 96, eng, seed=0)
    rng = np.random.default_rng(0)
    B = args.block
    print(f"# sampled_coupling --oracle: {machine()}; embedded target, {args.contexts} contexts over {args.prompts} "
          f"held-out prompts, B={B}, top_p={args.top_p}; rev {git_rev()}\n")
    print("| setting | a2: perfect drafter, position 2 | x1 tokens per context (mean) | tokens per round if every later "
          "position agreed as often | contexts |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for temp in [float(x) for x in args.temps.split(",") if float(x) > 0]:
        filt = dict(temperature=temp, top_p=args.top_p)
        agree, n_x1 = [], []
        per_prompt = -(-args.contexts // len(prompts))
        for pi, p in enumerate(prompts):
            r = eng.generate(p.text, max_tokens=args.gen, speculative=False, seed=2000 + pi, **filt)
            ctx_all = eng.tokenize(p.text) + list(r.tokens)
            n0 = len(ctx_all) - len(r.tokens)
            for j in np.linspace(0, len(r.tokens) - 2, per_prompt).astype(int):
                ctx = ctx_all[: n0 + j]
                p1 = kept_probs(eng.eval(ctx)[-1], **filt)
                order = np.argsort(-p1)
                cut = min(int(np.searchsorted(np.cumsum(p1[order]), 0.999)) + 1, 64)
                x1s, w1 = order[:cut], p1[order[:cut]] / p1[order[:cut]].sum()
                p2 = np.stack([kept_probs(eng.eval(ctx + [int(x)])[-1], **filt) for x in x1s])  # [cut, V]
                q2 = w1 @ p2
                with np.errstate(divide="ignore"):
                    lp2, lq2 = np.log(p2), np.log(q2)
                for _ in range(400):
                    x = rng.choice(cut, p=w1)
                    g = rng.gumbel(size=q2.size)
                    agree.append(np.argmax(lp2[x] + g) == np.argmax(lq2 + g))
                n_x1.append(cut)
        a2 = float(np.mean(agree))
        per_round = 2.0 + sum(a2 ** k for k in range(1, B - 1))
        setting = f"T={temp:g}, top_p {args.top_p:g}"
        print(f"| {setting} | {a2:.3f} | {np.mean(n_x1):.1f} | {per_round:.2f} | {len(n_x1)} |")
        rows.append(dict(bench="sampled_coupling_oracle", setting=setting, temperature=temp, top_p=args.top_p,
                         a2=a2, tokens_per_round_if_geometric=per_round, x1_per_context=float(np.mean(n_x1)),
                         contexts=len(n_x1), draws=len(agree), block=B, machine=machine(), rev=git_rev()))
    write_jsonl(args.json, rows)


if __name__ == "__main__":
    main()
