"""The CPU graphs' thread count (csrc/runtime/thread_governor.h): lowered while the machine is
oversubscribed, probed back up, and free to change between any two graphs because every op gives
the same bits on any number of threads."""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from fixtures import make_spec_pair

T = _core.testing
G = T.ThreadGovernor


@pytest.fixture(scope="module", params=["llama", "qwen3moe", "qwen35", "qwen3next"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("threads-" + request.param)
    _, tg, dg = make_spec_pair(d, request.param, seed=5, block_size=8)
    return str(tg), str(dg)


def run_graphs(g, n, *, ratio, now, wall=0.002):
    """n graphs of `wall` seconds each at the governor's counts, the computing thread on the CPU
    for `ratio` of each; returns the counts used and the clock after them."""
    used = []
    for _ in range(n):
        k = g.threads(now)
        used.append(k)
        g.observe(k, wall, ratio(k) * wall, now)
        now += wall
    return used, now


def test_governor_halves_when_the_thread_waits_and_probes_back():
    g = G(8)
    used, now = run_graphs(g, 8, ratio=lambda k: 0.95, now=0.0)
    assert used == [8] * 8 and g.current == 8 and g.reductions == 0  # idle machine: kept
    used, now = run_graphs(g, 24, ratio=lambda k: 0.3, now=now)  # busy: 8 -> 4 -> 2 -> 1
    assert g.current == 1 and g.reductions == 3, used
    assert used == [8] * 8 + [4] * 8 + [2] * 8
    # still busy: a probe at 2 threads after G.k_probe_min_s fails at its first graph (under k_low),
    # and the next waits twice as long
    used, now = run_graphs(g, 10, ratio=lambda k: 0.3 if k > 1 else 0.2, now=now + G.k_probe_min_s)
    assert used == [2] + [1] * 9 and g.current == 1
    # a probe between k_low and k_high runs its k_probe graphs, then fails
    used, now = run_graphs(g, 10, ratio=lambda k: 0.6 if k > 1 else 0.2, now=now + 2 * G.k_probe_min_s)
    assert used == [2] * G.k_probe + [1] * (10 - G.k_probe) and g.current == 1
    used, now = run_graphs(g, 10, ratio=lambda k: 0.3, now=now + 2 * G.k_probe_min_s)
    assert set(used) == {1}  # the interval doubled again (4 s)
    # the load goes: the one-thread graphs run freely, which brings the next probe within
    # k_probe_min_s though the interval had doubled; probes succeed one doubling at a time back to 8
    used, now = run_graphs(g, 8, ratio=lambda k: 0.95, now=now)  # a free window at 1 thread
    used, now = run_graphs(g, G.k_probe, ratio=lambda k: 0.95, now=now + G.k_probe_min_s)
    assert used == [2] * G.k_probe and g.current == 2
    for want in (4, 8):
        used, now = run_graphs(g, G.k_probe, ratio=lambda k: 0.95, now=now + G.k_probe_max_s)
        assert used == [want] * G.k_probe and g.current == want


def test_governor_keeps_one_thread_and_asked_counts():
    g = G(1)
    run_graphs(g, 50, ratio=lambda k: 0.1, now=0.0)
    assert g.current == 1 and g.reductions == 0
    g = G(3)  # odd counts halve to 1 and probe back at min(2 * current, asked)
    used, now = run_graphs(g, 16, ratio=lambda k: 0.2, now=0.0)
    assert used == [3] * 8 + [1] * 8 and g.current == 1
    used, _ = run_graphs(g, G.k_probe, ratio=lambda k: 0.9, now=now + G.k_probe_max_s)
    assert used == [2] * G.k_probe and g.current == 2


def test_every_op_gives_the_same_bits_on_any_thread_count(pair):
    """Logits of prompts of 5, 40 and 130 tokens (AR steps' and prefill chunks' kernels) on 1, 2
    and 3 threads: equal as bits."""
    tg, dg = pair
    rng = np.random.default_rng(0)
    got = {}
    for nt in (1, 2, 3):
        with dn.Engine(tg, drafter=dg, n_threads=nt, n_ctx=256, kv_type="f32") as e:
            if not got:
                prompts = [list(map(int, rng.integers(3, e.n_vocab, n))) for n in (5, 40, 130)]
            got[nt] = [e.eval(p).view(np.uint32) for p in prompts]
    for nt in (2, 3):
        for a, b in zip(got[1], got[nt]):
            assert np.array_equal(a, b), f"{nt} threads"


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, seed=7, logprobs=2), dict(speculative=False)])
def test_thread_count_changing_mid_request_keeps_the_output(pair, kw):
    """A request whose graphs switch between 1 and 2 threads at every streamed piece (speculative
    greedy, seeded sampled with logprobs, and AR) gives the tokens and logprobs of the same request
    on a fixed thread count."""
    tg, dg = pair
    prompt = [5, 17, 23, 99, 3, 41, 8, 60]
    with dn.Engine(tg, drafter=dg, n_threads=2, n_ctx=256, kv_type="f32") as e:
        want = e.generate(prompt, max_tokens=40, **kw)
        T.set_threads(e._core, 1)
        pieces, k = [], 0
        for piece in e.generate(prompt, max_tokens=40, stream=True, **kw):
            k += 1
            T.set_threads(e._core, 1 + k % 2)
            if getattr(piece, "result", None) is not None:
                got = piece.result
        T.set_threads(e._core, 0)
        assert k > 3
    assert got.tokens == want.tokens
    if kw.get("logprobs"):
        assert [(x.token, x.logprob, tuple(x.top)) for x in got.logprobs] == \
            [(x.token, x.logprob, tuple(x.top)) for x in want.logprobs]


def test_runner_reports_its_threads(pair):
    tg, dg = pair
    with dn.Engine(tg, drafter=dg, n_threads=2, n_ctx=128, kv_type="f32") as e:
        r = T.runner_threads(e._core)
        assert r["asked"] == 2 and 1 <= r["now"] <= 2 and r["reductions"] >= 0
        T.set_threads(e._core, 1)
        assert T.runner_threads(e._core)["now"] == 1
        with pytest.raises(ValueError, match="threads must be in"):
            T.set_threads(e._core, 3)
