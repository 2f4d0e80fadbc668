"""The issue-4 pipeline end to end: tokenizer -> hybrid target -> DFlash drafter -> GGUF ->
speculative decoding on held-out prompts. Every stage is seeded; the defaults are the recipe of
the embedded default pair (dflash_native/models/), about 40 minutes on a quiet 2-core machine.
Prints and (with --json) records the recipe, the losses and the measured acceptance / speed
(the same held-out measurement as `spec_e2e.py --pair`).

    python bench/train_pair.py --out /tmp/pair --json bench/results/train_pair.jsonl

Reproducibility: torch on the CPU is deterministic for a fixed thread count, and every stage is
seeded, so a rerun with the same --threads writes the same weights (the run records a hash of
each GGUF) and measures the same acceptance lengths; only the tok/s figures carry noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, heldout_eval, machine, write_jsonl  # noqa: E402


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    import dflash_native as dn
    from dflash_native.train import pipeline
    from dflash_native.train.target import train_target
    from dflash_native.train.tokenizer import train_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target-steps", type=int, default=320)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--drafter-steps", type=int, default=2500)
    ap.add_argument("--drafter-prompts", type=int, default=1536)
    ap.add_argument("--drafter-new-tokens", type=int, default=96)
    ap.add_argument("--drafter-taps", default="1,3,5,6", help="target layers the drafter reads (HF ids)")
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--anchors-per-seq", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--context-length", type=int, default=None,
                    help="drafter prompts spread up to this many tokens of context (default: 64-token prompts only)")
    ap.add_argument("--window", type=int, default=None, help="the drafter's attention window (default: context length)")
    ap.add_argument("--long-share", type=float, default=None,
                    help="with --context-length: the share of drafter prompts drawn long (default 1)")
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--w-kl", type=float, default=0.0,
                    help="weight of the distillation term KL(p_target || p_drafter) beside the block CE (0: CE only)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="fine-tune this drafter GGUF (e.g. the embedded one) instead of training a fresh one")
    ap.add_argument("--sampled-share", type=float, default=0.0,
                    help="share of the drafter's engine continuations sampled instead of greedy")
    ap.add_argument("--sample-temperatures", default="0.7,1.0")
    ap.add_argument("--seed", type=int, default=0, help="drafter prompts, anchors and sampling seeds")
    ap.add_argument("--outtype", default="f16", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for training and engine threads")
    ap.add_argument("--reuse-target", action="store_true",
                    help="take the tokenizer and target already in --out (a finished run) and train only the drafter")
    ap.add_argument("--target-gguf", type=Path, default=None,
                    help="train only the drafter, for this target GGUF (e.g. the embedded one): its HF checkpoint is "
                         "re-created from the file (train/from_gguf.py) with the tokenizer retrained deterministically")
    ap.add_argument("--install", type=Path, default=None,
                    help="copy the pair and its recipes here as default-{target,drafter}-OUTTYPE.gguf")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    times = {}

    if a.target_gguf is not None:
        from dflash_native.train.from_gguf import target_checkpoint_from_gguf

        t0 = time.perf_counter()
        tok_dir = train_tokenizer(a.out / "tokenizer", vocab_size=4096)
        target_dir = target_checkpoint_from_gguf(a.target_gguf, a.out / "target", tok_dir)
        target_recipe = {"results": {}}
        times.update(tokenizer_s=time.perf_counter() - t0, target_s=0.0)
    elif a.reuse_target:
        target_dir = a.out / "target"
        target_recipe = json.loads((target_dir / "recipe.json").read_text())
        times.update(tokenizer_s=0.0, target_s=target_recipe["results"]["wall_s"])
    else:
        t0 = time.perf_counter()
        tok_dir = train_tokenizer(a.out / "tokenizer", vocab_size=4096)
        times["tokenizer_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        target_dir = train_target(a.out / "target", tokenizer_dir=tok_dir, steps=a.target_steps, seq_len=a.seq_len,
                                  batch_size=a.batch, lr=a.target_lr, n_threads=a.threads,
                                  eval_every=max(a.target_steps // 4, 1), log_every=10)
        times["target_s"] = time.perf_counter() - t0
        target_recipe = json.loads((Path(target_dir) / "recipe.json").read_text())
    target_gguf = a.target_gguf or dn.convert_hf_to_gguf(target_dir, a.out / f"target-{a.outtype}.gguf",
                                                         outtype=a.outtype)
    drafter_gguf = a.out / f"drafter-{a.outtype}.gguf"

    t0 = time.perf_counter()
    drafter_recipe = pipeline.run(
        target_dir, None, a.out / "drafter", n_prompts=a.drafter_prompts, prompt_tokens=64,
        max_new_tokens=a.drafter_new_tokens, target_layer_ids=[int(x) for x in a.drafter_taps.split(",")],
        target_gguf=target_gguf, out_gguf=drafter_gguf, outtype=a.outtype, num_layers=a.drafter_layers,
        block_size=a.block_size, steps=a.drafter_steps, seqs_per_step=a.seqs_per_step,
        anchors_per_seq=a.anchors_per_seq, draft_vocab_size=a.draft_vocab, n_threads=a.threads,
        engine_threads=a.threads, log_every=100, context_length=a.context_length, window=a.window,
        long_share=a.long_share, lr=a.drafter_lr, w_kl=a.w_kl, init_from=a.init_from, seed=a.seed,
        sampled_share=a.sampled_share, sample_temperatures=[float(x) for x in a.sample_temperatures.split(",")],
        continuations_file=a.out / "continuations.json")
    times["drafter_s"] = time.perf_counter() - t0
    times["train_wall_s"] = time.perf_counter() - t_start

    res = target_recipe.get("results", {})
    print(f"# train_pair: {machine()}; rev {git_rev()}; training wall {times['train_wall_s']:.0f} s "
          f"(tokenizer {times['tokenizer_s']:.0f}, target {times['target_s']:.0f}, drafter {times['drafter_s']:.0f})")
    print(f"target: final train loss {res.get('final_train_loss')}, held-out {res.get('final_heldout_loss')}")
    print(f"drafter: acceptance on its training anchors {drafter_recipe.get('acceptance_before')} -> "
          f"{drafter_recipe.get('acceptance_after')}")
    hashes = {"target_sha256": sha256(Path(target_gguf)), "drafter_sha256": sha256(drafter_gguf)}
    print(f"target {hashes['target_sha256'][:16]}, drafter {hashes['drafter_sha256'][:16]}")
    rows = heldout_eval(target_gguf, drafter_gguf, sorted({4, 8, a.block_size}), n_prompts=a.eval_prompts,
                        gen=a.gen, threads=a.threads, label=str(a.out))
    times["wall_s"] = time.perf_counter() - t_start
    for row in rows:
        row.update(bench="train_pair", **times, **hashes, target_steps=a.target_steps,
                   drafter_steps=a.drafter_steps, target_final_heldout_loss=res.get("final_heldout_loss"),
                   drafter_acceptance_train=drafter_recipe.get("acceptance_after"), args=vars(a) | {
                       "out": str(a.out), "install": str(a.install), "json": str(a.json)})
    print(f"whole run: {times['wall_s'] / 60:.1f} min")
    write_jsonl(a.json, rows)

    if a.install is not None:
        a.install.mkdir(parents=True, exist_ok=True)
        if Path(target_gguf).resolve() != (a.install / f"default-target-{a.outtype}.gguf").resolve():
            shutil.copy(target_gguf, a.install / f"default-target-{a.outtype}.gguf")
        shutil.copy(drafter_gguf, a.install / f"default-drafter-{a.outtype}.gguf")
        if (Path(target_dir) / "recipe.json").is_file():
            shutil.copy(Path(target_dir) / "recipe.json", a.install / "default-target-recipe.json")
        shutil.copy(a.out / "drafter" / "recipe.json", a.install / "default-drafter-recipe.json")


if __name__ == "__main__":
    main()
