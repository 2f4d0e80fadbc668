"""NumPy references for tree verify: the accept rule and the best-first tree (csrc/spec/verify.h,
csrc/spec/tree.h), written from their definitions rather than from the C++ algorithms."""

from __future__ import annotations

import itertools

import numpy as np


def accept_tree(parents, tokens, target):
    """Walk from the root; at each node take the lowest-index child whose token is the target's
    argmax there. Returns the path's tokens (root excluded) plus the bonus token."""
    parents, tokens, target = (np.asarray(a, dtype=np.int64) for a in (parents, tokens, target))
    out, cur = [], 0
    while True:
        hits = np.flatnonzero((parents == cur) & (tokens == target[cur]))
        if hits.size == 0:
            return out + [int(target[cur])]
        cur = int(hits[0])
        out.append(int(tokens[cur]))


def topk(logits, K):
    """Per row the K largest entries, value descending then index ascending, with p = softmax."""
    logits = np.asarray(logits, dtype=np.float64)
    order = np.lexsort((np.arange(logits.shape[1])[None, :].repeat(logits.shape[0], 0), -logits), axis=1)[:, :K]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return order, np.take_along_axis(p, order, axis=1)


def build_tree(root, top_tok, top_p, budget, min_score=0.0):
    """Every path of the full tree (a rank per position), scored by the product of its
    probabilities (float64, root first); the 1 + budget best by (score desc, depth asc, tokens
    lexicographic), those with score >= min_score and no zero probability. Node order is that
    order; parents index into it."""
    top_tok, top_p = np.asarray(top_tok), np.asarray(top_p, dtype=np.float32)
    n_pos, K = top_tok.shape
    paths = []  # (score, depth, tokens, ranks)
    for depth in range(1, n_pos + 1):
        for ranks in itertools.product(range(K), repeat=depth):
            s, ok = 1.0, True
            for pos, r in enumerate(ranks):
                p = float(top_p[pos, r])
                s *= p
                ok &= p > 0.0
            if ok and s >= min_score:
                paths.append((s, depth, tuple(int(top_tok[pos, r]) for pos, r in enumerate(ranks)), ranks))
    paths.sort(key=lambda x: (-x[0], x[1], x[2]))
    chosen = paths[:budget]
    index = {(): 0}
    parents, tokens, depths = [-1], [int(root)], [0]
    for i, (s, depth, toks, ranks) in enumerate(chosen, start=1):
        index[ranks] = i
        parents.append(index[ranks[:-1]])  # present: a prefix scores no less and sorts first
        tokens.append(toks[-1])
        depths.append(depth)
    return parents, tokens, depths
