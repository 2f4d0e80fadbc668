"""The speculation controller (csrc/spec/controller.h, Engine(gate=True), the default).

What it decides never changes the output: every test compares with AR. Its decisions are tested
under fixed costs (_core.testing.controller_fixed_costs), so that they depend on acceptance only
and not on this machine's timing; forced drafts (Engine._draft_override) set the acceptance."""

from __future__ import annotations

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.cli import default_pair
from dflash_native.convert import convert_hf_to_gguf
from fixtures import cycling_drafts, make_random_checkpoint, make_random_drafter_gguf

PROMPT = [int(x) for x in np.random.default_rng(4).integers(3, 500, 13)]
TEXT = "def parse_args(argv):\n    "


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def random_pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("ctl-" + request.param)
    ckpt = make_random_checkpoint(d / "t", request.param, seed=11)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f32", seed=12, block_size=8, target_gguf=tg)
    return tg, dg


@pytest.fixture
def embedded():
    pair = default_pair()
    assert pair is not None, "the package ships its default pair"
    return dn.Engine(pair[0], drafter=pair[1], n_ctx=1024, n_threads=1)


def fixed_costs(eng, ar=1.0, draft=0.5, v0=1.0, v1=0.1):
    """The controller prices an AR step at `ar`, a draft at `draft`, a verify of n at v0 + v1 n."""
    _core.testing.controller_fixed_costs(eng._spec, ar, draft, v0, v1)


def test_controller_is_the_default_and_lossless(random_pair):
    """Under measured costs (whatever this machine makes of them) the output is AR's."""
    eng = dn.Engine(random_pair[0], drafter=random_pair[1], n_ctx=512, kv_type="f32", n_threads=1)
    assert eng.gate
    ar = eng.generate(PROMPT, max_tokens=150, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=150)
    assert sp.tokens == ar.tokens and sp.stats.stop_reason == "length"
    # its first step is AR (it measures AR); the rest are rounds or AR steps
    assert sp.stats.ar_steps >= 1 and sp.stats.ar_steps + sum(
        k * c for k, c in enumerate(sp.stats.acceptance_histogram)) == len(sp.tokens) - 1


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_controller_is_lossless_on_accepted_drafts(random_pair, verify):
    """Drafts from the AR output with chosen mismatches (cycling_drafts: round r's first wrong draft at
    3r mod 8) under fixed costs where a verified token is cheap: the controller's rounds commit every
    length 1..8 of the block, and the output is still AR's, bit for bit."""
    eng = dn.Engine(random_pair[0], drafter=random_pair[1], n_ctx=512, kv_type="f32", n_threads=1, verify=verify,
                    tree_budget=16)
    B = eng.block_size
    assert eng.gate and B == 8
    fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=0.01)
    ar = eng.generate(PROMPT, max_tokens=150, speculative=False)
    eng._draft_override = cycling_drafts(ar.tokens + [0] * B, every=3)
    try:
        sp = eng.generate(PROMPT, max_tokens=150)
    finally:
        eng._draft_override = None
    assert sp.tokens == ar.tokens and sp.stats.stop_reason == "length"
    hist = sp.stats.acceptance_histogram
    assert sp.stats.mean_acceptance_length > 1.5 and all(hist[1: B + 1]), hist
    assert sp.stats.ar_steps + sum(k * c for k, c in enumerate(hist)) == len(sp.tokens) - 1


def test_falls_back_to_ar_and_probes_again_with_a_doubling_backoff(random_pair):
    """Speculation that loses to AR (a random drafter: nothing is accepted) is left for AR after
    min_rounds (4) rounds, probed again after 16 AR steps, then after 32, 64 ...; exact throughout."""
    eng = dn.Engine(random_pair[0], drafter=random_pair[1], n_ctx=512, kv_type="f32", n_threads=1)
    fixed_costs(eng, ar=1.0, draft=0.5, v0=1.0, v1=0.1)
    ar = eng.generate(PROMPT, max_tokens=200, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=200)
    assert sp.tokens == ar.tokens
    st = sp.stats
    # 1 AR + 4 rounds + 16 AR + 4 rounds + 32 AR + 4 rounds + 64 AR + 4 rounds + 128 AR ... = 200 tokens
    assert st.controller_switches >= 6
    assert st.rounds <= 4 * (st.controller_switches // 2 + 1) and st.ar_steps >= 1 + 16 + 32 + 64


def test_goes_back_to_speculation_when_drafts_are_accepted_again(embedded):
    """Both directions in one request: drafts that are all rejected for the first 80 tokens send
    it to AR; once drafts are the AR continuation, a probe wins and the request ends speculating."""
    eng = embedded
    ar = eng.generate(TEXT, max_tokens=400, speculative=False)
    full = ar.tokens + [0] * 64

    def forced(prompt, out, B):
        if len(out) < 80:  # a wrong first draft: nothing accepted
            return [(full[len(out)] + 1) % eng.n_vocab] * (B - 1)
        return full[len(out): len(out) + B - 1]

    fixed_costs(eng, ar=1.0, draft=0.5, v0=1.0, v1=0.1)
    eng._draft_override = forced
    try:
        sp = eng.generate(TEXT, max_tokens=400)
        state = _core.testing.controller_state(eng._spec)
    finally:
        eng._draft_override = None
    assert sp.tokens == ar.tokens
    assert sp.stats.controller_switches >= 2 and sp.stats.ar_steps >= 16
    assert state["mode"] == "spec"
    hist = sp.stats.acceptance_histogram
    assert sum(hist[8:]) >= 10  # long accepted runs once the drafts are right


def test_verifies_fewer_drafts_as_verify_costs_more(embedded):
    """Perfect drafts (the AR continuation): when a verified token is cheap, the controller verifies
    about the whole block; when it costs as much as an AR step per token, it speculates no more."""
    eng = embedded
    ar = eng.generate(TEXT, max_tokens=200, speculative=False)
    full = ar.tokens + [0] * 64
    eng._draft_override = lambda prompt, out, B: full[len(out): len(out) + B - 1]
    try:
        fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=0.01)
        cheap = eng.generate(TEXT, max_tokens=200)
        fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=5.0)
        dear = eng.generate(TEXT, max_tokens=200)
    finally:
        eng._draft_override = None
    assert cheap.tokens == ar.tokens and dear.tokens == ar.tokens
    assert cheap.stats.mean_verified_length >= 12 and cheap.stats.ar_steps <= 1 + cheap.stats.rounds // 32 + 1
    assert dear.stats.ar_steps > 4 * dear.stats.rounds


def test_gate_false_restores_fixed_settings(embedded):
    """gate=False: every step is a round of block_size, as before the controller."""
    eng = embedded
    ar = eng.generate(TEXT, max_tokens=120, speculative=False)
    eng.gate = False
    try:
        assert not eng.gate
        sp = eng.generate(TEXT, max_tokens=120)
    finally:
        eng.gate = True
    assert sp.tokens == ar.tokens
    assert sp.stats.ar_steps == 0 and sp.stats.controller_switches == 0
    assert sp.stats.mean_verified_length == eng.block_size
    assert eng.generate(TEXT, max_tokens=120).tokens == ar.tokens  # on again


def test_long_ar_stretch_leaves_the_ring_as_a_fresh_prefill(tmp_path):
    """AR stretches longer than the ring queue one feature row per step; rows older than the ring
    are dropped before the push. After such stretches the ring, the caches and the next draft
    equal a fresh prefill of the same tokens, bitwise."""
    ckpt = make_random_checkpoint(tmp_path / "t", "qwen3_5", seed=21)
    tg = convert_hf_to_gguf(ckpt, tmp_path / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(tmp_path / "d.gguf", ckpt, outtype="f32", seed=22, block_size=8, target_gguf=tg)
    eng = dn.Engine(tg, drafter=dg, n_ctx=512, kv_type="f32", n_threads=1, feature_ring_capacity=16)
    fixed_costs(eng)  # nothing is accepted: stretches of 16, 32, 64 AR steps
    ar = eng.generate(PROMPT, max_tokens=120, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=120)
    assert sp.tokens == ar.tokens and sp.stats.ar_steps > 64 and sp.stats.stop_reason == "length"
    t, s = eng._core, eng._spec
    out = sp.tokens
    assert t.n_past == len(PROMPT) + len(out) - 1

    t2 = _core.Target(str(tg), n_ctx=512, kv_type="f32", max_verify=8, n_threads=1)
    s2 = _core.Spec(t2, str(dg), ring_capacity=16)
    # the fresh prefill in chunks of at most 64 tokens (n_cached: the prompt cache's continuation):
    # a prompt chunk of more than 64 rows takes the wide GEMM or ggml's matmul, which the contract
    # allows ("Exactness contract": prompt chunks > 64 tokens) and which rounds otherwise
    seq = PROMPT + out[:-1]
    for n in range(0, len(seq), 64):
        first = s2.prefill(seq[: n + 64], n_cached=n)
    assert first == out[-1]
    d1 = _core.testing.draft_logits(s, out[-1], 8, t)  # pushes the pending rows first
    d2 = _core.testing.draft_logits(s2, out[-1], 8, t2)
    assert _core.testing.ring_slot_positions(s) == _core.testing.ring_slot_positions(s2)
    for il in range(s.drafter_n_layer):
        for x, y in zip(_core.testing.ring_kv(s, il), _core.testing.ring_kv(s2, il)):
            np.testing.assert_array_equal(x, y)
    for a, b in zip(caches(t), caches(t2)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(d1, d2)


def caches(t):
    return [_core.testing.gdn_state(t, i) if ty == "gdn" else _core.testing.kv(t, i)
            for i, ty in enumerate(t.layer_types)]


def test_controller_state_reports_costs(embedded):
    """The read-out the benchmarks record: measured AR, draft and verify costs, one per size."""
    eng = embedded
    eng.generate(TEXT, max_tokens=64)
    st = _core.testing.controller_state(eng._spec)
    assert st["mode"] in ("ar", "spec") and len(st["verify_s"]) == eng.block_size
    assert st["ar_s"] > 0 and st["draft_s"] > 0 and all(v > 0 for v in st["verify_s"])


def test_a_request_keeps_the_calibration_but_measures_its_own_rate(embedded):
    """A new request starts from the window's calibration (how often drafts of each confidence
    were accepted), not from the prior, but judges speculation on its own rounds only: the
    previous request's rate was measured at another context length."""
    eng = embedded
    fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=0.05)
    first = eng.generate(TEXT, max_tokens=120)
    after = _core.testing.controller_state(eng._spec)
    observed = sum(n for n, _ in after["bins"])
    assert observed > 0 and after["spec_tok_s"] > 0
    short = eng.generate(TEXT, max_tokens=2)  # a request of one step: the AR step it starts with
    assert short.stats.ar_steps == 1 and short.stats.rounds == 0
    fresh = _core.testing.controller_state(eng._spec)
    assert fresh["mode"] == "spec"
    assert fresh["bins"] == after["bins"]  # calibration kept
    assert fresh["spec_tok_s"] == 0.0  # no rate until this request's rounds
    again = eng.generate(TEXT, max_tokens=120)
    assert again.tokens == first.tokens


def test_each_sampling_regime_keeps_its_own_calibration(embedded):
    """How often a draft of a given confidence is accepted depends on how the target's token is
    chosen: at T = 1.5 the embedded drafter's draws are rarely the target's. Once a sampled request
    has measured that, the next one at the same settings starts with AR steps and probes later
    (fewer rounds), while greedy requests, calibrated apart, speculate as before; exact throughout."""
    eng = embedded
    fixed_costs(eng, ar=1.0, draft=1.0, v0=1.0, v1=0.2)
    hot = dict(temperature=1.5, seed=5)
    greedy_before = eng.generate(TEXT, max_tokens=40)
    ar = eng.generate(TEXT, max_tokens=40, speculative=False, **hot)
    first = eng.generate(TEXT, max_tokens=40, **hot)
    st = _core.testing.controller_state(eng._spec)
    assert st["regimes"] == 2 and not st["round_can_win"]
    assert sum(n for n, _ in st["bins"]) > 0 and sum(h for _, h in st["bins"]) < sum(n for n, _ in st["bins"]) / 2
    second = eng.generate(TEXT, max_tokens=40, **hot)
    assert first.tokens == ar.tokens and second.tokens == ar.tokens
    assert first.stats.rounds >= 4 and second.stats.rounds < first.stats.rounds
    assert second.stats.ar_steps >= 16  # the count-down before a probe
    greedy_after = eng.generate(TEXT, max_tokens=40)
    assert greedy_after.tokens == greedy_before.tokens
    assert greedy_after.stats.rounds == greedy_before.stats.rounds  # its calibration untouched


def test_the_last_eight_sampling_regimes_keep_their_calibration(embedded):
    """The controller keeps the calibration of the 8 most recently used regimes: after a request at
    T = 1.5 and 7 requests at other settings (no greedy request in between), a request at
    T = 1.5 again starts from its calibration (a cold start must not count as a greedy request)."""
    eng = embedded
    fixed_costs(eng, ar=1.0, draft=1.0, v0=1.0, v1=0.2)
    eng.generate(TEXT, max_tokens=40, temperature=1.5, seed=5)
    kept = _core.testing.controller_state(eng._spec)["bins"]
    assert sum(n for n, _ in kept) > 0
    for i in range(7):
        eng.generate(TEXT, max_tokens=1, temperature=1.0 + i / 16, seed=5)
    eng.generate(TEXT, max_tokens=1, temperature=1.5, seed=5)  # the prefill only: no step
    st = _core.testing.controller_state(eng._spec)
    assert st["regimes"] == 8 and st["bins"] == kept


def test_a_round_of_no_verified_drafts_still_calibrates(embedded):
    """When the controller verifies none of the drafts (k = 0), the bonus token still says whether
    the first draft would have been accepted: the calibration learns instead of staying empty."""
    eng = embedded
    fixed_costs(eng, ar=1.0, draft=1.0, v0=1.0, v1=0.2)
    eng.generate(TEXT, max_tokens=40, temperature=1.5, seed=5)
    assert sum(n for n, _ in _core.testing.controller_state(eng._spec)["bins"]) > 0


def test_probes_ar_less_often_the_further_ahead_speculation_is(embedded):
    """The AR cost decides only near the margin: with speculation at >= 4x AR's rate, the AR
    cost probe comes every 128 rounds (32 x 4), not every 32."""
    eng = embedded
    ar = eng.generate(TEXT, max_tokens=900, speculative=False)
    full = ar.tokens + [0] * 64
    eng._draft_override = lambda prompt, out, B: full[len(out): len(out) + B - 1]
    try:
        fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=0.05)  # a 16-token round: 2.0 for ~16 tokens
        sp = eng.generate(TEXT, max_tokens=900)
    finally:
        eng._draft_override = None
    assert sp.tokens == ar.tokens
    assert 40 <= sp.stats.rounds < 128
    assert sp.stats.ar_steps == 1  # the request's first step only


def test_chooses_how_many_tree_nodes_to_verify():
    """verify="tree" under the controller: it verifies the prefix of the best-first tree with the
    most expected tokens per unit cost, tree_budget at most: nearly the whole budget when a
    verified token is cheap, little of it when each costs as much as an AR step; exact always."""
    pair = default_pair()
    eng = dn.Engine(pair[0], drafter=pair[1], n_ctx=1024, n_threads=1, verify="tree", tree_budget=24)
    ar = eng.generate(TEXT, max_tokens=160, speculative=False)
    fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=0.001)
    cheap = eng.generate(TEXT, max_tokens=160)
    fixed_costs(eng, ar=1.0, draft=0.2, v0=1.0, v1=0.3)
    dear = eng.generate(TEXT, max_tokens=160)
    assert cheap.tokens == ar.tokens and dear.tokens == ar.tokens
    assert cheap.stats.mean_verified_length >= 20
    assert dear.stats.rounds > 0 and dear.stats.mean_verified_length < 10
    eng.gate = False  # fixed settings: the whole budget every round
    fixed = eng.generate(TEXT, max_tokens=160)
    assert fixed.tokens == ar.tokens and fixed.stats.mean_verified_length == 25


def spiky_costs(eng, spike, p, seed=7):
    """A busy machine, made up (_core.testing.controller_synthetic_costs): every step's measured time
    is the fixed_costs(ar=1, draft=0.3, v0=1, v1=0.1) time plus, with probability p, a wait of
    `spike` (seeded per step), and the controller estimates its costs from these times."""
    _core.testing.controller_synthetic_costs(eng._spec, 1.0, 0.3, 1.0, 0.1, spike, p, seed)


@pytest.mark.parametrize("spike,p", [(20.0, 0.3), (50.0, 0.5), (200.0, 0.1)])
def test_keeps_speculating_on_a_busy_machine(embedded, spike, p):
    """Waits of 20-200x an AR step on 10-50% of the steps (a loaded machine: a descheduled thread
    stalls a graph whatever its size) slow AR steps and rounds alike, so drafts that are all
    accepted keep winning: request after request on one engine, the controller keeps speculating
    (the AR steps are its cost probes and a request's first step), and the output is AR's."""
    eng = embedded
    ar = eng.generate(TEXT, max_tokens=300, speculative=False)
    full = ar.tokens + [0] * 64
    eng._draft_override = lambda prompt, out, B: full[len(out): len(out) + B - 1]
    try:
        spiky_costs(eng, spike, p)
        runs = [eng.generate(TEXT, max_tokens=300) for _ in range(3)]
        state = _core.testing.controller_state(eng._spec)
    finally:
        eng._draft_override = None
    for sp in runs:
        assert sp.tokens == ar.tokens
        assert sp.stats.mean_acceptance_length >= 8, sp.stats
        assert sp.stats.ar_steps <= 1 + sp.stats.rounds // 32 + 1, sp.stats
    assert state["mode"] == "spec" and state["round_can_win"]


def test_still_falls_back_on_a_busy_machine(embedded):
    """The same waits with drafts that are never accepted: a round commits one token for two graph
    runs, so the controller goes to AR as on a quiet machine; exact throughout."""
    eng = embedded
    ar = eng.generate(TEXT, max_tokens=200, speculative=False)
    full = ar.tokens + [0] * 64
    eng._draft_override = lambda prompt, out, B: [(full[len(out)] + 1) % eng.n_vocab] * (B - 1)
    try:
        spiky_costs(eng, 50.0, 0.5)
        sp = eng.generate(TEXT, max_tokens=200)
    finally:
        eng._draft_override = None
    assert sp.tokens == ar.tokens
    assert sp.stats.ar_steps > 4 * sp.stats.rounds and sp.stats.controller_switches >= 2
