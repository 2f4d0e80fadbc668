"""Forced drafts (Engine._draft_override, the request's draft source: what the benchmarks'
acceptance-controlled modes use) reach the verify pass, alone and through the scheduler
(Engine(n_seq > 1)): each round commits what the forced drafts make it commit, and the output
stays AR's. A draft source that never reached the spec session (the round's drafter drafts
instead) fails here: the random drafter's drafts are rejected, every round commits 1 token."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dflash_native as dn
from fixtures import check_cycled_rounds, cycling_drafts, make_spec_pair

B = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, tg, dg = make_spec_pair(tmp_path_factory.mktemp("draft-source"), "qwen35", seed=3)
    return str(tg), str(dg)


def prompts(n):
    rng = np.random.default_rng(7)
    return [[int(x) for x in rng.integers(3, 500, 6 + 3 * i)] for i in range(n)]


@pytest.mark.parametrize("n_seq", [1, 3])
def test_forced_drafts_set_the_acceptance(pair, n_seq):
    eng = dn.Engine(pair[0], drafter=pair[1], block_size=B, n_ctx=128, kv_type="f32", n_threads=2, gate=False,
                    n_seq=n_seq)
    ps = prompts(n_seq)
    refs = [eng.generate(p, max_tokens=40 + B, speculative=False).tokens for p in ps]
    overrides = {tuple(p): cycling_drafts(ref) for p, ref in zip(ps, refs)}
    eng._draft_override = lambda prompt, out, Bc: overrides[tuple(prompt)](prompt, out, Bc)
    results = [None] * n_seq

    def client(i):
        results[i] = eng.generate(ps[i], max_tokens=40)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_seq)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, ref in zip(results, refs):
        assert r.tokens == ref[:40]
        check_cycled_rounds(r.stats, B, every=3, complete=len(r.tokens) == 40)
    if n_seq > 1:
        assert eng._sched.pass_stats["passes"] > 0
