"""The op profiler (csrc/base/profile.h) and the per-shape graph plans of graph_runner::run."""
from __future__ import annotations

import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.cli import default_pair


@pytest.fixture(scope="module")
def engine():
    target, drafter = default_pair()
    return dn.Engine(target, drafter=drafter, gate=False, block_size=8, n_ctx=256, n_threads=2)


PROMPT = "def parse(self, text):\n    "


def test_profile_levels(engine):
    ar = engine.generate(PROMPT, max_tokens=24, speculative=False).tokens
    try:
        _core.profile(1)
        sp1 = engine.generate(PROMPT, max_tokens=24).tokens
        rep1 = _core.profile_report()
        _core.profile(2)
        sp2 = engine.generate(PROMPT, max_tokens=24).tokens
        rep2 = _core.profile_report()
    finally:
        _core.profile(0)
    # node-at-a-time compute changes nothing in the output
    assert sp1 == ar and sp2 == ar
    for rep in (rep1, rep2):
        for key in ("target/:build", "target/:alloc", "target/:compute", "draft/:compute", "encode/:compute"):
            calls, seconds = rep[key]
            assert calls >= 1 and seconds > 0.0, key
    assert not any("/" in k and not k.split("/", 1)[1].startswith(":") for k in rep1), "level 1 times no ops"
    # level 2: our custom ops by name, ggml ops by op; the verify passes record the GDN tape; the draft
    # graph ends in DFlash 2's selector lattice (TOP_K), else in top1 under a draft cutoff, else argmax
    last = ("draft/TOP_K" if engine._spec.selector_top_k else "draft/top1" if engine.draft_cutoff > 0
            else "draft/argmax")
    for key in ("target/matmul", "target/attn", "target/gdn_record", "target/RMS_NORM", "draft/matmul", last):
        assert rep2[key][0] >= 1, key
    # off: nothing accumulates
    engine.generate(PROMPT, max_tokens=8)
    assert _core.profile_report() == {}


def test_profile_bad_level():
    with pytest.raises(ValueError, match="level"):
        _core.profile(3)


def test_graph_plans_are_bounded():
    target, _ = default_pair()
    t = _core.Target(str(target), n_ctx=512, n_threads=2)
    for n in range(1, 45):  # 44 prompt lengths: 44 graph shapes
        t.reset()
        t.decode(list(range(1, n + 1)))
        assert 1 <= _core.testing.n_graph_plans(t) <= 32
    assert _core.testing.n_graph_plans(t) == 32
    # a shape whose plan was dropped is planned again and gives the same logits
    t.reset()
    a = t.decode([5, 6, 7])
    for n in range(10, 44):
        t.reset()
        t.decode(list(range(1, n + 1)))
    t.reset()
    b = t.decode([5, 6, 7])
    assert (a == b).all()
