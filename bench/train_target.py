"""How many tokens/s does target training reach on this machine?

One training step (forward, backward, AdamW) of `dflash_native.train.target`'s model
(transformers Qwen3_5ForCausalLM, float32, sdpa, torch CPU) on random tokens, for the
hybrid (GDN + one full-attention layer in four) and, side by side, the same shape with
every layer full attention, so the cost of transformers' PyTorch GDN fallback
(`torch_chunk_gated_delta_rule`; flash-linear-attention has no CPU kernel) shows. Use the
tok/s to size a training run: tokens = tok/s x seconds.

    python bench/train_target.py --threads 2 --hidden 320 --layers 8 --seq-len 256 --batch 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, summarize, write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None, help="default: 2.8 x hidden, rounded to 32")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import torch
    import transformers

    from dflash_native.train.target import make_config

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    ff = a.intermediate or 32 * round(2.8 * a.hidden / 32)
    shapes = {"hybrid": {}, "all-attention": {"layer_types": ["full_attention"] * a.layers}}
    print(f"# train_target: {machine()}; {a.threads} threads; hidden {a.hidden}, {a.layers} layers, ffn {ff}, "
          f"vocab {a.vocab}, batch {a.batch} x seq {a.seq_len}; torch {torch.__version__}; rev {git_rev()}")
    print("| layers | params | step s (median) | min | max | tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for label, extra in shapes.items():
        cfg = make_config(a.vocab, {"<|endoftext|>": a.vocab - 4}, hidden_size=a.hidden, num_hidden_layers=a.layers,
                          intermediate_size=ff, **extra)
        cfg.pop("architectures")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                              dtype=torch.float32, attn_implementation="sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, a.vocab - 4, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
        times = []
        for rep in range(a.reps + 1):  # the first step is warm-up
            t = time.perf_counter()
            logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rep:
                times.append(time.perf_counter() - t)
        s = summarize(times)
        n_params = sum(p.numel() for p in model.parameters())
        tok_s = a.batch * a.seq_len / s["median"]
        print(f"| {label} | {n_params / 1e6:.1f} M | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} "
              f"| {tok_s:.0f} |", flush=True)
        rows.append({"bench": "train_target", "layers": label, "hidden": a.hidden, "n_layers": a.layers, "ffn": ff,
                     "vocab": a.vocab, "batch": a.batch, "seq_len": a.seq_len, "threads": a.threads,
                     "n_params": n_params, "step_s": s, "tok_s": tok_s, "machine": machine(), "rev": git_rev()})
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    main()
