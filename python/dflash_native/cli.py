"""dflash-native command line: generate, convert, demo."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _cmd_generate(a) -> int:
    from .engine import Engine

    eng = Engine(a.target, drafter=a.drafter, block_size=a.block_size, n_ctx=a.n_ctx, n_threads=a.threads,
                 kv_type=a.kv_type)
    prompt = a.prompt
    if a.prompt_file:
        prompt = Path(a.prompt_file).read_text()
    if prompt is None:
        prompt = sys.stdin.read()
    if a.chat:
        stream = eng.chat([{"role": "user", "content": prompt}], max_tokens=a.max_tokens, stop=a.stop, stream=True)
    else:
        stream = eng.generate(prompt, max_tokens=a.max_tokens, stop=a.stop, stream=True)
    result = None
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
        result = piece.result or result
    sys.stdout.write("\n")
    s = result.stats
    print(f"[dflash-native] {s.n_prompt_tokens} prompt tokens at {s.prefill_tok_s:.1f} tok/s, "
          f"{s.n_generated} generated at {s.decode_tok_s:.1f} tok/s (stop: {s.stop_reason})", file=sys.stderr)
    if s.speculative:
        print(f"[dflash-native] {s.rounds} rounds of B={s.block_size}, mean acceptance length "
              f"{s.mean_acceptance_length:.2f}; draft {s.draft_s:.2f}s, verify {s.verify_s:.2f}s, "
              f"rollback {s.rollback_s:.3f}s", file=sys.stderr)
    if a.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": s.as_dict()}))
    return 0


def _cmd_convert(a) -> int:
    from .convert import convert_hf_to_gguf

    out = convert_hf_to_gguf(a.src, a.dst, outtype=a.outtype)
    print(f"wrote {out}")
    return 0


def _cmd_convert_drafter(a) -> int:
    from .convert_dflash import convert_dflash_to_gguf

    out = convert_dflash_to_gguf(a.src, a.dst, outtype=a.outtype, target_gguf=a.target)
    print(f"wrote {out}")
    return 0


def _cmd_train_drafter(a) -> int:
    try:
        from .train import pipeline
    except ImportError as e:  # torch / transformers / tokenizers
        raise ValueError(f"training needs the [train] extra (pip install torch==2.13.0, then "
                         f"pip install 'dflash-native[train]'): {e}") from None
    layers = [int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None
    recipe = pipeline.run(a.target, a.data, a.out, n_prompts=a.prompts, prompt_tokens=a.prompt_tokens,
                          max_new_tokens=a.max_new_tokens, target_layer_ids=layers, target_gguf=a.target_gguf,
                          out_gguf=a.gguf, outtype=a.outtype, num_layers=a.layers, block_size=a.block_size,
                          steps=a.steps, lr=a.lr, seed=a.seed, n_threads=a.threads, log_every=a.log_every)
    print(json.dumps({k: recipe[k] for k in recipe if not isinstance(recipe[k], (list, dict))}, indent=1))
    return 0


def default_pair() -> tuple[Path, Path] | None:
    """The small trained target + drafter that ship with the package (see models/*-recipe.json)."""
    d = Path(__file__).resolve().parent / "models"
    t, dr = d / "default-target-q8_0.gguf", d / "default-drafter-q8_0.gguf"
    return (t, dr) if t.is_file() and dr.is_file() else None


def _cmd_demo(a) -> int:
    from .engine import Engine

    pair = default_pair()
    if pair is None or a.random:
        return _demo_random(a)
    target, drafter = pair
    print("[dflash-native demo] The embedded default pair: a 12M-parameter Qwen3.5-architecture hybrid target\n"
          "(GDN + attention) trained here for ~17 minutes on the Python standard library, and a 1-layer DFlash\n"
          "drafter trained on its greedy continuations (recipes in dflash_native/models/). Greedy AR vs DFlash:",
          flush=True)
    eng = Engine(target, drafter=drafter, n_ctx=1024, n_threads=a.threads, block_size=a.block_size)
    ar = eng.generate(a.prompt, max_tokens=a.max_tokens, speculative=False)
    sp = eng.generate(a.prompt, max_tokens=a.max_tokens)
    return _demo_report(eng, a.prompt, ar, sp)


def _demo_report(eng, prompt, ar, sp) -> int:
    print(f"model: {eng.arch}, layers: {eng.layer_types}, threads: {eng.n_threads}, block size: {eng.block_size}")
    print(f"prompt: {prompt!r}")
    print(f"output: {sp.text!r}")
    s, t = ar.stats, sp.stats
    print(f"AR:          {s.n_prompt_tokens} prompt tokens, prefill {s.prefill_tok_s:.1f} tok/s; "
          f"{s.n_generated} generated, decode {s.decode_tok_s:.1f} tok/s")
    print(f"speculative: {t.rounds} rounds, mean acceptance length {t.mean_acceptance_length:.2f} of {t.block_size}, "
          f"decode {t.decode_tok_s:.1f} tok/s ({t.decode_tok_s / max(s.decode_tok_s, 1e-9):.2f}x AR)")
    same = sp.tokens == ar.tokens
    print(f"speculative output == AR output: {same}")
    return 0 if same else 1


def _demo_random(a) -> int:
    from .engine import Engine
    from .testing import make_random_checkpoint
    from .convert import convert_hf_to_gguf
    from .testing_dflash import make_random_drafter_gguf

    print("[dflash-native demo] A tiny Qwen3.5-architecture hybrid (Gated DeltaNet + attention layers) and a\n"
          "DFlash drafter for it, both with RANDOM weights, converted with our converters; greedy AR and\n"
          "speculative generation. The text is gibberish and a random drafter is almost never accepted; the\n"
          "numbers and the exactness check are real.", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_random_checkpoint(Path(tmp) / "target", "qwen3_5", seed=a.seed)
        target = convert_hf_to_gguf(ckpt, Path(tmp) / "demo-qwen35.gguf", outtype=a.outtype)
        drafter = make_random_drafter_gguf(Path(tmp) / "demo-drafter.gguf", ckpt, outtype=a.outtype, seed=a.seed + 1,
                                           block_size=8, target_gguf=target)
        eng = Engine(target, drafter=drafter, n_ctx=1024, n_threads=a.threads)
        ar = eng.generate(a.prompt, max_tokens=a.max_tokens, speculative=False)
        sp = eng.generate(a.prompt, max_tokens=a.max_tokens)
        return _demo_report(eng, a.prompt, ar, sp)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-native", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text with a GGUF target")
    g.add_argument("--target", required=True, help="target model GGUF")
    g.add_argument("--drafter", default=None, help="DFlash drafter GGUF: speculative decoding")
    g.add_argument("--block-size", type=int, default=None, help="tokens verified per round (default: the drafter's)")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--n-ctx", type=int, default=4096)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print the result as JSON after the text")
    g.set_defaults(fn=_cmd_generate)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF")
    c.add_argument("src", help="directory with config.json and *.safetensors")
    c.add_argument("dst", help="output .gguf path")
    c.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    c.set_defaults(fn=_cmd_convert)

    cd = sub.add_parser("convert-drafter", help="convert a z-lab DFlash drafter checkpoint to GGUF")
    cd.add_argument("src", help="directory with the drafter's config.json and *.safetensors")
    cd.add_argument("dst", help="output .gguf path")
    cd.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    cd.add_argument("--target", default=None, help="the target GGUF: checks the pair and copies its tokenizer")
    cd.set_defaults(fn=_cmd_convert_drafter)

    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a Hugging Face target on local text")
    t.add_argument("--target", required=True, help="HF target checkpoint directory (config.json, safetensors, "
                   "tokenizer.json with a <|MASK|> token)")
    t.add_argument("--data", default=None, help="text: a directory, a file (default: the Python standard library)")
    t.add_argument("--out", required=True, help="output directory for the drafter checkpoint")
    t.add_argument("--gguf", default=None, help="also convert the drafter to this GGUF")
    t.add_argument("--target-gguf", default=None, help="the target's GGUF (checks the pair, copies the tokenizer)")
    t.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    t.add_argument("--target-layer-ids", default=None, help="comma-separated target layers to tap (HF ids)")
    t.add_argument("--layers", type=int, default=1, help="drafter layers")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--prompts", type=int, default=64)
    t.add_argument("--prompt-tokens", type=int, default=64)
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--log-every", type=int, default=20)
    t.set_defaults(fn=_cmd_train_drafter)

    d = sub.add_parser("demo", help="run generation on a small built-in model (no download)")
    d.add_argument("--prompt", default="def _splitext(p, sep, altsep, extsep):\n    \"\"\"Split the extension from a pathname.")
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--block-size", type=int, default=4)
    d.add_argument("--random", action="store_true", help="random tiny models instead of the embedded pair")
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=_cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dflash-native: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
