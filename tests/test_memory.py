"""Weights are the GGUF's mapped pages (no second copy in memory), and Engine.memory_report().

The peak-RSS test loads a ~130 MB random model written by our converter in a child process and
reads /proc/self/status there: with the file mapped, the process's anonymous memory grows by the
caches and compute buffers only, and its peak resident size by at most the file plus a bounded
overhead; reading the file instead (use_mmap=False) grows anonymous memory by the whole file, so
the measurement tells the two apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dflash_native as dn
from fixtures import make_random_gguf, make_spec_pair
from reference.gguf_edit import rewrite_gguf

gguf = pytest.importorskip("gguf")

MB = 1 << 20
# Beside the weights: KV cache (n_ctx 256), compute buffers, the allocator and the import itself.
OVERHEAD = 64 * MB

CHILD = textwrap.dedent("""
    import json, sys
    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
        return out
    import dflash_native as dn
    before = status()
    eng = dn.Engine(sys.argv[1], n_ctx=256, n_threads=2, use_mmap=sys.argv[2] == "1")
    eng.eval([1, 2, 3, 4, 5, 6, 7, 8])
    after = status()
    print(json.dumps({"before": before, "after": after, "report": eng.memory_report()}))
""")


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    """~130 MB of F16 weights (64M parameters)."""
    return make_random_gguf(tmp_path_factory.mktemp("mem") / "big.gguf", "qwen3", outtype="f16", seed=1,
                            hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)


def measure(path, use_mmap: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), "1" if use_mmap else "0"], capture_output=True,
                         text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_mapped_weights_are_not_copied(big_gguf):
    size = os.path.getsize(big_gguf)
    assert size > 100 * MB
    m = measure(big_gguf, use_mmap=True)
    anon = m["after"]["RssAnon"] - m["before"]["RssAnon"]
    peak = m["after"]["VmHWM"] - m["before"]["VmRSS"]
    print(f"file {size / MB:.0f} MB; mapped: anonymous +{anon / MB:.1f} MB, file-backed "
          f"+{(m['after']['RssFile'] - m['before']['RssFile']) / MB:.1f} MB, peak +{peak / MB:.1f} MB")
    assert anon < OVERHEAD
    assert peak < size + OVERHEAD
    rep = m["report"]
    assert rep["target_weights_mapped"] > 0.99 * size - 1 * MB  # every weight in place (norms are F32 here)
    assert rep["target_weights_copied"] == 0


def test_reading_the_file_instead_copies_it(big_gguf):
    """The same measurement without the mapping: anonymous memory takes the whole file."""
    size = os.path.getsize(big_gguf)
    m = measure(big_gguf, use_mmap=False)
    anon = m["after"]["RssAnon"] - m["before"]["RssAnon"]
    print(f"file {size / MB:.0f} MB; read: anonymous +{anon / MB:.1f} MB")
    assert anon > 0.9 * size
    assert m["report"]["target_weights_mapped"] == 0
    assert m["report"]["target_weights_copied"] > 0.99 * size - 1 * MB


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_random_gguf(tmp_path_factory.mktemp("mem-small") / "m.gguf", "qwen3", outtype="f16", seed=2)


def test_converted_norms_are_copies_and_compute_the_same(small, tmp_path):
    """Norm weights stored as F16 become F32 copies at load; everything else stays mapped, and the
    logits equal those of the file read into memory."""
    half = rewrite_gguf(small, tmp_path / "half-norms.gguf",
                        tensor_fn=lambda name, a: (a.astype(np.float16), gguf.GGMLQuantizationType.F16)
                        if name.endswith("norm.weight") else a)
    n_norm_floats = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(half).tensors if t.name.endswith("norm.weight"))
    toks = [5, 9, 200, 31, 7, 64]
    mapped = dn.Engine(half, n_ctx=64, n_threads=2)
    read = dn.Engine(half, n_ctx=64, n_threads=2, use_mmap=False)
    rep = mapped.memory_report()
    assert rep["target_weights_copied"] == 4 * n_norm_floats
    assert rep["target_weights_mapped"] > 0
    assert rep["target_weights_mapped"] + rep["target_weights_copied"] == read.memory_report()["target_weights_copied"]
    np.testing.assert_array_equal(mapped.eval(toks), read.eval(toks))


def test_memory_report_parts(small):
    a = dn.Engine(small, n_ctx=128, n_threads=2)
    b = dn.Engine(small, n_ctx=256, n_threads=2)
    ra, rb = a.memory_report(), b.memory_report()
    for r in (ra, rb):
        assert r["total"] == sum(v for k, v in r.items() if k not in ("total", "on_device"))
        assert r["target_weights_mapped"] > 0 and r["kv_cache"] > 0
        # a dense target without a drafter: no GDN layers, no drafter parts
        for k in ("gdn_state", "gdn_tape", "feature_ring", "feature_queue", "drafter_weights_mapped", "drafter_weights_copied",
                  "compute_drafter"):
            assert r[k] == 0, k
    assert rb["kv_cache"] == 2 * ra["kv_cache"]
    assert ra["target_weights_mapped"] == rb["target_weights_mapped"]
    assert ra["compute_target"] == 0  # no graph has run yet
    a.eval([1, 2, 3])
    assert a.memory_report()["compute_target"] > 0
    f32 = dn.Engine(small, n_ctx=128, n_threads=2, kv_type="f32").memory_report()
    assert f32["kv_cache"] == 2 * ra["kv_cache"]  # F16 by default


def test_memory_report_with_a_drafter(tmp_path):
    _, tg, dg = make_spec_pair(tmp_path, "qwen35", seed=5)
    eng = dn.Engine(tg, drafter=dg, n_ctx=256, n_threads=2, block_size=8, feature_ring_capacity=64)
    eng.generate([5, 6, 7, 8, 9], max_tokens=24)
    r = eng.memory_report()
    print(r)
    assert r["total"] == sum(v for k, v in r.items() if k not in ("total", "on_device"))
    for k in ("target_weights_mapped", "drafter_weights_mapped", "kv_cache", "gdn_state", "gdn_tape", "feature_ring",
              "compute_target", "compute_drafter"):
        assert r[k] > 0, k
    # the tape holds (k, u, g) and the conv inputs of one block per GDN layer: far below a state per token
    assert r["gdn_tape"] < 8 * r["gdn_state"]
    # F32 ring of capacity 64 + 8 scratch slots: its size follows the capacity
    bigger = dn.Engine(tg, drafter=dg, n_ctx=256, n_threads=2, block_size=8, feature_ring_capacity=136)
    assert bigger.memory_report()["feature_ring"] == 2 * r["feature_ring"]
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.memory_report()
