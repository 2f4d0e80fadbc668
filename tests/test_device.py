"""The device path (docs/architecture.md, "Devices"): graphs of stock ggml ops on a ggml device
other than the CPU, here ggml's RPC backend on loopback. A `dflash-native rpc-server` process holds
the weights, caches, tape and feature ring, so any host access to a device tensor's data would fail
there, and any CPU custom op in a device graph is refused by the runner. DFLASH_NATIVE_TEST_DEVICE
names another device to run the same tests on (e.g. CUDA0 on a GPU machine: bench/gpu/run.sh)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import dflash_native as dn
from dflash_native import _core
from dflash_native.lossless import NEAR_TIE, first_divergence_gap
from fixtures import DRAFTER_KINDS, cycling_drafts, drafts_kept_until, make_kind_pair, make_spec_pair, walk_tickets

B = 8
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, 11)]
PAIRS = ["qwen3", "qwen35", "qwen35moe", "qwen3next"]


def _die_with_parent():
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ENGINES: list = []


def _track(eng):
    """Every engine of this module is closed before its RPC server goes away: ggml-rpc aborts a
    process whose server vanished under it (docs/architecture.md, "Devices")."""
    _ENGINES.append(eng)
    return eng


def _start_server(tmp_path_factory) -> str:
    """A `dflash-native rpc-server` on loopback for the rest of this process: "rpc://127.0.0.1:PORT"."""
    assert dn.rpc_available(), ("this ggml was built without its RPC backend: reinstall llama-cpp-python with "
                                "CMAKE_ARGS=-DGGML_RPC=on (README, Tests)")
    port = _free_port()
    log = tmp_path_factory.mktemp("rpc") / "server.log"
    # the server lives until this process ends (PR_SET_PDEATHSIG): an engine a failed test's
    # traceback still holds frees its device buffers at exit, and ggml-rpc aborts a client whose
    # server is gone
    proc = subprocess.Popen([sys.executable, "-m", "dflash_native", "rpc-server", "--port", str(port), "--threads", "1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 60
    while True:  # listening once a connection opens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"rpc://127.0.0.1:{port}"
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, f"no RPC server: {log.read_text()}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """The device string the engines of this module run on: an RPC server process of our own on
    loopback, or DFLASH_NATIVE_TEST_DEVICE."""
    try:
        yield os.environ.get("DFLASH_NATIVE_TEST_DEVICE") or _start_server(tmp_path_factory)
    finally:
        for eng in _ENGINES:
            eng.close()
        _ENGINES.clear()


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two RPC servers of our own, for a model split by layers over them."""
    return [_start_server(tmp_path_factory) for _ in range(2)]


@pytest.fixture(scope="module", params=PAIRS)
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("device-" + request.param)
    _, tg, dg = make_spec_pair(d, request.param, seed=5, block_size=B)
    return {"name": request.param, "target": str(tg), "drafter": str(dg)}


def engine(pair, device, **kw):
    kw.setdefault("gate", False)
    kw.setdefault("n_ctx", 256)
    return _track(dn.Engine(pair["target"], drafter=pair["drafter"], device=device, n_threads=1, block_size=B,
                            kv_type="f32", **kw))


def test_devices_are_listed_and_named(device):
    names = [d["name"] for d in dn.devices()]
    assert "CPU" in names
    assert all(set(d) == {"name", "description", "type", "memory_free", "memory_total"} for d in dn.devices())
    assert _core.resolve_device("cpu") == "CPU"
    name = _core.resolve_device(device)
    assert name != "CPU" and name in [d["name"] for d in dn.devices()]
    # ggml lists an RPC server's device as a GPU: "gpu" still means one of this machine's
    try:
        gpu = _core.resolve_device("gpu")
    except ValueError:
        gpu = None
    assert gpu is None or not gpu.startswith("RPC"), gpu
    assert dn.gpu_available() == (gpu is not None)


def test_bad_devices_are_clear_errors(pair):
    with pytest.raises(ValueError, match="no device 'tpu0'.*CPU"):
        engine(pair, "tpu0")
    port = _free_port()  # nothing listens there: ggml-rpc would abort the process, we refuse first
    with pytest.raises(ValueError, match="cannot reach the RPC server"):
        engine(pair, f"rpc://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="rpc://HOST:PORT"):
        engine(pair, "rpc://nohostport")
    with pytest.raises(ValueError, match="cannot reach the RPC server"):
        engine(pair, f"rpc://127.0.0.1:{port},127.0.0.1:{port}")


def test_tree_verify_on_a_device(pair, device):
    """Tree verify runs where the stock ops allow: a dense target (the tree's mask in the attention,
    the drafter's top-K by ggml_argsort_top_k + ggml_get_rows, the path's K/V rows compacted) gives
    AR's output under the near-tie rule, every node on the device. A target with GDN layers is
    refused: ggml's GDN and conv ops step along one sequence, not a tree's branches."""
    if pair["name"] != "qwen3":
        with pytest.raises(ValueError, match="verify='tree' over a target with GDN layers runs on the CPU only"):
            engine(pair, device, verify="tree", tree_budget=8)
        return
    eng = engine(pair, device, verify="tree", tree_budget=8)
    _core.testing.check_placement(eng._core, True)
    for p in (PROMPT, [int(x) for x in np.random.default_rng(3).integers(3, 500, 17)]):
        ar = eng.generate(p, max_tokens=32, speculative=False).tokens
        r = eng.generate(p, max_tokens=32)
        assert r.stats.rounds > 0
        gap = first_divergence_gap(eng, p, ar, r.tokens)
        assert gap is None or gap < NEAR_TIE, f"first divergence at a top-2 gap of {gap}"
    assert _core.testing.placement(eng._core) == []


def test_every_node_runs_on_the_device(pair, device):
    """Prefill, AR steps, draft and ring push, chain verify and the commit graph: the scheduler
    places every node on the device (no named exceptions), and no graph holds a custom op (the
    runner raises on one)."""
    eng = engine(pair, device, gate=True)
    assert eng._core.device == _core.resolve_device(device)
    _core.testing.check_placement(eng._core, True)
    ref = eng.generate(PROMPT, max_tokens=24, speculative=False).tokens
    eng._draft_override = cycling_drafts(ref)
    r = eng.generate(PROMPT, max_tokens=24)
    assert r.tokens == ref
    assert sum(r.stats.acceptance_histogram) > 0
    assert _core.testing.placement(eng._core) == []


def test_speculative_equals_ar_under_the_near_tie_rule(pair, device):
    """Greedy speculative output equals AR output on the device, or first differs where AR's top-2
    logits are a near-tie. Drafts are forced from the AR output with chosen misses, so rounds
    commit more than one token and every depth of the block is reached."""
    eng = engine(pair, device)
    prompts = [PROMPT, PROMPT[:5] + [7, 9, 11], [int(x) for x in np.random.default_rng(3).integers(3, 500, 17)]]
    depths = set()
    lengths = []
    for i, p in enumerate(prompts):
        ar = eng.generate(p, max_tokens=40, speculative=False).tokens
        eng._draft_override = cycling_drafts(ar, every=(3, 5, 7)[i])
        r = eng.generate(p, max_tokens=40)
        eng._draft_override = None
        gap = first_divergence_gap(eng, p, ar, r.tokens)
        assert gap is None or gap < NEAR_TIE, f"prompt {i}: first divergence at a top-2 gap of {gap}"
        hist = r.stats.acceptance_histogram
        depths |= {k for k, c in enumerate(hist) if c}
        lengths.append(r.stats.mean_acceptance_length)
    assert np.mean(lengths) > 1.5
    assert depths >= set(range(1, B + 1)), f"block depths reached: {sorted(depths)}"


def caches(t):
    return [_core.testing.gdn_state(t, i) if ty == "gdn" else _core.testing.kv(t, i)
            for i, ty in enumerate(t.layer_types)]


@pytest.mark.parametrize("n_keep", [1, 3, B])
def test_rollback_equals_a_fresh_device_computation(pair, device, n_keep):
    """After a verify of B tokens that keeps n: K/V, GDN and conv state equal those of a fresh device
    engine that ran the same prefill and then just the n kept tokens (an AR step for one, else a round
    of block n whose drafts are all right). Keeping all B is the same computation: bitwise. Keeping
    fewer, the fresh engine's batch is n tokens where the verify's was B, and ggml's batched kernels
    round by batch size: ggml-cpu (over RPC) within 2e-4, a GPU-style backend's tiled shaders by more
    (lavapipe: 6.4e-4 in a K row of the 3-layer qwen3 pair)."""
    a = engine(pair, device)
    ref = a.generate(PROMPT, max_tokens=2 * B, speculative=False).tokens
    s, t = a._spec, a._core
    last = s.prefill(PROMPT)
    r = _core.testing.round(s, last, B, drafts_kept_until(ref, B, n_keep))
    assert len(r.committed) == n_keep
    got = caches(t)
    b = engine(pair, device)
    assert b._spec.prefill(PROMPT) == last
    if n_keep == 1:
        b._spec.ar_step(last)
    else:
        assert len(_core.testing.round(b._spec, last, n_keep, ref[1:n_keep]).committed) == n_keep
    assert b._core.n_past == t.n_past == len(PROMPT) + n_keep
    atol, rtol = (2e-4, 1e-4) if device.startswith("rpc://") else (2e-3, 1e-3)
    for x, y in zip(got, caches(b._core)):
        for u, v in zip(x, y):
            if n_keep == B:
                np.testing.assert_array_equal(u, v)
            else:
                np.testing.assert_allclose(u, v, atol=atol, rtol=rtol)
    # the next round drafts from the pushed features and verifies the same tokens
    r1 = _core.testing.round(s, r.committed[-1], B, ref[n_keep + 1: n_keep + B])
    r2 = _core.testing.round(b._spec, r.committed[-1], B, ref[n_keep + 1: n_keep + B])
    assert r1.committed == r2.committed


@pytest.mark.parametrize("pair", [p for p in PAIRS if p != "qwen3"], indirect=True)  # GDN targets
@pytest.mark.parametrize("n_keep", [1, 2, 5, B])
def test_tape_replay_equals_the_verify_state_bitwise(pair, device, n_keep):
    """The same kernel runs: commit replays the tape (the verify's own k, v, g, beta) through
    ggml_gated_delta_net from the state saved before the verify, and gives bit for bit the state
    the verify's op itself reached after token n_keep (the snapshot baseline keeps exactly that:
    ggml's per-token snapshots of the same op). Conv state and K/V are copies of the same values."""
    assert "gdn" in engine(pair, device)._core.layer_types
    ref = engine(pair, device).generate(PROMPT, max_tokens=2 * B, speculative=False).tokens
    states = []
    for rollback in ("tape", "snapshot"):
        eng = _track(dn.Engine.for_benchmark(pair["target"], drafter=pair["drafter"], rollback=rollback, device=device,
                                             n_ctx=256, n_threads=1, block_size=B, kv_type="f32", gate=False))
        last = eng._spec.prefill(PROMPT)
        forced = drafts_kept_until(ref, B, n_keep)
        assert len(_core.testing.round(eng._spec, last, B, forced).committed) == n_keep
        states.append(caches(eng._core))
    for x, y in zip(*states):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


def test_memory_lives_on_the_device(pair, device):
    eng = engine(pair, device)
    eng.generate(PROMPT, max_tokens=8)
    m = eng.memory_report()
    assert eng.device == _core.resolve_device(device)
    assert m["target_weights_mapped"] == 0 and m["target_weights_copied"] > 0  # a device holds its own copy
    held = sum(m[k] for k in ("target_weights_copied", "drafter_weights_copied", "kv_cache", "gdn_state", "gdn_tape",
                              "feature_ring"))
    # everything but the host's queue of taps and the inputs' host buffers lives on the device
    assert held <= m["on_device"] <= m["total"] - m["feature_queue"]


def test_a_model_split_over_two_servers_computes_what_one_does(pair, two_servers):
    """rpc://A,B puts the first half of the layers (and the embeddings) on A, the rest, the output
    head, the drafter, ring and feature queue on B, as llama.cpp's --rpc splits a model. Both
    servers run ggml's CPU kernels and the hand-offs between them are copies, so the split computes
    bit for bit what one server does: prompt logits, AR and speculative tokens. Every node runs on
    one of the two devices."""
    one = engine(pair, two_servers[0])
    split = engine(pair, ",".join([two_servers[0], two_servers[1][len("rpc://"):]]))
    assert split.device.count(",") == 1 and split.device.split(",")[0] == one.device
    _core.testing.check_placement(split._core, True)
    np.testing.assert_array_equal(split.eval(PROMPT), one.eval(PROMPT))
    ref = one.generate(PROMPT, max_tokens=24, speculative=False).tokens
    assert split.generate(PROMPT, max_tokens=24, speculative=False).tokens == ref
    for eng in (one, split):
        eng._draft_override = cycling_drafts(ref)
    a, b = one.generate(PROMPT, max_tokens=24), split.generate(PROMPT, max_tokens=24)
    assert a.tokens == b.tokens and a.stats.acceptance_histogram == b.stats.acceptance_histogram
    assert _core.testing.placement(split._core) == []


def test_rpc_server_on_a_port_in_use_is_a_clear_error(two_servers):
    """ggml's server prints a failure to listen and returns: the command says so and exits 2."""
    port = two_servers[0].rsplit(":", 1)[1]
    p = subprocess.run([sys.executable, "-m", "dflash_native", "rpc-server", "--port", port, "--threads", "1"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in p.stderr, (p.returncode, p.stderr)
    bad = subprocess.run([sys.executable, "-m", "dflash_native", "rpc-server", "--device", "tpu0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no device 'tpu0'" in bad.stderr, bad.stderr


# ---- several sequence slots on a device (docs/architecture.md, "Devices", "The scheduler") ----

N_SEQ = 3


def _tol(device):
    """ggml's batched kernels round by batch width (see test_rollback_equals_a_fresh_device_computation):
    a slot's work inside a wider pass, or its sequence decoded afresh in one prefill, agrees within
    these. Measured: ggml-cpu over RPC 7e-6 at most on the hybrid pair; lavapipe's Vulkan shaders
    (F16 tiles in wide matmuls) up to 5e-3 in a logit and 4e-3 (1e-3 relative) in a cache entry
    between a pass of a prompt chunk alone and the same chunk beside other slots' work."""
    return (2e-4, 1e-4) if device.startswith("rpc://") else (1e-2, 1e-2)


def _skip_on_lavapipe(device):
    """Not met on lavapipe (Mesa's software Vulkan): llvmpipe's shader thread crashes (SIGSEGV inside
    libvulkan_lvp) in these tests' scheduler steps when they run after others in one process (each
    alone passes), and over the GDN hybrids a batched verify's logits differ from the same verify
    alone by up to 2e-2. Not yet understood; RPC covers them (docs/architecture.md, "Devices")."""
    desc = next((d["description"] for d in dn.devices() if d["name"] == _core.resolve_device(device)), "")
    if "llvmpipe" in desc:
        pytest.skip("n_seq > 1 on lavapipe: see _skip_on_lavapipe")


def slot_caches(t, slot):
    return [_core.testing.gdn_state(t, i, slot) if ty == "gdn" else _core.testing.kv(t, i, slot)
            for i, ty in enumerate(t.layer_types)]


def assert_caches_close(a, b, device, what):
    atol, rtol = _tol(device)
    for il, (x, y) in enumerate(zip(a, b)):
        for u, v in zip(x, y):
            assert u.shape == v.shape, f"{what}: layer {il} shapes {u.shape} != {v.shape}"
            np.testing.assert_allclose(u, v, atol=atol, rtol=rtol, err_msg=f"{what}: layer {il}")


def test_batched_target_on_a_device(pair, device):
    """decode_batch on a device: random prompt chunks, AR steps and chain verifies of 3 slots in
    shuffled order, one pass each step, with commits of random kept prefixes on every slot (not only
    the selected one). Each item's logits match a one-slot device Target doing the same work alone,
    and after every step each advanced slot's K/V, GDN and conv state match its committed sequence
    decoded afresh on the device. Every node of every graph on the device."""
    _skip_on_lavapipe(device)
    T = _core.testing
    rng = np.random.default_rng(11)
    kw = dict(n_ctx=256, n_threads=1, kv_type="f32", device=device)
    bt = T.batch_target(pair["target"], N_SEQ, max_verify=B, **kw)
    T.check_placement(bt, True)
    ref = [_core.Target(pair["target"], max_verify=B, **kw) for _ in range(N_SEQ)]
    fresh = _core.Target(pair["target"], n_batch=64, **kw)
    atol, rtol = _tol(device)
    prompts = [[int(x) for x in rng.integers(3, 500, int(rng.integers(2, 30)))] for _ in range(N_SEQ)]
    fed, history = [0] * N_SEQ, [[] for _ in range(N_SEQ)]
    counts = {"prefill": 0, "decode": 0, "verify": 0, "fresh": 0, "wide": 0}
    for step in range(12):
        slots = [s for s in range(N_SEQ) if rng.random() < 0.8]
        if not slots:
            continue
        rng.shuffle(slots)
        work = []
        for s in slots:
            left = len(prompts[s]) - fed[s]
            if left > 0:
                n = int(rng.integers(1, min(left, 12) + 1))
                work.append((s, prompts[s][fed[s]:fed[s] + n], "prefill" if n < left else "decode"))
            elif rng.random() < 0.35:
                work.append((s, [int(rng.integers(3, 500))], "decode"))
            else:
                work.append((s, [int(x) for x in rng.integers(3, 500, int(rng.integers(1, B + 1)))], "verify"))
        counts["wide"] += len(work) > 1
        for (s, toks, kind), logits in zip(work, T.decode_batch(bt, work)):
            counts[kind] += 1
            if kind == "verify":
                want = ref[s].verify(toks)
            else:
                want = ref[s].decode(toks)[-1:]
                fed[s] = min(len(prompts[s]), fed[s] + len(toks))
                if kind == "prefill":
                    want = want[:0]
            assert logits.shape == want.shape
            np.testing.assert_allclose(logits, want, atol=atol, rtol=rtol, err_msg=f"step {step} slot {s} {kind}")
        for s, toks, kind in work:
            if kind == "verify":
                keep = int(rng.integers(1, len(toks) + 1))
                T.commit_slot(bt, s, keep)
                ref[s].commit(keep)
                toks = toks[:keep]
            history[s] += toks
            assert T.slot_n_past(bt, s) == ref[s].n_past == len(history[s])
            fresh.reset()
            fresh.decode(history[s])
            assert_caches_close(slot_caches(bt, s), caches(fresh), device, f"step {step} slot {s} vs its sequence afresh")
            counts["fresh"] += 1
    assert all(counts[k] for k in ("prefill", "decode", "verify", "wide")), counts
    assert T.placement(bt) == []


def _interleave(eng, reqs, rng):
    """reqs as streams advanced from one thread in a seeded random order, each joining at a random
    point (as test_scheduler.py's interleaved); returns their results."""
    pending, live, results = list(range(len(reqs))), {}, {}
    while pending or live:
        if pending and (not live or rng.random() < 0.4):
            i = pending.pop(0)
            live[i] = eng.generate(**reqs[i], stream=True)
        i = int(rng.choice(list(live)))
        piece = next(live[i])
        if getattr(piece, "result", None) is not None:
            results[i] = piece.result
            del live[i]
    return [results[i] for i in range(len(reqs))]


@pytest.mark.parametrize("gate", [False, True])
def test_batched_requests_on_a_device_equal_their_solo_runs(pair, device, gate):
    """An n_seq = 3 engine on the device, 5 requests (more than its slots) joining at random
    points: greedy speculative ones with drafts forced from their AR output (misses cycling through
    the block, so rounds commit 1..B tokens), one with logprobs (the pass then reads logit rows) and
    an AR one. Each request's tokens equal its solo AR run's on the same device, or first differ
    where AR's top-2 logits are a near-tie. Passes ran several requests' work, and every node of every
    graph (the batched target pass, commits, drafts and ring pushes of three slots) ran on the device.
    gate=True: each slot's controller chooses AR or a round and how many drafts to verify (by timings:
    no claim on the acceptance then; the shared drafter pass: test_shared_drafter_pass_on_a_device)."""
    _skip_on_lavapipe(device)
    rng = np.random.default_rng(4)
    prompts = [[int(x) for x in rng.integers(3, 500, int(rng.integers(3, 20)))] for _ in range(5)]
    reqs = [dict(prompt=p, max_tokens=int(rng.integers(16, 33))) for p in prompts]
    reqs[3]["logprobs"] = 2
    reqs[4]["speculative"] = False
    solo = engine(pair, device)
    ar = [solo.generate(**dict(r, speculative=False)).tokens for r in reqs]
    eng = engine(pair, device, n_seq=N_SEQ, gate=gate)
    _core.testing.check_placement(eng._core, True)
    drafts = {tuple(r["prompt"]): cycling_drafts(a, every=(3, 5, 7, 3, 5)[i]) for i, (r, a) in enumerate(zip(reqs, ar))}
    eng._draft_override = lambda prompt, out, Bc: drafts[tuple(prompt)](prompt, out, Bc)
    got = _interleave(eng, reqs, rng)
    for i, (r, a, g) in enumerate(zip(reqs, ar, got)):
        gap = first_divergence_gap(solo, r["prompt"], a, g.tokens)
        assert gap is None or gap < NEAR_TIE, f"request {i}: first divergence at a top-2 gap of {gap}"
    assert got[3].logprobs is not None and len(got[3].logprobs) == len(got[3].tokens)
    assert gate or np.mean([g.stats.mean_acceptance_length for g in got[:4]]) > 1.5
    assert got[4].stats.rounds == 0
    assert sum(eng._sched.pass_stats["width"][2:]) > 0, eng._sched.pass_stats
    assert _core.testing.placement(eng._core) == []


def test_slot_caches_after_a_batched_step_equal_a_fresh_device_computation(pair, device):
    """The scheduler's tickets on an n_seq = 3 device engine, forced drafts (rounds keep 1..B of
    their B tokens): after every step the advanced request's slot holds the caches of its sequence
    (prompt and every emitted token but the last) decoded afresh on a one-slot device Target, and
    its feature ring (filled from the batched passes' taps, which stay in the slot's device queue)
    holds, at every position it has, the rows a one-slot engine's prefill of that sequence pushes."""
    _skip_on_lavapipe(device)
    rng = np.random.default_rng(8)
    prompts = [[int(x) for x in rng.integers(3, 500, int(rng.integers(3, 20)))] for _ in range(4)]
    solo = engine(pair, device)
    ar = [solo.generate(p, max_tokens=24, speculative=False).tokens for p in prompts]
    eng = engine(pair, device, n_seq=N_SEQ)
    fresh = _core.Target(pair["target"], n_ctx=256, n_threads=1, kv_type="f32", n_batch=64, device=device)

    def submit(i):
        src = cycling_drafts(ar[i], every=(3, 5, 7, 3)[i])
        # exact_max_tokens: no round commits past max_tokens, so the slot holds just the tokens emitted
        return eng._sched.submit(prompts[i], True, max_tokens=24, exact_max_tokens=True,
                                 draft_source=lambda out, Bc: src(prompts[i], out, Bc))

    outs, checked, ring_past_prompt = {}, 0, 0
    for i, t in walk_tickets(rng, len(prompts), submit, outs):
        seq = prompts[i] + outs[i][:-1]
        assert _core.testing.slot_n_past(eng._core, t.slot) == len(seq)
        fresh.reset()
        fresh.decode(seq)
        assert_caches_close(slot_caches(eng._core, t.slot), caches(fresh), device, f"request {i} slot {t.slot}")
        ring_past_prompt += _check_ring(eng._sched.spec(t.slot), solo, seq, device, f"request {i} slot {t.slot}") \
            >= len(prompts[i])
        checked += 1
    assert checked >= 5 and ring_past_prompt >= 3
    ps = eng._sched.pass_stats
    assert sum(ps["width"][2:]) > 0 and ps["batched_prefills"] > 0, ps  # prompts in the shared pass too
    for i, p in enumerate(prompts):
        gap = first_divergence_gap(solo, p, ar[i], outs[i])
        assert gap is None or gap < NEAR_TIE, f"request {i}: first divergence at a top-2 gap of {gap}"


def _check_ring(spec, solo, seq, device, what):
    """spec's ring rows, at every position it holds, against a one-slot engine's prefill of seq."""
    held = np.array(_core.testing.ring_slot_positions(spec))
    solo._spec.prefill(seq)
    assert (np.array(_core.testing.ring_slot_positions(solo._spec))[held >= 0] == held[held >= 0]).all()
    rows = held >= 0
    for il in range(spec.drafter_n_layer):
        got, want = _core.testing.ring_kv(spec, il), _core.testing.ring_kv(solo._spec, il)
        assert_caches_close([[g[rows] for g in got]], [[w[rows] for w in want]], device, f"{what} ring layer {il}")
    return held.max()


def test_prompt_cache_continues_a_slot_on_a_device(pair, device):
    """A request continuing the sequence a slot holds (cache_prompt) prefills only its new tokens, in
    the step's shared pass: their taps go to the slot's device queue behind the rows the last
    request left queued, and the ring then holds, at every position, the rows of the whole sequence
    prefilled afresh; the tokens are the solo AR run's under the near-tie rule."""
    _skip_on_lavapipe(device)
    solo = engine(pair, device)
    eng = engine(pair, device, n_seq=N_SEQ)
    sched = eng._sched
    t1 = sched.submit(PROMPT, True, max_tokens=12, exact_max_tokens=True, cache_prompt=True)
    out1 = []
    while not t1.done:
        out1 += t1.next()[0]
    prompt2 = PROMPT + out1 + [7]
    t2 = sched.submit(prompt2, True, max_tokens=10, exact_max_tokens=True, cache_prompt=True)
    out2 = t2.next()[0]
    assert t2.slot == t1.slot and sched.pass_stats["batched_prefills"] >= 2, sched.pass_stats
    while not t2.done:
        out2 += t2.next()[0]
        if not t2.done:
            seq = prompt2 + out2[:-1]
            assert _check_ring(sched.spec(t2.slot), solo, seq, device, "continued request") >= len(PROMPT)
    ar = solo.generate(prompt2, max_tokens=10, speculative=False).tokens
    gap = first_divergence_gap(solo, prompt2, ar, out2)
    assert gap is None or gap < NEAR_TIE, f"first divergence at a top-2 gap of {gap}"


def test_slots_over_a_split_compute_what_one_server_does(pair, two_servers):
    """n_seq = 3 over a model split by layers over two RPC servers: each slot's caches beside its
    layers' weights, the batched passes handing hidden states between the servers. Both run ggml's
    CPU kernels and the hand-offs are copies, so the same batched requests, advanced in the same
    order, give bit for bit the tokens and rounds of one server's engine; every node on a device."""
    ar = engine(pair, two_servers[0]).generate(PROMPT, max_tokens=24, speculative=False).tokens
    reqs = [dict(prompt=PROMPT, max_tokens=24), dict(prompt=PROMPT[:6], max_tokens=20),
            dict(prompt=PROMPT[3:], max_tokens=16, speculative=False), dict(prompt=PROMPT[:4] + [9], max_tokens=20)]
    results = []
    for dev in (two_servers[0], ",".join([two_servers[0], two_servers[1][len("rpc://"):]])):
        eng = engine(pair, dev, n_seq=N_SEQ)
        _core.testing.check_placement(eng._core, True)
        eng._draft_override = lambda prompt, out, Bc: (list(ar[len(out):len(out) + Bc - 1]) + [1] * Bc)[:Bc - 1]
        results.append(_interleave(eng, reqs, np.random.default_rng(2)))
        assert sum(eng._sched.pass_stats["width"][2:]) > 0, eng._sched.pass_stats
        assert _core.testing.placement(eng._core) == []
    assert results[0][0].stats.mean_acceptance_length > 1.5  # its drafts are its AR output
    for i, (a, b) in enumerate(zip(*results)):
        assert a.tokens == b.tokens, f"request {i}"
        assert a.stats.acceptance_histogram == b.stats.acceptance_histogram, f"request {i}"


def test_slots_on_a_device_hold_their_caches_there(pair, device):
    """memory_report per slot: each slot's caches and ring are a one-slot engine's, held by the
    device; an n_seq whose caches the device cannot hold is a MemoryError at creation."""
    _skip_on_lavapipe(device)
    one = engine(pair, device)
    solo = one.memory_report()
    eng = engine(pair, device, n_seq=N_SEQ)
    eng.generate(PROMPT, max_tokens=4)
    rep = eng.memory_report()
    assert len(rep["slots"]) == N_SEQ
    for part in ("kv_cache", "gdn_state", "gdn_tape", "feature_ring"):
        assert all(s[part] == solo[part] for s in rep["slots"]), part
        assert rep[part] == N_SEQ * solo[part], part
    for s in rep["slots"]:
        assert s["on_device"] == s["kv_cache"] + s["gdn_state"] + s["gdn_tape"] + s["feature_ring"] > 0
    assert sum(s["on_device"] for s in rep["slots"]) <= rep["on_device"] <= rep["total"] - rep["feature_queue"]
    free = next(d["memory_free"] for d in dn.devices() if d["name"] == eng.device)
    n_ctx = 1 << 16
    per_slot = rep["slots"][0]["kv_cache"] * (n_ctx // 256)  # K/V scale with n_ctx (the rest does not)
    n_seq = int(free // per_slot) + 2
    with pytest.raises(MemoryError, match=f"n_seq = {n_seq} .*on device {eng.device}.*lower n_seq or n_ctx"):
        engine(pair, device, n_seq=n_seq, n_ctx=n_ctx)


@pytest.fixture(scope="module", params=list(DRAFTER_KINDS))
def kind_pair(request, tmp_path_factory):
    return make_kind_pair(tmp_path_factory.mktemp("device-kind-" + request.param), request.param, block_size=B)


def _fixed_costs(spec):
    # speculation pays and the controller's choices depend only on acceptance (no timing)
    _core.testing.controller_fixed_costs(spec, ar_s=1.0, draft_s=0.2, verify0_s=0.9, verify1_s=0.05)


def _shared_settings(i):
    """Request i's settings in check_shared_drafts: greedy, greedy with logprobs (the pass then
    reads the target's logit rows), seeded sampled (its drafts drawn from the shared drafter pass's
    logits rows, read back from the device)."""
    return [{}, dict(temperature=0.0, logprobs=2), dict(temperature=0.8, top_p=0.95, seed=101)][i % 3]


def check_shared_drafts(pair, device):
    """Three requests on an n_seq = 3 device engine under the controller (fixed costs: its choices
    depend on acceptance only; the batch's controller off, its AR steps would change the rounds),
    all admitted at the first step, so their rounds draft in one drafter pass on the device
    (pass_stats shared_drafts: a pass that failed, e.g. over a CPU op the device runner refuses,
    falls back to drafting each slot alone and is not counted). Each request's tokens equal its run
    alone on a one-slot engine on the same device: greedy ones under the near-tie rule (against the
    solo speculative run and the solo AR run); the sampled one exactly over RPC (ggml-cpu rounds a
    batched F32 matmul within 3e-6: a seeded draw moves only when it lands that close to a
    boundary). Every node of every graph, the shared drafter pass's too, ran on the device."""
    rng = np.random.default_rng(4)
    n = 3
    solo = engine(pair, device, gate=True)
    _fixed_costs(solo._spec)
    prompts = [[int(x) for x in rng.integers(3, 500, int(k))] for k in (9, 17, 25)]
    want = [solo.generate(p, max_tokens=32, **_shared_settings(i)) for i, p in enumerate(prompts)]
    ar = [solo.generate(p, max_tokens=32, speculative=False).tokens for p in prompts]
    eng = engine(pair, device, n_seq=n, gate=True)
    _core.testing.check_placement(eng._core, True)
    sched = eng._sched
    _core.testing.batch_controller_params(sched, enabled=False)
    for k in range(n):
        _fixed_costs(sched.spec(k))
    tickets = []
    for i, p in enumerate(prompts):
        kw = _shared_settings(i)
        smp = _core.Sampling(kw.get("temperature", 0.0), top_p=kw.get("top_p", 1.0), seed=kw.get("seed", 0),
                             logprobs=kw.get("logprobs", -1)) if kw else None
        tickets.append(sched.submit(p, True, sampling=smp, max_tokens=32))
    outs = [[] for _ in range(n)]
    while not all(t.done for t in tickets):
        for i, t in enumerate(tickets):
            if not t.done:
                outs[i] += t.next()[0]
    ps = sched.pass_stats
    assert ps["shared_drafts"] > 0, ps
    assert _core.testing.placement(eng._core) == []
    assert sum(t.stats["rounds"] for t in tickets) > 0
    for i, p in enumerate(prompts):
        if "seed" in _shared_settings(i):
            if device.startswith("rpc://"):
                assert outs[i] == want[i].tokens, f"request {i}: sampled tokens differ from its solo run"
            continue
        for ref in (want[i].tokens, ar[i]):
            gap = first_divergence_gap(solo, p, ref, outs[i])
            assert gap is None or gap < NEAR_TIE, f"request {i}: first divergence at a top-2 gap of {gap}"


def test_shared_drafter_pass_on_a_device(pair, device):
    """The scheduler's rounds of several slots draft in one drafter pass on the device: each slot's
    queued features pushed from its device feature queue, each block's top-1 in stock ops
    (check_shared_drafts)."""
    _skip_on_lavapipe(device)
    check_shared_drafts(pair, device)


def test_shared_drafter_pass_of_each_kind_on_a_device(kind_pair, device):
    """The same for a DFlash 2 drafter (each block's selector lattice, stock ops, in the shared
    pass) and DSpark (the Markov head's argmax chain and the confidence head per block)."""
    _skip_on_lavapipe(device)
    check_shared_drafts(kind_pair, device)


def check_drafts_as_alone(pair, device):
    """spec_session::draft_batch on 3 slots of a device engine, each after a prefill and a round
    (whose committed rows wait in the slot's device feature queue, pushed into the ring by the
    shared pass), against each sequence's draft alone on a one-slot device engine in the same
    state: the same drafts with their probabilities within the batched rounding, or, where a
    draft differs, one whose probability ties the solo one's there (the first difference ends the
    comparison: a DSpark or DFlash 2 draft depends on the drafts before it). Every node on the
    device."""
    T = _core.testing
    rng = np.random.default_rng(9)
    prompts = [[int(x) for x in rng.integers(3, 500, int(k))] for k in (7, 15, 26)]
    solo = engine(pair, device, gate=True)
    ar = [solo.generate(p, max_tokens=B + 2, speculative=False).tokens for p in prompts]
    eng = engine(pair, device, n_seq=N_SEQ, gate=True)
    T.check_placement(eng._core, True)
    specs = [eng._sched.spec(k) for k in range(N_SEQ)]
    seqs = [_prefill_and_round(s, p, a) for s, p, a in zip(specs, prompts, ar)]
    assert all(len(q) > 3 for q in seqs), seqs  # each round committed several rows
    got = T.draft_batch(specs, [q[-1] for q in seqs], B)
    assert T.placement(eng._core) == []
    atol, _ = _tol(device)
    for i, p in enumerate(prompts):
        assert _prefill_and_round(solo._spec, p, ar[i]) == seqs[i], f"slot {i}: alone it committed other tokens"
        last = seqs[i][-1]
        want_tok, want_p = T.draft_top1(solo._spec, last, B)
        tok, pr = got[i]
        assert len(tok) == len(want_tok) == B - 1
        for j in range(B - 1):
            assert abs(pr[j] - want_p[j]) <= atol + 1e-3 * abs(want_p[j]), f"slot {i} draft {j}: p {pr[j]} vs {want_p[j]}"
            if tok[j] != want_tok[j]:
                break
        else:
            continue
        gap = _draft_gap(solo, last, want_tok, j, tok[j])
        assert gap < NEAR_TIE, f"slot {i} draft {j}: {tok[j]} vs {want_tok[j]} alone, {gap} apart in its scores"


def _prefill_and_round(spec, prompt, ar):
    """spec's prompt, the controller's first step (AR: it leaves the controller at a round, fixed
    costs) and a round outside the controller of drafts forced from the AR output `ar` (so it
    commits B tokens, their rows queued for the next draft's push); the tokens each gave."""
    _fixed_costs(spec)
    first = spec.prefill(prompt)
    r = spec.step(first, B)
    assert r.ar
    rd = _core.testing.round(spec, r.committed[-1], B, forced_draft=ar[2:B + 1])
    return [first] + list(r.committed) + list(rd.committed)


def _draft_gap(solo, last, want, j, other):
    """How far token `other` is, at draft j of solo's block after `last`, below solo's own choice
    want[j] in the scores it chose by: the drafter's logits, or DFlash 2's selector scores from the
    predecessor it chose (inf when `other` is not among its candidates)."""
    T = _core.testing
    k = solo._spec.selector_top_k
    if not k:
        logits = T.draft_logits(solo._spec, last, B, solo._core)[j]
        return float(logits[want[j]] - logits[other])
    lat = T.draft_lattice(solo._spec, last, B)  # [B-1, k + k*k]: candidates, then k scores per predecessor
    pred = 0 if j == 0 else [int(c) for c in lat[j - 1][:k]].index(want[j - 1])
    cand, score = [int(c) for c in lat[j][:k]], lat[j][k + pred * k: k + (pred + 1) * k]
    return float(score.max() - score[cand.index(other)]) if other in cand else float("inf")


def test_shared_drafter_pass_drafts_as_alone_on_a_device(pair, device):
    _skip_on_lavapipe(device)
    check_drafts_as_alone(pair, device)


def test_shared_drafter_pass_of_each_kind_drafts_as_alone_on_a_device(kind_pair, device):
    _skip_on_lavapipe(device)
    check_drafts_as_alone(kind_pair, device)
