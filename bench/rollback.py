"""Hybrid rollback cost per verify: GDN tape replay vs per-token state snapshots vs re-decode.

Kernel level, at Qwen3.5-4B GDN dims by default (d_k = d_v = 128, 32 value heads, 16 key heads,
24 GDN layers, conv kernel 4), T = 16 verified tokens, accepting n of them:

- tape (ours): the verify pass records (k, u, g) per token per head; rollback replays the n
  accepted tokens from the untouched state. Extra work in verify: writing the tape.
- snapshot (llama.cpp's way for Qwen3.5): the verify pass copies the full state after every
  token; rollback copies snapshot n back.
- re-decode: save the state before verify, restore it, and run the accepted tokens again
  (here only the GDN recurrence is re-run: a lower bound; the real cost is a target forward).

Bytes are per verify, all GDN layers. Times are per verify, all GDN layers, single thread.

    python bench/rollback.py --json bench/results/rollback.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN35_05B, QWEN35_4B, cached_drafter, cached_gguf, git_rev, machine, summarize, write_jsonl  # noqa: E402


def timeit(fn, reps):
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return summarize(out)


def main():
    from dflash_native import _core

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--h-v", type=int, default=32)
    ap.add_argument("--h-k", type=int, default=16)
    ap.add_argument("--gdn-layers", type=int, default=24)
    ap.add_argument("--d-conv", type=int, default=4)
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--engine", action="store_true", help="also compare the three rollbacks inside the engine")
    ap.add_argument("--verify-4b", action="store_true",
                    help="time a B=16 verify forward and its rollback on a Qwen3.5-4B-shaped Q8_0 target")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    d, H_v, H_k, T, L = a.d, a.h_v, a.h_k, a.T, a.gdn_layers
    n_ch = d * (2 * H_k + H_v)
    rng = np.random.default_rng(0)

    def l2(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q, k = l2(rng.standard_normal((T, H_k, d))), l2(rng.standard_normal((T, H_k, d)))
    v = rng.standard_normal((T, H_v, d)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (T, H_v)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, H_v)).astype(np.float32)
    S0 = (0.1 * rng.standard_normal((H_v, d, d))).astype(np.float32)
    _, tk, tu, tg = _core.gdn_tape_record(q, k, v, g, beta, S0)

    state_bytes = S0.nbytes
    tape_bytes = tk.nbytes + tu.nbytes + tg.nbytes
    conv_in_bytes = T * n_ch * 4              # both need the conv inputs (tape) or conv states (snapshots)
    conv_snap_bytes = T * (a.d_conv - 1) * n_ch * 4

    print(f"# rollback: {machine()}; d={d} H_v={H_v} H_k={H_k} GDN layers={L} T={T}; rev {git_rev()}")
    rows = []

    # bytes per verify, all GDN layers
    b_tape = L * (tape_bytes + conv_in_bytes)
    b_snap = L * (T * state_bytes + conv_snap_bytes)
    b_redecode = L * (state_bytes + (a.d_conv - 1) * n_ch * 4)
    print(f"{'method':<12}{'bytes/verify':>16}{'vs snapshot':>13}")
    for name, b in (("tape", b_tape), ("snapshot", b_snap), ("re-decode", b_redecode)):
        print(f"{name:<12}{b / 2**20:>13.2f} MiB{b / b_snap:>13.4f}")
    print(f"GDN recurrent state alone: tape {tape_bytes} B vs snapshots {T * state_bytes} B per layer "
          f"= 1/{T * state_bytes / tape_bytes:.1f}")
    rows.append({"bench": "rollback", "what": "bytes", "tape": b_tape, "snapshot": b_snap, "redecode": b_redecode,
                 "recurrent_ratio_snapshot_over_tape": T * state_bytes / tape_bytes})

    # time per verify, all GDN layers (one layer measured, x L)
    work = S0.copy()
    snaps = np.empty((T, *S0.shape), np.float32)

    def snapshot_verify():
        for t in range(T):  # the copy a snapshotting verify pass makes after each token
            np.copyto(snaps[t], work)

    print(f"\n{'accepted n':<12}{'tape replay':>14}{'snapshot':>14}{'re-decode*':>14}   (ms per verify, {L} layers)")
    for n in (1, T // 2, T):
        t_replay = timeit(lambda: _core.testing.gdn_tape_replay_inplace(work, tk, tu, tg, n, n_threads=1), a.reps)
        t_snap_rb = timeit(lambda: np.copyto(work, snaps[n - 1]), a.reps)
        t_snap_rec = timeit(snapshot_verify, a.reps)
        t_redecode = timeit(lambda: _core.gdn_tape_record(q[:n], k[:n], v[:n], g[:n], beta[:n], S0), a.reps)
        tape_ms = L * t_replay["median"] * 1e3
        snap_ms = L * (t_snap_rec["median"] + t_snap_rb["median"]) * 1e3
        re_ms = L * t_redecode["median"] * 1e3
        print(f"{n:<12}{tape_ms:>14.2f}{snap_ms:>14.2f}{re_ms:>14.2f}")
        rows.append({"bench": "rollback", "what": "time_ms_per_verify", "n_accepted": n, "tape_replay": tape_ms,
                     "snapshot_copy_and_restore": snap_ms, "redecode_recurrence_only": re_ms,
                     "layers": L, "machine": machine(), "rev": git_rev()})
    print("* re-decode here re-runs only the GDN recurrence; re-running the accepted tokens through the\n"
          "  whole target costs a forward pass (see spec_e2e.py for forward timings).")
    if a.engine:
        rows += engine_rollback(a)
    if a.verify_4b:
        rows += verify_4b(a)
    write_jsonl(a.json, rows)


def verify_4b(a) -> list[dict]:
    """The denominator of the replay goal at the dims it is stated for: one verify forward of
    T = 16 tokens on a Qwen3.5-4B-shaped Q8_0 target, and the commit after it (GDN tape replay
    of n kept tokens + conv state), in the engine with the bench's thread count."""
    from dflash_native import _core

    target = cached_gguf("qwen35-4b", "qwen3_5", "q8_0", **QWEN35_4B)
    t = _core.Target(str(target), n_ctx=256, n_threads=a.threads, max_verify=16)
    prompt = [int(x) for x in np.random.default_rng(0).integers(10, 600, 64)]
    block = [int(x) for x in np.random.default_rng(1).integers(10, 600, 16)]
    print(f"\nqwen35-4b q8_0 ({t.weights_bytes / 2**30:.2f} GiB), T = 16, threads={a.threads}")
    print(f"{'kept n':<8}{'verify ms':>11}{'commit ms':>11}{'commit / verify':>17}")
    rows = []
    for n in (1, 8, 16):
        v_ms, c_ms = [], []
        for _ in range(a.reps if a.reps < 3 else 3):
            t.reset()
            t.decode(prompt)
            t0 = time.perf_counter()
            t.verify(block)
            t1 = time.perf_counter()
            t.commit(n)
            t2 = time.perf_counter()
            v_ms.append((t1 - t0) * 1e3)
            c_ms.append((t2 - t1) * 1e3)
        v, c = float(np.median(v_ms)), float(np.median(c_ms))
        print(f"{n:<8}{v:>11.1f}{c:>11.2f}{c / v:>17.2%}")
        rows.append({"bench": "rollback", "what": "verify_4b", "n_kept": n, "verify_ms": v, "commit_ms": c,
                     "commit_over_verify": c / v, "threads": a.threads, "machine": machine(), "rev": git_rev()})
    return rows


def engine_rollback(a) -> list[dict]:
    """The three rollbacks inside the engine: Qwen3.5-0.5B-shaped Q8_0 target, B = 16, drafts
    forced to commit tau tokens per round (as in spec_e2e.py); rollback time per round and
    end-to-end tok/s, same prompt and tokens for every mode."""
    import dflash_native as dn

    B, gen = 16, 48
    target = cached_gguf("qwen35-0.5b", "qwen3_5", "q8_0", **QWEN35_05B)
    drafter = cached_drafter("qwen35-0.5b", "q8_0", QWEN35_05B, B, 1)
    prompt = [int(x) for x in np.random.default_rng(0).integers(10, 600, 64)]
    print(f"\nengine: qwen35-0.5b q8_0, B={B}, {gen} tokens, threads={a.threads}")
    print(f"{'mode':<10}{'tau':>5}{'rollback ms/round':>19}{'verify ms':>11}{'tok/s':>8}")
    rows, ref = [], None
    for mode in ("tape", "snapshot", "redecode"):
        eng = dn.Engine.for_benchmark(target, drafter=drafter, block_size=B, n_ctx=256, n_threads=a.threads,
                                      rollback=mode)
        if ref is None:
            ref = eng.generate(prompt, max_tokens=gen + B, speculative=False).tokens
        for tau in (1, 8, 16):
            def forced(p, out, Bc, tau=tau):
                good = (list(ref[len(out): len(out) + Bc - 1]) + [0] * Bc)[: Bc - 1]
                if tau < Bc:
                    good[tau - 1] = (good[tau - 1] + 1) % 500
                return good

            eng._draft_override = forced
            eng.generate(prompt, max_tokens=B + 2)  # warm-up
            r = eng.generate(prompt, max_tokens=gen)
            assert r.tokens == ref[:gen]
            st = r.stats
            print(f"{mode:<10}{tau:>5}{st.rollback_s / st.rounds * 1e3:>19.2f}{st.verify_s / st.rounds * 1e3:>11.1f}"
                  f"{st.decode_tok_s:>8.2f}")
            rows.append({"bench": "rollback", "what": "engine", "mode": mode, "B": B, "tau": tau,
                         "rollback_ms_per_round": st.rollback_s / st.rounds * 1e3,
                         "verify_ms_per_round": st.verify_s / st.rounds * 1e3, "tok_s": st.decode_tok_s,
                         "cache_bytes": eng._core.cache_bytes, "machine": machine(), "rev": git_rev()})
    return rows


if __name__ == "__main__":
    main()
