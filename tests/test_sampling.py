"""Sampled generation through the engine: speculative output equals AR output at the same seed,
bit for bit, and the seed alone decides the output.

Pairs are random tiny models written by the package's converters (dense Qwen3 and hybrid Qwen3.5)
and the embedded default pair, all on the package's batch-invariant kernels (matmul="own"), under
which a verify row's logits are the AR step's bit for bit: so no near-tie rule here.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.convert import convert_hf_to_gguf
from fixtures import SPEC_PAIRS, make_random_checkpoint, make_random_drafter_gguf, make_spec_pair

PAIRS = {k: SPEC_PAIRS[k] for k in ("qwen3", "qwen35")}

PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 9)]

SETTINGS = [
    dict(temperature=0.3), dict(temperature=0.7), dict(temperature=1.0), dict(temperature=1.5),
    dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=3.0), dict(temperature=3.0, top_k=10, min_p=0.01),  # flat enough for coupled drafts to be accepted
]


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    _, tg, dg = make_spec_pair(tmp_path_factory.mktemp("sampling-" + request.param), request.param, seed=11)
    return tg, dg


def engine(pair, **kw):
    """Fixed rounds (gate=False) unless a test asks for the controller: these tests are about rounds."""
    kw.setdefault("gate", False)
    return dn.Engine(pair[0], drafter=pair[1], n_ctx=256, kv_type="f32", n_threads=2, **kw)


@pytest.mark.parametrize("B,capacity", [(2, 8), (3, 13), (16, 16)])
@pytest.mark.parametrize("si", range(len(SETTINGS)))
def test_sampled_speculative_equals_sampled_ar(pair, B, capacity, si):
    """Every setting, block size and ring capacity (all below the 48 generated tokens), two seeds
    each (one past 2^63): the speculative tokens are the AR tokens."""
    eng = engine(pair, block_size=B, feature_ring_capacity=capacity)
    for seed in (1000 + si, 2**63 + si):
        kw = dict(max_tokens=48, seed=seed, **SETTINGS[si])
        ar = eng.generate(PROMPT, speculative=False, **kw)
        sp = eng.generate(PROMPT, **kw)
        assert sp.stats.speculative and sp.stats.rounds > 0 and sp.stats.seed == seed
        assert sp.tokens == ar.tokens, (seed, SETTINGS[si])
        assert len(sp.tokens) == 48 or sp.stats.stop_reason == "eos"  # a sampled EOS ends both alike


def test_acceptance_happens(pair):
    """The coupled drafts are accepted at times (at T = 3 the tiny random models' distributions are
    flat enough for the shared noise to decide both draws): the rounds above run their accept and
    rollback paths with natural drafts, not only forced ones."""
    eng = engine(pair, block_size=8)
    hist = np.zeros(9, dtype=int)
    for seed in range(6):
        hist += np.array(eng.generate(PROMPT, max_tokens=48, temperature=3.0, seed=seed).stats.acceptance_histogram)
    assert hist[2:].sum() > 0, hist


@pytest.mark.parametrize("B", [2, 5, 16])
def test_forced_acceptance_lengths_stay_exact(pair, B):
    """Drafts replaced by the sampled AR continuation with errors injected: acceptance lengths
    across 1..B occur and the committed tokens are still sampled AR's."""
    eng = engine(pair, block_size=B)
    kw = dict(max_tokens=60, temperature=0.8, top_p=0.95, seed=77)
    ref = eng.generate(PROMPT, speculative=False, **{**kw, "max_tokens": 80}).tokens
    rng = np.random.default_rng(B)

    def override(prompt, out, Bc):
        good = (ref + [0] * 80)[len(out): len(out) + Bc - 1]
        return [t if rng.random() > 0.2 else (t + 1) % 500 for t in good]

    eng._draft_override = override
    sp = eng.generate(PROMPT, **kw)
    assert sp.tokens == ref[:60]
    if B > 2:
        assert sum(c > 0 for c in sp.stats.acceptance_histogram[1:]) > 2, sp.stats.acceptance_histogram


@pytest.mark.parametrize("cutoff", [0.5, 0.99999])
def test_draft_cutoff_stays_exact(pair, cutoff):
    """The cut multiplies the drafts' probabilities under the drafter's filtered, tempered
    distribution; it changes how many drafts are verified, never the output. (The random
    drafters are confident, p ~ 0.999 per draft: only the high cutoff cuts.)"""
    eng = engine(pair, block_size=8, draft_cutoff=cutoff)
    kw = dict(max_tokens=40, temperature=1.5, seed=5)
    ar = eng.generate(PROMPT, speculative=False, **kw).tokens
    sp = eng.generate(PROMPT, **kw)
    assert sp.tokens == ar
    if cutoff > 0.9:
        assert sp.stats.mean_verified_length < 8, sp.stats.verified_tokens


@pytest.mark.parametrize("ar_s", [1e-3, 1e3])
def test_controller_with_sampling_stays_exact(pair, ar_s):
    """Under the controller (fixed costs: AR made cheap, then dear) sampled rounds, the controller's
    sampled AR steps and its fall-backs commit sampled AR's tokens."""
    eng = engine(pair, block_size=8, gate=True)
    _core.testing.controller_fixed_costs(eng._spec, ar_s, 0.5, 1.0, 0.1)
    kw = dict(max_tokens=60, temperature=3.0, seed=8)
    ar = eng.generate(PROMPT, speculative=False, **kw).tokens
    sp = eng.generate(PROMPT, **kw)
    assert sp.tokens == ar and sp.stats.ar_steps >= 1
    if ar_s < 1:
        assert sp.stats.controller_switches >= 2 and sp.stats.ar_steps > sp.stats.rounds
    else:
        assert sp.stats.controller_switches == 0 and sp.stats.rounds > sp.stats.ar_steps


def test_same_seed_same_output_across_engines_and_threads(pair):
    kw = dict(max_tokens=32, temperature=1.0, top_k=50, seed=123)
    out = set()
    for n_threads in (1, 2):
        for spec in (False, True):
            eng = dn.Engine(pair[0], drafter=pair[1], n_ctx=256, kv_type="f32", n_threads=n_threads, block_size=4)
            out.add(tuple(eng.generate(PROMPT, speculative=spec, **kw).tokens))
            eng.close()
    assert len(out) == 1


def test_different_seeds_differ(pair):
    eng = engine(pair)
    outs = {tuple(eng.generate(PROMPT, max_tokens=24, temperature=3.0, seed=s).tokens) for s in range(8)}
    assert len(outs) == 8


def test_seed_none_is_reported_and_repeats(pair):
    eng = engine(pair)
    r = eng.generate(PROMPT, max_tokens=24, temperature=0.8)
    assert isinstance(r.stats.seed, int) and 0 <= r.stats.seed < 2**64
    assert eng.generate(PROMPT, max_tokens=24, temperature=0.8, seed=r.stats.seed).tokens == r.tokens
    assert eng.generate(PROMPT, max_tokens=24, temperature=0.8, speculative=False,
                        seed=r.stats.seed).tokens == r.tokens


def test_temperature_zero_is_greedy(pair):
    eng = engine(pair)
    g = eng.generate(PROMPT, max_tokens=24)
    z = eng.generate(PROMPT, max_tokens=24, temperature=0.0, top_k=3, top_p=0.5, seed=9)
    assert z.tokens == g.tokens and z.stats.seed is None and g.stats.seed is None


def test_first_draw_is_the_samplers_draw_on_the_logits(pair):
    """The engine's first token is the sampler's draw on the prompt's last logits row at position
    len(prompt): the distribution test of test_sampler.py carries over to generation."""
    eng = engine(pair)
    logits = np.ascontiguousarray(eng.eval(PROMPT)[-1])
    for seed in range(10):
        s = dict(temperature=0.9, top_p=0.9, seed=seed)
        want, _ = _core.testing.sample(logits, _core.Sampling(**s), len(PROMPT))
        for spec in (False, True):
            assert eng.generate(PROMPT, max_tokens=1, speculative=spec, **s).tokens == [want]


def test_stream_and_chat_take_the_settings(pair):
    eng = engine(pair)
    kw = dict(max_tokens=20, temperature=0.9, seed=4)
    want = eng.generate(PROMPT, **kw).tokens
    last = None
    for last in eng.generate(PROMPT, stream=True, **kw):
        pass
    assert last.result.tokens == want
    msgs = [{"role": "user", "content": "hello"}]
    a = eng.chat(msgs, speculative=False, **kw)
    b = eng.chat(msgs, **kw)
    assert a.tokens == b.tokens and b.stats.seed == 4


def test_cli_sampling_flags(pair):
    def run(*extra):
        p = subprocess.run([sys.executable, "-m", "dflash_native", "generate", "--target", str(pair[0]),
                            "--prompt", "hello world", "--max-tokens", "12", "--threads", "2", "--json",
                            "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        import json

        return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr

    a, err = run("--seed", "42")
    assert "sampled with seed 42" in err and a["stats"]["seed"] == 42
    b, _ = run("--seed", "42", "--drafter", str(pair[1]))
    assert a["tokens"] == b["tokens"]
    c, err = run()
    assert c["stats"]["seed"] is not None and f"seed {c['stats']['seed']}" in err


# ---- the embedded default pair ------------------------------------------------------------------

@pytest.mark.parametrize("B,tree", [(4, {}), (16, {}), (16, dict(verify="tree", tree_budget=8)),
                                    (16, dict(verify="tree", tree_budget=32))])
def test_default_pair_sampled_speculative_equals_sampled_ar(B, tree):
    """Chains and sampled trees (children by the drafter's perturbed scores) on the trained pair."""
    from dflash_native.cli import default_pair
    from dflash_native.train.corpus import heldout_prompts

    pair = default_pair()
    assert pair is not None
    eng = dn.Engine(pair[0], drafter=pair[1], n_ctx=512, n_threads=2, block_size=B, **tree)
    acc = []
    for i, p in enumerate(heldout_prompts(2, 96, eng, seed=2)):
        for s in (dict(temperature=0.3), dict(temperature=0.7, top_p=0.95), dict(temperature=1.0, top_k=40)):
            kw = dict(max_tokens=48, seed=31 * i + 7, **s)
            ar = eng.generate(p.text, speculative=False, **kw)
            sp = eng.generate(p.text, **kw)
            assert sp.tokens == ar.tokens, (i, s)
            acc.append(sp.stats.mean_acceptance_length)
    assert max(acc) > 1.0  # drafts were accepted: the rounds ran their rollback


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    arch, t_over, d_over = PAIRS["qwen35"]
    d = tmp_path_factory.mktemp("sampling-joint")
    ckpt = make_random_checkpoint(d / "target", arch, seed=11, **t_over)
    tg = convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32")
    return tg, make_random_drafter_gguf(d / "drafter.gguf", ckpt, outtype="f32", seed=12, block_size=16,
                                        target_gguf=tg, **d_over)


def test_joint_distribution_of_two_tokens_with_the_drafter(hybrid_pair):
    """The first two tokens of speculative generation (the prefill's draw, then the first round's)
    over 20,000 fixed seeds follow P(t1) P(t2 | t1) of the filtered, tempered target softmax
    (chi-square at significance 1e-3; top_k = 6 keeps the joint table small)."""
    from reference import sampling_ref as ref
    from test_sampler import ALPHA, N_SEEDS, chi_square_p_value

    s = dict(temperature=2.0, top_k=6)
    eng = engine(hybrid_pair, block_size=2)
    p1 = ref.kept_probs(eng.eval(PROMPT)[-1], **s)
    first = np.flatnonzero(p1)
    joint = np.zeros((len(p1), len(p1)))
    for t1 in first:
        joint[t1] = p1[t1] * ref.kept_probs(eng.eval(PROMPT + [int(t1)])[-1], **s)
    counts = np.zeros_like(joint)
    spec = eng._spec  # the steps generate() takes, without its per-call Python (checked below)
    for seed in range(N_SEEDS):
        sampling = _core.Sampling(seed=seed * 0x9E3779B1 + 1, **s)
        t1 = spec.prefill(PROMPT, sampling)
        t2 = spec.round(t1, 2, sampling=sampling).committed[0]
        counts[t1, t2] += 1
        if seed < 20:
            assert eng.generate(PROMPT, max_tokens=2, seed=sampling.seed, **s).tokens == [t1, t2]
    assert counts[joint == 0].sum() == 0
    assert chi_square_p_value(counts.ravel(), joint.ravel()) > ALPHA
