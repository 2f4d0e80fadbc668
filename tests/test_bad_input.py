"""Bad input raises a clear Python exception and never aborts the process."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

import dflash_native as dn
from fixtures import make_random_gguf
from reference.gguf_edit import rewrite_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_random_gguf(tmp_path_factory.mktemp("bad") / "good.gguf", "qwen3_5", outtype="f16", seed=3)


def load_in_subprocess(path: Path, **engine_kwargs) -> str:
    """Build an Engine in a fresh interpreter; return the exception text. A crash fails the test."""
    code = textwrap.dedent(f"""
        import dflash_native as dn
        try:
            dn.Engine({str(path)!r}, n_ctx=64, **{engine_kwargs!r})
        except ValueError as e:
            print("VALUEERROR:", e)
        else:
            print("LOADED")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"process died with {p.returncode}: {p.stderr[-2000:]}"
    return p.stdout.strip()


def test_good_file_loads(good):
    assert load_in_subprocess(good) == "LOADED"


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        dn.Engine(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        dn.Engine(p)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        dn.Engine(tmp_path)


@pytest.mark.parametrize("frac", [0.001, 0.5, 0.999])
def test_truncated_gguf(good, tmp_path, frac):
    data = good.read_bytes()
    p = tmp_path / "trunc.gguf"
    p.write_bytes(data[: max(8, int(len(data) * frac))])
    out = load_in_subprocess(p)
    assert out.startswith("VALUEERROR:") and ("truncated" in out or "failed to parse" in out), out


def test_unknown_arch(good, tmp_path):
    p = rewrite_gguf(good, tmp_path / "arch.gguf", kv={"general.architecture": "mamba9"})
    out = load_in_subprocess(p)
    assert "unsupported target architecture 'mamba9'" in out, out


def test_wrong_tensor_shape(good, tmp_path):
    def fn(name, a):
        return a[:, :-1].copy() if name == "blk.0.ffn_up.weight" else a

    out = load_in_subprocess(rewrite_gguf(good, tmp_path / "shape.gguf", tensor_fn=fn))
    assert "blk.0.ffn_up.weight" in out and "has shape" in out, out


def test_missing_tensor(good, tmp_path):
    out = load_in_subprocess(rewrite_gguf(good, tmp_path / "miss.gguf",
                                          tensor_fn=lambda n, a: None if n == "blk.1.attn_k_norm.weight" else a))
    assert "missing tensor 'blk.1.attn_k_norm.weight'" in out, out


def test_missing_key(good, tmp_path):
    out = load_in_subprocess(rewrite_gguf(good, tmp_path / "key.gguf", drop_keys=("qwen35.ssm.conv_kernel",)))
    assert "missing key 'qwen35.ssm.conv_kernel'" in out, out


def test_bad_hparams(good, tmp_path):
    out = load_in_subprocess(rewrite_gguf(good, tmp_path / "hp.gguf", kv={"qwen35.attention.head_count": 0}))
    assert out.startswith("VALUEERROR:") and "head_count" in out, out


def test_file_without_vocabulary_runs_on_token_ids(good, tmp_path):
    """tokenizer.ggml.model "none" with a vocab_size (what the converter writes without a
    tokenizer.json): llama.cpp loads it with dummy tokens but asserts when asked to tokenize; the
    engine runs on token ids and refuses text with a ValueError."""
    from gguf import GGUFValueType

    p = rewrite_gguf(good, tmp_path / "novocab.gguf",
                     kv={"tokenizer.ggml.model": ("none", GGUFValueType.STRING), "qwen35.vocab_size": 640},
                     drop_keys=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                                "tokenizer.ggml.pre"))
    code = textwrap.dedent(f"""
        import dflash_native as dn
        eng = dn.Engine({str(p)!r}, n_ctx=64)
        assert eng.tokenizer is None
        print(len(eng.generate([1, 2, 3], max_tokens=3).tokens))
        try:
            eng.generate("some text", max_tokens=3)
        except ValueError as e:
            print("VALUEERROR:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "3" and "has no tokenizer" in out.stdout, out.stdout


@pytest.mark.parametrize("kv,msg", [
    ({"tokenizer.ggml.eos_token_id": 640}, "tokenizer.ggml.eos_token_id: must be a token id in [0, 640)"),
    ({"tokenizer.ggml.pre": ("gemma4", "str")}, "tokenizer.ggml.pre: 'gemma4' is not a byte-level BPE pre-tokenizer"),
    ({"tokenizer.ggml.model": ("bert", "str")}, "tokenizer.ggml.model: 'bert' is not supported"),
])
def test_broken_vocabulary_names_the_key(good, tmp_path, kv, msg):
    from gguf import GGUFValueType

    kv = {k: (v[0], GGUFValueType.STRING) if isinstance(v, tuple) else v for k, v in kv.items()}
    out = load_in_subprocess(rewrite_gguf(good, tmp_path / "vocab.gguf", kv=kv))
    assert out.startswith("VALUEERROR: [tokenizer]") and msg in out, out


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_fifo_is_refused_before_it_is_opened(pair, tmp_path, which):
    """Opening a FIFO for reading blocks until a writer comes: it must be refused from its type."""
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    tg, dg = pair
    out = load_in_subprocess(fifo, drafter=str(dg)) if which == "target" else spec_error(tg, fifo)
    assert "not a regular file" in out, out


@pytest.fixture(scope="module")
def eng(good):
    return dn.Engine(good, n_ctx=32, n_threads=2)


def test_prompt_longer_than_ctx(eng):
    with pytest.raises(ValueError, match="context overflow: 0 cached [+] 40 new tokens > n_ctx = 32"):
        eng.generate(list(range(5, 45)), max_tokens=4)
    with pytest.raises(ValueError, match="context overflow"):
        eng.eval(list(range(5, 45)))


def test_empty_prompt(eng):
    with pytest.raises(ValueError, match="empty input"):
        eng.generate([], max_tokens=4)
    with pytest.raises(ValueError, match="empty input"):
        eng.generate("", max_tokens=4)
    with pytest.raises(ValueError, match="empty input"):
        eng.generate([], max_tokens=0)  # the core checks the prompt even when nothing is generated


def test_token_outside_vocab(eng):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([1, 2, eng.n_vocab], max_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng._core.decode([-1])


def test_bad_arguments(good, eng):
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate([1, 2], max_tokens=-1)
    with pytest.raises(ValueError, match="kv_type"):
        dn.Engine(good, kv_type="q4")
    with pytest.raises(ValueError, match="n_ctx"):
        dn.Engine(good, n_ctx=0)
    with pytest.raises(ValueError, match="n_threads"):
        dn.Engine(good, n_threads=-1)
    with pytest.raises(ValueError, match="no device .tpu.*rpc://HOST:PORT"):
        dn.Engine(good, device="tpu")
    with pytest.raises(ValueError, match="tokens must be a 1-D"):
        eng._core.decode([[1, 2]])
    with pytest.raises(ValueError, match="tap layer"):
        eng._core.decode([1], taps=[99])


@pytest.mark.skipif(dn.gpu_available(), reason="this ggml has a GPU backend")
def test_gpu_missing_says_how_to_get_it(good):
    with pytest.raises(ValueError, match="CMAKE_ARGS"):
        dn.Engine(good, device="gpu")


def test_context_overflow_in_decode_keeps_state(eng):
    core = eng._core
    core.reset()
    core.decode(list(range(3, 30)))
    with pytest.raises(ValueError, match="context overflow"):
        core.decode(list(range(3, 10)))
    assert core.n_past == 27  # nothing was appended


def test_engine_still_correct_after_errors(eng):
    """Errors leave nothing corrupted: the same request gives the same answer before and after."""
    before = eng.generate([5, 6, 7], max_tokens=8).tokens
    for bad in ([], list(range(100)), [eng.n_vocab + 5]):
        with pytest.raises(ValueError):
            eng.generate(bad, max_tokens=8)
    assert eng.generate([5, 6, 7], max_tokens=8).tokens == before


def test_generation_stops_at_context_end(eng):
    r = eng.generate([5, 6, 7], max_tokens=100)
    assert r.stats.stop_reason in ("context", "eos")
    if r.stats.stop_reason == "context":
        assert len(r.tokens) == 32 - 3 + 1  # the last token comes from the logits at position n_ctx-1


# ---- drafter / target mismatches ------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from fixtures import make_random_pair

    return make_random_pair(tmp_path_factory.mktemp("badpair"), seed=1, block_size=8)


def spec_error(tg, dg, **kw) -> str:
    return load_in_subprocess(tg, drafter=str(dg), **kw)


def test_good_pair_loads(pair):
    assert spec_error(*pair) == "LOADED"


def test_drafter_hidden_size_mismatch(pair, tmp_path):
    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "h.gguf", kv={"dflash.embedding_length": 80})
    assert "drafter hidden size 80 != target hidden size 64" in spec_error(tg, bad)


def test_drafter_tap_beyond_target_layers(pair, tmp_path):
    from gguf import GGUFValueType

    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "l.gguf", kv={"dflash.target_layers": ([1, 9], GGUFValueType.ARRAY)})
    assert "outside the target's 4 layers" in spec_error(tg, bad)


def test_mask_token_outside_vocab(pair, tmp_path):
    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "m.gguf", kv={"tokenizer.ggml.mask_token_id": 100000})
    assert "mask token id 100000 is outside the target vocabulary" in spec_error(tg, bad)


def test_vocab_mismatch(pair, tmp_path):
    from gguf import GGUFValueType

    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "v.gguf", kv={"tokenizer.ggml.tokens": (["a", "b", "c"], GGUFValueType.ARRAY)},
                       drop_keys=("tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores"))
    assert "drafter vocabulary (3 tokens) != target vocabulary" in spec_error(tg, bad)


@pytest.mark.parametrize("ids,msg", [([5, 3], "strictly ascending (3 after 5)"),
                                     ([1, 100000], "draft_vocab id 100000 is outside the target vocabulary")])
def test_bad_draft_vocab_in_file(pair, tmp_path, ids, msg):
    from gguf import GGUFValueType

    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "dv.gguf", kv={"dflash.draft_vocab": (ids, GGUFValueType.ARRAY)})
    assert msg in spec_error(tg, bad)


@pytest.mark.parametrize("value,msg", [(0, "dflash.trained_context_length 0 must be in [1, 1048576]"),
                                       (1 << 21, "dflash.trained_context_length 2097152 must be in [1, 1048576]"),
                                       (-5, "'dflash.trained_context_length' = -5 is out of range")])
def test_bad_trained_context_length_in_file(pair, tmp_path, value, msg):
    from gguf import GGUFValueType

    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "tc.gguf", kv={"dflash.trained_context_length": (value, GGUFValueType.INT32)})
    assert msg in spec_error(tg, bad)


def test_block_size_and_capacity(pair):
    tg, dg = pair
    assert "block_size must be in [2, 64]" in spec_error(tg, dg, block_size=1)
    assert "feature_ring_capacity 4 must be >= block_size 8" in spec_error(tg, dg, feature_ring_capacity=4)
    assert "drafter_window" in spec_error(tg, dg, drafter_window=0)


def test_drafter_block_size_below_2_in_file(pair, tmp_path):
    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "b.gguf", kv={"dflash.block_size": 1})
    assert "block_size 1 must be in [2, 1024]" in spec_error(tg, bad, block_size=4)


@pytest.mark.parametrize("value", [0, 2**31, 2**32 - 1])
def test_drafter_block_size_out_of_range_in_file(pair, tmp_path, value):
    """The engine reads the drafter's block size first (to size the target's verify batch): through
    the core's parser, range-checked, before anything is allocated from it."""
    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "b.gguf", kv={"dflash.block_size": value})
    assert f"block_size {value} must be in [2, 1024]" in spec_error(tg, bad)


def test_target_given_as_drafter(pair):
    tg, _ = pair
    assert "not a DFlash drafter" in spec_error(tg, tg, block_size=4)


def test_speculative_without_drafter(pair):
    eng = dn.Engine(pair[0], n_ctx=64)
    with pytest.raises(ValueError, match="needs an Engine created with a drafter"):
        eng.generate([1, 2], max_tokens=2, speculative=True)


# ---- non-finite logits: the same clear error on every path -----------------------------

def _nan_where(names, row=None, value=np.nan):
    def fn(name, a):
        if name in names:
            a = a.copy()
            if row is None:
                a[...] = value
            else:
                a[row] = value
        return a
    return fn


@pytest.fixture(scope="module")
def nan_files(pair, tmp_path_factory):
    """Targets whose logits are NaN everywhere, NaN in one column, inf in one column, or NaN
    only after token 99 is fed; a drafter whose logits are NaN (with a draft vocabulary, so the
    row -> id mapping sees the flag too)."""
    from gguf import GGUFValueType

    tg, dg = pair
    d = tmp_path_factory.mktemp("nan")
    return {
        "all_nan": rewrite_gguf(tg, d / "all.gguf", tensor_fn=_nan_where({"output_norm.weight"})),
        "one_nan": rewrite_gguf(tg, d / "row.gguf", tensor_fn=_nan_where({"output.weight"}, row=17)),
        "one_inf": rewrite_gguf(tg, d / "inf.gguf", tensor_fn=_nan_where({"output.weight"}, row=17, value=np.inf)),
        "token_99": rewrite_gguf(tg, d / "emb.gguf", tensor_fn=_nan_where({"token_embd.weight"}, row=99)),
        "drafter": rewrite_gguf(dg, d / "dnan.gguf", tensor_fn=_nan_where({"output_norm.weight"}),
                                kv={"dflash.draft_vocab": (list(range(0, 600, 3)), GGUFValueType.ARRAY)}),
    }


NON_FINITE = r"non-finite logits \(NaN or inf\) at position"


@pytest.mark.parametrize("kind", ["all_nan", "one_nan", "one_inf"])
def test_non_finite_logits_raise_on_every_path(pair, nan_files, kind):
    """AR greedy used to commit the argmax of NaN rows (<|MASK|> x 8, stop 'length')."""
    eng = dn.Engine(nan_files[kind], drafter=pair[1], n_ctx=64, n_threads=2)
    for matmul_eng in (eng, dn.Engine.for_benchmark(nan_files[kind], n_ctx=64, n_threads=2, matmul="ggml")):
        with pytest.raises(RuntimeError, match=r"\[decode\] " + NON_FINITE + " 2"):
            matmul_eng.generate([5, 6, 7], max_tokens=8, speculative=False)
    with pytest.raises(RuntimeError, match=r"\[decode\] " + NON_FINITE + " 2"):
        eng.generate([5, 6, 7], max_tokens=8)  # speculative: the prefill
    with pytest.raises(RuntimeError, match=r"\[decode\] " + NON_FINITE + " 0"):
        eng.eval([5, 6, 7])
    stream = eng.generate([5, 6, 7], max_tokens=8, stream=True)
    with pytest.raises(RuntimeError, match=NON_FINITE):
        next(stream)


def test_non_finite_logits_in_verify_and_ar_step(pair, nan_files):
    eng = dn.Engine(nan_files["token_99"], drafter=pair[1], gate=False, n_ctx=64, n_threads=2)
    fresh = dn.Engine(nan_files["token_99"], drafter=pair[1], gate=False, n_ctx=64, n_threads=2)
    want = fresh.generate([5, 6, 7], max_tokens=10).tokens
    eng._draft_override = lambda prompt, out, B: [99] * (B - 1)  # the target verifies token 99 at position 4
    with pytest.raises(RuntimeError, match=r"\[verify\] " + NON_FINITE + " 4"):
        eng.generate([5, 6, 7], max_tokens=10)
    eng._draft_override = None
    assert eng.generate([5, 6, 7], max_tokens=10).tokens == want  # state reset: the engine goes on
    core = eng._core
    core.reset()
    core.decode_greedy([5, 6])
    with pytest.raises(RuntimeError, match=r"\[decode\] " + NON_FINITE + " 2"):
        core.decode_greedy([99])  # one AR step


def test_non_finite_logits_in_sampled_paths(pair, nan_files):
    """Sampling reads the logits rows on the host: NaN or inf there raises as in greedy decoding."""
    kw = dict(max_tokens=8, temperature=0.8, seed=1)
    eng = dn.Engine(nan_files["one_nan"], drafter=pair[1], gate=False, n_ctx=64, n_threads=2)
    with pytest.raises(RuntimeError, match=r"\[decode\] " + NON_FINITE + " 2"):
        eng.generate([5, 6, 7], speculative=False, **kw)
    with pytest.raises(RuntimeError, match=r"\[decode\] " + NON_FINITE + " 2"):
        eng.generate([5, 6, 7], **kw)  # the sampled prefill
    eng = dn.Engine(nan_files["token_99"], drafter=pair[1], gate=False, n_ctx=64, n_threads=2)
    eng._draft_override = lambda prompt, out, B: [99] * (B - 1)
    with pytest.raises(RuntimeError, match=r"\[verify\] " + NON_FINITE + " 4"):
        eng.generate([5, 6, 7], **kw)
    # a drafter's NaN logits: test_failed_drafter_falls_back_to_ar


# A drafter whose logits are NaN used to fail every speculative request while AR on the same engine
# worked. Now the first NaN draft is recorded (stats.drafter_failure, one RuntimeWarning and the
# "dflash_native" log) and the engine decodes AR from then on, with AR's output.
@pytest.mark.parametrize("verify, cutoff, dv", [("chain", 0.0, True), ("chain", 0.0, False),  # argmax op
                                                ("chain", 0.5, True), ("chain", 0.5, False),  # top1 op
                                                ("tree", 0.0, True)])                         # topk op
@pytest.mark.parametrize("gate", [False, True])
def test_failed_drafter_falls_back_to_ar(pair, nan_files, verify, cutoff, dv, gate, caplog):
    import warnings

    ar = dn.Engine(pair[0], n_ctx=64, n_threads=2)
    eng = dn.Engine(pair[0], drafter=nan_files["drafter"], gate=gate, verify=verify, draft_cutoff=cutoff, n_ctx=64,
                    n_threads=2)
    assert len(eng._spec.draft_vocab) == 200
    eng.draft_vocab = dv
    assert eng._spec.drafter_failure == ""
    for i, kw in enumerate([dict(), dict(temperature=0.8, seed=1), dict()]):
        want = ar.generate([5, 6, 7], max_tokens=10, **kw).tokens
        with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="dflash_native"):
            warnings.simplefilter("always")
            r = eng.generate([5, 6, 7], max_tokens=10, **kw)
        assert r.tokens == want and r.stats.speculative
        assert re.search(r"\[draft\] the drafter failed .*\[draft\] " + NON_FINITE, r.stats.drafter_failure), \
            r.stats.drafter_failure
        assert sum(r.stats.acceptance_histogram) == 0 and r.stats.ar_steps >= 1  # no round: AR steps
        said = [w for w in caught if issubclass(w.category, RuntimeWarning) and "drafter failed" in str(w.message)]
        logged = [rec for rec in caplog.records if "drafter failed" in rec.getMessage()]
        assert len(said) == len(logged) == (1 if i == 0 else 0)  # once per engine
        caplog.clear()
    assert eng.generate([5, 6, 7], max_tokens=10, speculative=False).tokens == want
    # a stream, and the core's own round: AR steps too
    assert "".join(eng.generate([5, 6, 7], max_tokens=10, stream=True)) == \
        ar.generate([5, 6, 7], max_tokens=10).text
    eng._core.reset()
    last = eng._spec.prefill([5, 6, 7], None)
    assert eng._spec.round(last, 4).ar


def test_healthy_drafter_reports_no_failure(pair):
    eng = dn.Engine(*pair[:1], drafter=pair[1], n_ctx=64, n_threads=2)
    r = eng.generate([5, 6, 7], max_tokens=10)
    assert r.stats.drafter_failure == "" and eng._spec.drafter_failure == ""


def test_top1_flags_non_finite_rows():
    from dflash_native import _core

    logits = np.array([[1, np.nan, 3], [1, 2, 3], [np.inf, 0, 0], [-np.inf, 0, 0]], dtype=np.float32)
    arg, p = _core.testing.top1(logits)
    assert arg.tolist() == [-1, 2, -1, -1]
    assert np.isnan(p[[0, 2, 3]]).all() and 0 < p[1] < 1


# ---- arguments: a clear ValueError for every wrong type or value ------------------------

ENGINE_BAD = [
    (dict(block_size=True), "block_size must be an int, got bool"),
    (dict(block_size=2.5), "block_size must be an int, got float"),
    (dict(block_size=1000), r"block_size \(max_verify\) must be in \[0, 64\]"),
    (dict(block_size=65), r"block_size \(max_verify\) must be in \[0, 64\]"),
    (dict(block_size=-2), r"block_size \(max_verify\) must be in \[0, 64\]"),
    (dict(n_batch=-3), "n_batch must be >= 1, got -3"),
    (dict(n_ctx=True), "n_ctx must be an int"),
    (dict(n_ctx="64"), "n_ctx must be an int"),
    (dict(n_ctx=2**70), "n_ctx = 1180591620717411303424 is out of range"),
    (dict(n_ctx=2**62), r"n_ctx must be <= 2147483647 \(positions are int32\), got 4611686018427387904"),  # was a GGML_ASSERT
    (dict(n_threads=2**40), "n_threads = 1099511627776 is out of range"),
    (dict(n_threads=100000), r"n_threads must be in \[1, 512\]"),
    (dict(drafter_window=2**63), "drafter_window = 9223372036854775808 is out of range"),
    (dict(drafter_window=0), "drafter_window must be a positive int or None"),
    (dict(feature_ring_capacity=None), "feature_ring_capacity must be an int"),
    (dict(feature_ring_capacity=-1), "feature_ring_capacity -1 must be >= block_size"),
    (dict(kv_type=16), "kv_type must be a str"),
    (dict(device=None), "device must be a str"),
    (dict(gate=1), "gate must be True or False"),
    (dict(draft_vocab="yes"), "draft_vocab must be True or False"),
    (dict(draft_cutoff="0.1"), "draft_cutoff must be a number"),
    (dict(draft_cutoff=True), "draft_cutoff must be a number"),
    (dict(draft_cutoff=float("nan")), r"draft_cutoff must be in \[0, 1\], got nan"),
    (dict(draft_cutoff=1.5), r"draft_cutoff must be in \[0, 1\]"),
    (dict(drafter=3), "drafter must be a path"),
]


@pytest.mark.parametrize("kw,msg", ENGINE_BAD, ids=[str(k) for k, _ in ENGINE_BAD])
def test_engine_argument(pair, kw, msg):
    tg, dg = pair
    kw = {"drafter": dg, "n_ctx": 64, **kw}
    with pytest.raises(ValueError, match=msg):
        dn.Engine(tg, **kw)


BENCH_BAD = [
    (dict(rollback="undo"), "rollback must be 'tape'"),
    (dict(rollback=None), "rollback must be a str"),
    (dict(matmul=b"own"), "matmul must be a str"),
    (dict(matmul="blas"), "matmul must be 'own' or 'ggml'"),
]


@pytest.mark.parametrize("kw,msg", BENCH_BAD, ids=[str(k) for k, _ in BENCH_BAD])
def test_benchmark_baseline_argument(pair, kw, msg):
    """Engine.for_benchmark's modes give the same clear ValueError as the constructor's arguments."""
    tg, dg = pair
    with pytest.raises(ValueError, match=msg):
        dn.Engine.for_benchmark(tg, drafter=dg, n_ctx=64, **kw)


def test_engine_target_argument(tmp_path):
    with pytest.raises(ValueError, match="target must be a path"):
        dn.Engine(None)
    with pytest.raises(ValueError, match="no such file"):
        dn.Engine(str(tmp_path / "nope.gguf").encode())  # a bytes path is a path


def test_numpy_ints_work(pair):
    tg, dg = pair
    eng = dn.Engine(tg, drafter=dg, n_ctx=np.int64(64), n_threads=np.int32(2), block_size=np.int64(4),
                    feature_ring_capacity=np.uint16(64), draft_cutoff=np.float32(0.25), draft_vocab=np.bool_(True))
    assert (eng.n_ctx, eng.block_size, eng.draft_cutoff) == (64, 4, 0.25)
    want = eng.generate([5, 6, 7], max_tokens=6).tokens
    assert eng.generate(np.array([5, 6, 7], dtype=np.int32), max_tokens=np.int64(6)).tokens == want
    assert eng.generate([np.int64(5), np.uint8(6), 7], max_tokens=6, stream=np.bool_(False)).tokens == want
    assert eng.eval(np.array([5, 6, 7])).shape == (3, eng.n_vocab)
    eng.draft_cutoff = np.float64(0.5)
    eng.draft_vocab = np.bool_(False)
    assert (eng.draft_cutoff, eng.draft_vocab) == (0.5, False)


GENERATE_BAD = [
    (dict(prompt=b"\x05\x06"), "got bytes: pass text as a str"),
    (dict(prompt=bytearray(b"ab")), "got bytearray"),
    (dict(prompt=[5.0, 6.7]), "token ids must be ints, got float 5.0 at index 0"),
    (dict(prompt=np.array([5.0, 6.0])), "1-D integer array, got float64"),
    (dict(prompt=[[5, 6]]), "token ids must be ints, got list"),
    (dict(prompt=[True, 5]), "token ids must be ints, got bool"),
    (dict(prompt=None), "expected a str or a sequence of token ids, got NoneType"),
    (dict(prompt=5), "expected a str or a sequence of token ids, got int"),
    (dict(max_tokens=True), "max_tokens must be an int, got bool"),
    (dict(max_tokens=4.0), "max_tokens must be an int, got float"),
    (dict(max_tokens=-1), "max_tokens must be >= 0, got -1"),
    (dict(stop=[1]), "stop strings must be str, got int"),
    (dict(stop=b"x"), "stop must be a str, a sequence of str or None, got bytes"),
    (dict(stop=5), "stop must be a str, a sequence of str or None, got int"),
    (dict(stream="yes"), "stream must be True or False"),
    (dict(speculative=1), "speculative must be True or False"),
    (dict(temperature=-0.5), r"\[sampling\] temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), r"\[sampling\] temperature must be a finite number >= 0"),
    (dict(temperature="0.7"), "temperature must be a number, got str"),
    (dict(temperature=0.7, top_p=0.0), r"\[sampling\] top_p must be in \(0, 1\]"),
    (dict(temperature=0.7, top_p=1.01), r"\[sampling\] top_p must be in \(0, 1\]"),
    (dict(temperature=0.7, min_p=1.0), r"\[sampling\] min_p must be in \[0, 1\)"),
    (dict(temperature=0.7, min_p=-0.1), r"\[sampling\] min_p must be in \[0, 1\)"),
    (dict(temperature=0.7, top_k=-1), r"\[sampling\] top_k must be >= 0"),
    (dict(temperature=0.7, top_k=2.0), "top_k must be an int, got float"),
    (dict(temperature=0.7, seed=1.5), r"seed must be None or an int in \[0, 2\*\*64\), got float"),
    (dict(temperature=0.7, seed="3"), "seed must be None or an int"),
    (dict(temperature=0.7, seed=True), "seed must be None or an int"),
    (dict(temperature=0.7, seed=-1), "seed must be None or an int"),
    (dict(temperature=0.7, seed=2**64), "seed must be None or an int"),
    (dict(top_p=2.0), r"\[sampling\] top_p"),  # checked under greedy too
]


@pytest.mark.parametrize("kw,msg", GENERATE_BAD, ids=[str(k) for k, _ in GENERATE_BAD])
def test_generate_argument(eng, kw, msg):
    kw = {"prompt": [5, 6, 7], "max_tokens": 2, **kw}
    with pytest.raises(ValueError, match=msg):
        eng.generate(kw.pop("prompt"), **kw)


def test_token_ids_past_int32(eng):
    for bad in ([5, 2**40], [5, 2**70], np.array([5, 2**40])):
        with pytest.raises(ValueError, match="token id|1-D sequence of integers"):
            eng.generate(bad, max_tokens=2)
        with pytest.raises(ValueError, match="token id|1-D sequence of integers"):
            eng.eval(bad)


def test_stop_none_means_no_stop_strings(eng):
    assert eng.generate([5, 6, 7], max_tokens=6, stop=None).tokens == eng.generate([5, 6, 7], max_tokens=6).tokens


def test_chat_arguments(eng):
    for messages, msg in [([{"role": "user", "content": None}], "message 0: 'content' must be a str, got NoneType"),
                          ([{"role": 3, "content": "hi"}], "message 0: 'role' must be a str, got int"),
                          ([{"role": "user"}], "message 0 must be a dict with 'role' and 'content'"),
                          ("hi", "messages must be a list of dicts, got str"),
                          (None, "messages must be a list of dicts, got NoneType")]:
        with pytest.raises(ValueError, match=msg):
            eng.chat(messages, max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        eng.chat([{"role": "user", "content": "hi"}], max_tokens="2")


def test_eval_and_text_arguments(eng):
    for bad, msg in [(b"ab", "got bytes"), ([1.5], "token ids must be ints"), (None, "got NoneType")]:
        with pytest.raises(ValueError, match=msg):
            eng.eval(bad)
    for bad in (b"hi", None, 5):
        with pytest.raises(ValueError, match="text must be a str"):
            eng.tokenize(bad)
    for bad, msg in [(b"ab", "got bytes"), ([1.5], "token ids must be ints"), ([-1], "outside the vocabulary")]:
        with pytest.raises(ValueError, match=msg):
            eng.detokenize(bad)
    assert eng.detokenize(np.array([5, 6])) == eng.detokenize([5, 6])


def test_detokenize_outside_vocab_does_not_abort(good):
    """llama.cpp threw std::out_of_range through ctypes: the process aborted."""
    code = textwrap.dedent(f"""
        import dflash_native as dn
        eng = dn.Engine({str(good)!r}, n_ctx=32)
        for bad in ([eng.tokenizer.n_vocab], [5, 10**6]):
            try:
                eng.detokenize(bad)
            except ValueError as e:
                print("VALUEERROR:", e)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"process died with {p.returncode}: {p.stderr[-2000:]}"
    assert p.stdout.count("VALUEERROR: [tokenizer] token id") == 2, p.stdout


def test_setter_arguments(pair):
    eng = dn.Engine(pair[0], drafter=pair[1], n_ctx=64)
    for bad, msg in [("0.1", "must be a number"), (float("nan"), "got nan"), (2, r"in \[0, 1\]"),
                     (None, "must be a number")]:
        with pytest.raises(ValueError, match=msg):
            eng.draft_cutoff = bad
    for bad in (1, "no", None):
        with pytest.raises(ValueError, match="draft_vocab must be True or False"):
            eng.draft_vocab = bad
    assert (eng.draft_cutoff, eng.draft_vocab) == (0.0, True)  # unchanged by the refused values


@pytest.mark.parametrize("args,msg", [
    (["--max-tokens", "-1"], "max_tokens must be >= 0"),
    (["--block-size", "1000"], "block_size"),
    (["--n-ctx", "0"], "n_ctx must be >= 1"),
    (["--threads", "-2"], "n_threads"),
    (["--prompt-file", "."], "Is a directory"),
    (["--prompt", ""], "empty input"),
])
def test_cli_errors(pair, capsys, args, msg):
    from dflash_native.cli import main

    base = ["generate", "--target", str(pair[0]), "--drafter", str(pair[1]), "--n-ctx", "64"]
    if "--prompt" not in args and "--prompt-file" not in args:
        base += ["--prompt", "def f"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert "dflash-native: error:" in err and msg in err, err


# ---- the other target architectures: files whose keys or shapes do not fit ----

@pytest.fixture(scope="module")
def good_llama(tmp_path_factory) -> Path:
    from fixtures import LLAMA3_ROPE_SCALING

    return make_random_gguf(tmp_path_factory.mktemp("bad-llama") / "llama.gguf", "llama", outtype="f16", seed=3,
                            rope_parameters=dict(LLAMA3_ROPE_SCALING))


@pytest.fixture(scope="module")
def good_moe(tmp_path_factory) -> Path:
    return make_random_gguf(tmp_path_factory.mktemp("bad-moe") / "moe.gguf", "qwen3_moe", outtype="f16", seed=3)


def test_llama_and_moe_files_load(good_llama, good_moe):
    assert load_in_subprocess(good_llama) == "LOADED"
    assert load_in_subprocess(good_moe) == "LOADED"


def _drop(name):
    return lambda n, a: None if n == name else a


def _trim(name):
    return lambda n, a: a[..., :-1].copy() if n == name else a


@pytest.mark.parametrize("edit, msg", [
    (dict(tensor_fn=_trim("blk.1.attn_q.weight")), "'blk.1.attn_q.weight' has shape"),
    (dict(tensor_fn=_trim("rope_freqs.weight")), "'rope_freqs.weight' has shape [7], expected [8]"),
    (dict(tensor_fn=_drop("blk.0.ffn_norm.weight")), "missing tensor 'blk.0.ffn_norm.weight'"),
    (dict(drop_keys=("llama.block_count",)), "missing key 'llama.block_count'"),
    (dict(kv={"llama.rope.scaling.type": ("linear", GGUFValueType.STRING)}), "rope.scaling.type 'linear' is not supported for llama"),
    (dict(kv={"llama.attention.head_count_kv": 3}), "head_count 4 must be a positive multiple of head_count_kv 3"),
])
def test_bad_llama_file(good_llama, tmp_path, edit, msg):
    out = load_in_subprocess(rewrite_gguf(good_llama, tmp_path / "bad.gguf", **edit))
    assert out.startswith("VALUEERROR:") and msg in out, out


@pytest.mark.parametrize("edit, msg", [
    (dict(kv={"qwen3moe.expert_count": 9}), "'blk.0.ffn_gate_inp.weight' has shape [64, 8], expected [64, 9]"),
    (dict(kv={"qwen3moe.expert_used_count": 9}), "expert_used_count 9 must be in [1, expert_count 8]"),
    (dict(kv={"qwen3moe.expert_used_count": 0}), "expert_used_count 0 must be in [1, expert_count 8]"),
    (dict(kv={"qwen3moe.expert_feed_forward_length": 16}), "'blk.0.ffn_gate_exps.weight' has shape [64, 32, 8]"),
    (dict(drop_keys=("qwen3moe.expert_count",)), "missing key 'qwen3moe.expert_count'"),
    (dict(tensor_fn=lambda n, a: a[:7].copy() if n == "blk.1.ffn_down_exps.weight" else a),
     "'blk.1.ffn_down_exps.weight' has shape [32, 64, 7], expected [32, 64, 8]"),
    (dict(tensor_fn=_drop("blk.1.ffn_up_exps.weight")), "missing tensor 'blk.1.ffn_up_exps.weight'"),
])
def test_bad_moe_file(good_moe, tmp_path, edit, msg):
    out = load_in_subprocess(rewrite_gguf(good_moe, tmp_path / "bad.gguf", **edit))
    assert out.startswith("VALUEERROR:") and msg in out, out


@pytest.fixture(scope="module")
def good_next(tmp_path_factory) -> Path:
    """A tiny qwen3next file: layers [GDN, attention, GDN, attention], 8 experts (top 2, width 32), a
    shared expert of width 48, 2 key / 4 value GDN heads of 16."""
    return make_random_gguf(tmp_path_factory.mktemp("bad-next") / "next.gguf", "qwen3_next", outtype="f16", seed=3)


def test_qwen3next_file_loads(good_next):
    assert load_in_subprocess(good_next) == "LOADED"


@pytest.mark.parametrize("edit, msg", [
    (dict(kv={"qwen3next.expert_count": 9}), "'blk.0.ffn_gate_inp.weight' has shape [64, 8], expected [64, 9]"),
    (dict(kv={"qwen3next.expert_used_count": 0}), "expert_used_count 0 must be in [1, expert_count 8]"),
    (dict(kv={"qwen3next.expert_shared_feed_forward_length": 40}),
     "'blk.0.ffn_gate_shexp.weight' has shape [64, 48], expected [64, 40]"),
    # without its own key the shared expert is feed_forward_length wide, as llama.cpp reads it
    (dict(drop_keys=("qwen3next.expert_shared_feed_forward_length",)),
     "'blk.0.ffn_gate_shexp.weight' has shape [64, 48], expected [64, 128]"),
    (dict(drop_keys=("qwen3next.expert_shared_feed_forward_length", "qwen3next.feed_forward_length")),
     "qwen3next needs a shared expert"),
    (dict(kv={"qwen3next.ssm.time_step_rank": 6}), "ssm.inner_size 64 != value head dim x value heads"),
    (dict(kv={"qwen3next.ssm.group_count": 3}), "value heads 4 must be a multiple of key heads 3"),
    (dict(tensor_fn=lambda n, a: a[:7].copy() if n == "blk.2.ssm_ba.weight" else a),
     "'blk.2.ssm_ba.weight' has shape [64, 7], expected [64, 8]"),
    (dict(tensor_fn=_drop("blk.0.ssm_ba.weight")), "missing tensor 'blk.0.ssm_ba.weight'"),
    (dict(tensor_fn=_drop("blk.1.ffn_gate_inp_shexp.weight")), "missing tensor 'blk.1.ffn_gate_inp_shexp.weight'"),
    (dict(tensor_fn=lambda n, a: a[:7].copy() if n == "blk.3.ffn_up_exps.weight" else a),
     "'blk.3.ffn_up_exps.weight' has shape [64, 32, 7], expected [64, 32, 8]"),
    (dict(add_tensors={"blk.0.ssm_in.weight": np.zeros((192, 64))}), "'blk.0.ssm_in.weight' (the fused qkvz"),
    (dict(kv={"qwen3next.nextn_predict_layers": 4}), "nextn_predict_layers 4 must be less than block_count"),
])
def test_bad_qwen3next_file(good_next, tmp_path, edit, msg):
    out = load_in_subprocess(rewrite_gguf(good_next, tmp_path / "bad.gguf", **edit))
    assert out.startswith("VALUEERROR:") and msg in out, out


# ---- nothing in a file is silently ignored (issue 38) -------------------------------------
# llama.cpp counts the tensors it created against the file's and stops on a mismatch; we do the same
# for tensors and keys: a tensor or key the architecture does not read is an error naming it.

@pytest.fixture(scope="module")
def good_untied(tmp_path_factory) -> Path:
    """A qwen3 file with its own lm_head (output.weight)."""
    return make_random_gguf(tmp_path_factory.mktemp("bad-untied") / "untied.gguf", "qwen3", outtype="f16", seed=3,
                            tie_word_embeddings=False)


def test_renamed_output_is_refused_not_tied(good_untied, tmp_path):
    """A one-byte rename of output.weight loaded before: the lm_head fell back to the embeddings."""
    assert load_in_subprocess(good_untied) == "LOADED"
    out = load_in_subprocess(rewrite_gguf(good_untied, tmp_path / "r.gguf", rename={"output.weight": "output.weighs"}))
    assert out.startswith("VALUEERROR:") and "tensor 'output.weighs'" in out and "not part of a 'qwen3'" in out, out


_F32 = GGUFValueType.FLOAT32
# (fixture, edit, the name the error must give): unknown tensors, and keys that change the computation
# in llama.cpp (sliding window, soft caps, scales, gating functions, partial rotary for the drafter...)
STRICT_TARGET_CASES = [
    ("good", dict(add_tensors={"blk.0.attn_q.bias": np.zeros(128)}), "tensor 'blk.0.attn_q.bias'"),
    ("good", dict(rename={"blk.1.ffn_up.weight": "blk.1.ffn_upp.weight"}), "missing tensor 'blk.1.ffn_up.weight'"),
    ("good", dict(add_tensors={"blk.9.attn_norm.weight": np.zeros(64)}), "tensor 'blk.9.attn_norm.weight'"),
    ("good", dict(kv={"qwen35.attention.sliding_window": 128}), "key 'qwen35.attention.sliding_window'"),
    ("good", dict(kv={"qwen35.final_logit_softcapping": (30.0, _F32)}), "key 'qwen35.final_logit_softcapping'"),
    ("good", dict(kv={"qwen35.attn_logit_softcapping": (50.0, _F32)}), "key 'qwen35.attn_logit_softcapping'"),
    ("good", dict(kv={"qwen35.logit_scale": (0.5, _F32)}), "key 'qwen35.logit_scale'"),
    ("good", dict(kv={"qwen35.embedding_scale": (8.0, _F32)}), "key 'qwen35.embedding_scale'"),
    ("good", dict(kv={"qwen35.vocab_size": 641}), "vocab_size 641 != the 640 rows of token_embd.weight"),
    ("good_llama", dict(add_tensors={"output.weight_": np.zeros((640, 64))}), "tensor 'output.weight_'"),
    ("good_llama", dict(kv={"llama.rope.scaling.longrope": 1}), "'llama.rope.scaling.longrope' is not supported"),
    ("good_llama", dict(kv={"llama.attention.layer_norm_epsilon": (1e-5, _F32)}),
     "key 'llama.attention.layer_norm_epsilon'"),
    ("good_moe", dict(kv={"qwen3moe.expert_gating_func": 2}), "key 'qwen3moe.expert_gating_func'"),
    ("good_moe", dict(kv={"qwen3moe.expert_weights_scale": (2.5, _F32)}), "key 'qwen3moe.expert_weights_scale'"),
    ("good_moe", dict(add_tensors={"blk.0.exp_probs_b.bias": np.zeros(8)}), "tensor 'blk.0.exp_probs_b.bias'"),
    ("good_next", dict(add_tensors={"blk.1.attn_sinks.weight": np.zeros(4)}), "tensor 'blk.1.attn_sinks.weight'"),
    ("good_next", dict(kv={"qwen3next.expert_shared_count": 2}), "key 'qwen3next.expert_shared_count'"),
]


@pytest.mark.parametrize("fixture, edit, name", STRICT_TARGET_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(STRICT_TARGET_CASES)])
def test_unread_tensor_or_key_is_refused(request, tmp_path, fixture, edit, name):
    src = request.getfixturevalue(fixture)
    out = load_in_subprocess(rewrite_gguf(src, tmp_path / "strict.gguf", **edit))
    assert out.startswith("VALUEERROR:") and name in out, out


def test_harmless_keys_load(good, tmp_path):
    """What llama.cpp's converter and quantizer add that changes nothing (general.*, tokenizer.*,
    quantize.*) still loads: the allow-list is explicit."""
    S = GGUFValueType.STRING
    p = rewrite_gguf(good, tmp_path / "ok.gguf", kv={
        "general.license": ("apache-2.0", S), "general.quantized_by": ("someone", S),
        "quantize.imatrix.file": ("imatrix.dat", S), "quantize.imatrix.entries_count": 7,
        "tokenizer.ggml.padding_token_id": 0, "qwen35.vocab_size": 640})
    assert load_in_subprocess(p) == "LOADED"


# Drafter files that are not what they claim, or that llama.cpp runs and this engine does not:
# refused by name. (DFlash 2's selector and convs, DSpark's Markov head, partial RoPE and the
# attention scales are implemented: tests/test_dflash2.py, test_dspark.py, test_drafter_options.py.)
STRICT_DRAFTER_CASES = [
    (dict(kv={"dflash.conv_kernel_size": 4, "dflash.conv_group_size": 8}), "without the selector tensors",
     "dflash.conv_kernel_size"),
    (dict(add_tensors={"blk.0.attn_conv_base": np.zeros((2, 4, 64))}), "not part of a 'dflash'",
     "blk.0.attn_conv_base"),
    (dict(add_tensors={"selector_hidden.weight": np.zeros((8, 64))}), "needs dflash.conv_kernel_size",
     "selector_hidden.weight"),
    (dict(kv={"dflash.selector_rank": 8}), "without the selector tensors", "dflash.selector_rank"),
    (dict(add_tensors={"markov_w2.weight": np.zeros((640, 8))}), "without markov_w1.weight", "markov_w2"),
    (dict(kv={"dflash.sample_from_anchor": (True, GGUFValueType.BOOL)}), "without markov_w1.weight",
     "dflash.sample_from_anchor"),
    (dict(kv={"dflash.hyper_connection.count": 4}), "DeepSeek-V4", "dflash.hyper_connection.count"),
    (dict(add_tensors={"d2t": np.zeros(10)}), "d2t", "d2t"),
    (dict(add_tensors={"blk.0.attn_post_norm.weight": np.zeros(64)}), "not part of a 'dflash'",
     "blk.0.attn_post_norm.weight"),
    (dict(rename={"enc.output_norm.weight": "enc.output_norm.weight."}), "missing tensor", "enc.output_norm.weight"),
    (dict(kv={"dflash.rope.dimension_count": 7}), "must be even", "rope.dimension_count"),
    (dict(kv={"dflash.hidden_activation": ("gelu", GGUFValueType.STRING)}), "hidden_activation 'gelu'", "silu"),
]


@pytest.mark.parametrize("edit, kind, name", STRICT_DRAFTER_CASES, ids=[c[2] for c in STRICT_DRAFTER_CASES])
def test_unimplemented_drafter_is_refused(pair, tmp_path, edit, kind, name):
    tg, dg = pair
    out = spec_error(tg, rewrite_gguf(dg, tmp_path / "d.gguf", **edit))
    assert out.startswith("VALUEERROR:") and kind in out and name in out, out
