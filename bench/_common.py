"""Shared bench helpers: machine description, timing statistics, JSON lines, cached models."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The random test models (tests/fixtures: the package's random_models with the fixture
# tokenizer) are imported as the tests import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CACHE = Path(os.environ.get("DFLASH_BENCH_CACHE", Path.home() / ".cache" / "dflash-native-bench"))

# A Qwen3.5-0.8B-shaped hybrid (hidden 1024, 24 layers, 3 GDN : 1 attention), vocab cut to
# 151936 (Qwen2.5-0.5B's) so the model is about 0.5-0.6B parameters.
QWEN35_05B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
)


# Qwen3.5-4B's shape (hidden 2560, 32 layers = 24 GDN + 8 gated attention, FFN 9216, GDN 16 key /
# 32 value heads x 128), vocabulary cut to 151936 like the 0.5B shape above.
QWEN35_4B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True,
)


# A mixture-of-experts target of about 1B parameters that fits this machine, in Qwen3.5-MoE's
# layout (the flagship DFlash target family): the 0.5B hybrid's attention and GDN layers with 16
# routed experts of width 512 (top-4) and a shared expert of width 512 in every layer: ~1.03B
# parameters in all (0.60B in experts), ~0.58B read per token.
QWEN35MOE_1B = dict(
    {k: v for k, v in QWEN35_05B.items() if k != "intermediate_size"},
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
)
QWEN35MOE_TINY = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, head_dim=64, linear_key_head_dim=64,
                      linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def bench_target(moe: bool, tiny: bool) -> tuple[str, str, dict]:
    """(cache name, random_models arch, config overrides) of the benchmarks' random target: the
    0.5B hybrid or, with moe, the 1B Qwen3.5-MoE shape; tiny: a smoke-run size of either."""
    if moe:
        return ("qwen35moe-tiny", "qwen3_5_moe", dict(QWEN35MOE_TINY)) if tiny else \
            ("qwen35moe-1b", "qwen3_5_moe", dict(QWEN35MOE_1B))
    if tiny:
        return "qwen35-tiny", "qwen3_5", dict(vocab_size=4096, hidden_size=256, intermediate_size=512,
                                              num_hidden_layers=4)
    return "qwen35-0.5b", "qwen3_5", dict(QWEN35_05B)


def resolve_pair(target, drafter) -> tuple[Path, Path]:
    """--target/--drafter, each defaulting to the embedded pair's file."""
    from dflash_native.cli import default_pair

    if target is None or drafter is None:
        pair = default_pair()
        if pair is None:
            raise SystemExit("no embedded pair in this install: give --target and --drafter")
        target, drafter = target or pair[0], drafter or pair[1]
    return target, drafter


def machine() -> str:
    """CPU model, cores, OS and the ISA (isa()): every JSON line records it, since figures from
    different CPUs must never be mixed."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, ISA {isa()}, ggml {ggml_isa()}"


def ggml_isa() -> str:
    """The x86 / vector features the ggml both engines load was built with (llama.cpp's system
    info: "AVX AVX2 F16C FMA ..."; the dev env's -march=native ggml lists AVX512 here, the
    AVX2-only one of bench/isa_env.py does not); "unknown" without llama_cpp."""
    try:
        import llama_cpp
    except ImportError:
        return "unknown"
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    on = [f for f, v in re.findall(r"(\w+) = (\d+)", info) if v == "1" and f.startswith(("SSE", "AVX", "F16C", "FMA",
                                                                                              "AMX", "NEON", "SVE"))]
    return " ".join(on) or "no vector features"


def isa() -> str:
    """The ISA the engine's own kernels run ("avx2 (capped)" under DFLASH_NATIVE_ISA=avx2:
    bench/isa_env.py) and the CPU's vector flags (what the numbers depend on)."""
    from dflash_native import _core

    flags: set[str] = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    keep = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile")
            if f in flags]
    return f"{_core.isa()} ({' '.join(keep) or 'no cpuinfo flags'})"


def llama_bufts(plain: bool = False) -> str:
    """How the benchmarks let llama.cpp (llama-cpp-python) place its weights, recorded in their
    JSON lines as `llama_bufts`; call llama_prepare(path) before each llama_cpp.Llama:

    - "default": llama.cpp's own choice (its extra buffer types: AMX where the CPU and this ggml
      have it, else CPU_REPACK's repacked GEMV / GEMM weights), on a CPU without AMX;
    - "repack (no AMX)": on a CPU with AMX_INT8, whose AMX path crashes (SIGSEGV) on batched
      quantized matmuls (llama-cpp-python 0.3.36; tests/llamacpp_tools.py): the matrices CPU_REPACK
      takes are repacked as on a CPU without AMX (AMD Zen 4, most Intel parts), the rest plain
      (llamacpp_tools.repack_without_amx);
    - "plain" (plain=True, the benches' --no-extra-bufts): no extra buffer types, llama.cpp's plain
      CPU kernels anywhere."""
    import llama_cpp.llama_cpp as L

    if plain:
        from llamacpp_tools import plain_cpu_kernels

        plain_cpu_kernels()
        return "plain"
    if (not os.path.exists("/proc/cpuinfo") or "amx_int8" not in open("/proc/cpuinfo").read()
            or "AMX_INT8 = 1" not in L.llama_print_system_info().decode(errors="replace")):
        return "default"  # no AMX in the CPU, or none in this ggml (bench/isa_env.py's AVX2-only build)
    return "repack (no AMX)"


def llama_prepare(path, bufts: str) -> None:
    """Before llama_cpp.Llama(model_path=path): the overrides that "repack (no AMX)" needs for this
    file (none left from another file in the other modes)."""
    from llamacpp_tools import clear_repack, repack_without_amx

    if bufts == "repack (no AMX)":
        repack_without_amx(path)
    else:
        clear_repack()


def cached_gguf(name: str, arch: str, outtype: str, seed: int = 0, **overrides) -> Path:
    """Build (once) a random model with the package's own converter."""
    from fixtures import make_random_gguf

    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{name}-{outtype}-s{seed}.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp.gguf")
        make_random_gguf(tmp, arch, outtype=outtype, seed=seed, **overrides)
        tmp.rename(path)
    return path


def cached_typed_gguf(name: str, arch: str, outtype: str, seed: int = 0, **overrides) -> Path:
    """cached_gguf for our converter's types (f32, f16, bf16, q8_0); any other type
    (dflash_native.quantization.FTYPES: q4_k_m, q6_k, q4_0, iq4_xs, ...) is llama.cpp's quantizer
    over the cached F16 file, cached beside it."""
    from dflash_native.convert import OUTTYPES

    if outtype in OUTTYPES:
        return cached_gguf(name, arch, outtype, seed, **overrides)
    import dflash_native as dn

    path = CACHE / f"{name}-{outtype}-s{seed}.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp.gguf")
        dn.quantize(cached_gguf(name, arch, "f16", seed, **overrides), tmp, outtype)
        tmp.rename(path)
    return path


def cached_drafter(target_name: str, outtype: str, shape: dict, block_size: int, n_layers: int, seed: int = 1,
                   target_gguf: Path | None = None):
    """A random DFlash drafter for a cached random target (only the shape matters for speed).
    target_gguf: the drafter carries that target's tokenizer (its mask token included), as a
    converted DFlash GGUF does; llama.cpp's DFlash needs it (without a vocabulary its mask token
    is -1). Without it, no vocabulary (the older cached files)."""
    from dflash_native.random_models import make_random_drafter_gguf

    tok = f"-b{block_size}-vocab" if target_gguf is not None else ""
    path = CACHE / f"{target_name}-drafter{n_layers}{tok}-{outtype}-s{seed}.gguf"
    if not path.exists():
        cfg = dict(shape, model_type="qwen3_5_text", num_hidden_layers=shape["num_hidden_layers"],
                   mask_token_id=shape["vocab_size"] - 1)
        n = shape["num_hidden_layers"]
        ids = [1, n // 2, n - 2] if n_layers > 1 else [n // 2]
        tmp = path.with_suffix(".tmp.gguf")
        make_random_drafter_gguf(tmp, cfg, outtype=outtype, seed=seed, block_size=block_size,
                                 num_hidden_layers=n_layers, target_layer_ids=ids,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 target_gguf=target_gguf)
        tmp.rename(path)
    return path


def concurrent_clients(per_client: list[list], call, shared: bool = False) -> tuple[float, list[tuple[float, object]]]:
    """len(per_client) client threads started together, thread i calling call(i, item) on its
    items per_client[i] one after another; shared: the items in one queue instead (the first of
    every client's, then the second, ...), each thread taking the next when its call returns, so
    that C requests stay in flight until the queue is empty (a serving benchmark's max
    concurrency; per client, the wall time is the slowest client's list). Returns the wall seconds
    from the common start to the last return and every call's (seconds, result), client by client,
    each in its items' order (whichever thread ran it); a call's exception is re-raised here."""
    import collections
    import threading

    C = len(per_client)
    out: list[list] = [[None] * len(items) for items in per_client]
    errors: list[BaseException] = []
    go = threading.Barrier(C + 1)
    width = max((len(items) for items in per_client), default=0)
    queue = collections.deque((c, j) for j in range(width) for c in range(C) if j < len(per_client[c]))
    lock = threading.Lock()

    def take(i):
        if not shared:
            return None
        with lock:
            return queue.popleft() if queue else None

    def client(i):
        try:
            go.wait()
            j = 0
            while True:
                job = take(i) if shared else ((i, j) if j < len(per_client[i]) else None)
                if job is None:
                    return
                c, k = job
                j += 1
                t0 = time.perf_counter()
                r = call(i, per_client[c][k])
                out[c][k] = (time.perf_counter() - t0, r)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(C)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, [x for o in out for x in o]


def summarize(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *a):
        self.s = time.perf_counter() - self.t0


def pass_timers(t, ll, prompt, block, greedy: bool = False):
    """(ours(n), llama(n)): the seconds of one n-token pass after `prompt`, ours on a _core.Target
    (n = 1 an AR step, else a verify followed by commit(1); greedy: only the argmax ids come back,
    else every row's logits) and llama.cpp's eval of n tokens (llama-cpp-python's Llama)."""
    def ours(n):
        t.reset()
        t.decode(prompt) if not greedy else t.decode_greedy(prompt)
        with Timer() as tm:
            if n == 1:
                t.decode_greedy(block[:1])
            elif greedy:
                t.verify_greedy(block[:n])
            else:
                t.verify(block[:n])
        if n > 1:
            t.commit(1)
        return tm.s

    def llama(n):
        ll.reset()
        ll.eval(prompt)
        with Timer() as tm:
            ll.eval(block[:n])
        return tm.s

    return ours, llama


def write_jsonl(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def heldout_eval(target, drafter, blocks, *, cutoffs=(0.0,), n_prompts: int = 16, prompt_tokens: int = 96,
                 gen: int = 128, threads: int = 2, seed: int = 0, label: str = "pair",
                 matmul: str = "own", draft_vocabs=(True,), reps: int = 1, gate: bool = True) -> list[dict]:
    """Greedy AR vs DFlash on held-out code prompts (train/corpus.heldout_prompts: stdlib files
    never trained on), one engine per block size; per prompt AR runs, then DFlash at each
    `cutoffs` value (Engine.draft_cutoff), side by side. Prints a table; returns one row per
    (block size, cutoff, draft vocabulary on/off: `draft_vocabs`). tok/s counts the tokens after
    the first (which comes from the prefill) over decode time; with reps > 1, each prompt runs AR and every DFlash setting reps
    times, interleaved, and each one's fastest pass counts (its tokens are the same every pass).
    "spec == AR" is the lossless rule: the prompts whose speculative
    output is identical to AR's, and for the others the top-2 logit gap of AR's logits where they
    first differ (F16/F32 batched and single-token matmuls round differently, so a divergence is
    only allowed at a near-tie: dflash_native.lossless)."""
    import numpy as np

    import dflash_native as dn
    from dflash_native.lossless import first_divergence_gap, verdict
    from dflash_native.train import corpus

    rows = []
    print("| B | cutoff | draft vocab | mean acceptance length (pooled) | per-prompt mean | mean verified | AR tok/s "
          "| DFlash tok/s | speedup | draft ms | verify ms | rollback ms | other ms | rounds | spec == AR |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for B in blocks:
        eng = dn.Engine.for_benchmark(target, drafter=drafter, block_size=B, n_ctx=prompt_tokens + gen + 2 * B + 8,
                                      n_threads=threads, matmul=matmul, gate=gate)
        prompts = corpus.heldout_prompts(n_prompts, prompt_tokens, eng, seed=seed)
        eng.draft_vocab = True
        n_dv = len(eng._spec.draft_vocab)  # tokens in the drafter's draft vocabulary (0: it has none)
        eng.generate(prompts[0].text, max_tokens=16, speculative=False)  # warm-up (graph plans, caches)
        eng.generate(prompts[0].text, max_tokens=16)
        ar_s, n_ar = 0.0, 0
        per = {(c, dv): dict(acc=[], committed=0, verified=0, gaps=[], sp=0.0, n_sp=0, draft=0.0, verify=0.0,
                             rollback=0.0, rounds=0)
               for dv in draft_vocabs for c in cutoffs}
        for p in prompts:
            # `reps` interleaved passes per prompt, each configuration's fastest kept: on a shared
            # machine, bursts of stolen time land on one pass or another, rarely on all of them
            ar_runs, sp_runs = [], {key: [] for key in per}
            for _ in range(reps):
                ar_runs.append(eng.generate(p.text, max_tokens=gen, speculative=False))
                for (c, dv) in per:
                    eng.draft_cutoff = c
                    eng.draft_vocab = dv
                    sp_runs[(c, dv)].append(eng.generate(p.text, max_tokens=gen))
            ar = min(ar_runs, key=lambda r: r.stats.decode_s)
            ar_s += ar.stats.decode_s
            n_ar += max(ar.stats.n_generated - 1, 0)
            for key, t in per.items():
                sp = min(sp_runs[key], key=lambda r: r.stats.decode_s)
                s = sp.stats
                t["gaps"].append(first_divergence_gap(eng, p.text, ar.tokens, sp.tokens))
                t["acc"].append(s.mean_acceptance_length)
                t["committed"] += sum(k * n for k, n in enumerate(s.acceptance_histogram))
                t["verified"] += s.verified_tokens
                t["sp"] += s.decode_s
                t["n_sp"] += max(s.n_generated - 1, 0)
                for k in ("draft", "verify", "rollback"):
                    t[k] += getattr(s, k + "_s")
                t["rounds"] += s.rounds
        ar_tok_s = n_ar / ar_s
        for (c, dv), t in per.items():
            R = max(t["rounds"], 1)
            sp_tok_s = t["n_sp"] / t["sp"]
            other = (t["sp"] - t["draft"] - t["verify"] - t["rollback"]) / R
            ok, cell = verdict(t["gaps"])
            row = {"bench": "spec_e2e_heldout", "pair": label, "B": B, "draft_cutoff": c,
                   "draft_vocab": n_dv if dv else 0,
                   # pooled over all rounds of all prompts (what the speedup sees); the per-prompt mean
                   # weights a short-round prompt like a long one and reads higher
                   "mean_acceptance_length": t["committed"] / R, "mean_verified_length": t["verified"] / R,
                   "mean_acceptance_length_per_prompt": float(np.mean(t["acc"])),
                   "ar_tok_s": ar_tok_s, "spec_tok_s": sp_tok_s, "speedup": sp_tok_s / ar_tok_s,
                   "draft_ms_per_round": 1e3 * t["draft"] / R, "verify_ms_per_round": 1e3 * t["verify"] / R,
                   "rollback_ms_per_round": 1e3 * t["rollback"] / R, "other_ms_per_round": 1e3 * other,
                   "reps": reps,
                   "rounds": t["rounds"], "spec_identical_prompts": t["gaps"].count(None),
                   "divergence_gaps": t["gaps"], "lossless": ok, "prompts": len(prompts),
                   "prompt_tokens": prompt_tokens, "gen": gen, "threads": threads,
                   "matmul": matmul, "target": Path(target).name, "drafter": Path(drafter).name, "machine": machine(),
                   "rev": git_rev()}
            print(f"| {B} | {c:g} | {row['draft_vocab'] or 'all'} | {row['mean_acceptance_length']:.2f} | "
                  f"{row['mean_acceptance_length_per_prompt']:.2f} | "
                  f"{row['mean_verified_length']:.2f} | "
                  f"{ar_tok_s:.1f} | {sp_tok_s:.1f} | {row['speedup']:.2f}x | {row['draft_ms_per_round']:.2f} | "
                  f"{row['verify_ms_per_round']:.2f} | {row['rollback_ms_per_round']:.2f} | "
                  f"{row['other_ms_per_round']:.2f} | {t['rounds']} | {cell} |", flush=True)
            rows.append(row)
    return rows


def load_phase_args(ap, *, load: int, gen: int) -> None:
    """The options of a bench run in quiet / load / after phases (controller_load.py, threads_load.py)."""
    ap.add_argument("--target"), ap.add_argument("--drafter")
    ap.add_argument("--load", type=int, default=load, help="busy-loop processes during the load phase")
    ap.add_argument("--requests", type=int, default=4, help="requests per phase")
    ap.add_argument("--gen", type=int, default=gen)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)


def load_phases(n_load: int):
    """Yields "quiet", "load" and "after"; during "load", n_load busy-loop processes
    (`while True: pass`) run beside the caller, killed when the phase ends."""
    for phase in ("quiet", "load", "after"):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n_load)] \
            if phase == "load" else []
        try:
            yield phase
        finally:
            for p in procs:
                p.kill()
                p.wait()
