"""Drafter kinds side by side (issue 36): DFlash, DFlash 2 and DSpark.

Default mode: acceptance and speed of trained drafters on the embedded target. The embedded
target's HF checkpoint is re-created from its GGUF (train/from_gguf.py, as `train_pair.py
--target-gguf` does); one drafter of each kind is trained with `train-drafter --kind` on the same
prompts, the same engine continuations (generated once, cached in --out), the same steps and
seed (pipeline.run; --steps / --prompts scale the budget; the shipped drafter's recipe is 2500
steps on 1536 prompts); the shipped default drafter runs beside them. On held-out prompts
(corpus.heldout_prompts: stdlib files never trained on) each prompt runs AR, then every
drafter, greedy and at T = 0.7 (top-p 0.95, seeded), chain and tree verify, interleaved.
gate=False: fixed block size and tree budget, so the acceptance lengths depend only on the
models (not on the machine's load); tok/s and speedup do depend on it. Columns: mean acceptance
length (committed tokens per round, pooled over prompts), tok/s (tokens after the first over
decode time), speedup over AR in the same run, and whether every prompt's output equals AR's.

    python bench/drafters.py --out /tmp/drafters --json bench/results/drafters.jsonl
    python bench/drafters.py --out /tmp/drafters --steps 20 --prompts 16 --eval-prompts 2 --gen 32  # smoke
    python bench/drafters.py --out /tmp/drafters --kinds dflash2  # one kind beside the shipped drafter
    python bench/drafters.py --out /tmp/drafters --kinds "" --drafter mix=mix.gguf  # a drafter file beside it
    python bench/drafters.py --out /tmp/drafters --kinds dflash2 --window 1024  # a longer training window

--window W: the --kinds' training window (`train-drafter --window`; default 256, the shipped
recipe's); a drafter trained with another window is written as KIND-sS-pP-wW.gguf. The header and
the JSON lines give each drafter's trained window as its GGUF records it (dflash.trained_context_length).

--drafter NAME=PATH (repeatable): a drafter GGUF trained elsewhere (e.g. `train-drafter
--constrained-extra`) measured beside the shipped one and the --kinds, on the same prompts and modes.
--baseline NAME: the drafter the paired per-prompt table compares the others against (default shipped).

--llama-server: llama.cpp's own DFlash beside ours (issue 36, "against llama.cpp's DFlash 2 on the
same files"): llama-server built from the pinned llama-cpp-python sdist's sources
(bench/_llamacpp_server.py), one slot, the same threads, with each drafter GGUF above as its
drafter (`--spec-type draft-dflash`, draft-dspark for the DSpark file: what llama.cpp infers from
the file), at most 15 draft tokens a round (B = 16), and once without a drafter. The same
held-out prompts as token ids, T = 0, interleaved with our runs prompt by prompt. Columns:
llama.cpp's mean acceptance length (its /metrics: 1 + accepted drafts per round), tok/s (its
timings: tokens after the first over the time from the first to the last), speedup over
llama-server's AR and over our AR, and how many prompts' tokens equal our AR's.

    python bench/drafters.py --out /tmp/drafters --llama-server --json bench/results/drafters.jsonl

--cost: the draft pass's cost per kind over DFlash's, random drafters with the same backbone (same
seed, layers, heads, taps) on one random target (the 0.5B-shaped hybrid, or --tiny): the greedy
draft pass (`Spec.draft`: the block, the head, and DFlash 2's lattice read-back and walk) and the
top-1 pass the controller and draft_cutoff use (`_core.testing.draft_top1`), median ms, reps alternating.

    python bench/drafters.py --cost --json bench/results/drafters.jsonl
"""

from __future__ import annotations

import argparse
import statistics
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


def main_cost(a) -> None:
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


def trained_drafters(a) -> dict[str, Path]:
    """The shipped drafter and one trained drafter per kind (KINDS) for the embedded target, in
    a.out (a drafter already there is reused)."""
    from dflash_native.cli import default_pair
    from dflash_native.train import pipeline
    from dflash_native.train.from_gguf import target_checkpoint_from_gguf
    from dflash_native.train.tokenizer import train_tokenizer

    target_gguf, shipped = default_pair()
    a.out.mkdir(parents=True, exist_ok=True)
    target_dir = a.out / "target"
    if not (target_dir / "config.json").is_file():
        target_checkpoint_from_gguf(target_gguf, target_dir, train_tokenizer(a.out / "tokenizer", vocab_size=4096))
    out = {"shipped": shipped}
    for kind in a.kinds:
        # the window in the name unless it is the recipe's 256 (the files trained before --window keep their names)
        gguf = a.out / f"{kind}-s{a.steps}-p{a.prompts}{'' if a.window == 256 else f'-w{a.window}'}.gguf"
        if not gguf.is_file():
            # the shipped drafter's recipe (models/default-drafter-recipe.json) at this budget
            pipeline.run(target_dir, None, a.out / gguf.stem, n_prompts=a.prompts, prompt_tokens=64,
                         max_new_tokens=96, target_layer_ids=[1, 3, 5, 6], target_gguf=target_gguf, out_gguf=gguf,
                         outtype="f16", block_size=16, steps=a.steps, seqs_per_step=8, anchors_per_seq=16,
                         draft_vocab_size=1024 if kind == "dflash" else 0, kind=kind, n_threads=a.threads,
                         engine_threads=a.threads, log_every=50, context_length=4096, window=a.window, long_share=0.25,
                         continuations_file=a.out / f"continuations-p{a.prompts}.json", seed=0)
        out[kind] = gguf
    for name, path in a.drafter:
        out[name] = path
    return {"target": target_gguf, **out}


def gguf_kind(path: Path) -> str:
    """The drafter kind a DFlash-architecture GGUF holds: DFlash 2 (its convolution keys), DSpark
    (its confidence-head key) or DFlash."""
    from gguf import GGUFReader

    keys = GGUFReader(path).fields
    if "dflash.conv_kernel_size" in keys:
        return "dflash2"
    return "dspark" if "dflash.has_confidence_head" in keys else "dflash"


def gguf_window(path: Path) -> int | None:
    """The drafter window a DFlash-architecture GGUF was trained with (dflash.trained_context_length:
    the engine's default drafter window), None when the file has no such key."""
    from gguf import GGUFReader

    f = GGUFReader(path).fields.get("dflash.trained_context_length")
    return None if f is None else int(f.parts[f.data[0]][0])


def main_trained(a) -> None:
    import dflash_native as dn
    from dflash_native.train import corpus

    files = trained_drafters(a)
    target = files.pop("target")
    modes = [(T, v) for T in (0.0, 0.7) for v in ("chain", "tree")]
    engines = {(k, v): dn.Engine(target, drafter=path, block_size=16, n_ctx=96 + a.gen + 64, n_threads=a.threads,
                                 gate=False, verify=v, **({"tree_budget": 15} if v == "tree" else {}))
               for k, path in files.items() for v in ("chain", "tree")}
    ar_eng = engines["shipped", "chain"]
    prompts = corpus.heldout_prompts(a.eval_prompts, 96, ar_eng, seed=0)
    ar_eng.generate(prompts[0].text, max_tokens=8, speculative=False)  # warm-up (graph plans)
    llama = LlamaPeers(target, files, a, n_ctx=96 + a.gen + 64) if a.llama_server else None
    tot = {key: dict(committed=0, rounds=0, n=0, s=0.0, same=0, per_prompt=[]) for key in [("ar", T, "-") for T in (0.0, 0.7)]
           + [(k, T, v) for k in files for T, v in modes]}
    for i, p in enumerate(prompts):
        for T in (0.0, 0.7):
            kw = dict(max_tokens=a.gen, **({"temperature": T, "top_p": 0.95, "seed": i} if T else {}))
            ar = ar_eng.generate(p.text, speculative=False, **kw)
            _add(tot["ar", T, "-"], ar, ar)
            for k in files:
                for v in ("chain", "tree"):
                    _add(tot[k, T, v], engines[k, v].generate(p.text, **kw), ar)
            if llama is not None and T == 0.0:
                llama.run(ar_eng.tokenize(p.text), a.gen, ar.tokens)
    rows = []
    kinds = {k: gguf_kind(path) for k, path in files.items()}
    windows = {k: gguf_window(path) for k, path in files.items()}
    trained = (f"{', '.join(a.kinds)} trained {a.steps} steps on {a.prompts} prompts with a {a.window}-token window "
               f"(shipped and --drafter files: their own recipes), " if a.kinds else "")
    print(f"embedded target, held-out prompts {len(prompts)} x {a.gen} tokens, B = 16, tree budget 15, gate off, "
          f"{trained}{a.threads} threads; trained windows (dflash.trained_context_length): "
          + ", ".join(f"{k} {w}" for k, w in windows.items()))
    print("| drafter | T | verify | mean acceptance length | tok/s | speedup | spec == AR |")
    print("|---|---:|---|---:|---:|---:|---|")
    for (k, T, v), t in tot.items():
        if k == "ar":
            continue
        tok_s, ar_tok_s = t["n"] / t["s"], tot["ar", T, "-"]["n"] / tot["ar", T, "-"]["s"]
        row = dict(bench="drafters_trained", drafter=k, kind=kinds[k], temperature=T, verify=v,
                   mean_acceptance_length=t["committed"] / max(t["rounds"], 1), rounds=t["rounds"], tok_s=tok_s,
                   ar_tok_s=ar_tok_s, speedup=tok_s / ar_tok_s, spec_equals_ar=t["same"], prompts=len(prompts),
                   per_prompt_acceptance_length=t["per_prompt"],
                   gen=a.gen, steps=a.steps if k in KINDS else None, train_prompts=a.prompts if k in KINDS else None,
                   window=a.window if k in KINDS else None, trained_context_length=windows[k],
                   file=files[k].name, threads=a.threads, machine=machine(), isa=isa(), rev=git_rev())
        print(f"| {k} | {T:g} | {v} | {row['mean_acceptance_length']:.2f} | {tok_s:.1f} | {row['speedup']:.2f}x | "
              f"{t['same']}/{len(prompts)} |", flush=True)
        rows.append(row)
    paired_against(tot, rows, a.baseline)
    if llama is not None:
        rows += llama.report(tot["ar", 0.0, "-"]["n"] / tot["ar", 0.0, "-"]["s"], len(prompts))
        llama.close()
    write_jsonl(a.json, rows)


def paired_against(tot: dict, rows: list[dict], base: str) -> None:
    """Per mode, each other drafter's per-prompt mean acceptance length minus drafter `base`'s on
    the same prompt: the mean difference, its standard error and the prompts higher / lower
    (printed, and added to the drafter's row)."""
    others = [key for key in tot if key[0] not in ("ar", base)]
    if not others:
        return
    print(f"\nper prompt, against {base} (paired mean acceptance length difference)")
    print("| drafter | T | verify | mean difference | standard error | prompts higher / lower |")
    print("|---|---:|---|---:|---:|---|")
    for key, row in zip([key for key in tot if key[0] != "ar"], rows):
        if key not in others:
            continue
        d = [x - y for x, y in zip(tot[key]["per_prompt"], tot[base, *key[1:]]["per_prompt"])]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        row.update(paired_baseline=base, diff_vs_baseline=statistics.mean(d), diff_vs_baseline_se=se,
                   prompts_higher=sum(x > 0 for x in d), prompts_lower=sum(x < 0 for x in d))
        print(f"| {key[0]} | {key[1]:g} | {key[2]} | {row['diff_vs_baseline']:+.2f} | {se:.2f} | "
              f"{row['prompts_higher']} / {row['prompts_lower']} |")


class LlamaPeers:
    """llama-server (one slot) per drafter file, and one without a drafter: llama.cpp's DFlash on
    the same files (see the module's --llama-server)."""

    def __init__(self, target: Path, files: dict, a, n_ctx: int):
        from _llamacpp_server import LlamaServer

        self.a = a
        self.files = files
        self.servers = {}
        try:
            self.servers["ar"] = LlamaServer(target, threads=a.threads, ctx_per_slot=n_ctx)
            for k, path in files.items():
                self.servers[k] = LlamaServer(target, threads=a.threads, ctx_per_slot=n_ctx, drafter=path, draft_max=15)
        except BaseException:
            self.close()
            raise
        for srv in self.servers.values():
            srv.complete([1, 2, 3, 4], 8)  # warm-up
        self.before = {k: srv.spec_counters() for k, srv in self.servers.items()}
        self.tot = {k: dict(n=0, s=0.0, same=0) for k in self.servers}

    def run(self, prompt_ids: list[int], gen: int, ar_tokens: list[int]) -> None:
        for k, srv in self.servers.items():
            r = srv.complete(prompt_ids, gen)
            t = self.tot[k]
            t["n"] += max(int(r["timings"].get("predicted_n", 0)) - 1, 0)
            t["s"] += float(r["timings"].get("predicted_ms", 0.0)) / 1e3
            t["same"] += r["tokens"] == list(ar_tokens)

    def report(self, our_ar_tok_s: float, n_prompts: int) -> list[dict]:
        from _llamacpp_server import accept_length, llama_bufts

        rows = []
        llama_ar = self.tot["ar"]["n"] / max(self.tot["ar"]["s"], 1e-9)
        print(f"\nllama.cpp llama-server (pinned sources), one slot, T = 0, at most 15 drafts a round, "
              f"{self.a.threads} threads, the same held-out prompts")
        print("| drafter | llama.cpp type | mean acceptance length | tok/s | speedup over its AR | over our AR | "
              "tokens == our AR |")
        print("|---|---|---:|---:|---:|---:|---|")
        for k, srv in self.servers.items():
            t = self.tot[k]
            tok_s = t["n"] / max(t["s"], 1e-9)
            acc = accept_length(self.before[k], srv.spec_counters()) if srv.spec_type else None
            row = dict(bench="drafters_llamacpp", drafter=k, spec_type=srv.spec_type, temperature=0.0,
                       mean_acceptance_length=acc, tok_s=tok_s, llama_ar_tok_s=llama_ar,
                       speedup_over_llama_ar=tok_s / llama_ar, speedup_over_our_ar=tok_s / our_ar_tok_s,
                       tokens_equal_our_ar=t["same"], prompts=n_prompts, gen=self.a.gen, draft_max=15 if srv.spec_type else None,
                       file=self.files[k].name if k in self.files else None, threads=self.a.threads,
                       peer="llama.cpp llama-server", llama_bufts=llama_bufts(), machine=machine(), isa=isa(),
                       rev=git_rev())
            print(f"| {k if k != 'ar' else '(none: AR)'} | {srv.spec_type or '-'} | "
                  f"{format(acc, '.2f') if acc is not None else '-'} | {tok_s:.1f} | {row['speedup_over_llama_ar']:.2f}x | "
                  f"{row['speedup_over_our_ar']:.2f}x | {t['same']}/{n_prompts} |", flush=True)
            rows.append(row)
        return rows

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()


def _add(t: dict, r, ar) -> None:
    """Adds one generation's rounds, committed tokens, decode time and AR equality to `t`, and its
    mean acceptance length to t["per_prompt"] (for paired comparisons of drafters)."""
    s = r.stats
    committed, rounds = sum(k * n for k, n in enumerate(s.acceptance_histogram)), sum(s.acceptance_histogram)
    t["committed"] += committed
    t["rounds"] += rounds
    t["per_prompt"].append(committed / max(rounds, 1))
    t["n"] += max(s.n_generated - 1, 0)
    t["s"] += s.decode_s
    t["same"] += r.tokens == ar.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost", action="store_true", help="the draft pass's cost per kind (random drafters)")
    ap.add_argument("--tiny", action="store_true", help="--cost: a smoke-run size")
    ap.add_argument("--block", type=int, default=16, help="--cost: block size")
    ap.add_argument("--layers", type=int, default=1, help="--cost: drafter layers")
    ap.add_argument("--reps", type=int, default=20, help="--cost: repetitions")
    ap.add_argument("--out", type=Path, default=CACHE / "drafters", help="trained drafters and their data")
    ap.add_argument("--steps", type=int, default=2500, help="training steps per kind")
    ap.add_argument("--prompts", type=int, default=1536, help="training prompts (the engine continues each)")
    ap.add_argument("--window", type=int, default=256,
                    help="the --kinds' training window (train-drafter --window; the shipped recipe's 256); "
                         "the file name carries it when it is not 256")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per held-out prompt")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to train and measure")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                    help="also this drafter GGUF (repeatable), beside the shipped one and the --kinds")
    ap.add_argument("--baseline", default="shipped", metavar="NAME",
                    help="the drafter the paired per-prompt table compares the others against (shipped, a --kinds "
                         "kind or a --drafter NAME)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", action="store_true",
                    help="also llama.cpp's llama-server with each drafter file (built on first use)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.kinds = [k for k in a.kinds.split(",") if k]
    if not 1 <= a.window <= 4096:  # the recipe's context_length
        ap.error(f"--window: a training window of 1 to 4096 tokens (the recipe's context_length), got {a.window}")
    if unknown := [k for k in a.kinds if k not in KINDS]:
        ap.error(f"--kinds: unknown kind(s) {unknown}, known: {list(KINDS)}")
    named = [d.partition("=") for d in a.drafter]
    if bad := [d for d, (n, eq, p) in zip(a.drafter, named) if not (n and eq and Path(p).is_file())
               or n in ("shipped", "target", *a.kinds)]:
        ap.error(f"--drafter: NAME=PATH of an existing file, NAME not shipped, target or a --kinds kind; got {bad}")
    a.drafter = [(n, Path(p)) for n, _, p in named]
    if not a.cost and a.baseline not in ("shipped", *a.kinds, *(n for n, _ in a.drafter)):
        ap.error(f"--baseline: shipped, a --kinds kind or a --drafter NAME, got {a.baseline!r}")
    (main_cost if a.cost else main_trained)(a)


if __name__ == "__main__":
    main()
