"""llama.cpp's llama-server as the benchmarks' peer (bench/_llamacpp_server.py): started as a real
process on a tiny random pair, with and without its DFlash, from concurrent clients.

These tests run only where the binary is already built for the pinned llama.cpp sources
(`python bench/_llamacpp_server.py` builds it, minutes); they never build it, and are skipped
(reported as skipped) otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _llamacpp_server import (LlamaServer, accept_length, built_llama_server, run_clients,  # noqa: E402
                              spec_type)
from fixtures import make_random_pair  # noqa: E402

EXE = built_llama_server()
pytestmark = pytest.mark.skipif(EXE is None, reason="llama-server is not built for the pinned sources "
                                                    "(python bench/_llamacpp_server.py builds it)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_random_pair(tmp_path_factory.mktemp("peer"), seed=7, block_size=8, outtype="f32")


def test_spec_type_reads_the_drafter(pair):
    target, drafter = pair
    assert spec_type(drafter) == "draft-dflash"
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        spec_type(target)


def test_llama_server_ar_and_dflash(pair):
    import dflash_native as dn

    target, drafter = pair
    prompts = [[5, 17, 99, 3, 240, 61, 8], [300, 12, 7, 7, 45], [2, 90, 150, 33, 71, 18, 4, 200], [11, 250, 6]]
    n = 24
    eng = dn.Engine(target, n_ctx=128)
    vocab = eng.n_vocab
    eng.close()
    with LlamaServer(target, parallel=2, threads=1, ctx_per_slot=128, binary=EXE) as ar, \
            LlamaServer(target, parallel=2, threads=1, ctx_per_slot=128, drafter=drafter, draft_max=7,
                        binary=EXE) as sp:
        assert ar.spec_type is None and sp.spec_type == "draft-dflash"
        per_client = [prompts[:2], prompts[2:]]
        got_ar, wall = run_clients(ar, per_client, n)
        assert wall > 0 and len(got_ar) == 4
        before = sp.spec_counters()
        got_sp, _ = run_clients(sp, per_client, n)
        after = sp.spec_counters()
        for r in got_ar + got_sp:
            assert 1 <= len(r["tokens"]) <= n and all(0 <= t < vocab for t in r["tokens"])
            assert r["latency_s"] > 0 and r["timings"]["predicted_n"] == len(r["tokens"])
        # the speculative server speculated: rounds of at most 7 drafts, counted by /metrics
        assert after["rounds"] > before["rounds"]
        assert 0 < after["drafted"] - before["drafted"] <= 7 * (after["rounds"] - before["rounds"])
        assert sum(int(r["timings"].get("draft_n", 0)) for r in got_sp) == after["drafted"] - before["drafted"]
        assert 1.0 <= accept_length(before, after) <= 8.0
        assert ar.spec_counters()["rounds"] == 0
        proc = sp.proc
    assert proc.poll() is not None  # closed with its block
