"""The issue-4 pipeline end to end at a chosen budget: tokenizer -> hybrid target -> DFlash drafter
-> GGUF -> speculative decoding on held-out prompts. Prints and (with --json) records the recipe,
the losses and the measured acceptance / speed. Every stage is seeded.

    python bench/train_pair.py --out /tmp/pair --target-steps 120 --drafter-steps 300 --json bench/results/train_pair.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, write_jsonl  # noqa: E402


def main():
    import numpy as np

    import dflash_native as dn
    from dflash_native.train import corpus, pipeline
    from dflash_native.train.target import train_target
    from dflash_native.train.tokenizer import train_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target-steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--drafter-steps", type=int, default=300)
    ap.add_argument("--drafter-prompts", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--engine-threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    times = {}

    t0 = time.perf_counter()
    tok_dir = train_tokenizer(a.out / "tokenizer", vocab_size=4096)
    times["tokenizer_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    target_dir = train_target(a.out / "target", tokenizer_dir=tok_dir, steps=a.target_steps, seq_len=a.seq_len,
                              batch_size=a.batch, n_threads=a.threads, eval_every=max(a.target_steps // 4, 1),
                              log_every=10)
    times["target_s"] = time.perf_counter() - t0
    target_recipe = json.loads((Path(target_dir) / "recipe.json").read_text())
    target_gguf = dn.convert_hf_to_gguf(target_dir, a.out / "target-q8_0.gguf", outtype="q8_0")

    t0 = time.perf_counter()
    drafter_recipe = pipeline.run(target_dir, None, a.out / "drafter", n_prompts=a.drafter_prompts, prompt_tokens=64,
                                  max_new_tokens=64, target_gguf=target_gguf, out_gguf=a.out / "drafter-q8_0.gguf",
                                  outtype="q8_0", num_layers=1, block_size=a.block_size, steps=a.drafter_steps,
                                  n_threads=a.threads, log_every=25)
    times["drafter_s"] = time.perf_counter() - t0

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    prompts = corpus.heldout_prompts(a.eval_prompts, 96, tok, seed=0)
    rows = []
    print(f"# train_pair: {machine()}; rev {git_rev()}; wall {time.perf_counter() - t_start:.0f} s so far")
    res = target_recipe.get("results", {})
    print(f"target: final train loss {res.get('final_train_loss')}, held-out {res.get('final_heldout_loss')}")
    print(f"drafter: acceptance on its training anchors {drafter_recipe.get('acceptance_before')} -> "
          f"{drafter_recipe.get('acceptance_after')}")
    for B in sorted({4, 8, a.block_size}):
        eng = dn.Engine(target_gguf, drafter=a.out / "drafter-q8_0.gguf", block_size=B, n_ctx=512,
                        n_threads=a.engine_threads)
        acc, ar_s, sp_s, n_ar, n_sp, same = [], 0.0, 0.0, 0, 0, True
        for p in prompts:
            ar = eng.generate(p.text, max_tokens=a.gen, speculative=False)
            sp = eng.generate(p.text, max_tokens=a.gen)
            same &= sp.tokens == ar.tokens
            acc.append(sp.stats.mean_acceptance_length)
            ar_s += ar.stats.decode_s
            sp_s += sp.stats.decode_s
            n_ar += max(ar.stats.n_generated - 1, 0)
            n_sp += max(sp.stats.n_generated - 1, 0)
        row = {"bench": "train_pair", "B": B, "mean_acceptance_length": float(np.mean(acc)),
               "ar_tok_s": n_ar / ar_s, "spec_tok_s": n_sp / sp_s, "speedup": (n_sp / sp_s) / (n_ar / ar_s),
               "spec_equals_ar": bool(same), "prompts": len(prompts), "gen": a.gen, **times,
               "target_steps": a.target_steps, "drafter_steps": a.drafter_steps,
               "target_final_heldout_loss": res.get("final_heldout_loss"),
               "machine": machine(), "rev": git_rev()}
        print(f"B={B}: mean acceptance {row['mean_acceptance_length']:.2f}, AR {row['ar_tok_s']:.1f} tok/s, "
              f"spec {row['spec_tok_s']:.1f} tok/s, speedup {row['speedup']:.2f}x, spec == AR: {same}")
        rows.append(row)
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
