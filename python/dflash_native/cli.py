"""dflash-native command line: generate, convert, convert-drafter, quantize, train-drafter, demo, serve."""

from __future__ import annotations

try:  # the console script imports this module before main's handlers run (_interrupt.py)
    from . import _interrupt
    import argparse
    import json
    import os
    import sys
    import tempfile
    from pathlib import Path
except KeyboardInterrupt:
    from . import _interrupt
    _interrupt.interrupted_import()
    raise


def _cmd_generate(a) -> int:
    from .engine import Engine

    target, drafter = _target_and_drafter(a, "generate")
    eng = Engine(target, drafter=drafter, block_size=a.block_size, n_ctx=a.n_ctx, n_threads=a.threads,
                 kv_type=a.kv_type, gate=not a.no_gate, draft_cutoff=a.draft_cutoff, verify=a.verify,
                 tree_budget=a.tree_budget, device=a.device, quiet=a.quiet)
    prompt = a.prompt
    if a.prompt_file:
        prompt = Path(a.prompt_file).read_text()
    if prompt is None:
        prompt = sys.stdin.read()
    kw = dict(max_tokens=a.max_tokens, stop=a.stop, stream=True, temperature=a.temperature, top_k=a.top_k,
              top_p=a.top_p, min_p=a.min_p, seed=a.seed, logprobs=a.logprobs)
    if a.chat:
        stream = eng.chat([{"role": "user", "content": prompt}], **kw)
    else:
        stream = eng.generate(prompt, **kw)
    result = None
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
        result = piece.result or result
    sys.stdout.write("\n")
    s = result.stats
    print(f"[dflash-native] {s.n_prompt_tokens} prompt tokens at {s.prefill_tok_s:.1f} tok/s, "
          f"{s.n_generated} generated at {s.decode_tok_s:.1f} tok/s (stop: {s.stop_reason})"
          + ("" if s.seed is None else f", sampled with seed {s.seed}"), file=sys.stderr)
    if s.speculative:
        print(f"[dflash-native] {s.rounds} rounds of B={s.block_size} and {s.ar_steps} AR steps, mean acceptance length "
              f"{s.mean_acceptance_length:.2f}; draft {s.draft_s:.2f}s, verify {s.verify_s:.2f}s, "
              f"rollback {s.rollback_s:.3f}s", file=sys.stderr)
    lps = _logprobs_rows(eng, result.logprobs) if result.logprobs is not None else None
    if lps is not None and not a.json:
        for r in lps:  # one line per generated token: the token, its logprob, then the alternatives
            alts = ", ".join(f"{t['text']!r} {t['logprob']:.4f}" for t in r["top"])
            print(f"[logprobs] {r['token']:>6} {r['text']!r:<16} {r['logprob']:9.4f}" + (f"  | {alts}" if alts else ""),
                  file=sys.stderr)
    if a.json:
        out = {"text": result.text, "tokens": result.tokens, "stats": s.as_dict()}
        if lps is not None:
            out["logprobs"] = lps
        print(json.dumps(out))
    return 0


def _logprobs_rows(eng, logprobs) -> list[dict]:
    """result.logprobs as JSON-ready rows: token id, its text (None without a tokenizer), logprob,
    and the alternatives in the same form."""
    def text(t: int):
        return eng.detokenize([t]) if eng.tokenizer is not None else None

    return [{"token": lp.token, "text": text(lp.token), "logprob": lp.logprob,
             "top": [{"token": t, "text": text(t), "logprob": v} for t, v in lp.top]} for lp in logprobs]


def _target_and_drafter(a, cmd: str):
    """--target / --drafter (GGUF paths or hf:// names); without --target the embedded pair (its
    drafter unless --drafter names another); --no-drafter: none."""
    target, drafter = a.target, a.drafter
    if target is None:
        pair = default_pair()
        if pair is None:
            raise ValueError(f"[{cmd}] no embedded default pair in this install: give --target")
        target, drafter = pair if drafter is None else (pair[0], drafter)
    if getattr(a, "no_drafter", False):
        drafter = None
    return target, drafter


def _cmd_serve(a) -> int:
    from .server import serve

    target, drafter = _target_and_drafter(a, "serve")
    serve(target, drafter=drafter, host=a.host, port=a.port, parallel=a.parallel, queue=a.queue, model_name=a.model_name,
          quiet=a.quiet, n_threads=a.threads, block_size=a.block_size, n_ctx=a.n_ctx, kv_type=a.kv_type,
          n_batch=a.n_batch,
          gate=not a.no_gate, draft_cutoff=a.draft_cutoff, verify=a.verify, tree_budget=a.tree_budget,
          shutdown_timeout=a.shutdown_timeout, device=a.device,
          **({} if a.max_body_bytes is None else {"max_body_bytes": a.max_body_bytes}))
    return 0


def _cmd_rpc_server(a) -> int:
    from . import _core

    sys.stdout.flush()
    _core.rpc_serve(a.host, a.port, device=a.device, n_threads=a.threads or (os.cpu_count() or 1),
                    cache_dir=a.cache_dir or "")
    return 0


def _cmd_convert(a) -> int:
    from .convert import convert_hf_to_gguf

    out = convert_hf_to_gguf(a.src, a.dst, outtype=a.outtype)
    print(f"wrote {out}")
    return 0


def _cmd_quantize(a) -> int:
    from .quantization import quantize

    out = quantize(a.src, a.dst, a.type, n_threads=a.threads, progress=not a.quiet)
    from gguf import GGUFReader

    types = sorted({t.tensor_type.name for t in GGUFReader(out).tensors})
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB; tensor types {', '.join(types)})")
    return 0


def _cmd_convert_drafter(a) -> int:
    from .convert_dflash import convert_dflash_to_gguf
    from .hub import is_hub_name, resolve

    target = resolve(a.target, quiet=a.quiet) if is_hub_name(a.target) else a.target
    out = convert_dflash_to_gguf(a.src, a.dst, outtype=a.outtype, target_gguf=target)
    print(f"wrote {out}")
    return 0


def _cmd_train_drafter(a) -> int:
    try:
        from .train import pipeline
    except ImportError as e:  # torch / transformers / tokenizers
        raise ValueError(f"training needs the [train] extra (pip install torch==2.13.0, then "
                         f"pip install 'dflash-native[train]'): {e}") from None
    layers = [int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None
    draft_vocab = a.draft_vocab if a.draft_vocab is not None else (1024 if a.kind == "dflash" else 0)
    recipe = pipeline.run(a.target, a.data, a.out, n_prompts=a.prompts, prompt_tokens=a.prompt_tokens,
                          max_new_tokens=a.max_new_tokens, target_layer_ids=layers, target_gguf=a.target_gguf,
                          out_gguf=a.gguf, outtype=a.outtype, num_layers=a.layers, block_size=a.block_size,
                          steps=a.steps, lr=a.lr, seed=a.seed, n_threads=a.threads, log_every=a.log_every,
                          seqs_per_step=a.seqs_per_step, anchors_per_seq=a.anchors_per_seq,
                          draft_vocab_size=draft_vocab, kind=a.kind, context_length=a.context_length, window=a.window,
                          long_share=a.long_share, w_ce=a.w_ce, w_kl=a.w_kl, init_from=a.init_from,
                          sampled_share=a.sampled_share,
                          sample_temperatures=[float(x) for x in a.sample_temperatures.split(",") if x.strip()],
                          sample_top_p=a.sample_top_p, constrained_share=a.constrained_share,
                          constrained_extra=a.constrained_extra, constraint=a.constraint,
                          constrained_prompts=a.constrained_prompts,
                          continuations_file=a.continuations_file,
                          continuations=a.continuations, engine_threads=a.threads)
    print(json.dumps({k: recipe[k] for k in recipe if not isinstance(recipe[k], (list, dict))}, indent=1))
    return 0


MODELS_DIR = Path(__file__).resolve().parent / "models"


def default_pair() -> tuple[Path, Path] | None:
    """The small trained target + drafter that ship with the package (see models/*-recipe.json)."""
    for kind in ("f16", "q8_0", "f32"):
        t, dr = MODELS_DIR / f"default-target-{kind}.gguf", MODELS_DIR / f"default-drafter-{kind}.gguf"
        if t.is_file() and dr.is_file():
            return t, dr
    return None


_KIND_NAMES = {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}  # train-drafter --kind


def _pair_description() -> str:
    """One paragraph on the embedded pair, from its recipes."""
    try:
        t = json.loads((MODELS_DIR / "default-target-recipe.json").read_text())
        d = json.loads((MODELS_DIR / "default-drafter-recipe.json").read_text())
        n_params = t["model"]["n_params"] / 1e6
        n_tok = t["train"]["n_tokens_seen"] / 1e6
        minutes = t["results"]["wall_s"] / 60
        return (f"a {n_params:.0f}M-parameter Qwen3.5-architecture hybrid target (GDN + attention layers) trained here "
                f"from scratch for {minutes:.0f} minutes ({n_tok:.1f}M tokens of the Python standard library), and a "
                f"{d['num_layers']}-layer {_KIND_NAMES[d.get('kind', 'dflash')]} drafter (block {d['block_size']}, "
                f"taps {d['target_layer_ids']}) "
                f"trained on its greedy continuations; recipes in dflash_native/models/")
    except (OSError, KeyError, ValueError):
        return "a small trained target and its drafter (dflash_native/models/)"


def _cmd_demo(a) -> int:
    from .engine import Engine

    if a.target is not None or a.drafter is not None:
        if a.target is None or a.drafter is None or a.random:
            raise ValueError("[demo] --target and --drafter go together (the demo compares speculative decoding "
                             "with AR), without --random")
        target, drafter = a.target, a.drafter
        print(f"[dflash-native demo] {target} with the drafter {drafter}.", flush=True)
    else:
        pair = default_pair()
        if pair is None or a.random:
            return _demo_random(a)
        target, drafter = pair
        print(f"[dflash-native demo] The embedded default pair: {_pair_description()}.", flush=True)
    eng = Engine(target, drafter=drafter, n_ctx=1024, n_threads=a.threads, block_size=a.block_size,
                 draft_cutoff=a.draft_cutoff, gate=not a.no_gate, verify=a.verify, tree_budget=a.tree_budget,
                 device=a.device, quiet=a.quiet)
    if a.prompt is not None:
        prompts = [a.prompt]
    else:  # code prompts from standard-library files the pair never trained on
        from .train.corpus import heldout_prompts

        prompts = [p.text for p in heldout_prompts(a.prompts, 96, eng, seed=0)]
    eng.generate(prompts[0], max_tokens=8)  # warm-up: graph plans
    runs = [(eng.generate(p, max_tokens=a.max_tokens, speculative=False), eng.generate(p, max_tokens=a.max_tokens))
            for p in prompts]
    return _demo_report(eng, prompts, runs)


def _demo_report(eng, prompts, runs) -> int:
    print(f"model: {eng.arch}, layers: {eng.layer_types}, threads: {eng.n_threads}, block size: {eng.block_size}, "
          f"draft cutoff: {eng.draft_cutoff:g}, verify: {eng.verify}")
    print(f"prompt 1 of {len(prompts)}: {prompts[0]!r}")
    print(f"output: {runs[0][1].text!r}")
    n_prompt = sum(ar.stats.n_prompt_tokens for ar, _ in runs)
    prefill_s = sum(ar.stats.prefill_s for ar, _ in runs)
    n_ar = sum(max(ar.stats.n_generated - 1, 0) for ar, _ in runs)
    ar_s = sum(ar.stats.decode_s for ar, _ in runs)
    n_sp = sum(max(sp.stats.n_generated - 1, 0) for _, sp in runs)
    sp_s = sum(sp.stats.decode_s for _, sp in runs)
    rounds = sum(sp.stats.rounds for _, sp in runs)
    ar_steps = sum(sp.stats.ar_steps for _, sp in runs)
    committed = sum(sum(k * c for k, c in enumerate(sp.stats.acceptance_histogram)) for _, sp in runs)
    ar_tok_s, sp_tok_s = n_ar / max(ar_s, 1e-9), n_sp / max(sp_s, 1e-9)
    print(f"AR:          {n_prompt} prompt tokens, prefill {n_prompt / max(prefill_s, 1e-9):.1f} tok/s; "
          f"{sum(ar.stats.n_generated for ar, _ in runs)} generated, decode {ar_tok_s:.1f} tok/s")
    verified = sum(sp.stats.verified_tokens for _, sp in runs)
    print(f"speculative: {rounds} rounds and {ar_steps} AR steps (controller: {'on' if eng.gate else 'off'}), "
          f"mean acceptance length {committed / max(rounds, 1):.2f} of "
          f"{eng.block_size} ({verified / max(rounds, 1):.2f} verified), decode {sp_tok_s:.1f} tok/s "
          f"({sp_tok_s / max(ar_tok_s, 1e-9):.2f}x AR)")
    from .lossless import first_divergence_gap, verdict

    ok, text = verdict([first_divergence_gap(eng, p, ar.tokens, sp.tokens) for p, (ar, sp) in zip(prompts, runs)])
    print(f"speculative output == AR output: {text}")
    return 0 if ok else 1


RANDOM_DEMO_PROMPT = "def _splitext(p, sep, altsep, extsep):\n    \"\"\"Split the extension from a pathname."


def _demo_random(a) -> int:
    from .convert import convert_hf_to_gguf
    from .engine import Engine
    from .random_models import make_random_checkpoint, make_random_drafter_gguf

    print("[dflash-native demo] A tiny Qwen3.5-architecture hybrid (Gated DeltaNet + attention layers) and a\n"
          "DFlash drafter for it, both with RANDOM weights, converted with our converters; greedy AR and\n"
          "speculative generation. The text is gibberish and a random drafter is almost never accepted; the\n"
          "numbers and the exactness check are real.", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_random_checkpoint(Path(tmp) / "target", "qwen3_5", seed=a.seed)
        target = convert_hf_to_gguf(ckpt, Path(tmp) / "demo-qwen35.gguf", outtype=a.outtype)
        drafter = make_random_drafter_gguf(Path(tmp) / "demo-drafter.gguf", ckpt, outtype=a.outtype, seed=a.seed + 1,
                                           block_size=8, target_gguf=target)
        eng = Engine(target, drafter=drafter, n_ctx=1024, n_threads=a.threads, block_size=a.block_size,
                     draft_cutoff=a.draft_cutoff, gate=not a.no_gate, verify=a.verify, tree_budget=a.tree_budget,
                     device=a.device)
        prompt = a.prompt if a.prompt is not None else RANDOM_DEMO_PROMPT
        runs = [(eng.generate(prompt, max_tokens=a.max_tokens, speculative=False),
                 eng.generate(prompt, max_tokens=a.max_tokens))]
        return _demo_report(eng, [prompt], runs)


def _outtypes() -> list[str]:
    from .convert import OUTTYPES

    return list(OUTTYPES)


class _Version(argparse.Action):
    """--version: the package's, ggml's and the backends' versions (computed when asked for)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the versions of dflash-native, ggml and its backends, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """dflash-native's version, ggml's (version and build commit), each ggml backend with the
    features it reports (the CPU's: its instruction sets), and the ISA of the package's own kernels."""
    from . import __version__, _core

    backends = []
    for name, features in _core.backends():
        on = [k if v == "1" else f"{k}={v}" for k, v in features.items() if v != "0"]
        backends.append(name + (f" ({' '.join(on)})" if on else ""))
    return "\n".join([f"dflash-native {__version__}", f"ggml {_core.ggml_version()}",
                      f"backends: {', '.join(backends) or 'none'}", f"own CPU kernels: {_core.isa()}"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-native", description=__doc__)
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_generate_parser(sub)
    _add_convert_parser(sub)
    _add_convert_drafter_parser(sub)
    _add_quantize_parser(sub)
    _add_train_drafter_parser(sub)
    _add_demo_parser(sub)
    _add_serve_parser(sub)
    _add_rpc_server_parser(sub)
    return p


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text with a GGUF target")
    _add_model_args(g)
    g.add_argument("--block-size", type=int, default=None, help="tokens verified per round (default: the drafter's)")
    _add_speculation_args(g, draft_cutoff=0.0)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="the prompt (default: --prompt-file, else stdin)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--n-ctx", type=int, default=4096)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print the result as JSON after the text")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p times the top probability")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same text, with or without a drafter "
                        "(default: a fresh one, printed)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each generated token's log-probability and the N (0..20) most probable "
                        "alternatives (stderr, or in --json); temperature 0: the raw logits' log-softmax")
    g.set_defaults(fn=_cmd_generate)


def _add_convert_parser(sub) -> None:
    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF")
    c.add_argument("src", help="directory with config.json and *.safetensors")
    c.add_argument("dst", help="output .gguf path")
    c.add_argument("--outtype", default="f16", choices=_outtypes())
    c.set_defaults(fn=_cmd_convert)


def _add_convert_drafter_parser(sub) -> None:
    cd = sub.add_parser("convert-drafter", help="convert a z-lab DFlash drafter checkpoint to GGUF")
    cd.add_argument("src", help="directory with the drafter's config.json and *.safetensors")
    cd.add_argument("dst", help="output .gguf path")
    cd.add_argument("--outtype", default="f16", choices=_outtypes())
    cd.add_argument("--target", default=None, help="the target GGUF (or an hf:// name): checks the pair and copies "
                    "its tokenizer")
    cd.add_argument("--quiet", action="store_true", help="no progress output while an hf:// target resolves")
    cd.set_defaults(fn=_cmd_convert_drafter)


def _add_quantize_parser(sub) -> None:
    from .quantization import quantize_types

    q = sub.add_parser("quantize", help="quantize a GGUF target or drafter with llama.cpp's quantizer")
    q.add_argument("src", help="input .gguf (F32 / F16 / BF16 usually)")
    q.add_argument("dst", help="output .gguf path")
    q.add_argument("--type", default="q4_k_m", type=str.lower, choices=quantize_types(),
                   help="llama.cpp file type (default q4_k_m)")
    q.add_argument("--threads", type=int, default=None)
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(fn=_cmd_quantize)


def _add_train_drafter_parser(sub) -> None:
    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a Hugging Face target on local text")
    t.add_argument("--target", required=True, help="HF target checkpoint directory (config.json, safetensors, "
                   "tokenizer.json with a <|MASK|> token)")
    t.add_argument("--data", default=None, help="text: a directory, a file (default: the Python standard library)")
    t.add_argument("--out", required=True, help="output directory for the drafter checkpoint")
    t.add_argument("--gguf", default=None, help="also convert the drafter to this GGUF")
    t.add_argument("--target-gguf", default=None, help="the target's GGUF: checks the pair, copies the tokenizer, "
                   "and generates the training continuations with our engine")
    t.add_argument("--continuations", default=None, choices=["engine", "torch"],
                   help="who continues the prompts greedily (default: engine when --target-gguf is given)")
    t.add_argument("--outtype", default="f16", choices=_outtypes())
    t.add_argument("--target-layer-ids", default=None, help="comma-separated target layers to tap (HF ids)")
    t.add_argument("--layers", type=_int_from(1), default=1, help="drafter layers")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--steps", type=_int_from(0), default=200)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seqs-per-step", type=_int_from(1), default=8, help="sequences per training step")
    t.add_argument("--anchors-per-seq", type=_int_from(1), default=16, help="random block anchors per sequence per step")
    t.add_argument("--kind", default="dflash", choices=["dflash", "dflash2", "dspark"],
                   help="drafter architecture: DFlash; DFlash 2 (dynamic convolutions + candidate selector); DSpark "
                        "(Markov + confidence heads)")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="draft over at most this many tokens: the most frequent of the target's continuations "
                        "(GGUF dflash.draft_vocab; 0 = the whole vocabulary; default 1024 for dflash, 0 for the "
                        "other kinds, which draft over the whole vocabulary)")
    t.add_argument("--prompts", type=_int_from(1), default=64)
    t.add_argument("--prompt-tokens", type=_int_from(1), default=64)
    t.add_argument("--max-new-tokens", type=_int_from(1), default=64)
    t.add_argument("--context-length", type=int, default=None,
                   help="context length N: prompts are drawn up to N - max-new-tokens long, so that anchors see "
                        "contexts spread up to N; also the window when --window is not given")
    t.add_argument("--window", type=int, default=None,
                   help="drafter window W (<= N, default N): blocks attend to at most W positions before them; the "
                        "GGUF records it as the engine's default drafter window")
    t.add_argument("--long-share", type=float, default=None,
                   help="with --context-length: the share of prompts drawn long (default 1); the rest have "
                        "--prompt-tokens tokens")
    t.add_argument("--w-ce", type=float, default=1.0, help="weight of the cross-entropy on the continuation's tokens")
    t.add_argument("--w-kl", type=float, default=0.0,
                   help="weight of the distillation term KL(p_target || p_drafter) at T = 1 (0: CE only)")
    t.add_argument("--init-from", default=None,
                   help="fine-tune this drafter (a GGUF this package wrote, or a checkpoint directory) instead of "
                        "training a fresh one")
    t.add_argument("--sampled-share", type=float, default=0.0,
                   help="share of the engine continuations that are sampled instead of greedy (0..1)")
    t.add_argument("--sample-temperatures", default="0.7,1.0",
                   help="comma-separated temperatures the sampled continuations cycle through")
    t.add_argument("--sample-top-p", type=float, default=0.95)
    t.add_argument("--constrained-share", type=float, default=0.0,
                   help="share of the engine continuations written under a JSON grammar (0..1), so the drafter "
                        "learns the target's structured output too")
    t.add_argument("--constrained-extra", type=_int_from(0), default=0,
                   help="this many more prompts (other draws of the same text and length mix), each continued "
                        "under the JSON grammar, added on top of the --prompts set (which, with its cached "
                        "continuations, stays as it is)")
    t.add_argument("--constraint", default="json",
                   help="their grammar: json (any JSON object, response_format json_object), schemas (a random "
                        "small JSON schema per continuation), or a JSON schema file")
    t.add_argument("--constrained-prompts", default="text", choices=["text", "chat"],
                   help="their prompts: the text as it is, or a chat request for JSON (the GGUF's chat template)")
    t.add_argument("--continuations-file", default=None,
                   help="JSON cache of the engine continuations: reused when it matches, else written")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=_int_from(1), default=1)
    t.add_argument("--log-every", type=_int_from(0), default=20, help="log every N steps (0: quiet)")
    t.set_defaults(fn=_cmd_train_drafter)


_NAME_HELP = ("a GGUF file, or a model name hf://ORG/REPO[@REVISION][:TYPE]: a GGUF repository's file for "
              "TYPE (e.g. Q4_K_M), or a Hugging Face checkpoint downloaded and converted (to TYPE: f16 by "
              "default, q8_0, q4_k_m, ...) once, into $DFLASH_NATIVE_CACHE (~/.cache/dflash-native)")


def _add_model_args(p, *, demo: bool = False) -> None:
    """--target, --drafter (files or hf:// names), --no-drafter (not in the demo) and --quiet."""
    p.add_argument("--target", default=None, help="target model (default: the embedded pair): " + _NAME_HELP)
    p.add_argument("--drafter", default=None, help=("its DFlash drafter, with --target: " if demo else
                                                    "DFlash drafter for speculative decoding (default: the embedded "
                                                    "pair's, without --target): ") + _NAME_HELP)
    if not demo:
        p.add_argument("--no-drafter", action="store_true", help="AR only")
    p.add_argument("--quiet", action="store_true",
                   help="no progress output while hf:// names download, convert and quantize (progress bars are "
                        "shown only when stderr is a terminal)")


def _add_speculation_args(p, *, draft_cutoff: float) -> None:
    p.add_argument("--draft-cutoff", type=float, default=draft_cutoff,
                   help="verify drafts only while the drafter's running top-1 probability >= this (0: no cap; "
                        "with the controller, a cap on its choice)")
    p.add_argument("--no-gate", action="store_true",
                   help="fixed settings: every step a round of the block size (default: the speculation controller "
                        "picks AR steps or rounds and the drafts each round verifies)")
    p.add_argument("--verify", choices=("chain", "tree"), default="chain",
                   help="chain: verify the top-1 drafts; tree: verify a best-first tree of drafts in one pass")
    p.add_argument("--tree-budget", type=int, default=32,
                   help="with --verify tree: the most draft tokens (tree nodes below the root) a round verifies, 1..63")
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu (default), gpu, a ggml device name (CUDA0, Vulkan0; see "
                        "dflash_native.devices()) or rpc://HOST:PORT (a `dflash-native rpc-server`)")


def _add_demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="run generation on a small built-in model (no download)")
    _add_model_args(d, demo=True)
    d.add_argument("--prompt", default=None, help="default: held-out standard-library code prompts")
    d.add_argument("--prompts", type=_int_from(1), default=4, help="held-out prompts to run (without --prompt and --random)")
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    _add_speculation_args(d, draft_cutoff=0.0)
    d.add_argument("--random", action="store_true", help="random tiny models instead of the embedded pair")
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--outtype", default="f16", choices=_outtypes(), help="with --random: the models' weight type")
    d.add_argument("--seed", type=int, default=0, help="with --random: the random weights' seed")
    d.set_defaults(fn=_cmd_demo)

def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the [server] extra)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000, help="TCP port, 1..65535")
    s.add_argument("--parallel", "--slots", dest="parallel", type=_int_from(1), default=1,
                   help="requests run at once: the engine's sequence slots, batched into shared passes "
                   "(--slots: the earlier name)")
    s.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot (503 beyond)")
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the target file's stem, "
                   "or an hf:// name's ORG/REPO[:TYPE])")
    s.add_argument("--block-size", type=int, default=None, help="tokens verified per round (default: the drafter's)")
    _add_speculation_args(s, draft_cutoff=0.0)
    s.add_argument("--n-ctx", type=int, default=4096)
    s.add_argument("--n-batch", type=int, default=512, help="prompt tokens per forward graph")
    s.add_argument("--threads", type=int, default=None, help="the engine's threads (default: every core)")
    s.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds running requests get to finish at Ctrl-C / SIGTERM before they are cancelled")
    s.add_argument("--max-body-bytes", type=_int_from(1), default=None,
                   help="largest request body accepted, in bytes; 413 beyond (default 8 MiB)")
    s.set_defaults(fn=_cmd_serve)


def _add_rpc_server_parser(sub) -> None:
    r = sub.add_parser("rpc-server", help="serve this machine's CPU (or another ggml device) over ggml's RPC protocol")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; the "
                   "protocol has no authentication, never expose it to an untrusted network)")
    r.add_argument("--port", type=_port, default=50052, help="TCP port, 1..65535")
    r.add_argument("--device", default="cpu", help="the device served: cpu (default) or a ggml device name")
    r.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    r.add_argument("--cache-dir", default=None, help="ggml's local tensor cache for repeated loads (default: none)")
    r.set_defaults(fn=_cmd_rpc_server)


def _int_from(lo: int):
    """An argparse type: an int >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}")
        return v

    return parse


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an int in [1, 65535], got {text!r}")
    return port


def main(argv=None) -> int:
    try:
        # a closed stdout / stderr (`>&-`) is None in Python: writes to it must not end in a traceback
        stdout_closed = sys.stdout is None
        for name in ("stdout", "stderr"):
            if getattr(sys, name) is None:
                setattr(sys, name, open(os.devnull, "w"))
        # the heavy imports (gguf, numpy, the converters) happen here, inside the handlers: Ctrl-C
        # while they load is an exit 130 like any other
        args = build_parser().parse_args(argv)
        if stdout_closed and args.cmd == "generate":
            raise ValueError("stdout is closed: nowhere to write the generated text")
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: the stream ends where it was, without a traceback
        _interrupt.ignore_further_interrupts()
        print("\ndflash-native: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`... | head`): stop quietly, like any filter; stdout goes to
        # /dev/null so that the interpreter's flush at exit raises nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, RuntimeError, MemoryError, OSError) as e:
        # the engine's errors name where they come from; a traceback would add nothing
        print(f"dflash-native: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
