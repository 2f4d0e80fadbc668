"""DFlash drafter training throughput (steps/s, anchors/s) and loss curves on this machine.

A random Qwen3.5-shaped hybrid target of hidden H (4 layers, one full-attention layer in two,
the tiny tokenizer's 640-token vocabulary unless --vocab), its greedy continuations of random
prompts (generated once per target, not timed in the training rate), then `train_drafter` for
each drafter depth. Every step trains `--seqs` sequences x `--anchors` anchors of block B in one
forward. Acceptance is the mean acceptance length (1..B) of the drafter's greedy blocks on the
training anchors, before and after.

    python bench/train_drafter.py --hidden 256 384 --layers 1 2 --json bench/results/train_drafter.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, write_jsonl  # noqa: E402


def main():
    import torch
    import transformers

    from dflash_native.hf_formats import mask_token_id_of
    from fixtures import make_random_checkpoint
    from dflash_native.train.drafter import greedy_continuations, train_drafter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 384])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--vocab", type=int, default=640)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=4, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    ap.add_argument("--n-prompts", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=112)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    print(f"machine: {machine()}; torch {torch.__version__}, {args.threads} thread(s)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-drafter-") as tmp:
        for h in args.hidden:
            ckpt = make_random_checkpoint(Path(tmp) / f"t{h}", "qwen3_5", seed=0, hidden_size=h,
                                          intermediate_size=3 * h, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=h // 4, linear_num_key_heads=4, linear_num_value_heads=4,
                                          linear_key_head_dim=h // 4, linear_value_head_dim=h // 4,
                                          vocab_size=args.vocab)
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
            rng = np.random.default_rng(0)
            prompts = [[int(x) for x in rng.integers(3, args.vocab - 16, args.prompt_len)]
                       for _ in range(args.n_prompts)]
            t0 = time.perf_counter()
            seqs = greedy_continuations(hf, prompts, args.new_tokens)
            t_gen = time.perf_counter() - t0
            # Random targets often fall into short loops; this says how predictable the data is.
            distinct = float(np.mean([len(set(s[len(p):])) for s, p in zip(seqs, prompts)]))
            for n_layers in args.layers:
                res = train_drafter(hf, Path(tmp) / f"d{h}-{n_layers}", sequences=seqs,
                                    sequence_prompt_lengths=[len(p) for p in prompts], target_layer_ids=[0, 2],
                                    num_layers=n_layers, block_size=args.block, mask_token_id=mask_token_id_of(ckpt),
                                    anchors_per_seq=args.anchors, seqs_per_step=args.seqs, steps=args.steps,
                                    lr=args.lr, warmup=10, gamma=7.0, seed=0, n_threads=args.threads)
                n_params = sum(p.numel() for p in
                               __import__("safetensors.torch", fromlist=["load_file"]).load_file(
                                   str(res.checkpoint / "model.safetensors")).values())
                marks = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
                curve = {m: float(np.mean(res.losses[max(0, m - 4):m + 1])) for m in marks}
                row = {"bench": "train_drafter", "hidden": h, "drafter_layers": n_layers, "block": args.block,
                       "vocab": args.vocab, "seqs_per_step": args.seqs, "anchors_per_seq": args.anchors,
                       "seq_len": args.prompt_len + args.new_tokens, "steps": args.steps,
                       "drafter_params": n_params, "steps_per_s": res.steps_per_s,
                       "anchors_per_s": res.anchors_per_s, "gen_seconds": t_gen, "distinct_tokens_per_continuation": distinct,
                       "acceptance_before": res.acceptance_before, "acceptance_after": res.acceptance_after,
                       "loss_curve": curve, "threads": args.threads, "machine": machine(), "git": git_rev()}
                rows.append(row)
                print(f"H={h} layers={n_layers} params={n_params / 1e6:.2f}M  {res.steps_per_s:.2f} steps/s  "
                      f"{res.anchors_per_s:.0f} anchors/s  acceptance {res.acceptance_before:.2f} -> "
                      f"{res.acceptance_after:.2f}  (greedy data {t_gen:.1f}s, {distinct:.1f} distinct tokens "
                      f"per {args.new_tokens}-token continuation)")
                print("    loss (mean of 5 steps ending at) " +
                      "  ".join(f"{m}: {v:.3f}" for m, v in curve.items()))
    print()
    print("| hidden | drafter layers | params | steps/s | anchors/s | loss first -> last | acceptance before -> after |")
    print("|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        c = list(r["loss_curve"].values())
        print(f"| {r['hidden']} | {r['drafter_layers']} | {r['drafter_params'] / 1e6:.2f}M | {r['steps_per_s']:.2f} "
              f"| {r['anchors_per_s']:.0f} | {c[0]:.2f} -> {c[-1]:.2f} | {r['acceptance_before']:.2f} -> "
              f"{r['acceptance_after']:.2f} |")
    write_jsonl(args.json, rows)


if __name__ == "__main__":
    main()
