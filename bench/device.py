"""The device path (docs/architecture.md, "Devices"), side by side in one run on one device:

  1. AR decode tok/s, ours against llama.cpp (llama-cpp-python) on the same device and file;
  2. the verify cost of 2..32 tokens over one AR step (ours: greedy verify, argmax ids back; llama.cpp:
     eval of N tokens over eval of 1, logits back as it always does);
  3. the acceptance-controlled speedup at block B (16) for tau in {4, 8, 12}: the real drafter runs,
     its tokens are replaced by the AR continuation with a miss after tau - 1 drafts, and the bound
     tau * t_AR / (t_verify(B) + t_draft) comes from the same run's timings;
  4. GDN rollback: the input tape (commit replays it through ggml_gated_delta_net) against ggml's
     per-token state snapshots: memory and commit time per round;
  5. on RPC, the bytes that cross loopback per AR step and per round (counted on `lo` by the kernel,
     /proc/net/dev), and from them the round time of a 2-machine layer split of a 27B Q4_K_M target
     on 10 GbE, next to AR's (the model is printed with the table).

    python bench/device.py --device rpc --model tiny --json bench/results/device.jsonl   # RPC servers on loopback
    python bench/device.py --device CUDA0 --model 4b --outtypes q4_k_m,q8_0 --json ...    # a GPU (bench/gpu/run.sh)

--device rpc starts two `dflash-native rpc-server` processes on loopback, one for our engine and
one for llama.cpp (a server serves one client connection at a time). Figures over RPC on this
machine say that the path works, not how fast a device is.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (QWEN35_05B, QWEN35_4B, Timer, cached_drafter, cached_typed_gguf, git_rev, machine,  # noqa: E402
                     pass_timers, summarize, write_jsonl)

VERIFY_SIZES = (2, 4, 8, 16, 32)
MODELS = {
    "tiny": ("qwen35-tiny-dev", dict(QWEN35_05B, vocab_size=4096, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=4, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                                     linear_num_key_heads=4, linear_num_value_heads=4)),
    "0.5b": ("qwen35-0.5b", dict(QWEN35_05B)),
    "4b": ("qwen35-4b", dict(QWEN35_4B)),
}


def bench_models(model: str, outtype: str, B: int) -> tuple[Path, Path]:
    """(target, drafter) GGUFs of a random MODELS[model] target: F16 from the package's converter,
    any other type llama.cpp's quantizer over it (cached); a 1-layer drafter, F16 or Q8_0."""
    import dflash_native as dn

    name, shape = MODELS[model]
    with Timer() as tb:
        f16 = cached_typed_gguf(name, "qwen3_5", "f16", **shape)
        target = f16
        if outtype != "f16":
            target = f16.with_name(f16.name.replace("-f16-", f"-{outtype}-q-"))
            if not target.exists():
                tmp = target.with_suffix(".tmp.gguf")
                dn.quantize(f16, tmp, outtype, progress=False)
                tmp.rename(target)
        drafter = cached_drafter(name, "f16" if outtype == "f16" else "q8_0", shape, B, 1)
    print(f"{name} {outtype}: {target.stat().st_size / 2**30:.2f} GiB, models ready in {tb.s:.0f} s", flush=True)
    return target, drafter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_native", "rpc-server", "--port", str(port), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the RPC server did not start")


def lo_bytes() -> int:
    """Bytes received on loopback so far (each byte a client and server exchange, counted once)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


def llama_worker(a) -> None:
    """llama.cpp's side, in a process of its own (so that it sees only its own RPC server: llama.cpp
    offloads to every GPU-type device registered in the process): prints one JSON line."""
    import json

    import ctypes

    import llama_cpp

    rpc = a.device.startswith("rpc://")
    if rpc:
        # llama.cpp's --rpc: register the server's devices with llama.cpp's own ggml (this package may
        # carry a copy of its own), then offload every layer to the GPU-type devices registered
        # the libggml llama.cpp itself loaded (a wheel holds libggml.so and libggml.so.0 as two copies)
        loaded = {line.split()[-1] for line in open("/proc/self/maps") if "/libggml.so" in line}
        ggml = ctypes.CDLL(min(loaded, key=lambda p: (not p.endswith(".so.0"), p)))
        vp = ctypes.c_void_p
        ggml.ggml_backend_reg_by_name.restype = vp
        ggml.ggml_backend_reg_get_proc_address.restype = vp
        ggml.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
        ggml.ggml_backend_reg_dev_count.argtypes = [vp]
        ggml.ggml_backend_reg_dev_get.restype = vp
        ggml.ggml_backend_reg_dev_get.argtypes = [vp, ctypes.c_size_t]
        ggml.ggml_backend_device_register.argtypes = [vp]
        reg = ggml.ggml_backend_reg_by_name(b"RPC")
        assert reg, "llama.cpp's ggml has no RPC backend"
        add = ctypes.CFUNCTYPE(vp, ctypes.c_char_p)(ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server"))
        srv = add(a.device[len("rpc://"):].encode())
        for i in range(ggml.ggml_backend_reg_dev_count(srv)):
            ggml.ggml_backend_device_register(ggml.ggml_backend_reg_dev_get(srv, i))
    ll = llama_cpp.Llama(model_path=str(a.worker_model), n_ctx=a.worker_n_ctx, n_threads=a.threads,
                         n_threads_batch=a.threads, n_batch=512, n_ubatch=512, flash_attn=True, verbose=False,
                         n_gpu_layers=-1 if a.device != "cpu" else 0)
    n_vocab = ll.n_vocab()
    prompt = [int(x) for x in np.random.default_rng(0).integers(10, 600, a.prompt_len)]

    def argmax():
        return int(np.argmax(np.ctypeslib.as_array(ll._ctx.get_logits(), shape=(n_vocab,))))

    def ar():
        ll.reset()
        ll.eval(prompt)
        tok = argmax()
        with Timer() as td:
            for _ in range(32):
                ll.eval([tok])
                tok = argmax()
        return td.s / 32

    ar()
    b0 = lo_bytes()
    ar_s = summarize([ar() for _ in range(a.reps)])["median"]
    # over RPC the steps must have crossed loopback: else llama.cpp ran on this process's CPU
    assert not rpc or lo_bytes() - b0 > 1000 * a.reps, "llama.cpp did not run on the RPC server"
    print(json.dumps({"ar_s": ar_s, "verify": verify_times(None, ll, prompt, a.reps)}))


def llama_side(a, target, device, n_ctx) -> dict:
    import json

    out = subprocess.run([sys.executable, __file__, "--llama-worker", "--worker-model", str(target), "--worker-n-ctx",
                          str(n_ctx), "--device", device, "--threads", str(a.threads), "--reps", str(a.reps),
                          "--prompt-len", str(a.prompt_len)], capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"llama.cpp worker failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def ours_ar(t, prompt, reps, n_decode=32):
    """Our AR decode seconds per token (greedy, the argmax id is what comes back), the median of reps."""
    def run():
        t.reset()
        tok = int(t.decode_greedy(prompt))
        with Timer() as td:
            for _ in range(n_decode):
                tok = int(t.decode_greedy([tok]))
        return td.s / n_decode

    run()  # warm-up: graph plans, kernels
    return summarize([run() for _ in range(reps)])["median"]


def verify_times(t, ll, prompt, reps):
    """{n: median seconds of an n-token pass} for n = 1 and VERIFY_SIZES: ours (t) or llama.cpp's (ll)."""
    block = [int(x) for x in np.random.default_rng(1).integers(10, 600, max(VERIFY_SIZES))]

    ours, llama = pass_timers(t, ll, prompt, block, greedy=True)
    fn = ours if t is not None else llama
    for n in (1,) + VERIFY_SIZES:
        fn(n)  # warm-up: one plan per size
    return {n: summarize([fn(n) for _ in range(reps)])["median"] for n in (1,) + VERIFY_SIZES}


def forced(ref, tau):
    def override(prompt, out, Bc):
        good = (list(ref[len(out): len(out) + Bc - 1]) + [0] * Bc)[: Bc - 1]
        if tau < Bc:  # accept tau - 1 drafts, then a wrong one: every round commits tau tokens
            good[tau - 1] = (good[tau - 1] + 1) % 500
        return good
    return override


def speedup(eng, prompt, gen, taus, B):
    import dflash_native  # noqa: F401

    eng.generate(prompt, max_tokens=8, speculative=False)  # warm-up
    ar = eng.generate(prompt, max_tokens=gen + B + 1, speculative=False)
    ref = ar.tokens
    t_ar = ar.stats.decode_s / max(ar.stats.n_generated - 1, 1)
    rows = []
    for tau in taus:
        eng._draft_override = forced(ref, tau)
        eng.generate(prompt, max_tokens=B + 2)  # warm-up
        r = eng.generate(prompt, max_tokens=gen)
        st = r.stats
        t_draft, t_verify = st.draft_s / st.rounds, st.verify_s / st.rounds
        tau_m = st.mean_acceptance_length
        bound = tau_m * t_ar / (t_verify + t_draft)
        rows.append(dict(tau_target=tau, mean_acceptance_length=tau_m, tok_s=st.decode_tok_s, ar_tok_s=1 / t_ar,
                         speedup=st.decode_tok_s * t_ar, bound=bound, measured_over_bound=st.decode_tok_s * t_ar / bound,
                         t_draft_s=t_draft, t_verify_s=t_verify, rollback_s_per_round=st.rollback_s / st.rounds,
                         identical=r.tokens == ref[:gen], rounds=st.rounds))
    eng._draft_override = None
    return rows


def rollback_compare(target, drafter, device, prompt, gen, B, threads, n_ctx):
    """{mode: (GDN tape or snapshot bytes, commit seconds per round)} at tau = B / 2."""
    import dflash_native as dn

    out = {}
    for mode in ("tape", "snapshot"):
        eng = dn.Engine.for_benchmark(target, drafter=drafter, rollback=mode, device=device, block_size=B, n_ctx=n_ctx,
                                      n_threads=threads, gate=False)
        ref = eng.generate(prompt, max_tokens=gen + B + 1, speculative=False).tokens
        eng._draft_override = forced(ref, B // 2)
        eng.generate(prompt, max_tokens=B + 2)
        st = eng.generate(prompt, max_tokens=gen).stats
        out[mode] = (eng.memory_report()["gdn_tape"], st.rollback_s / st.rounds)
        eng.close()
    return out


def bytes_per_step(t, eng, prompt, B, gen):
    """Loopback bytes per AR step and per round (tau = B / 2) of our engine over RPC."""
    t.reset()
    tok = int(t.decode_greedy(prompt))
    b0 = lo_bytes()
    n = 16
    for _ in range(n):
        tok = int(t.decode_greedy([tok]))
    ar = (lo_bytes() - b0) / n
    ref = eng.generate(prompt, max_tokens=gen + B + 1, speculative=False).tokens
    eng._draft_override = forced(ref, B // 2)
    b0 = lo_bytes()
    st = eng.generate(prompt, max_tokens=gen).stats
    per_round = (lo_bytes() - b0) / st.rounds
    eng._draft_override = None
    return ar, per_round


def split_model(ar_bytes, round_bytes, n_embd_here, B, t_ar_dev, t_round_dev):
    """The round of a 27B Q4_K_M target split by layers over 2 machines on 10 GbE. Model: the
    client's traffic (inputs, ids) is what this run measured, unchanged by the split; the split adds
    one hidden-state hand-off per pass between the machines, n_embd x tokens F32 (27B: n_embd 5120),
    at 1.25 GB/s plus a 50 us one-way latency per message; compute is the same device time spread
    over the two machines' layers (sequential: a pipeline of one request does not overlap)."""
    bw, lat, n_embd = 1.25e9, 50e-6, 5120
    hand_ar = lat + n_embd * 4 / bw
    hand_round = lat + n_embd * B * 4 / bw
    client_ar = lat + ar_bytes / bw
    client_round = 2 * lat + round_bytes / bw
    return dict(model="27B Q4_K_M, 2 machines, 10 GbE (1.25 GB/s, 50 us latency), compute as measured here",
                ar_s=t_ar_dev + client_ar + hand_ar, round_s=t_round_dev + client_round + 2 * hand_round,
                ar_network_s=client_ar + hand_ar, round_network_s=client_round + 2 * hand_round)


def main():
    import dflash_native as dn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="rpc", help="rpc (two local RPC servers), or a ggml device name (CUDA0)")
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--outtypes", default="q8_0")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (each RPC server's, or the host's)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--taus", default="4,8,12")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker-n-ctx", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llama_worker:
        return llama_worker(a)

    name, shape = MODELS[a.model]
    B = a.block
    taus = [int(x) for x in a.taus.split(",")]
    prompt = [int(x) for x in np.random.default_rng(0).integers(10, 600, a.prompt_len)]
    n_ctx = a.prompt_len + a.gen + 3 * B + 16
    servers = []
    if a.device == "rpc":
        p1, ours_ep = start_rpc_server(a.threads)
        p2, llama_ep = start_rpc_server(a.threads)
        servers = [p1, p2]
        device, llama_device = f"rpc://{ours_ep}", f"rpc://{llama_ep}"
    else:
        device = llama_device = a.device
    print(f"# device: {machine()}; device {device} ({dn._core.resolve_device(device)}); {name}; threads={a.threads}, "
          f"B={B}, prompt={a.prompt_len}, gen={a.gen}; rev {git_rev()}")
    rows = []
    try:
        for outtype in a.outtypes.split(","):
            print(f"\n## {outtype}")
            target, drafter = bench_models(a.model, outtype, B)
            base = dict(bench="device", device=device, device_name=dn._core.resolve_device(device), model=name,
                        outtype=outtype, threads=a.threads, machine=machine(), rev=git_rev())
            from dflash_native import _core

            t = _core.Target(str(target), n_ctx=n_ctx, n_threads=a.threads, kv_type="f16", device=device,
                             max_verify=max(VERIFY_SIZES))
            # ours, llama.cpp (its own process), ours again: the median of both of our halves
            ours_a = ours_ar(t, prompt, a.reps)
            ours_v = verify_times(t, None, prompt, a.reps)
            peer = llama_side(a, target, llama_device, n_ctx)
            ours_s = summarize([ours_a, ours_ar(t, prompt, a.reps)])["median"]
            llama_s = peer["ar_s"]
            print(f"AR decode: ours {1 / ours_s:.1f} tok/s, llama.cpp {1 / llama_s:.1f} tok/s, ratio {llama_s / ours_s:.2f}")
            rows.append(base | dict(section="ar", ours_tok_s=1 / ours_s, llama_tok_s=1 / llama_s,
                                    ratio=llama_s / ours_s))
            lv = {int(k): v for k, v in peer["verify"].items()}
            print("verify of N over one AR step: " + "  ".join(
                f"N={n}: {ours_v[n] / ours_v[1]:.2f} (llama.cpp {lv[n] / lv[1]:.2f})" for n in VERIFY_SIZES))
            rows.append(base | dict(section="verify_curve", ours_s={str(k): v for k, v in ours_v.items()},
                                    llama_s={str(k): v for k, v in lv.items()}))

            eng = dn.Engine(target, drafter=drafter, device=device, block_size=B, n_ctx=n_ctx, n_threads=a.threads,
                            gate=False)
            sp = speedup(eng, prompt, a.gen, taus, B)
            print(f"{'tau':>6}{'tok/s':>9}{'speedup':>9}{'bound':>8}{'meas/bound':>11}{'t_draft ms':>11}"
                  f"{'t_verify ms':>12}{'commit ms':>10}{'same':>6}")
            for r in sp:
                print(f"{r['mean_acceptance_length']:>6.2f}{r['tok_s']:>9.1f}{r['speedup']:>9.2f}{r['bound']:>8.2f}"
                      f"{r['measured_over_bound']:>11.3f}{r['t_draft_s'] * 1e3:>11.2f}{r['t_verify_s'] * 1e3:>12.2f}"
                      f"{r['rollback_s_per_round'] * 1e3:>10.2f}{'yes' if r['identical'] else 'NO':>6}")
                rows.append(base | dict(section="speedup", B=B) | r)
            rb = rollback_compare(target, drafter, device, prompt, a.gen, B, a.threads, n_ctx)
            print(f"GDN rollback at tau = {B // 2}: input tape {rb['tape'][0] / 2**20:.2f} MiB, commit "
                  f"{rb['tape'][1] * 1e3:.2f} ms/round; snapshots {rb['snapshot'][0] / 2**20:.2f} MiB, commit "
                  f"{rb['snapshot'][1] * 1e3:.2f} ms/round")
            rows.append(base | dict(section="rollback", B=B, tape_bytes=rb["tape"][0], tape_commit_s=rb["tape"][1],
                                    snapshot_bytes=rb["snapshot"][0], snapshot_commit_s=rb["snapshot"][1]))
            if a.device == "rpc":
                ar_b, round_b = bytes_per_step(t, eng, prompt, B, a.gen)
                t_round = sp[0]["t_draft_s"] + sp[0]["t_verify_s"] + sp[0]["rollback_s_per_round"]
                m = split_model(ar_b, round_b, shape["hidden_size"], B, ours_s, t_round)
                print(f"loopback bytes: {ar_b / 1024:.1f} KiB per AR step, {round_b / 1024:.1f} KiB per round "
                      f"(tau {B // 2}); {m['model']}: AR {m['ar_s'] * 1e3:.2f} ms "
                      f"(network {m['ar_network_s'] * 1e3:.2f}), round {m['round_s'] * 1e3:.2f} ms "
                      f"(network {m['round_network_s'] * 1e3:.2f})")
                rows.append(base | dict(section="rpc_bytes", B=B, ar_bytes=ar_b, round_bytes=round_b) | m)
            eng.close()
            del t
    finally:
        for p in servers:
            p.kill()
    write_jsonl(a.json, rows)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
