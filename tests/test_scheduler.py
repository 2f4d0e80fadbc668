"""The engine over several sequence slots (csrc/engine/scheduler.h; Engine(n_seq=N)): requests run
at once, each step one target pass over every active request's work, joining and leaving between
steps. Exactness per sequence: a request's output in any batch (tokens, logprobs, stop reason) is
its output run alone on a one-slot engine, bit for bit, and each slot's caches after a step are
those of its sequence computed afresh.

Streams are advanced from one thread, interleaved at random, so that joins and leaves happen at
seeded, reproducible steps (each next() of a stream runs engine steps for every active request);
the threaded tests run the same through threads, as a server does.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from fixtures import DRAFTER_KINDS, make_kind_pair, make_spec_pair, walk_tickets

T = _core.testing
N_CTX = 192
B = 4


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen35", "qwen3next"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("sched-" + request.param)
    _, tg, dg = make_spec_pair(d, request.param, seed=5, block_size=B)
    return {"target": str(tg), "drafter": str(dg)}


@pytest.fixture(scope="module", params=list(DRAFTER_KINDS))
def kind_pair(request, tmp_path_factory):
    return make_kind_pair(tmp_path_factory.mktemp("sched-kind-" + request.param), request.param, block_size=B)


def engine(pair, n_seq, **kw):
    return dn.Engine(pair["target"], drafter=pair["drafter"], n_ctx=N_CTX, kv_type="f32", n_threads=2, block_size=B,
                     n_seq=n_seq, **kw)


def random_requests(rng, vocab, n, *, sampled=True, logprobs=True, ar=True):
    reqs = []
    for _ in range(n):
        r = dict(prompt=list(map(int, rng.integers(3, vocab, int(rng.integers(2, 40))))),
                 max_tokens=int(rng.integers(1, 28)))
        if sampled and rng.random() < 0.5:
            r.update(temperature=float(rng.choice([0.6, 1.0])), seed=int(rng.integers(1 << 30)),
                     top_p=float(rng.choice([1.0, 0.9])))
        if logprobs and rng.random() < 0.3:
            r["logprobs"] = int(rng.integers(0, 4))
        if ar and rng.random() < 0.25:
            r["speculative"] = False
        reqs.append(r)
    return reqs


def result_of(res):
    lps = None if res.logprobs is None else [(x.token, x.logprob, tuple(x.top))
                                             for x in res.logprobs]
    return res.tokens, lps, res.stats.stop_reason


def solo_results(pair, reqs, **kw):
    with engine(pair, 1, **kw) as e:
        return [e.generate(**r) for r in reqs]


def interleaved(eng, reqs, rng, *, inspect=None):
    """The requests as streams advanced from one thread in a seeded random order, each starting
    (joining) at a random point; returns their results. inspect(eng, live) runs after every
    advance, with the live streams' (request, tokens so far, ticket)."""
    pending = list(range(len(reqs)))
    live = {}  # index -> (generator, tokens so far)
    results = {}
    while pending or live:
        if pending and (not live or rng.random() < 0.35):
            i = pending.pop(0)
            live[i] = eng.generate(**reqs[i], stream=True)
        i = int(rng.choice(list(live)))
        try:
            piece = next(live[i])
        except StopIteration:  # pragma: no cover - the last piece carries the result first
            raise AssertionError("stream ended without its result")
        if getattr(piece, "result", None) is not None:
            results[i] = piece.result
            del live[i]
        if inspect is not None:
            inspect(eng)
    return [results[i] for i in range(len(reqs))]


@pytest.mark.parametrize("n_seq,seed", [(2, 0), (3, 1)])
def test_random_mix_equals_solo(pair, n_seq, seed):
    """Greedy and seeded sampled, speculative and AR requests with logprobs, more than the slots,
    joining at random points: each one's tokens, logprobs and stop reason are its solo run's."""
    rng = np.random.default_rng(seed)
    with engine(pair, n_seq) as eng:
        reqs = random_requests(rng, eng.n_vocab, n_seq + 3)
        # and a prompt wider than the batch-invariant width (64): its prefill runs alone
        reqs.insert(2, dict(prompt=list(map(int, rng.integers(3, eng.n_vocab, 90))), max_tokens=12))
        got = interleaved(eng, reqs, rng)
        ps = eng._sched.pass_stats
    want = solo_results(pair, reqs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert result_of(g) == result_of(w), f"request {i} ({reqs[i]}) differs from its solo run"
    assert sum(ps["width"][2:]) > 0, f"no pass ran several requests' work: {ps}"
    assert ps["batched_prefills"] > 0, ps  # prompts of 2-40 tokens: prefilled in the shared pass


@pytest.mark.parametrize("seed", [2])
def test_drafter_kinds_batched_equal_solo(kind_pair, seed):
    """DFlash 2 and DSpark drafters, gate off: the same tokens and the same rounds (acceptance
    histograms: the drafts were the solo run's) as each request run alone."""
    rng = np.random.default_rng(seed)
    with engine(kind_pair, 3, gate=False) as eng:
        reqs = random_requests(rng, eng.n_vocab, 5, ar=False)
        got = interleaved(eng, reqs, rng)
    want = solo_results(kind_pair, reqs, gate=False)
    for i, (g, w) in enumerate(zip(got, want)):
        assert result_of(g) == result_of(w), f"request {i} differs from its solo run"
        assert g.stats.acceptance_histogram == w.stats.acceptance_histogram, f"request {i}: other rounds"


def caches(t, slot):
    out = []
    for il, kind in enumerate(t.layer_types):
        f = T.gdn_state if kind == "gdn" else T.kv
        out.append(f(t, il, slot))
    return out


def solo_caches(t, il_kinds):
    return [(T.gdn_state if k == "gdn" else T.kv)(t, il) for il, k in enumerate(il_kinds)]


def test_slot_caches_after_each_step_equal_a_fresh_computation(pair):
    """After every step, the slot of the request just advanced holds the caches of its sequence (its
    prompt and every emitted token but the last) decoded afresh on a one-slot target. The
    scheduler's tickets directly: next() returns once a step emitted the ticket's tokens."""
    rng = np.random.default_rng(7)
    fresh = _core.Target(pair["target"], n_ctx=N_CTX, n_threads=2, kv_type="f32", n_batch=32)
    checked = 0
    with engine(pair, 3, gate=False) as eng:
        sched = eng._sched
        reqs = random_requests(rng, eng.n_vocab, 5, logprobs=False)

        def submit(i):
            r = reqs[i]
            sampling = _core.Sampling(r["temperature"], top_p=r["top_p"], seed=r["seed"]) if "temperature" in r else None
            # exact_max_tokens: no round commits past max_tokens, so the slot holds just the tokens emitted
            return sched.submit(r["prompt"], r.get("speculative", True), sampling=sampling,
                                max_tokens=r["max_tokens"] + 8, exact_max_tokens=True)

        outs = {}
        for i, t in walk_tickets(rng, len(reqs), submit, outs):
            seq = reqs[i]["prompt"] + outs[i][:-1]
            assert T.slot_n_past(eng._core, t.slot) == len(seq)
            fresh.reset()
            fresh.decode(seq)
            for il, (x, y) in enumerate(zip(caches(eng._core, t.slot), solo_caches(fresh, eng.layer_types))):
                for u, v in zip(x, y):
                    assert np.array_equal(u, v), f"request {i} slot {t.slot} layer {il} differs"
            checked += 1
        assert sum(sched.pass_stats["width"][2:]) > 0
    assert checked >= 5
    want = solo_results(pair, [dict(r, max_tokens=r["max_tokens"] + 8) for r in reqs], gate=False)
    for i in range(len(reqs)):
        assert outs[i] == want[i].tokens, f"request {i} differs from its solo run"


def test_tree_requests_in_a_batch(pair):
    """Tree rounds verify in the shared passes (their masks, positions and GDN tree ops per
    segment), greedy and seeded sampled with logprobs: outputs still the solo runs'."""
    rng = np.random.default_rng(3)
    with engine(pair, 2, verify="tree", tree_budget=6) as eng:
        reqs = random_requests(rng, eng.n_vocab, 4)
        got = interleaved(eng, reqs, rng)
        ps = eng._sched.pass_stats
    assert ps["tree_verifies"] > 0 and sum(ps["width"][2:]) > 0, ps
    want = solo_results(pair, reqs, verify="tree", tree_budget=6)
    for i, (g, w) in enumerate(zip(got, want)):
        assert result_of(g) == result_of(w), f"request {i} differs from its solo run"


def test_chain_and_tree_rounds_share_passes(pair):
    """Chain and tree requests (scheduler tickets: the policy is per request), greedy and seeded
    sampled, in one batch: each request's tokens are its solo run's, and so are the rounds of those
    that start on a fresh slot."""
    rng = np.random.default_rng(11)
    with engine(pair, 3, verify="tree", tree_budget=6) as eng:
        sched = eng._sched
        T.batch_controller_params(sched, enabled=False)  # its AR steps would change the rounds
        for k in range(3):
            fixed_costs(sched.spec(k))
        prompts = [list(map(int, rng.integers(3, eng.n_vocab, int(rng.integers(4, 30))))) for _ in range(5)]
        trees = [i % 2 == 0 for i in range(5)]
        smp = [_core.Sampling(0.8, seed=50 + i, logprobs=1) if i % 3 == 1 else None for i in range(5)]
        outs, tickets = {}, {}

        def submit(i):
            tickets[i] = sched.submit(prompts[i], True, tree=trees[i], sampling=smp[i], max_tokens=24)
            return tickets[i]

        for _ in walk_tickets(rng, 5, submit, outs):
            pass
        ps = sched.pass_stats
        hist = {i: t.stats["acceptance_histogram"] for i, t in tickets.items()}
    assert ps["tree_verifies"] > 0 and sum(ps["width"][2:]) > 0, ps
    for i, p in enumerate(prompts):
        with engine(pair, 1, verify="tree" if trees[i] else "chain", tree_budget=6) as solo:
            fixed_costs(solo._spec)
            kw = dict(temperature=0.8, seed=50 + i, logprobs=1) if smp[i] else {}
            r = solo.generate(p, max_tokens=24, **kw)
        assert outs[i] == r.tokens, f"request {i} ({'tree' if trees[i] else 'chain'}): tokens differ from its solo run"
        if i < 3:  # the first on each slot: a fresh controller, as the solo engine's (a slot's calibration carries over)
            assert hist[i] == r.stats.acceptance_histogram, f"request {i}: rounds differ from its solo run"


def test_threads_and_failures(pair):
    """Requests from threads at once, among them one with a token outside the vocabulary and one
    stopped early by its caller: the bad one raises its own error, the others give their solo
    outputs, and the engine serves the next requests."""
    rng = np.random.default_rng(11)
    with engine(pair, 3) as eng:
        vocab = eng.n_vocab
        reqs = random_requests(rng, vocab, 6)
        results, errors = {}, {}

        def run(i, r):
            try:
                results[i] = eng.generate(**r)
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                errors[i] = e

        bad = dict(prompt=[5, vocab + 3], max_tokens=4)
        ths = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(reqs + [bad])]
        for t in ths:
            t.start()
        # a stream abandoned after its first piece: its slot frees for the others
        it = eng.generate(prompt=reqs[0]["prompt"], max_tokens=20, stream=True)
        next(it)
        it.close()
        for t in ths:
            t.join()
        assert set(errors) == {len(reqs)}, errors
        assert isinstance(errors[len(reqs)], ValueError) and "vocabulary" in str(errors[len(reqs)])
        again = eng.generate(**reqs[1])
    want = solo_results(pair, reqs)
    for i in range(len(reqs)):
        assert result_of(results[i]) == result_of(want[i]), f"request {i} differs from its solo run"
    assert result_of(again) == result_of(want[1])


def test_prompt_cache_per_slot(pair):
    """cache_prompt: a continuation goes to the slot holding its prefix, reuses it, and gives the
    cold start's output."""
    rng = np.random.default_rng(5)
    with engine(pair, 2) as eng:
        vocab = eng.n_vocab
        a = list(map(int, rng.integers(3, vocab, 20)))
        b = list(map(int, rng.integers(3, vocab, 24)))
        ra = eng.generate(a, max_tokens=6, cache_prompt=True)
        rb = eng.generate(b, max_tokens=6, cache_prompt=True)
        a2 = a + ra.tokens + [7, 8, 9]
        b2 = b + rb.tokens + [10, 11]
        r2 = eng.generate(a2, max_tokens=8, cache_prompt=True)
        s2 = eng.generate(b2, max_tokens=8, cache_prompt=True)
        assert r2.stats.n_cached_tokens == len(a) + len(ra.tokens) - 1
        assert s2.stats.n_cached_tokens == len(b) + len(rb.tokens) - 1
    with engine(pair, 1) as solo:
        assert r2.tokens == solo.generate(a2, max_tokens=8).tokens
        assert s2.tokens == solo.generate(b2, max_tokens=8).tokens


def test_close_and_eval_wait_for_requests(pair):
    with engine(pair, 2) as eng:
        it = eng.generate(prompt=[5, 6, 7], max_tokens=30, stream=True)
        next(it)
        with pytest.raises(RuntimeError, match="still running"):
            eng.close(timeout=0.2)
        for _ in it:
            pass
        eng.close()
        with pytest.raises(RuntimeError, match="closed"):
            eng.generate([5], max_tokens=2)


def test_slots_that_do_not_fit_fail_at_creation(pair):
    with pytest.raises(MemoryError, match="n_seq"):
        dn.Engine(pair["target"], drafter=pair["drafter"], n_ctx=1 << 20, n_seq=64, n_threads=1)
    with pytest.raises(ValueError, match="n_seq"):
        dn.Engine(pair["target"], drafter=pair["drafter"], n_seq=0)


def test_memory_report_counts_every_slot(pair):
    with engine(pair, 1) as one:
        solo = one.memory_report()
    with engine(pair, 3) as eng:
        eng.generate([5, 6, 7], max_tokens=3)
        rep = eng.memory_report()
    slots = rep["slots"]
    assert len(slots) == 3
    for part in ("kv_cache", "gdn_state", "gdn_tape", "feature_ring"):
        assert all(s[part] == solo[part] for s in slots), part  # each slot holds a one-slot engine's caches
        assert rep[part] == sum(s[part] for s in slots) == 3 * solo[part], part
    assert rep["drafter_weights_mapped"] + rep["drafter_weights_copied"] == \
        solo["drafter_weights_mapped"] + solo["drafter_weights_copied"]  # one drafter, shared


def fixed_costs(spec):
    # speculation pays and the controller's choices depend only on acceptance (no timing)
    T.controller_fixed_costs(spec, ar_s=1.0, draft_s=0.2, verify0_s=0.9, verify1_s=0.05)


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_drafter_pass_drafts_as_alone(pair, sampled):
    """Rounds under the controller (fixed costs: its choices depend on acceptance only) draft in one
    drafter pass over the slots (pass_stats shared_drafts): every request's rounds (its acceptance
    histogram) and tokens equal its run alone on a one-slot engine. sampled: seeded sampled requests
    (their draws from the shared pass's logits rows) beside greedy ones with logprobs."""
    check_batched_drafts(pair, sampled=sampled)


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_drafter_pass_of_each_kind(kind_pair, sampled):
    """The same for DSpark (Markov and confidence heads) and DFlash 2 (each block's selector lattice
    in the shared pass: the greedy path and the sampled coherent draws as alone)."""
    check_batched_drafts(kind_pair, sampled=sampled)


def test_batched_drafter_pass_with_forced_drafts(pair):
    """A draft source (benchmarks' forced acceptance) replaces the shared pass's drafts as it
    replaces a solo round's: the same rounds and tokens as solo, the pass still shared."""
    check_batched_drafts(pair, forced=True)


def forced_source(ref, n_vocab, tau=3):
    """Drafts: the AR continuation ref after the tokens so far, its tau-th draft made wrong."""
    def source(out, B):
        d = (list(ref[len(out): len(out) + B - 1]) + [1] * B)[: B - 1]
        if tau <= len(d):
            d[tau - 1] = (d[tau - 1] + 1) % n_vocab
        return d
    return source


def batched_sampling(i, sampled):
    """Request i's settings in check_batched_drafts: greedy, or (sampled) alternately seeded sampled
    and greedy with logprobs (both read the pass's logits rows)."""
    if not sampled:
        return {}
    if i % 2 == 0:
        return dict(temperature=0.8, top_p=0.95, seed=100 + i)
    return dict(temperature=0.0, logprobs=2)


def check_batched_drafts(pair, sampled=False, forced=False):
    rng = np.random.default_rng(4)
    n = 3
    refs = sources = None
    if forced:
        with engine(pair, 1) as ar:
            prompts0 = [list(map(int, np.random.default_rng(4).integers(3, ar.n_vocab, int(k)))) for k in (9, 17, 25)]
            refs = [ar.generate(p, max_tokens=48, speculative=False).tokens for p in prompts0]
            sources = [forced_source(r, ar.n_vocab) for r in refs]
    with engine(pair, n) as eng:
        sched = eng._sched
        T.batch_controller_params(sched, enabled=False)  # its AR steps would change the rounds
        for k in range(n):
            fixed_costs(sched.spec(k))
        prompts = prompts0 if forced else \
            [list(map(int, rng.integers(3, eng.n_vocab, int(rng.integers(4, 30))))) for _ in range(n)]
        tickets = []
        for i, p in enumerate(prompts):  # all admitted at the first step
            kw = batched_sampling(i, sampled)
            smp = _core.Sampling(kw.get("temperature", 0.0), top_p=kw.get("top_p", 1.0), seed=kw.get("seed", 0),
                                 logprobs=kw.get("logprobs", -1)) if kw else None
            tickets.append(sched.submit(p, True, sampling=smp, max_tokens=40,
                                        draft_source=sources[i] if forced else None))
        outs = [[] for _ in range(n)]
        while not all(t.done for t in tickets):
            for i, t in enumerate(tickets):
                if not t.done:
                    outs[i] += t.next()[0]
        shared = sched.pass_stats["shared_drafts"]
        hist = [t.stats["acceptance_histogram"] for t in tickets]
    for i, p in enumerate(prompts):
        with engine(pair, 1) as solo:
            fixed_costs(solo._spec)
            if forced:
                solo._draft_override = lambda prompt, out, B, f=sources[i]: f(out, B)
            r = solo.generate(p, max_tokens=40, **batched_sampling(i, sampled))
        assert outs[i] == r.tokens, f"request {i}: tokens differ from its solo run"
        if i < 3:  # the first on each slot: a fresh controller, as the solo engine's (a slot's calibration carries over)
            assert hist[i] == r.stats.acceptance_histogram, f"request {i}: rounds differ from its solo run"
    assert shared > 0, f"shared drafter passes: {shared}"


def drain(ticket, out):
    while not ticket.done:
        out += ticket.next()[0]
    return out


@pytest.mark.parametrize("n_batch", [32, 80])
def test_long_prompts_prefill_a_chunk_a_step(pair, n_batch):
    """A prompt longer than the batch-invariant width prefills one n_batch chunk per engine step,
    alone (the chunks start() runs), between the other requests' steps; its last chunk rides the
    shared pass when it fits (n_batch 32: 150 = 4 x 32 + 22), else runs alone too (n_batch 80:
    150 = 80 + 70). Every request, greedy or sampled, speculative or AR, equals its solo run on an
    engine of the same n_batch, and the other requests commit tokens while the prompt prefills."""
    rng = np.random.default_rng(7)
    with engine(pair, 2, n_batch=n_batch) as eng:
        sched = eng._sched
        long_ = list(map(int, rng.integers(3, eng.n_vocab, 150)))
        a = sched.submit([5, 6, 7, 8], False, max_tokens=40)
        got_a = list(a.next()[0])
        b = sched.submit(long_, True, max_tokens=10)
        chunks = []
        for _ in range(2):  # each next() of a's: one engine step (an AR token), one chunk of b's prompt
            got_a += a.next()[0]
            chunks.append(sched.pass_stats["prefill_chunks"])
        assert chunks == [1, 2], chunks
        assert len(got_a) == 3 and b.slot >= 0
        drain(a, got_a)
        got_b = drain(b, [])
        # and a random mix with long prompts of both kinds
        mix = random_requests(rng, eng.n_vocab, 4)
        mix.insert(1, dict(prompt=list(map(int, rng.integers(3, eng.n_vocab, 120))), max_tokens=8,
                           temperature=0.8, seed=3, logprobs=2))
        mix.insert(3, dict(prompt=list(map(int, rng.integers(3, eng.n_vocab, 100))), max_tokens=8,
                           speculative=False))
        got = interleaved(eng, mix, rng)
        ps = sched.pass_stats
    reqs = [dict(prompt=[5, 6, 7, 8], max_tokens=40, speculative=False), dict(prompt=long_, max_tokens=10)]
    want = solo_results(pair, reqs + mix, n_batch=n_batch)
    assert got_a == want[0].tokens and got_b == want[1].tokens
    for i, (g, w) in enumerate(zip(got, want[2:])):
        assert result_of(g) == result_of(w), f"request {i} ({mix[i]}) differs from its solo run"
    assert ps["prefill_chunks"] >= (4 + 3 + 3 if n_batch == 32 else 2 + 1 + 1), ps


def test_a_cancelled_chunked_prefill_leaves_the_slot_clean(pair):
    """A request cancelled between its prompt's chunks ends with nothing; the request beside it and
    the next ones on the engine equal their solo runs."""
    rng = np.random.default_rng(8)
    with engine(pair, 2, n_batch=32) as eng:
        sched = eng._sched
        long_ = list(map(int, rng.integers(3, eng.n_vocab, 150)))
        a = sched.submit([5, 6, 7, 8], True, max_tokens=30)
        got_a = list(a.next()[0])
        b = sched.submit(long_, True, max_tokens=10)
        got_a += a.next()[0]
        assert sched.pass_stats["prefill_chunks"] == 1
        b.stop()  # cancelled mid-prefill
        assert drain(b, []) == [] and b.stop_reason == "stop"
        drain(a, got_a)
        after = [eng.generate(long_[:140], max_tokens=6), eng.generate(long_[:100], max_tokens=6)]
    with engine(pair, 1, n_batch=32) as solo:
        assert got_a == solo.generate([5, 6, 7, 8], max_tokens=30).tokens
        for r, p in zip(after, (long_[:140], long_[:100])):
            assert r.tokens == solo.generate(p, max_tokens=6).tokens


def test_eval_between_requests_drops_the_prompt_caches(pair):
    """eval() runs on the target outside the scheduler: a later cache_prompt request starts cold
    (its output still the cold start's)."""
    with engine(pair, 2) as eng:
        a = [5, 6, 7, 8, 9, 10]
        ra = eng.generate(a, max_tokens=4, cache_prompt=True)
        eng.eval([11, 12, 13, 14])
        a2 = a + ra.tokens + [20]
        r = eng.generate(a2, max_tokens=6, cache_prompt=True)
        assert r.stats.n_cached_tokens == 0
    with engine(pair, 1) as solo:
        assert r.tokens == solo.generate(a2, max_tokens=6).tokens


# The batch's controller (engine/batch_controller.h): whole steps judged by committed tokens per
# second against all-AR steps over as many requests.

def feed(bc, n, spec_rate, ar_rate, steps, tokens=4, stall=None, switch=0.0):
    """steps of the controller's own choosing at width n: a speculative step commits `tokens` at
    spec_rate tokens/s, an all-AR step n tokens at ar_rate; stall(i) -> extra seconds of step i;
    switch: extra seconds of a step whose mode differs from the step before (the caches' refill).
    Returns the choices made."""
    choices = []
    for i in range(steps):
        spec = bc.speculate(n)
        tok = tokens if spec else n
        sec = tok / (spec_rate if spec else ar_rate) + (stall(i) if stall else 0.0)
        if choices and choices[-1] != spec:
            sec += switch
        choices.append(spec)
        bc.observe(n, spec, tok, sec)
    return choices


def runs_of(ch):
    """[(mode, length)] runs of a list of choices"""
    runs = []
    for c in ch:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return [tuple(r) for r in runs]


def test_batch_controller_keeps_speculation_that_wins():
    """Speculation twice as fast as AR: kept, with a run of ar_run all-AR steps per ar_every
    speculative steps after the first run (which measures AR)."""
    bc = T.BatchController(4, ar_every=8, ar_run=2, settle_steps=1)
    ch = feed(bc, 3, spec_rate=200.0, ar_rate=100.0, steps=100)
    assert ch[:2] == [False, False]  # the width's first steps are an AR run
    ar_at = [i for i, c in enumerate(ch) if not c]
    assert ar_at == [i for i in range(100) if i % 10 < 2], ar_at  # then 8 speculative steps per AR run
    assert bc.switches == 0
    # tokens per request per second
    assert bc.rate(3, True) == pytest.approx(200.0 / 3) and bc.rate(3, False) == pytest.approx(100.0 / 3)


def test_batch_controller_falls_back_to_ar_and_probes():
    """Speculation slower than AR: after probe_steps measured speculative steps (the first after
    AR steps is not measured) the batch goes AR for backoff_min steps, probes again, and each lost
    probe doubles the back-off (capped). Once speculation wins again, it is kept."""
    bc = T.BatchController(4, ar_every=16, ar_run=2, settle_steps=1, probe_steps=4, backoff_min=8, backoff_max=32)
    ch = feed(bc, 2, spec_rate=50.0, ar_rate=100.0, steps=2 + 5 + 8 + 5 + 16 + 5 + 32 + 5 + 32)
    assert runs_of(ch) == [(False, 2), (True, 5), (False, 8), (True, 5), (False, 16), (True, 5),
                           (False, 32), (True, 5), (False, 32)], runs_of(ch)
    assert sum(1 for c in ch if not c) == bc.forced_ar_steps  # every AR step was the controller's
    # speculation becomes the faster: the next probe keeps it, with its periodic AR runs
    ch = feed(bc, 2, spec_rate=300.0, ar_rate=100.0, steps=44)
    assert ch == [True] * 16 + [False] * 2 + [True] * 16 + [False] * 2 + [True] * 8, ch


def test_batch_controller_leaves_out_the_switch_steps():
    """The first steps after a step of the other mode pay for the switch (the caches, the
    drafter's backlog of features), not for their mode: they are not measured. AR 1.25x faster than
    speculation, with a switch cost that would make a lone periodic AR step look 3x slower: the
    rates are the steady ones and the batch goes AR."""
    bc = T.BatchController(4, ar_every=16, ar_run=4, settle_steps=2, probe_steps=4, backoff_min=64, backoff_max=64)
    ch = feed(bc, 4, spec_rate=160.0, ar_rate=200.0, steps=60, switch=0.04)
    assert bc.rate(4, False) == pytest.approx(200.0 / 4) and bc.rate(4, True) == pytest.approx(160.0 / 4)
    assert runs_of(ch)[:3] == [(False, 4), (True, 6), (False, 50)], runs_of(ch)
    with pytest.raises(ValueError, match="ar_run must be > settle_steps"):
        T.BatchController(4, ar_run=2, settle_steps=2)


def test_batch_controller_keeps_speculation_by_a_margin():
    """Speculation 1.05x AR per measured step is dropped under the default margin (1.1: what the
    steps' rates leave out, the admissions and the drain of requests that finish apart, costs
    speculation more), and kept with margin 1."""
    bc = T.BatchController(4, probe_steps=4, backoff_min=64, backoff_max=64)
    assert runs_of(feed(bc, 4, spec_rate=105.0, ar_rate=100.0, steps=80)) == [(False, 6), (True, 7), (False, 64), (True, 3)]
    bc = T.BatchController(4, probe_steps=4, margin=1.0)
    assert sum(feed(bc, 4, spec_rate=105.0, ar_rate=100.0, steps=80)) > 60
    with pytest.raises(ValueError, match="margin must be in"):
        T.BatchController(4, margin=0.9)


def test_batch_controller_widths_are_judged_apart():
    """At 2 requests speculation wins, at 6 it loses: each width class (2-3, 4-7) keeps its own
    mode, and 5 is judged with 6."""
    bc = T.BatchController(8, probe_steps=4, backoff_min=64)
    for _ in range(4):
        feed(bc, 2, spec_rate=300.0, ar_rate=100.0, steps=20)
        feed(bc, 6, spec_rate=80.0, ar_rate=100.0, steps=20)
    assert sum(feed(bc, 2, 300.0, 100.0, 16)) >= 16 - 6  # speculating, but for an AR run at most
    assert sum(feed(bc, 6, 80.0, 100.0, 16)) <= 3 + 4  # AR, but for a probe at most
    assert sum(feed(bc, 5, 80.0, 100.0, 16)) == 0
    assert [T.BatchController.width_class(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [0, 1, 1, 2, 2, 3, 4]


def test_batch_controller_ignores_stalls():
    """A stall of the machine (one step in ten takes 50x its time) in either mode does not turn the
    decision: speculation 1.5x AR is kept; 0.7x AR is dropped."""
    stall = lambda i: 2.0 if i % 10 == 3 else 0.0  # noqa: E731
    bc = T.BatchController(4, probe_steps=4)
    ch = feed(bc, 3, spec_rate=150.0, ar_rate=100.0, steps=200, stall=stall)
    assert bc.switches == 0 and sum(ch) > 160  # all but the periodic AR runs (6 steps in 38)
    bc = T.BatchController(4, probe_steps=4, backoff_min=64, backoff_max=64)
    ch = feed(bc, 3, spec_rate=70.0, ar_rate=100.0, steps=200, stall=stall)
    assert sum(ch) < 40, sum(ch)


def test_steps_the_batch_makes_ar_equal_solo(pair):
    """A batch controller that makes two steps in three AR for every request (ar_every 1): the
    requests' tokens, logprobs and stop reasons are still their solo runs' (greedy and seeded
    sampled, speculative and AR requests), and the AR steps it imposed are counted."""
    rng = np.random.default_rng(7)
    with engine(pair, 3) as eng:
        T.batch_controller_params(eng._sched, ar_every=1)
        reqs = random_requests(rng, eng.n_vocab, 6, logprobs=True)
        for r in reqs:
            r["max_tokens"] = max(r["max_tokens"], 12)
        got = interleaved(eng, reqs, rng)
        ps = eng._sched.pass_stats
        # what it measured: the AR rate of the width classes it imposed AR steps in (tokens per
        # request per second; the speculative window restarts at each probe)
        rates = [T.batch_controller_rates(eng._sched, n) for n in (1, 2, 3)]
    want = solo_results(pair, reqs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert result_of(g) == result_of(w), f"request {i} ({reqs[i]}) differs from its solo run"
    assert ps["batch_ar_steps"] > 0, ps
    assert any(ar > 0 for _, ar, _ in rates) and all(spec >= 0 for spec, _, _ in rates), rates
    assert ps["steps"] >= ps["passes"] / 2 and 0 < ps["step_s"], ps  # the engine's steps and their time
