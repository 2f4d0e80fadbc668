"""The draft pass's cost per drafter kind over DFlash's, side by side (issue 36).

One random target (the 0.5B-shaped hybrid, or --tiny) and one random drafter of each kind with
the same backbone (same seed, layers, heads, taps): DFlash; DFlash 2 (two-tap dynamic convs,
selector rank 64, top-k 8); DSpark (Markov rank 64, confidence head, anchor-first). Per kind, one
Spec on the same target context; the reps alternate the kinds. Measured: the greedy draft pass
(`Spec.draft`: the block, the head, and DFlash 2's lattice read-back and walk) and the top-1 pass
the controller and draft_cutoff use (`_core.testing.draft_top1`), median ms, and each over DFlash's.

Random drafters say nothing about acceptance: tokens per round and speedups per kind need trained
drafters (train-drafter has no --kind yet), so this script measures cost only.

    python bench/drafters.py --json bench/results/drafters.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import CACHE, bench_target, cached_gguf, git_rev, isa, machine, summarize, write_jsonl  # noqa: E402

KINDS = {
    "dflash": dict(kind="dflash"),
    "dflash2": dict(kind="dflash2", dflash_config={"conv_kernel_size": 2, "conv_group_size": 64, "selector_rank": 64,
                                                    "selector_top_k": 8}),
    "dspark": dict(kind="dspark", markov_rank=64, confidence_head=True),
}


def kind_drafter(target_name: str, shape: dict, kind: str, block_size: int, n_layers: int) -> Path:
    """A random drafter of `kind` for the cached target (same seed and backbone for every kind)."""
    from dflash_native.random_models import make_random_drafter_gguf

    path = CACHE / f"{target_name}-{kind}{n_layers}-b{block_size}-f16.gguf"
    if not path.exists():
        from dflash_native.random_models import target_config

        cfg = dict(target_config("qwen3_5", shape), mask_token_id=shape["vocab_size"] - 1)
        n = cfg["num_hidden_layers"]
        ids = [1, n // 2, n - 2] if n_layers > 1 else [n // 2]
        tmp = path.with_suffix(".tmp.gguf")
        heads = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=cfg["hidden_size"] // 8)
        make_random_drafter_gguf(tmp, cfg, outtype="f16", seed=1, block_size=block_size, num_hidden_layers=n_layers,
                                 target_layer_ids=ids, **heads, **KINDS[kind])
        tmp.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a smoke-run size")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1, help="drafter layers")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from dflash_native import _core

    name, arch, shape = bench_target(moe=False, tiny=a.tiny)
    target = cached_gguf(name, arch, "f16", **shape)
    drafters = {k: kind_drafter(name, shape, k, a.block, a.layers) for k in KINDS}
    prompt = list(range(10, 138))
    specs = {}  # one target per kind: a target's graph plans are keyed by shape, one drafter's each
    for k, path in drafters.items():
        t = _core.Target(str(target), n_ctx=512, kv_type="f16", max_verify=a.block, n_threads=a.threads)
        specs[k] = (t, _core.Spec(t, str(path), block_size=a.block, ring_capacity=256))
    times = {(k, m): [] for k in KINDS for m in ("draft", "top1")}
    for rep in range(a.reps + 1):  # rep 0: warm-up (plans, caches)
        for k, (_, s) in specs.items():
            last = s.prefill(prompt)  # the same context for every kind
            for m, f in (("draft", lambda: s.draft(last, a.block)), ("top1", lambda: _core.testing.draft_top1(s, last, a.block))):
                t0 = time.perf_counter()
                f()
                if rep:
                    times[k, m].append(time.perf_counter() - t0)
    base = {m: summarize(times["dflash", m])["median"] for m in ("draft", "top1")}
    rows = []
    print(f"target {name}, drafter layers {a.layers}, B = {a.block}, {a.threads} threads, {a.reps} reps")
    print(f"{'kind':8} {'draft ms':>9} {'x DFlash':>9} {'top1 ms':>9} {'x DFlash':>9}")
    for k in KINDS:
        d, p = (summarize(times[k, m])["median"] for m in ("draft", "top1"))
        print(f"{k:8} {d * 1e3:9.2f} {d / base['draft']:9.3f} {p * 1e3:9.2f} {p / base['top1']:9.3f}")
        rows.append(dict(bench="drafters", kind=k, target=name, block=a.block, layers=a.layers, threads=a.threads,
                         draft_ms=d * 1e3, draft_x_dflash=d / base["draft"], top1_ms=p * 1e3,
                         top1_x_dflash=p / base["top1"], machine=machine(), isa=isa(), rev=git_rev()))
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
