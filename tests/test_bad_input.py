"""Bad input raises a clear Python exception and never aborts the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def eng(good):
    return dn.Engine(good, n_ctx=32, n_threads=2)


def test_prompt_longer_than_ctx(eng):
    with pytest.raises(ValueError, match="longer than n_ctx = 32"):
        eng.generate(list(range(5, 45)), max_tokens=4)
    with pytest.raises(ValueError, match="longer than n_ctx"):
        eng.eval(list(range(5, 45)))


def test_empty_prompt(eng):
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([], max_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate("", max_tokens=4)


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
        dn.Engine(good, n_threads=0)
    with pytest.raises(ValueError, match="unknown device"):
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
    from dflash_native.convert import convert_hf_to_gguf
    from fixtures import make_random_checkpoint, make_random_drafter_gguf

    d = tmp_path_factory.mktemp("badpair")
    ckpt = make_random_checkpoint(d / "t", "qwen3_5", seed=1)
    tg = convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f16")
    dg = make_random_drafter_gguf(d / "d.gguf", ckpt, outtype="f16", seed=2, block_size=8, target_gguf=tg)
    return tg, dg


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
    assert "block_size must be an int >= 2" in spec_error(tg, dg, block_size=1)
    assert "feature_ring_capacity 4 must be >= block_size 8" in spec_error(tg, dg, feature_ring_capacity=4)
    assert "drafter_window" in spec_error(tg, dg, drafter_window=0)


def test_drafter_block_size_below_2_in_file(pair, tmp_path):
    tg, dg = pair
    bad = rewrite_gguf(dg, tmp_path / "b.gguf", kv={"dflash.block_size": 1})
    assert "block_size 1 must be >= 2" in spec_error(tg, bad, block_size=4)


def test_target_given_as_drafter(pair):
    tg, _ = pair
    assert "not a DFlash drafter" in spec_error(tg, tg, block_size=4)


def test_speculative_without_drafter(pair):
    eng = dn.Engine(pair[0], n_ctx=64)
    with pytest.raises(ValueError, match="needs an Engine created with a drafter"):
        eng.generate([1, 2], max_tokens=2, speculative=True)
