"""The seeded sampler (csrc/sampler.{h,cpp}) against its plain reference (tests/reference/sampling_ref.py),
and the distribution it draws from.

The C++ sampler must agree with the reference exactly (same token, same kept set), including tied
logits and -inf entries; its draws over many seeds must follow softmax(filtered logits / T).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_native import _core
from reference import sampling_ref as ref

T = _core.testing

KAT = [  # Random123's known-answer vectors for Philox4x32-10: (counter, key, output)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    assert tuple(T.philox4x32_10(list(ctr), list(key))) == expected
    assert tuple(int(w) for w in ref.philox4x32_10(ctr, key)) == expected


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64))
def test_gumbel_noise_matches_reference(seed, pos, tokens):
    """G(seed, pos, token) bit for bit, with seeds and positions past 32 bits (both key/counter words)."""
    ours = T.gumbel(seed, pos, np.array(tokens, dtype=np.int32))
    assert np.array_equal(ours, ref.gumbel(seed, pos, tokens))
    assert np.all(np.isfinite(ours)) and ours.min() > -3.7 and ours.max() < 36.5


def _sampling(temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    return _core.Sampling(temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)


# Logits with many exact ties (small integers, halves) or spread floats, some -inf.
_logit = st.one_of(st.integers(-6, 6).map(lambda x: x / 2),
                   st.floats(-30, 30, allow_nan=False, width=32),
                   st.just(-math.inf))
_row = st.lists(_logit, min_size=1, max_size=120).filter(lambda r: any(x > -math.inf for x in r))
_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.05, 0.3, 0.7, 1.0, 1.5, 7.0]),
    "top_k": st.sampled_from([0, 1, 2, 5, 40]),
    "top_p": st.sampled_from([1.0, 0.999, 0.95, 0.5, 0.1, 1e-6]),
    "min_p": st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.99]),
})


@given(_row, _params, st.integers(0, 2**64 - 1), st.integers(0, 5000))
def test_sampler_matches_reference(row, params, seed, pos):
    logits = np.array(row, dtype=np.float32)
    s = _sampling(seed=seed, **params)
    kept = ref.filter_kept(logits, params["top_k"], params["top_p"], params["min_p"])
    assert T.sample_filter(logits, s) == kept
    tok, logprob = T.sample(logits, s, pos)
    assert tok == ref.sample(logits, seed=seed, pos=pos, **params)
    assert tok in kept and logits[tok] > -np.inf
    p = ref.kept_probs(logits, **params)
    if p[tok] > 1e-280:  # the float64 reference underflows below that
        assert math.isclose(logprob, math.log(p[tok]), rel_tol=1e-9, abs_tol=1e-9)


@given(_row, _params, st.integers(0, 2**64 - 1), st.integers(0, 5000), st.randoms(use_true_random=False))
def test_sampler_with_token_ids_matches_reference(row, params, seed, pos, rnd):
    """A drafter's draft vocabulary: entry i is token ids[i] (ascending); the noise follows the id."""
    logits = np.array(row, dtype=np.float32)
    ids = np.array(sorted(rnd.sample(range(4 * len(row) + 10), len(row))), dtype=np.int32)
    tok, _ = T.sample(logits, _sampling(seed=seed, **params), pos, ids)
    assert tok == ref.sample(logits, seed=seed, pos=pos, ids=ids, **params)


def test_ties_go_to_the_lower_token_id():
    """top-k among equal logits keeps the lower ids; the draw never leaves the kept set."""
    logits = np.zeros(10, dtype=np.float32)
    assert T.sample_filter(logits, _sampling(1.0, top_k=3)) == [0, 1, 2]
    draws = {T.sample(logits, _sampling(1.0, top_k=3, seed=s), 7)[0] for s in range(200)}
    assert draws == {0, 1, 2}


def test_minus_inf_is_never_drawn():
    logits = np.full(50, -np.inf, dtype=np.float32)
    logits[[3, 17, 40]] = [0.0, 5.0, -20.0]
    draws = T.sample_seeds(logits, _sampling(100.0), np.arange(2000, dtype=np.uint64), 3)
    assert set(draws.tolist()) == {3, 17, 40}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_raise(bad):
    logits = np.zeros(20, dtype=np.float32)
    logits[5] = bad
    with pytest.raises(RuntimeError, match="non-finite logits"):
        T.sample(logits, _sampling(1.0), 0)


def test_all_minus_inf_raises():
    with pytest.raises(RuntimeError, match="every logit is -inf"):
        T.sample(np.full(8, -np.inf, dtype=np.float32), _sampling(1.0), 0)


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=1.0, top_k=-1), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"), (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, min_p=1.0), "min_p"), (dict(temperature=1.0, min_p=-0.1), "min_p"),
])
def test_bad_settings_raise(kw, match):
    with pytest.raises(ValueError, match=r"\[sampling\] " + match):
        _core.Sampling(**kw)


def test_greedy_settings_do_not_sample():
    with pytest.raises(ValueError, match="temperature > 0"):
        T.sample(np.zeros(4, dtype=np.float32), _sampling(0.0), 0)


# ---- the distribution --------------------------------------------------------------------------

N_SEEDS = 20_000
ALPHA = 1e-3  # fixed significance; the seeds are fixed too, so the outcome is deterministic


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of counts against probs, bins with expected count < 5 pooled into one."""
    from scipy.stats import chi2

    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any():
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b, dtype=np.float64), np.array(exp_b)
    keep = exp_b > 0
    stat = float((((obs_b - exp_b) ** 2)[keep] / exp_b[keep]).sum())
    return float(chi2.sf(stat, keep.sum() - 1))


@pytest.fixture(scope="module")
def tiny_logits(gguf_model):
    """The last-row logits of a tiny random Qwen3.5 on a fixed prompt, scaled up so that the
    distribution is far from uniform (a random tiny model's raw logits are nearly flat)."""
    import dflash_native as dn

    eng = dn.Engine(gguf_model("qwen3_5"), n_ctx=64, n_threads=2)
    prompt = [5, 17, 301, 42, 9]
    logits = eng.eval(prompt)[-1]
    eng.close()
    return np.ascontiguousarray(logits * (4.0 / logits.std()), dtype=np.float32), prompt


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.3), dict(temperature=0.7, top_k=20),
    dict(temperature=1.5, top_p=0.9), dict(temperature=0.7, min_p=0.05),
    dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02),
])
def test_draws_follow_the_filtered_softmax(tiny_logits, params):
    """Over 20,000 fixed seeds the first sampled token's histogram matches softmax(kept / T)
    (chi-square at a fixed significance), and nothing outside the kept set is ever drawn."""
    logits, prompt = tiny_logits
    seeds = np.arange(N_SEEDS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    draws = T.sample_seeds(logits, _sampling(**params), seeds, len(prompt))
    counts = np.bincount(draws, minlength=len(logits))
    probs = ref.kept_probs(logits, **params)
    assert counts[probs == 0].sum() == 0
    p = chi_square_p_value(counts, probs)
    assert p > ALPHA, (params, p)


def test_chi_square_rejects_a_wrong_temperature(tiny_logits):
    """The test above can fail: the draws at T = 1 against the softmax at T = 0.8 are rejected."""
    logits, prompt = tiny_logits
    seeds = np.arange(N_SEEDS, dtype=np.uint64)
    counts = np.bincount(T.sample_seeds(logits, _sampling(1.0), seeds, len(prompt)), minlength=len(logits))
    assert chi_square_p_value(counts, ref.kept_probs(logits, temperature=0.8)) < ALPHA


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.5, top_p=0.95),
                                    dict(temperature=0.05, min_p=0.001)])
def test_pruned_draw_equals_reference_on_a_large_vocabulary(params):
    """Over several 256-token blocks the draw skips the logs for tokens that cannot win; it must
    still pick the plain argmax over every kept token (the reference computes every score)."""
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(5000) * 4).astype(np.float32)
    logits[rng.integers(0, 5000, 50)] = -np.inf
    for seed in range(25):
        s = _sampling(seed=seed * 7919 + 3, **params)
        assert T.sample(logits, s, 123)[0] == ref.sample(logits, seed=s.seed, pos=123, **params)


# ---- the vectorised paths: every ISA, large rows ---------------------------------------------------

@pytest.fixture(params=T.matmul_isas())
def each_isa(request):
    """Runs the test with the package's kernels capped at each ISA this machine runs."""
    import dflash_native as dn

    dn.set_isa(request.param)
    yield request.param
    dn.set_isa("")


def test_noise_block_matches_reference(each_isa):
    """The draw's block Philox (AVX-512: 4 x 16 lanes in registers, masked tails) gives the scalar
    definition's bits for every length and for seeds and positions past 32 bits."""
    rng = np.random.default_rng(11)
    for n in [1, 7, 15, 16, 17, 63, 64, 65, 100, 255, 256, 257, 1000]:
        tokens = rng.integers(0, 2**31 - 1, n).astype(np.int32)
        seed, pos = int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 2**40))
        assert np.array_equal(T.noise_bits(seed, pos, tokens), ref.noise_bits(seed, pos, tokens)), (each_isa, n)


def _large_rows(rng):
    """4096-entry rows the small hypothesis rows do not reach: broad and peaked, spans past the
    filter's 64-nat bucket range, logits on the bucket edges (multiples of 1/8) with many ties,
    and -inf entries (the kept list is then not every entry)."""
    yield (rng.standard_normal(4096) * 2).astype(np.float32)  # broad
    yield (rng.standard_normal(4096) * 8).astype(np.float32)  # peaked
    yield (rng.standard_normal(4096) * 40).astype(np.float32)  # spans > 64 nats
    yield (rng.integers(-80, 8, 4096) / 8).astype(np.float32)  # ties on the bucket edges
    row = (rng.standard_normal(4096) * 3).astype(np.float32)
    row[rng.integers(0, 4096, 700)] = -np.inf
    yield row


@pytest.mark.parametrize("params", [
    dict(top_p=0.95), dict(top_p=0.5), dict(top_p=0.999), dict(top_p=1e-6), dict(top_k=40),
    dict(top_k=1000), dict(top_k=3000, top_p=0.9), dict(top_k=50, top_p=0.95, min_p=0.02), dict(min_p=0.001),
])
def test_filters_on_large_rows_match_reference(each_isa, params):
    """The bucketed top-k / top-p selection (sorting only the bucket where the cut falls) keeps the
    reference's set, which sorts every token; the draws agree as well."""
    rng = np.random.default_rng(3)
    for r, logits in enumerate(_large_rows(rng)):
        s = _sampling(0.7, seed=r + 1, **params)
        assert T.sample_filter(logits, s) == ref.filter_kept(logits, **params), (each_isa, r)
        for pos in (5, 4000):
            assert T.sample(logits, s, pos)[0] == ref.sample(logits, temperature=0.7, seed=r + 1, pos=pos, **params)


def test_pruned_draws_match_reference_at_every_isa(each_isa):
    """The pruning ladder and its vector pre-test skip tokens that cannot win; the draw still
    equals the reference's plain argmax over every kept token."""
    rng = np.random.default_rng(5)
    for r, logits in enumerate(_large_rows(rng)):
        for temp in (0.05, 0.7, 1.5):
            seed = 1000 * r + int(temp * 100)
            s = _sampling(temp, seed=seed)
            assert T.sample(logits, s, 77)[0] == ref.sample(logits, temperature=temp, seed=seed, pos=77), (each_isa, r, temp)


@pytest.mark.parametrize("temperature", [1e-37, 1e-38, 1e-39, 1e-45, 1e-300])
def test_tiny_temperature_draws_match_reference(each_isa, temperature):
    """A temperature so small that 1 / T or l / T overflows a float (the pruning pre-test then
    computes inf - inf or 0 * inf: NaN) must neither read outside the ladder nor skip a token: the
    draw is the reference's (the argmax, ties to the lower index)."""
    rng = np.random.default_rng(13)
    logits = np.array([10.0, 0.0, 9.0, 10.0, -3.0] * 200, dtype=np.float32)
    logits[rng.integers(0, len(logits), 50)] = rng.standard_normal(50).astype(np.float32)
    for seed in range(5):
        s = _sampling(temperature, seed=seed)
        assert T.sample(logits, s, 9)[0] == ref.sample(logits, temperature=temperature, seed=seed, pos=9)
