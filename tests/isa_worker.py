"""tests/test_isa.py's worker: runs the engines of a list of pairs in this process, whose own
kernels run the ISA that DFLASH_NATIVE_ISA (read once, at the first use) allows, and saves what
they computed, for the parent to compare bit for bit across ISAs.

    DFLASH_NATIVE_ISA=avx2 python tests/isa_worker.py cases.json out.npz

cases.json: [{"name": ..., "target": path, "drafter": path}, ...]. out.npz: per case `<name>/<what>`
arrays (logits, draft logits, token ids, log-probabilities), plus `isa` and `matmul_isa`.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import dflash_native as dn
from dflash_native import _core

BLOCK = 8
PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 12)]
N_GEN = 40
SAMPLED = dict(temperature=0.9, top_k=40, seed=7, logprobs=3)


def run_case(c: dict) -> dict:
    out = {}
    eng = dn.Engine(c["target"], drafter=c["drafter"], block_size=BLOCK, feature_ring_capacity=24, n_ctx=160,
                    n_threads=2, gate=False)
    out["eval"] = eng.eval(PROMPT)  # a batch of 12 tokens: the verify-sized matmuls
    for spec in (False, True):
        tag = "spec" if spec else "ar"
        g = eng.generate(PROMPT, max_tokens=N_GEN, speculative=spec)
        out[f"{tag}_greedy"] = np.array(g.tokens, np.int64)
        s = eng.generate(PROMPT, max_tokens=N_GEN, speculative=spec, **SAMPLED)
        out[f"{tag}_sampled"] = np.array(s.tokens, np.int64)
        out[f"{tag}_sampled_logprobs"] = np.array([lp.logprob for lp in s.logprobs], np.float32)
        out[f"{tag}_sampled_top"] = np.array([[v for _, v in lp.top] for lp in s.logprobs], np.float32)
        if spec:
            out["spec_rounds"] = np.array([g.stats.rounds, s.stats.rounds])
        out["stats_isa"] = np.array(g.stats.isa)
    eng.close()
    t = _core.Target(str(c["target"]), n_ctx=64, max_verify=BLOCK, n_threads=2)
    sp = _core.Spec(t, str(c["drafter"]), block_size=BLOCK, ring_capacity=32, window=0)
    out["draft"] = np.asarray(_core.testing.draft_logits(sp, sp.prefill(PROMPT), BLOCK, t))
    return out


def main() -> int:
    cases = json.loads(open(sys.argv[1]).read())
    arrays = {"isa": np.array(dn.isa()), "matmul_isa": np.array(_core.testing.matmul_isa())}
    for c in cases:
        for k, v in run_case(c).items():
            arrays[f"{c['name']}/{k}"] = v
    np.savez(sys.argv[2], **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
