"""DFlash speculative decoding: drafter parity, feature ring, rollback, lossless output.

Targets and drafters are random tiny models written by the package's converters; the drafter
reference is tests/reference/dflash_ref.py (PyTorch, independent of the C++ code).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from fixtures import SPEC_PAIRS, cycling_drafts, drafts_kept_until, make_random_checkpoint, make_random_drafter_gguf, make_spec_pair

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference.dflash_ref import DFlashRef, target_taps  # noqa: E402

PAIRS = SPEC_PAIRS


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-" + request.param)
    ckpt, tg, dg = make_spec_pair(d, request.param, seed=5)
    return {"name": request.param, "ckpt": ckpt, "target": tg, "drafter": dg, "drafter_ckpt": d / "drafter",
            "taps": PAIRS[request.param][2]["target_layer_ids"]}


def make(pair, B=8, capacity=64, window=0, n_ctx=256):
    t = _core.Target(str(pair["target"]), n_ctx=n_ctx, kv_type="f32", max_verify=16, n_threads=2)
    s = _core.Spec(t, str(pair["drafter"]), block_size=B, ring_capacity=capacity, window=window)
    return t, s


def ar_tokens(t, prompt, n, with_logits=False):
    t.reset()
    logits = [t.decode(prompt)[-1]]
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        logits.append(t.decode([out[-1]])[-1])
        out.append(int(np.argmax(logits[-1])))
    t.reset()
    return (out, logits) if with_logits else out


PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]


def test_drafter_matches_reference(pair):
    """Draft logits equal the PyTorch z-lab drafter on HF target taps of the same prompt."""
    t, s = make(pair, B=8)
    assert s.tap_layers == pair["taps"]
    last = s.prefill(PROMPT)
    ours = _core.testing.draft_logits(s, last, 8, t)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(pair["ckpt"]), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ref = DFlashRef.from_dirs(pair["drafter_ckpt"], pair["ckpt"])
    feats = target_taps(hf, PROMPT, pair["taps"])
    ref_logits = ref.forward([last] + [s.mask_token_id] * 7, feats)[1:]
    diff = np.abs(ours - ref_logits).max()
    print(f"{pair['name']}: max |draft logits - reference| = {diff:.2e}")
    assert ours.shape == ref_logits.shape
    # about 5x the worst case measured over the 7 pairs (F32): 3.8e-6 (qwen3), summation order only
    assert diff < 2e-5
    assert s.draft(last, 8) == [int(i) for i in ours.argmax(-1)]


@pytest.mark.parametrize("B,capacity", [(2, 8), (3, 13), (8, 16), (16, 16), (16, 300)])
def test_lossless_engine(pair, B, capacity):
    """Engine speculative output == AR output of the same engine, bit for bit: with the random
    drafter's own drafts (acceptance ~1), and with drafts from the AR output where round r's first
    miss sits at 3r mod B, so rounds commit every length 1..B (ring wrap-around included at the
    small capacities)."""
    eng = dn.Engine(pair["target"], drafter=pair["drafter"], gate=False, block_size=B, feature_ring_capacity=capacity,
                    n_ctx=256, kv_type="f32", n_threads=2)
    ar = eng.generate(PROMPT, max_tokens=60, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=60)
    assert sp.stats.speculative and sp.stats.rounds > 0
    assert sp.tokens == ar.tokens
    assert sum(sp.stats.acceptance_histogram) == sp.stats.rounds
    assert 1.0 <= sp.stats.mean_acceptance_length <= B
    every = 1 if B == 2 else 3 if B % 3 else 5
    n = B * (B + 1) // 2 + 2 * B  # room for B rounds of lengths 1..B
    ar = eng.generate(PROMPT, max_tokens=n, speculative=False)
    eng._draft_override = cycling_drafts(ar.tokens + [0] * B, every)
    forced = eng.generate(PROMPT, max_tokens=n)
    assert forced.tokens == ar.tokens
    hist = forced.stats.acceptance_histogram
    assert forced.stats.mean_acceptance_length > (1.5 if B > 2 else 1.2), hist
    # each round committed what the schedule says (the last may be cut by max_tokens or EOS): every
    # depth 1..B when the output is long enough for B rounds
    want = [0] * (B + 1)
    for r in range(forced.stats.rounds):
        k = (r * every) % B
        want[k + 1 if k < B - 1 else B] += 1
    assert sum(abs(a - b) for a, b in zip(hist, want)) <= 2, (hist, want)


@settings(deadline=None)  # examples: the profile's (conftest.py)
@given(st.sampled_from([2, 4, 7, 16]), st.integers(0, 2**31 - 1))
def test_lossless_with_forced_acceptance(pair_qwen35, B, seed):
    """Drafts replaced by the target's own continuation with injected errors: acceptance lengths
    across 1..B occur, and the committed stream is still the AR stream (near-tie rule)."""
    t, s = pair_qwen35
    rng = np.random.default_rng(seed)
    ref, _ = AR_CACHE.setdefault(id(t), ar_tokens(t, PROMPT, 100, with_logits=True))
    out = [s.prefill(PROMPT)]
    lengths = set()
    while len(out) < 70:
        good = ref[len(out): len(out) + B - 1]
        forced = [tok if rng.random() > 0.25 else (tok + 1) % 500 for tok in good]
        r = _core.testing.round(s, out[-1], B, forced)
        assert 1 <= len(r.committed) <= B
        lengths.add(len(r.committed))
        out += r.committed
        if out[: len(ref)] != ref[: len(out)]:
            break
    assert out[:70] == ref[:70]  # bit for bit: F16 weights run the batch-invariant kernels
    assert B == 2 or len(lengths) > 1


def test_forced_draft_of_the_wrong_length_is_refused(pair_qwen35):
    """A forced draft must hold B - 1 tokens (spec.cpp: check_forced_draft, which every round kind
    calls)."""
    t, s = pair_qwen35
    last = s.prefill(PROMPT)
    with pytest.raises(ValueError, match="forced draft must have B-1 = 3 tokens"):
        _core.testing.round(s, last, 4, [1, 2])
    s.reset()


AR_CACHE: dict = {}


@pytest.fixture(scope="module")
def pair_qwen35(tmp_path_factory):
    arch, t_over, d_over = PAIRS["qwen35-odd"]
    d = tmp_path_factory.mktemp("forced")
    ckpt = make_random_checkpoint(d / "target", arch, seed=8, **t_over)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f16")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f16", seed=9, target_gguf=tg, **d_over)
    t = _core.Target(str(tg), n_ctx=256, n_threads=2, max_verify=16)
    return t, _core.Spec(t, str(dg), block_size=16, ring_capacity=24)


def caches(t):
    return [_core.testing.gdn_state(t, i) if ty == "gdn" else _core.testing.kv(t, i)
            for i, ty in enumerate(t.layer_types)]


@pytest.mark.parametrize("n_keep", range(1, 9))
def test_rollback_every_acceptance_length(pair, n_keep):
    """After verifying B = 8 and keeping n, every cache equals a fresh computation of just those
    tokens: K/V (cursor), GDN recurrent and conv state, feature ring. Tolerance: batch vs
    single-token rounding in F32."""
    B = 8
    t, s = make(pair, B=B, capacity=12)
    ref = ar_tokens(t, PROMPT, 2 * B + 2)
    last = s.prefill(PROMPT)
    forced = drafts_kept_until(ref, B, n_keep)
    r = _core.testing.round(s, last, B, forced)
    assert len(r.committed) == n_keep
    got = caches(t)
    got_ring = [_core.testing.ring_kv(s, il) for il in range(s.drafter_n_layer)]
    got_pos = _core.testing.ring_slot_positions(s)
    n_past = t.n_past
    assert n_past == len(PROMPT) + n_keep

    # fresh: feed prompt + the kept tokens in one go
    t2, s2 = make(pair, B=B, capacity=12)
    s2.prefill(PROMPT + ref[:n_keep])
    assert t2.n_past == n_past
    for a, b in zip(got, caches(t2)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert _core.testing.ring_slot_positions(s2) == got_pos
    for il in range(s.drafter_n_layer):
        for x, y in zip(got_ring[il], _core.testing.ring_kv(s2, il)):
            np.testing.assert_array_equal(x, y)
    # and the next round behaves identically
    r1 = _core.testing.round(s, r.committed[-1], B, ref[n_keep + 1: n_keep + B])
    r2 = _core.testing.round(s2, r.committed[-1], B, ref[n_keep + 1: n_keep + B])
    assert r1.committed == r2.committed


def test_ar_step_keeps_the_ring_in_step(pair):
    """Spec.ar_step (the controller's AR step) commits the AR token and queues its features as a round's
    commit does, before a round (nothing pending) and after one (appended to the round's rows):
    the tokens are AR's, and the caches, the ring and the next draft equal a fresh prefill of the
    same tokens. Tolerance: batch vs single-token rounding in F32."""
    B = 8
    t, s = make(pair, B=B, capacity=12)
    ref = ar_tokens(t, PROMPT, 2 * B + 4)
    out = [s.prefill(PROMPT)]
    out.append(s.ar_step(out[-1]))
    forced = ref[2:B + 1]
    forced[2] = (forced[2] + 1) % 500  # reject from the third draft on: commits 3
    r = _core.testing.round(s, out[-1], B, forced)
    assert isinstance(r, dn.RoundResult) and len(r.committed) == 3 and r.n_verified == B
    out += r.committed
    out.append(s.ar_step(out[-1]))
    out.append(s.ar_step(out[-1]))
    assert out == ref[:len(out)]
    n_past = len(PROMPT) + len(out) - 1
    assert t.n_past == n_past

    t2, s2 = make(pair, B=B, capacity=12)
    assert s2.prefill(PROMPT + out[:-1]) == out[-1]
    for a, b in zip(caches(t), caches(t2)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    d1 = _core.testing.draft_logits(s, out[-1], B, t)  # pushes the pending features first
    d2 = _core.testing.draft_logits(s2, out[-1], B, t2)
    assert _core.testing.ring_slot_positions(s) == _core.testing.ring_slot_positions(s2)
    for il in range(s.drafter_n_layer):
        for x, y in zip(_core.testing.ring_kv(s, il), _core.testing.ring_kv(s2, il)):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(d1, d2)


@pytest.mark.parametrize("n_ar", [12, 13, 24, 25, 37])
def test_long_ar_stretch_then_draft_equals_prefill(pair, n_ar):
    """A long AR stretch queues a feature row per step; queue_features drops the older ones only past
    twice the ring capacity (12) and the draft's push skips those beyond it: at and past the
    capacity and twice it, the ring and the next draft equal a fresh prefill's."""
    B = 8
    t, s = make(pair, B=B, capacity=12)
    ref = ar_tokens(t, PROMPT, n_ar + 2)
    out = [s.prefill(PROMPT)]
    pending = 0  # rows queued: one per AR step, the older ones dropped past capacity + capacity / 8
    for _ in range(n_ar):
        out.append(s.ar_step(out[-1]))
        pending = pending + 1 if pending < 13 else 12
    assert out == ref[:len(out)]
    # the memory report counts the queue (host floats: n_taps * n_embd a row), bounded by 13 rows
    row_bytes = 4 * len(s.tap_layers) * t.n_embd
    assert pending * row_bytes <= t.memory_report(s)["feature_queue"] <= 13 * row_bytes
    t2, s2 = make(pair, B=B, capacity=12)
    assert s2.prefill(PROMPT + out[:-1]) == out[-1]
    d1 = _core.testing.draft_logits(s, out[-1], B, t)
    d2 = _core.testing.draft_logits(s2, out[-1], B, t2)
    assert _core.testing.ring_slot_positions(s) == _core.testing.ring_slot_positions(s2)
    for il in range(s.drafter_n_layer):
        for x, y in zip(_core.testing.ring_kv(s, il), _core.testing.ring_kv(s2, il)):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(d1, d2)


def test_ar_step_bad_token_is_an_error(pair):
    t, s = make(pair)
    s.prefill(PROMPT)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.ar_step(10**6)
    assert t.n_past == len(PROMPT)


@pytest.mark.parametrize("n_keep", [1, 4, 8])
def test_deferred_replay_equals_an_immediate_one(pair, n_keep):
    """commit() leaves the GDN replay to the next graph's GDN op (the verify's record op, or the
    decode's forward op), which does it per head on its own threads. Bit for bit, that equals the
    replay done at once on the host (which reading the cache forces)."""
    B = 8
    runs = []
    for flush in (False, True):
        t, s = make(pair, B=B)
        ref = ar_tokens(t, PROMPT, B + 2)
        last = s.prefill(PROMPT)
        forced = drafts_kept_until(ref, B, n_keep)
        r = _core.testing.round(s, last, B, forced)
        if flush:
            caches(t)
        nxt = [r.committed[-1]] + ref[:5]
        v = t.verify(nxt)                       # replays inside the record op, or nothing left
        t.commit(3)
        if flush:
            caches(t)
        d = t.decode([ref[6]])                  # replays inside the forward op, or nothing left
        runs.append((v, d, caches(t)))
    (v1, d1, c1), (v2, d2, c2) = runs
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_array_equal(d1, d2)
    for a, b in zip(c1, c2):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("reject_at", [1, 3, 8])
def test_fused_ring_push_equals_a_separate_push(pair, reject_at):
    """A round's committed features are pushed into the ring by the next draft graph. Drafts and
    ring contents then equal those of a separate push (forced by reading the ring) bit for bit,
    also across the ring's wrap (capacity 12)."""
    B = 8
    runs = []
    for flush in (True, False):
        t, s = make(pair, B=B, capacity=12)
        ref = ar_tokens(t, PROMPT, 5 * B)
        last = s.prefill(PROMPT)
        n, logits = 1, []
        for _ in range(4):
            forced = ref[n: n + B - 1]
            if reject_at < B:
                forced[reject_at - 1] = (forced[reject_at - 1] + 1) % 500
            r = _core.testing.round(s, last, B, forced)
            n += len(r.committed)
            last = r.committed[-1]
            if flush:
                _core.testing.ring_slot_positions(s)
            logits.append(_core.testing.draft_logits(s, last, B, t))
        assert t.n_past == len(PROMPT) + n - 1
        runs.append((logits, _core.testing.ring_slot_positions(s),
                     [_core.testing.ring_kv(s, il) for il in range(s.drafter_n_layer)]))
    (la, pa, ka), (lb, pb, kb) = runs
    assert pa == pb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(ka, kb):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


class RingModel:
    def __init__(self, cap):
        self.cap, self.n, self.slots = cap, 0, [-1] * cap

    def push(self, m):
        for p in range(self.n, self.n + m):
            self.slots[p % self.cap] = p
        self.n += m


@settings(deadline=None)  # examples: the profile's (conftest.py)
@given(st.integers(1, 19), st.lists(st.integers(1, 23), min_size=1, max_size=8), st.integers(0, 2**31 - 1))
def test_ring_wraparound(ring_pair, cap_off, pushes, seed):
    """After N pushes the ring holds exactly the last min(N, capacity) positions, each slot's K/V
    equal to the reference drafter's context K/V of that position."""
    t, drafter, ref, B = ring_pair
    cap = B + cap_off - 1  # capacities around the block size: B-1 .. B+17 (>= B enforced below)
    cap = max(cap, B)
    s = _core.Spec(t, str(drafter), block_size=B, ring_capacity=cap)
    rng = np.random.default_rng(seed)
    n_taps, H = len(s.tap_layers), t.n_embd
    total = sum(pushes)
    feats = rng.standard_normal((total, n_taps, H)).astype(np.float32)
    model = RingModel(cap)
    pos = 0
    for m in pushes:
        _core.testing.push_features(s, feats[pos: pos + m], pos)
        model.push(m)
        pos += m
        assert _core.testing.ring_slot_positions(s) == model.slots
    kv_ref = ref.context_kv(feats.reshape(total, n_taps * H), 0)
    for il, (k_ref, v_ref) in enumerate(kv_ref):
        k, v = _core.testing.ring_kv(s, il)
        for slot, p in enumerate(model.slots):
            if p >= 0:
                np.testing.assert_allclose(k[slot], k_ref[p], atol=1e-4, rtol=1e-4)
                np.testing.assert_allclose(v[slot], v_ref[p], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def ring_pair(tmp_path_factory):
    arch, t_over, d_over = PAIRS["qwen3"]
    d = tmp_path_factory.mktemp("ring")
    ckpt = make_random_checkpoint(d / "target", arch, seed=3, **t_over)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f32", seed=4, target_gguf=tg,
                                  ckpt_dir=d / "drafter", **d_over)
    t = _core.Target(str(tg), n_ctx=64, kv_type="f32", n_threads=2, max_verify=4)
    return t, dg, DFlashRef.from_dirs(d / "drafter", ckpt), 4


def test_ring_push_out_of_order_is_an_error(ring_pair):
    t, drafter, _, B = ring_pair
    s = _core.Spec(t, str(drafter), block_size=B, ring_capacity=8)
    f = np.zeros((2, len(s.tap_layers), t.n_embd), np.float32)
    with pytest.raises(ValueError, match="in order"):
        _core.testing.push_features(s, f, 3)


def test_window_limits_what_the_drafter_sees(pair):
    """A drafter window W equals a ring whose older positions were never there."""
    t, s = make(pair, B=4, capacity=64, window=5)
    last = s.prefill(PROMPT)
    windowed = _core.testing.draft_logits(s, last, 4, t)
    t2, s2 = make(pair, B=4, capacity=5)  # a ring of capacity 5 holds exactly the last 5 positions
    last2 = s2.prefill(PROMPT)
    assert last2 == last
    np.testing.assert_allclose(_core.testing.draft_logits(s2, last, 4, t2), windowed, atol=1e-5, rtol=0)


TRAINED = 12  # a trained context shorter than the generations below


@pytest.fixture(scope="module")
def trained_pair(pair, tmp_path_factory):
    """The pair's target with a drafter whose config.json records a trained context of TRAINED."""
    d = tmp_path_factory.mktemp("trained-" + pair["name"])
    arch, t_over, d_over = PAIRS[pair["name"]]
    dg = make_random_drafter_gguf(d / "drafter.gguf", pair["ckpt"], outtype="f32", seed=6, block_size=16,
                                  target_gguf=pair["target"], ckpt_dir=d / "drafter",
                                  dflash_config={"trained_context_length": TRAINED}, **d_over)
    return {**pair, "drafter": dg, "drafter_ckpt": d / "drafter"}


def test_trained_context_round_trips_to_the_engine(trained_pair):
    """config.json dflash_config.trained_context_length -> GGUF key -> the engine's default window;
    an explicit window overrides it, and the ring holds no more than the window."""
    from gguf import GGUFReader

    field = GGUFReader(trained_pair["drafter"]).fields["dflash.trained_context_length"]
    assert field.contents() == TRAINED
    t, s = make(trained_pair, B=4, capacity=64)
    assert s.trained_context_length == TRAINED and s.window == TRAINED and s.ring_capacity == TRAINED
    t, s = make(trained_pair, B=4, capacity=64, window=30)
    assert s.window == 30 and s.ring_capacity == 30
    t, s = make(trained_pair, B=4, capacity=8)  # a smaller ring still bounds what a draft sees
    assert s.window == 8 and s.ring_capacity == 8
    t, s = make(trained_pair, B=4, capacity=64, window=3)
    assert s.window == 3 and s.ring_capacity == 4  # the ring still holds a block


def test_untrained_drafter_attends_to_the_whole_ring(pair):
    t, s = make(pair, B=4, capacity=64)
    assert s.trained_context_length == 0 and s.window == 64 and s.ring_capacity == 64


@pytest.mark.parametrize("window", [0, 3])
def test_windowed_draft_matches_reference_on_the_window(trained_pair, window):
    """Default window (the trained context: a ring of TRAINED) and an explicit window below the
    block size (the ring holds a block, the mask hides the rest): the draft equals the reference
    drafter given only the window's last W target taps, at their positions."""
    prompt = PROMPT + PROMPT[:7]  # 18 positions > TRAINED
    t, s = make(trained_pair, B=4, capacity=64, window=window)
    W = window or TRAINED
    assert s.window == W
    last = s.prefill(prompt)
    ours = _core.testing.draft_logits(s, last, 4, t)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(trained_pair["ckpt"]), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ref = DFlashRef.from_dirs(trained_pair["drafter_ckpt"], trained_pair["ckpt"])
    feats = target_taps(hf, prompt, trained_pair["taps"])
    lo = len(prompt) - W
    want = ref.forward([last] + [s.mask_token_id] * 3, feats[lo:], ctx_start_pos=lo)[1:]
    diff = np.abs(ours - want).max()
    print(f"{trained_pair['name']} window {W}: max |draft logits - reference on the window| = {diff:.2e}")
    # about 5x the worst case measured over the pairs and windows (F32): 3.6e-6, summation order only
    assert diff < 2e-5
    whole = ref.forward([last] + [s.mask_token_id] * 3, feats)[1:]
    assert np.abs(whole - want).max() > 1e-3  # the older positions would have changed the draft


@pytest.mark.parametrize("window", [None, 5])
def test_lossless_with_the_trained_window(trained_pair, window):
    """Speculative == AR with a window (trained or explicit) far smaller than the generation."""
    eng = dn.Engine(trained_pair["target"], drafter=trained_pair["drafter"], gate=False,
                    block_size=4, drafter_window=window,
                    n_ctx=256, kv_type="f32", n_threads=2)
    ar = eng.generate(PROMPT, max_tokens=60, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=60)
    assert sp.stats.speculative and sp.stats.rounds > 0
    assert sp.tokens == ar.tokens


def test_stop_and_length_inside_a_committed_block(pair):
    """Rounds that commit many tokens at once still stop exactly where AR stops: max_tokens and
    stop strings cut inside the block (drafts forced to the AR continuation: full acceptance)."""
    eng = dn.Engine(pair["target"], drafter=pair["drafter"], gate=False,
                    block_size=8, n_ctx=256, kv_type="f32", n_threads=2)
    ar = eng.generate(PROMPT, max_tokens=40, speculative=False)
    ref = ar.tokens
    eng._draft_override = lambda prompt, out, B: (ref[len(out): len(out) + B - 1] + [0] * B)[: B - 1]
    for n in (1, 5, 13, 40):
        r = eng.generate(PROMPT, max_tokens=n)
        assert r.tokens == ref[:n] and r.stats.stop_reason == "length"
        assert r.stats.rounds <= (n + 7) // 8 + 1
    assert max(i for i, c in enumerate(eng.generate(PROMPT, max_tokens=40).stats.acceptance_histogram) if c) == 8
    text = eng.detokenize(ref)
    assert len(text) > 12
    stop = text[9:12]
    want = eng.generate(PROMPT, max_tokens=40, stop=[stop], speculative=False)
    got = eng.generate(PROMPT, max_tokens=40, stop=[stop])
    assert got.text == want.text and got.stats.stop_reason == want.stats.stop_reason == "stop"


# Q8_0 weights run the package's own batch-invariant matmul (dequantized rows, F32 tiles) on every
# CPU, and the GDN layers run one kernel for AR, verify and replay, so speculative decoding must be
# bitwise AR, with no near-tie slack: verify logits, every cache, every token. (Every other weight
# type: tests/test_quantized.py.)
Q8_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32, num_attention_heads=4,
                num_key_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4)


@pytest.fixture(scope="module")
def q8_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("q8")
    ckpt = make_random_checkpoint(d / "target", "qwen3_5", seed=21, **Q8_SHAPE)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="q8_0")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="q8_0", seed=22, target_gguf=tg, block_size=8,
                                  num_hidden_layers=1, target_layer_ids=[0, 2], head_dim=32)
    return tg, dg


def test_q8_0_verify_and_rollback_are_bitwise(q8_pair):
    tg, dg = q8_pair
    t = _core.Target(str(tg), n_ctx=128, n_threads=2, max_verify=8)
    block = [int(x) for x in np.random.default_rng(1).integers(3, 500, 8)]
    t.reset()
    t.decode(PROMPT)
    steps = np.concatenate([t.decode([x]) for x in block])
    for n_keep in (1, 3, 8):
        t.reset()
        t.decode(PROMPT)
        ver = t.verify(block)
        np.testing.assert_array_equal(ver, steps)
        t.commit(n_keep)
        got = caches(t)
        t.reset()
        t.decode(PROMPT)
        for x in block[:n_keep]:
            t.decode([x])
        for a, b in zip(got, caches(t)):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def test_q8_0_speculative_is_bitwise_ar(q8_pair):
    tg, dg = q8_pair
    eng = dn.Engine(tg, drafter=dg, gate=False, block_size=8, feature_ring_capacity=20, n_ctx=256, n_threads=2)
    ar = eng.generate(PROMPT, max_tokens=80, speculative=False)
    assert eng.generate(PROMPT, max_tokens=80).tokens == ar.tokens
    rng = np.random.default_rng(0)
    ref = ar.tokens
    eng._draft_override = lambda p, out, B: [tok if rng.random() > 0.2 else (tok + 1) % 500
                                             for tok in (ref[len(out): len(out) + B - 1] + [0] * B)[: B - 1]]
    r = eng.generate(PROMPT, max_tokens=80)
    assert r.tokens == ar.tokens
    assert r.stats.mean_acceptance_length > 2  # the injected error rate leaves long accepted runs


@pytest.mark.parametrize("mode", ["tape", "snapshot", "redecode"])
def test_rollback_baselines_are_exact_too(q8_pair, mode):
    """The benchmark baselines (per-token snapshots, re-decode) roll back to the same bits."""
    tg, dg = q8_pair
    eng = dn.Engine.for_benchmark(tg, drafter=dg, gate=False, block_size=8, n_ctx=256, n_threads=2, rollback=mode)
    ar = eng.generate(PROMPT, max_tokens=40, speculative=False).tokens
    rng = np.random.default_rng(1)
    eng._draft_override = lambda p, out, B: [tok if rng.random() > 0.3 else (tok + 1) % 500
                                             for tok in (ar[len(out): len(out) + B - 1] + [0] * B)[: B - 1]]
    r = eng.generate(PROMPT, max_tokens=40)
    assert r.tokens == ar and r.stats.mean_acceptance_length > 1.5


def test_unknown_rollback_mode(q8_pair):
    with pytest.raises(ValueError, match="rollback must be"):
        dn.Engine.for_benchmark(q8_pair[0], drafter=q8_pair[1], rollback="undo")


def test_baselines_are_not_engine_arguments(q8_pair):
    """The baselines are reached through Engine.for_benchmark only, not the documented constructor."""
    for kw in (dict(rollback="snapshot"), dict(matmul="ggml")):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            dn.Engine(q8_pair[0], drafter=q8_pair[1], **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        dn.Engine(q8_pair[0], _baselines={"rollback": "snapshot"})  # no hidden route either
    for kw in (dict(rollback="snapshot"), dict(matmul="ggml")):
        with pytest.raises(TypeError, match="incompatible constructor arguments"):
            _core.Target(q8_pair[0], n_ctx=32, **kw)


def test_eos_inside_a_committed_block(tmp_path):
    """A round that commits past the end-of-generation token stops exactly where AR stops."""
    ckpt = make_random_checkpoint(tmp_path / "t", "qwen3_5", seed=5)
    tg = convert_hf_to_gguf(ckpt, tmp_path / "t.gguf", outtype="f32")
    dg = make_random_drafter_gguf(tmp_path / "d.gguf", ckpt, outtype="f32", seed=6, block_size=8, target_gguf=tg)
    eng = dn.Engine(tg, drafter=dg, gate=False, n_ctx=256, kv_type="f32", n_threads=2)
    prompt = [int(t) for t in np.random.default_rng(26).integers(3, 600, 11)]  # found to end with EOS after 18
    ar = eng.generate(prompt, max_tokens=120, speculative=False)
    assert ar.stats.stop_reason == "eos" and len(ar.tokens) < 60
    full = ar.tokens + [eng.tokenizer.eos_token_id] + [5] * 16  # the continuation, EOS included
    eng._draft_override = lambda p, out, B: full[len(out): len(out) + B - 1]
    sp = eng.generate(prompt, max_tokens=120)
    assert sp.tokens == ar.tokens and sp.text == ar.text and sp.stats.stop_reason == "eos"
    assert sp.stats.mean_acceptance_length > 2


@pytest.mark.parametrize("cutoff", [0.02, 0.5, 1.0])
def test_draft_cutoff_is_lossless(pair, cutoff):
    """A confidence cut shortens the verify pass (down to `last` alone at cutoff 1) and never
    changes the output."""
    eng = dn.Engine(pair["target"], drafter=pair["drafter"], gate=False,
                    block_size=16, n_ctx=256, kv_type="f32", n_threads=2,
                    draft_cutoff=cutoff)
    ar = eng.generate(PROMPT, max_tokens=48, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=48)
    assert sp.tokens == ar.tokens
    assert 1.0 <= sp.stats.mean_acceptance_length <= sp.stats.mean_verified_length <= 16
    if cutoff == 1.0:  # a top-1 probability is < 1: no draft survives
        assert sp.stats.mean_verified_length == 1.0
    eng.draft_cutoff = 0.0
    full = eng.generate(PROMPT, max_tokens=48)
    assert full.tokens == ar.tokens and full.stats.mean_verified_length == 16.0


def test_draft_cutoff_keeps_the_confident_prefix(pair):
    """The verified drafts are the drafter's argmax while the running product of its top-1
    probabilities (softmax of draft_logits) stays >= the cutoff."""
    t, s = make(pair, B=16)
    last = s.prefill(PROMPT)
    logits = _core.testing.draft_logits(s, last, 16, t).astype(np.float64)                # [15, n_vocab]
    top1 = 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
    cum = np.cumprod(top1)
    for k in (0, 4, 15):
        s.prefill(PROMPT)
        s.draft_cutoff = 0.0 if k == 15 else float(np.sqrt(cum[k - 1] * cum[k]) if k else (1 + cum[0]) / 2)
        r = s.round(last, 16)
        assert r.n_verified == k + 1
        assert r.draft == [int(i) for i in logits.argmax(-1)[:k]]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="draft_cutoff"):
            s.draft_cutoff = bad
        with pytest.raises(ValueError, match="draft_cutoff"):
            dn.Engine(pair["target"], drafter=pair["drafter"], n_ctx=64, draft_cutoff=bad)


@pytest.fixture(scope="module")
def vocab_pair(pair, tmp_path_factory):
    """The same drafter (same seed) with a draft vocabulary of every other token id, less the
    tokens the whole-vocabulary drafter picks for PROMPT (so that the restriction shows)."""
    _, _, d_over = PAIRS[pair["name"]]
    t, s = make(pair, B=16)
    picked = set(s.draft(s.prefill(PROMPT), 16))
    ids = [i for i in range(3, t.n_vocab, 2) if i not in picked]
    d = tmp_path_factory.mktemp("vocab-" + pair["name"])
    dg = make_random_drafter_gguf(d / "drafter.gguf", pair["ckpt"], outtype="f32", seed=6, block_size=16,
                                  target_gguf=pair["target"], draft_vocab=ids, **d_over)
    return {**pair, "drafter": dg, "ids": ids}


def test_draft_vocab_drafts_its_argmax(vocab_pair):
    """With dflash.draft_vocab, a draft is the argmax over those rows of the lm_head (draft_logits
    still gives the whole vocabulary), through the argmax and the top-1/cutoff paths alike;
    draft_vocab=False drafts over the whole vocabulary again."""
    ids = np.array(vocab_pair["ids"])
    t, s = make(vocab_pair, B=16)
    assert s.draft_vocab == vocab_pair["ids"]
    last = s.prefill(PROMPT)
    logits = _core.testing.draft_logits(s, last, 16, t)                                  # [15, n_vocab]
    want = [int(i) for i in ids[logits[:, ids].argmax(-1)]]
    assert not set(want) & set(int(i) for i in logits.argmax(-1))         # the restriction matters here
    assert s.draft(last, 16) == want
    s.prefill(PROMPT)
    s.draft_cutoff = 1e-30                                                 # the top-1 path, every draft kept
    assert s.round(last, 16).draft == want
    full = _core.Spec(t, str(vocab_pair["drafter"]), block_size=16, ring_capacity=64, draft_vocab=False)
    assert full.draft_vocab == []
    last = full.prefill(PROMPT)
    assert full.draft(last, 16) == [int(i) for i in logits.argmax(-1)]


@pytest.mark.parametrize("cutoff", [0.0, 0.05])
def test_draft_vocab_is_lossless(vocab_pair, cutoff):
    eng = dn.Engine(vocab_pair["target"], drafter=vocab_pair["drafter"], gate=False,
                    block_size=8, n_ctx=256, kv_type="f32",
                    n_threads=2, draft_cutoff=cutoff)
    ar = eng.generate(PROMPT, max_tokens=60, speculative=False)
    sp = eng.generate(PROMPT, max_tokens=60)
    assert sp.stats.rounds > 0 and sp.tokens == ar.tokens
