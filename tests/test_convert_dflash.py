"""DFlash drafter HF -> GGUF converter, and the PyTorch reference drafter.

What llama.cpp (llama-cpp-python 0.3.36) does with a drafter GGUF, measured here:
- `llama_cpp.Llama(model_path=drafter)` fails, even with vocab_only=True: that
  class always creates a context, and a dflash context needs the target's
  context as `ctx_other` (for tok_embd / output). The low-level API loads the
  model on its own (hparams, vocabulary, every tensor shape checked by
  llama.cpp's loader), and with `ctx_other` set runs the drafter graph.
- With flash attention off and an F32 KV cache, llama.cpp's drafter logits
  match `DFlashRef` to ~4e-6 (logit std ~2); with flash attention on (CPU)
  they differ by ~2e-3 because ggml's CPU flash attention rounds through F16.
  So the parity tests pin FA off, and run on f16 / bf16 / q8_0 GGUFs with the
  reference's weights rounded the same way (tolerances below).
"""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

from dflash_native.convert import convert_hf_to_gguf
from dflash_native.convert_dflash import convert_dflash_to_gguf
from fixtures import (
    default_target_layer_ids,
    drafter_overrides_for_target,
    make_random_checkpoint,
    make_random_drafter_checkpoint,
    make_random_drafter_gguf,
    mask_token_id_of,
)
from reference.dflash_ref import DFlashRef, round_like_gguf, target_taps

torch = pytest.importorskip("torch")

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
OUT_QTYPE = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}
# (max |diff|, relative RMS) of llama.cpp drafter logits vs DFlashRef on the same
# rounded weights (logit std ~2). Measured worst over seeds 0-2, n_ctx 1/6/20,
# block 16, Qwen3 and Qwen3.5 targets: f32 6.2e-6 / 3.7e-7, f16 3.2e-3 / 3.6e-4,
# bf16 2.2e-2 / 2.2e-3, q8_0 8.1e-2 / 8.8e-3 (llama.cpp rounds the activations
# to the weight's dot-product type). The bars sit ~4x above.
TOLERANCE = {"f32": (1e-4, 1e-5), "f16": (1.5e-2, 1.5e-3), "bf16": (1e-1, 1e-2), "q8_0": (3e-1, 3e-2)}
N_THREADS = 2

# What llama.cpp's dflash loader requires (src/models/dflash.cpp, load_arch_tensors;
# ggml ne order) for a drafter of hidden size h, n_taps taps, head dims as below.
def _llama_cpp_tensor_ne(h: int, n_taps: int, n_layer: int, n_head: int, n_kv: int, hd: int,
                         n_ff: int) -> dict[str, list[int]]:
    ne = {"fc.weight": [n_taps * h, h], "enc.output_norm.weight": [h], "output_norm.weight": [h]}
    for i in range(n_layer):
        ne.update({
            f"blk.{i}.attn_norm.weight": [h],
            f"blk.{i}.attn_q.weight": [h, hd * n_head],
            f"blk.{i}.attn_k.weight": [h, hd * n_kv],
            f"blk.{i}.attn_v.weight": [h, hd * n_kv],
            f"blk.{i}.attn_output.weight": [hd * n_head, h],
            f"blk.{i}.attn_q_norm.weight": [hd],
            f"blk.{i}.attn_k_norm.weight": [hd],
            f"blk.{i}.ffn_norm.weight": [h],
            f"blk.{i}.ffn_gate.weight": [h, n_ff],
            f"blk.{i}.ffn_down.weight": [n_ff, h],
            f"blk.{i}.ffn_up.weight": [h, n_ff],
        })
    return ne


# key -> GGUF type (arrays: (ARRAY, element type)); llama.cpp reads the u32 keys with
# get_key (any integer type would do) and target_layers with get_arr into int32.
EXPECTED_KEY_TYPES = {
    "general.architecture": VT.STRING,
    "dflash.block_count": VT.UINT32,
    "dflash.context_length": VT.UINT32,
    "dflash.embedding_length": VT.UINT32,
    "dflash.feed_forward_length": VT.UINT32,
    "dflash.attention.head_count": VT.UINT32,
    "dflash.attention.head_count_kv": VT.UINT32,
    "dflash.attention.key_length": VT.UINT32,
    "dflash.attention.value_length": VT.UINT32,
    "dflash.attention.layer_norm_rms_epsilon": VT.FLOAT32,
    "dflash.rope.freq_base": VT.FLOAT32,
    "dflash.target_layers": (VT.ARRAY, VT.INT32),
    "dflash.block_size": VT.UINT32,
    "dflash.attention.causal": VT.BOOL,
    "tokenizer.ggml.mask_token_id": VT.UINT32,
    "general.file_type": VT.UINT32,
}


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------

TARGETS = {
    # 4 layers so that two taps fit below the last layer; untied lm_head
    "qwen3": dict(num_hidden_layers=4, tie_word_embeddings=False),
    # M-RoPE target (rope sections), tied embeddings, 4 layers (2 GDN + 2 attention)
    "qwen3_5": dict(tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """target(arch) -> (HF checkpoint dir, f32 GGUF)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"target-{arch}")
            ckpt = make_random_checkpoint(d / "hf", arch, seed=0, **TARGETS[arch])
            cache[arch] = (ckpt, convert_hf_to_gguf(ckpt, d / "target.gguf", outtype="f32"))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    """drafter(arch, outtype="f32", **overrides) -> (HF drafter dir, GGUF), built
    for target(arch) with its tokenizer taken from the target GGUF."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(arch: str, outtype: str = "f32", **overrides: Any) -> tuple[Path, Path]:
        key = (arch, outtype, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            ckpt, tgguf = target(arch)
            d = tmp_path_factory.mktemp(f"drafter-{arch}-{outtype}")
            kw = {"target_layer_ids": [0, 2], "num_hidden_layers": 2, "block_size": 8, **overrides}
            path = make_random_drafter_gguf(d / "drafter.gguf", ckpt, outtype=outtype, seed=1, target_gguf=tgguf,
                                            ckpt_dir=d / "hf", **kw)
            cache[key] = (d / "hf", path)
        return cache[key]

    return get


def _fields(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    reader = gguf.GGUFReader(path)
    values = {k: f.contents() for k, f in reader.fields.items()}
    types = {k: (VT(f.types[0]) if len(f.types) == 1 else (VT(f.types[0]), VT(f.types[-1])))
             for k, f in reader.fields.items()}
    return values, types, {t.name: t for t in reader.tensors}


def _config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def _st(ckpt: Path) -> dict[str, np.ndarray]:
    """Checkpoint tensors as float32, read with the safetensors package (not our reader)."""
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(str(ckpt / "model.safetensors")).items()}


def _write_st(ckpt: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(ckpt / "model.safetensors"))


# ---------------------------------------------------------------------------
# keys, tensors, types
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("outtype", OUTTYPES)
def test_keys_tensors_and_types(outtype, drafter, target):
    # intermediate 100: ffn_down rows are not whole Q8_0 blocks (F16 fallback)
    ckpt, path = drafter("qwen3", outtype, intermediate_size=100)
    cfg = _config(ckpt)
    values, types, tensors = _fields(path)

    for key, want in EXPECTED_KEY_TYPES.items():
        assert key in types, key
        assert types[key] == want, (key, types[key], want)
    h = cfg["hidden_size"]
    assert values["general.architecture"] == "dflash"
    assert values["general.file_type"] == FILE_TYPE[outtype]
    assert values["dflash.block_count"] == 2
    assert values["dflash.embedding_length"] == h
    assert values["dflash.feed_forward_length"] == 100
    assert values["dflash.attention.head_count"] == cfg["num_attention_heads"]
    assert values["dflash.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert values["dflash.attention.key_length"] == values["dflash.attention.value_length"] == cfg["head_dim"]
    assert values["dflash.context_length"] == cfg["max_position_embeddings"]
    assert values["dflash.rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert values["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert values["dflash.target_layers"] == [1, 3]  # HF ids [0, 2] + 1
    assert values["dflash.block_size"] == 8
    assert values["dflash.attention.causal"] is False
    assert values["tokenizer.ggml.mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    assert not any(k.startswith("dflash.attention.sliding_window") for k in values)
    assert "dflash.rope.dimension_sections" not in values  # a Qwen3 target has no M-RoPE

    want_ne = _llama_cpp_tensor_ne(h, 2, 2, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                   cfg["head_dim"], 100)
    assert {n: [int(x) for x in t.shape] for n, t in tensors.items()} == want_ne
    for name, t in tensors.items():
        if len(want_ne[name]) == 1:
            want = QT.F32
        elif outtype == "q8_0" and want_ne[name][0] % 32 != 0:
            want = QT.F16
        else:
            want = OUT_QTYPE[outtype]
        assert t.tensor_type == want, (name, t.tensor_type.name, want.name)
    if outtype == "q8_0":
        assert tensors["blk.0.ffn_down.weight"].tensor_type == QT.F16


def test_tensor_data_is_copied_unchanged(drafter):
    """F32 GGUF data == checkpoint data: norms are Qwen3's plain `x * w` (no +1),
    fc / projections are not permuted, hidden_norm lands in enc.output_norm."""
    ckpt, path = drafter("qwen3")
    src = _st(ckpt)
    _, _, tensors = _fields(path)
    pairs = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
             "output_norm.weight": "norm.weight"}
    hf_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for il in range(2):
        pairs.update({f"blk.{il}.{g}.weight": f"layers.{il}.{h}.weight" for g, h in hf_layer.items()})
    assert set(pairs) == set(tensors)
    for gname, hname in pairs.items():
        data = np.asarray(tensors[gname].data, dtype=np.float32).reshape(src[hname].shape)
        np.testing.assert_array_equal(data, src[hname], err_msg=gname)
    assert abs(float(src["norm.weight"].mean()) - 1.0) < 0.1  # the fixture's norms sit near 1, not 0


def test_tokenizer_copied_from_target_gguf(drafter, target):
    _, tgguf = target("qwen3")
    ckpt, path = drafter("qwen3")
    values, _, _ = _fields(path)
    tvalues, _, _ = _fields(tgguf)
    tok_keys = {k for k in tvalues if k.startswith("tokenizer.")}
    assert tok_keys <= set(values)
    for k in tok_keys - {"tokenizer.ggml.mask_token_id"}:
        assert values[k] == tvalues[k], k
    assert values["tokenizer.ggml.mask_token_id"] == mask_token_id_of(target("qwen3")[0])


def test_tokenizer_from_target_dir_and_none(target, tmp_path, caplog):
    tckpt, tgguf = target("qwen3")
    d = make_random_drafter_checkpoint(tmp_path / "d", **{**drafter_overrides_for_target(tckpt),
                                                          "target_layer_ids": [1]})
    from_dir = convert_dflash_to_gguf(d, tmp_path / "a.gguf", outtype="f32", target_dir=tckpt)
    values, _, _ = _fields(from_dir)
    tvalues, _, _ = _fields(tgguf)
    assert values["tokenizer.ggml.model"] == "gpt2"
    assert values["tokenizer.ggml.tokens"] == tvalues["tokenizer.ggml.tokens"]
    assert values["tokenizer.ggml.merges"] == tvalues["tokenizer.ggml.merges"]

    # the drafter dir's own tokenizer.json is used when present
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tckpt / name, d / name)
    own = convert_dflash_to_gguf(d, tmp_path / "b.gguf", outtype="f32")
    assert _fields(own)[0]["tokenizer.ggml.tokens"] == tvalues["tokenizer.ggml.tokens"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()

    with caplog.at_level(logging.WARNING):
        bare = convert_dflash_to_gguf(d, tmp_path / "c.gguf", outtype="f32")
    values, _, _ = _fields(bare)
    assert values["tokenizer.ggml.model"] == "none"
    assert values["tokenizer.ggml.mask_token_id"] == _config(d)["dflash_config"]["mask_token_id"]
    assert "no tokenizer.json" in caplog.text


def test_mrope_target_gets_degenerate_rope_sections(drafter):
    """As llama.cpp's converter: a drafter for an M-RoPE target carries sections
    [head_dim/2, 0, 0, 0] (every rotary pair uses the token position = NeoX)."""
    ckpt, path = drafter("qwen3_5")
    values, types, _ = _fields(path)
    assert values["dflash.rope.dimension_sections"] == [_config(ckpt)["head_dim"] // 2, 0, 0, 0]


def test_trained_context_length_key(target, tmp_path):
    """dflash_config.trained_context_length -> dflash.trained_context_length (UINT32); absent when the
    config has none; a value the engine would refuse is refused here first."""
    tckpt, _ = target("qwen3")
    base = {**drafter_overrides_for_target(tckpt), "target_layer_ids": [0, 1]}
    d = make_random_drafter_checkpoint(tmp_path / "tc", **base, dflash_config={"trained_context_length": 158})
    values, types, _ = _fields(convert_dflash_to_gguf(d, tmp_path / "tc.gguf", outtype="f32"))
    assert values["dflash.trained_context_length"] == 158
    assert types["dflash.trained_context_length"] == VT.UINT32
    d = make_random_drafter_checkpoint(tmp_path / "none", **base)
    assert "dflash.trained_context_length" not in _fields(convert_dflash_to_gguf(d, tmp_path / "n.gguf",
                                                                                 outtype="f32"))[0]
    for bad in (0, -1, 1 << 21, "158", 1.5):
        d = make_random_drafter_checkpoint(tmp_path / "bad", **base, dflash_config={"trained_context_length": bad})
        with pytest.raises(ValueError, match="trained_context_length must be an int in"):
            convert_dflash_to_gguf(d, tmp_path / "b.gguf", outtype="f32")


def test_sliding_window_and_causal_keys(target, tmp_path):
    tckpt, _ = target("qwen3")
    base = {**drafter_overrides_for_target(tckpt), "target_layer_ids": [0, 1], "num_hidden_layers": 2}

    d = make_random_drafter_checkpoint(tmp_path / "swa", **base, use_sliding_window=True, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention"], is_causal=False)
    values, types, _ = _fields(convert_dflash_to_gguf(d, tmp_path / "swa.gguf", outtype="f32"))
    assert values["dflash.attention.sliding_window"] == 5
    assert types["dflash.attention.sliding_window_pattern"] == (VT.ARRAY, VT.BOOL)
    assert values["dflash.attention.sliding_window_pattern"] == [True, False]
    assert values["dflash.attention.causal"] is False

    # z-lab: sliding layers are causal when is_causal is not given
    d = make_random_drafter_checkpoint(tmp_path / "all", **base, use_sliding_window=True, sliding_window=5,
                                       layer_types=["sliding_attention"] * 2)
    assert _fields(convert_dflash_to_gguf(d, tmp_path / "all.gguf", outtype="f32"))[0][
        "dflash.attention.causal"] is True

    d = make_random_drafter_checkpoint(tmp_path / "c", **base, is_causal=True)
    assert _fields(convert_dflash_to_gguf(d, tmp_path / "c.gguf", outtype="f32"))[0][
        "dflash.attention.causal"] is True


def test_legacy_block_size_prefixed_names_and_bf16(target, tmp_path):
    """Older configs keep block_size at the top level; some exports prefix names
    with `model.`; BF16 safetensors widen exactly to F32."""
    tckpt, _ = target("qwen3")
    d = make_random_drafter_checkpoint(tmp_path / "d", **{**drafter_overrides_for_target(tckpt),
                                                          "target_layer_ids": [1]},
                                       prefix="model.", dtype="bfloat16", block_size=4)
    cfg = _config(d)
    cfg["block_size"] = cfg["dflash_config"].pop("block_size")
    (d / "config.json").write_text(json.dumps(cfg))
    values, _, tensors = _fields(convert_dflash_to_gguf(d, tmp_path / "d.gguf", outtype="f32"))
    assert values["dflash.block_size"] == 4
    assert "fc.weight" in tensors and "blk.0.attn_q.weight" in tensors
    src = _st(d)
    np.testing.assert_array_equal(np.asarray(tensors["fc.weight"].data).reshape(src["model.fc.weight"].shape),
                                  src["model.fc.weight"])


def test_drafter_matching_a_target_config_dict(target, tmp_path):
    tckpt, _ = target("qwen3")
    cfg = _config(tckpt)
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter_overrides_for_target(cfg)
    kw = drafter_overrides_for_target({**cfg, "mask_token_id": 7})
    assert (kw["hidden_size"], kw["n_target_layers"], kw["vocab_size"], kw["mask_token_id"]) == (64, 4, 640, 7)
    path = make_random_drafter_gguf(tmp_path / "d.gguf", {**cfg, "mask_token_id": 7}, outtype="q8_0",
                                    target_layer_ids=[1, 2])
    values, _, tensors = _fields(path)
    assert values["dflash.target_layers"] == [2, 3] and values["tokenizer.ggml.mask_token_id"] == 7
    assert tensors["fc.weight"].tensor_type == QT.Q8_0


def test_default_target_layer_ids():
    assert default_target_layer_ids(24, 1) == [12]
    assert default_target_layer_ids(64, 2) == [1, 61]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(2, 1) == [0]  # never the last layer
    with pytest.raises(ValueError):
        default_target_layer_ids(1, 1)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

def _edit_config(key_path: Sequence[str], value: Any):
    def f(d: Path) -> None:
        cfg = _config(d)
        node = cfg
        for k in key_path[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[key_path[-1]]
        else:
            node[key_path[-1]] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return f


_DELETE = object()


def _edit_tensors(fn):
    def f(d: Path) -> None:
        t = _st(d)
        fn(t)
        _write_st(d, t)
    return f


BAD_CASES = {
    "no_config": (lambda d: (d / "config.json").unlink(), "has no config.json"),
    "bad_json": (lambda d: (d / "config.json").write_text("{nope"), "not valid JSON"),
    "not_dflash": (_edit_config(["architectures"], ["Qwen3ForCausalLM"]), "not a DFlashDraftModel"),
    "dflash2_without_keys": (_edit_config(["architectures"], ["DFlash2DraftModel"]),
                             "a DFlash2DraftModel needs dflash_config"),
    "no_dflash_config": (_edit_config(["dflash_config"], _DELETE), "missing 'dflash_config'"),
    "no_layer_ids": (_edit_config(["dflash_config", "target_layer_ids"], _DELETE), "target_layer_ids"),
    "empty_layer_ids": (_edit_config(["dflash_config", "target_layer_ids"], []), "target_layer_ids"),
    "negative_layer_id": (_edit_config(["dflash_config", "target_layer_ids"], [-1]), "negative"),
    "no_mask": (_edit_config(["dflash_config", "mask_token_id"], _DELETE), "mask_token_id"),
    "mask_outside_vocab": (_edit_config(["dflash_config", "mask_token_id"], 10 ** 6), "mask_token_id"),
    "block_size_1": (_edit_config(["dflash_config", "block_size"], 1), r"block_size must be an int in \[2, 64\]"),
    **{f"missing_{k}": (_edit_config([k], _DELETE), f"missing key '{k}'")
       for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings", "rms_norm_eps", "hidden_act")},
    "swa_without_window": (_edit_config(["sliding_window"], _DELETE), "'sliding_window' is missing"),
    "attention_bias": (_edit_config(["attention_bias"], True), "attention_bias"),
    "dflash2_partial_keys": (_edit_config(["dflash_config", "conv_kernel_size"], 2), "DFlash 2 needs all four"),
    "uniform_swa": (_edit_config(["dflash_config", "use_swa"], True), "unsupported DFlash options"),
    "mask_embedding": (lambda d: (d / "mask_embedding.pt").write_bytes(b"x"), "mask_embedding.pt"),
    "partial_rope": (_edit_config(["rope_parameters", "partial_rotary_factor"], 0.01), "partial_rotary_factor"),
    "last_layer_tap": (_edit_config(["dflash_config", "target_layer_ids"], [3]), "last layer"),
    "mixed_causality": (_edit_config(["layer_types"], ["sliding_attention", "full_attention"]), "cannot hold a mix"),
    "missing_tensor": (_edit_tensors(lambda t: t.pop("layers.1.mlp.up_proj.weight")),
                       "missing tensor 'layers.1.mlp.up_proj.weight'"),
    "fc_shape": (_edit_config(["dflash_config", "target_layer_ids"], [0, 1, 2]), "fc.weight has shape"),
    "unexpected_tensor": (_edit_tensors(lambda t: t.__setitem__("embed_tokens.weight", np.zeros((4, 4)))),
                          "unexpected tensors"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(case, target, tmp_path):
    tckpt, _ = target("qwen3")
    d = make_random_drafter_checkpoint(tmp_path / "d", **{**drafter_overrides_for_target(tckpt),
                                                          "target_layer_ids": [0, 2], "num_hidden_layers": 2},
                                       use_sliding_window=True, sliding_window=4)
    mutate, match = BAD_CASES[case]
    mutate(d)
    with pytest.raises(ValueError, match=match):
        convert_dflash_to_gguf(d, tmp_path / "out.gguf", outtype="f32")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.tmp").exists()


def test_bad_input_against_target(target, drafter, tmp_path):
    tckpt, tgguf = target("qwen3")
    ckpt, _ = drafter("qwen3")
    with pytest.raises(ValueError, match="unknown outtype"):
        convert_dflash_to_gguf(ckpt, tmp_path / "x.gguf", outtype="q4_0")
    with pytest.raises(ValueError, match="does not exist"):
        convert_dflash_to_gguf(tmp_path / "nope", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="target GGUF .* does not exist"):
        convert_dflash_to_gguf(ckpt, tmp_path / "x.gguf", target_gguf=tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ValueError, match="cannot read"):
        convert_dflash_to_gguf(ckpt, tmp_path / "x.gguf", target_gguf=tmp_path / "junk.gguf")

    wide = make_random_drafter_checkpoint(tmp_path / "wide", **{**drafter_overrides_for_target(tckpt),
                                                                "hidden_size": 96, "target_layer_ids": [0]})
    with pytest.raises(ValueError, match="hidden size 96 != hidden size 64"):
        convert_dflash_to_gguf(wide, tmp_path / "x.gguf", target_gguf=tgguf)
    deep = make_random_drafter_checkpoint(tmp_path / "deep", **{**drafter_overrides_for_target(tckpt),
                                                                "n_target_layers": 40, "target_layer_ids": [9]})
    with pytest.raises(ValueError, match="reach past the 4 layers"):
        convert_dflash_to_gguf(deep, tmp_path / "x.gguf", target_gguf=tgguf)
    vocab = make_random_drafter_checkpoint(tmp_path / "vocab", **{**drafter_overrides_for_target(tckpt),
                                                                  "vocab_size": 1000, "target_layer_ids": [0]})
    with pytest.raises(ValueError, match="vocab_size 1000 != vocabulary size 640"):
        convert_dflash_to_gguf(vocab, tmp_path / "x.gguf", target_gguf=tgguf)
    with pytest.raises(ValueError, match="is itself a DFlash drafter"):
        convert_dflash_to_gguf(ckpt, tmp_path / "x.gguf", target_gguf=drafter("qwen3")[1])
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp():
    mod = pytest.importorskip("llama_cpp")
    from llama_cpp import _logger

    mod.llama_backend_init()
    level = _logger.logger.level
    _logger.set_verbose(False)  # llama.cpp's load logs, errors only
    yield mod
    _logger.logger.setLevel(level)


def _cpp_fn(llama_cpp, mangled: str, restype, argtypes):
    """llama.cpp functions that 0.3.36 exports without C linkage (no Python binding)."""
    try:
        f = llama_cpp.llama_cpp._lib[mangled]
    except (AttributeError, KeyError):
        pytest.skip(f"{mangled} not exported by this libllama")
    f.restype, f.argtypes = restype, argtypes
    return f


def _load_model(llama_cpp, path: Path, *, vocab_only: bool = False):
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = vocab_only
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp could not load {path}"
    return model


def _ctx_params(llama_cpp, ctx_other=None):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
    cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # CPU FA rounds through F16
    cp.n_threads = cp.n_threads_batch = N_THREADS
    if ctx_other is not None:
        cp.ctx_other = ctx_other
    return cp


def test_llama_cpp_loads_drafter_standalone(llama_cpp, drafter, target):
    """llama.cpp's loader accepts the file on its own: hparams, the vocabulary
    with our mask token, target_layers, NeoX RoPE and every tensor shape."""
    ckpt, path = drafter("qwen3")
    cfg = _config(ckpt)
    vocab_model = _load_model(llama_cpp, path, vocab_only=True)
    try:
        vocab = llama_cpp.llama_model_get_vocab(vocab_model)
        assert llama_cpp.llama_vocab_n_tokens(vocab) == cfg["vocab_size"]
        assert llama_cpp.llama_vocab_mask(vocab) == cfg["dflash_config"]["mask_token_id"]
    finally:
        llama_cpp.llama_model_free(vocab_model)

    model = _load_model(llama_cpp, path)
    try:
        assert llama_cpp.llama_model_n_embd(model) == cfg["hidden_size"]
        assert llama_cpp.llama_model_n_layer(model) == 2
        assert llama_cpp.llama_model_rope_type(model) == llama_cpp.LLAMA_ROPE_TYPE_NEOX
        ids = _cpp_fn(llama_cpp, "_Z28llama_model_target_layer_idsPK11llama_model",
                      ctypes.POINTER(ctypes.c_int32), [ctypes.c_void_p])
        n_ids = _cpp_fn(llama_cpp, "_Z30llama_model_target_layer_ids_nPK11llama_model", ctypes.c_uint32,
                        [ctypes.c_void_p])
        assert [ids(model)[i] for i in range(n_ids(model))] == [1, 3]
        buf = ctypes.create_string_buffer(32)
        assert llama_cpp.llama_model_meta_val_str(model, b"dflash.block_size", buf, 32) > 0
        assert buf.value == b"8"
        # A dflash context needs the target as ctx_other (tok_embd / output): without it, no context.
        assert not llama_cpp.llama_init_from_model(model, _ctx_params(llama_cpp))
    finally:
        llama_cpp.llama_model_free(model)


class _LlamaDrafter:
    """llama.cpp running our drafter GGUF with the target's context as ctx_other:
    inject context features at their positions, then decode one block."""

    def __init__(self, llama_cpp, target_gguf: Path, drafter_gguf: Path):
        self.ll = llama_cpp
        self.t_model = _load_model(llama_cpp, target_gguf)
        self.t_ctx = llama_cpp.llama_init_from_model(self.t_model, _ctx_params(llama_cpp))
        self.d_model = _load_model(llama_cpp, drafter_gguf)
        self.d_ctx = llama_cpp.llama_init_from_model(self.d_model, _ctx_params(llama_cpp, self.t_ctx))
        assert self.t_ctx and self.d_ctx
        self.mrope = llama_cpp.llama_model_rope_type(self.d_model) == llama_cpp.LLAMA_ROPE_TYPE_MROPE
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.d_model))

    def close(self) -> None:
        ll = self.ll
        ll.llama_free(self.d_ctx)
        ll.llama_model_free(self.d_model)
        ll.llama_free(self.t_ctx)
        ll.llama_model_free(self.t_model)

    def draft_logits(self, block: Sequence[int], features: np.ndarray, ctx_start_pos: int, *,
                     causal: bool = False) -> np.ndarray:
        ll = self.ll
        ll.llama_set_causal_attn(self.d_ctx, causal)
        batch = ll.llama_batch_ext_init(self.d_ctx)
        try:
            rows = np.ascontiguousarray(features, dtype=np.float32)
            for i in range(rows.shape[0]):
                e = ll.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
                idx = ll.llama_batch_ext_add_embd(batch, 0, e)
                p = ctx_start_pos + i
                # an M-RoPE draft takes 4 position rows per embedding (llama.cpp's loop: {p, p, p, 0})
                pos = (ll.llama_pos * 4)(p, p, p, 0) if self.mrope else (ll.llama_pos * 1)(p)
                assert idx >= 0 and ll.llama_batch_ext_set_pos(batch, idx, pos)
            assert ll.llama_process(self.d_ctx, ll.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            ll.llama_batch_ext_clear(batch)
            for i, tok in enumerate(block):
                idx = ll.llama_batch_ext_add_token(batch, 0, int(tok))
                assert idx >= 0
                ll.llama_batch_ext_set_pos(batch, idx, (ll.llama_pos * 1)(ctx_start_pos + rows.shape[0] + i))
                ll.llama_batch_ext_set_output_logits(batch, idx, True)
            assert ll.llama_process(self.d_ctx, ll.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            return np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(self.d_ctx, i), shape=(self.n_vocab,))
                             .copy() for i in range(len(block))])
        finally:
            ll.llama_batch_ext_free(batch)


def _features(n_ctx: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_ctx, width)).astype(np.float32)


def _assert_close(got: np.ndarray, ref: np.ndarray, outtype: str, what: str) -> None:
    max_tol, rms_tol = TOLERANCE[outtype]
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    rel_rms = float(np.sqrt((diff ** 2).mean() / (ref.astype(np.float64) ** 2).mean()))
    assert np.isfinite(got).all(), f"{what}: non-finite llama.cpp logits"
    assert diff.max() <= max_tol and rel_rms <= rms_tol, (
        f"{what}: max |diff| {diff.max():.3g} (tol {max_tol}), relative RMS {rel_rms:.3g} (tol {rms_tol})")


PARITY_CASES = {
    # name: (target arch, drafter overrides, causal flag llama.cpp's loop would set)
    "noncausal": ("qwen3", {}, False),
    "causal": ("qwen3", {"is_causal": True}, True),
    "sliding_causal": ("qwen3", {"use_sliding_window": True, "sliding_window": 3,
                                 "layer_types": ["sliding_attention"] * 2}, True),
    "one_layer_three_taps_gqa4": ("qwen3", {"target_layer_ids": [2, 0, 1], "num_hidden_layers": 1,
                                            "num_key_value_heads": 1}, False),
    "mrope_target": ("qwen3_5", {}, False),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_llama_cpp_drafter_matches_reference(case, llama_cpp, drafter, target):
    arch, overrides, causal = PARITY_CASES[case]
    tckpt, tgguf = target(arch)
    ckpt, path = drafter(arch, "f32", **overrides)
    ref = DFlashRef.from_dirs(ckpt, tckpt)
    width = len(ref.target_layer_ids) * ref.hidden_size
    run = _LlamaDrafter(llama_cpp, tgguf, path)
    try:
        for n_ctx, start, seed in ((5, 3, 0), (1, 40, 1)):
            feats = _features(n_ctx, width, seed)
            block = [17] + [ref.mask_token_id] * (ref.block_size - 1)
            want = ref.forward(block, feats, ctx_start_pos=start)
            got = run.draft_logits(block, feats, start, causal=causal)
            # llama.cpp keeps the block's K/V in its cache; drop them so the next round sees only context
            assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(run.d_ctx), 0, -1, -1)
            _assert_close(got, want, "f32", f"{case} n_ctx={n_ctx}")
    finally:
        run.close()


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_llama_cpp_drafter_matches_reference_quantized(outtype, llama_cpp, drafter, target):
    tckpt, tgguf = target("qwen3")
    ckpt, path = drafter("qwen3", outtype)
    ref = DFlashRef.from_dirs(ckpt, tckpt, weights_as=outtype, target_weights_as="f32")
    feats = _features(6, 2 * ref.hidden_size, 2)
    block = [5] + [ref.mask_token_id] * (ref.block_size - 1)
    run = _LlamaDrafter(llama_cpp, tgguf, path)
    try:
        _assert_close(run.draft_logits(block, feats, 0), ref.forward(block, feats), outtype, outtype)
    finally:
        run.close()


def test_parity_check_catches_a_wrong_mapping(llama_cpp, drafter, target, tmp_path):
    """The parity bar has teeth: a GGUF whose hidden_norm and norm are swapped
    (a plausible mapping slip) lands far outside it."""
    tckpt, tgguf = target("qwen3")
    ckpt, _ = drafter("qwen3")
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    t = _st(bad)
    t["hidden_norm.weight"], t["norm.weight"] = t["norm.weight"], t["hidden_norm.weight"]
    _write_st(bad, t)
    path = convert_dflash_to_gguf(bad, tmp_path / "bad.gguf", outtype="f32", target_gguf=tgguf)
    ref = DFlashRef.from_dirs(ckpt, tckpt)
    feats = _features(5, 2 * ref.hidden_size)
    block = [17] + [ref.mask_token_id] * (ref.block_size - 1)
    run = _LlamaDrafter(llama_cpp, tgguf, path)
    try:
        diff = np.abs(run.draft_logits(block, feats, 3) - ref.forward(block, feats, ctx_start_pos=3))
    finally:
        run.close()
    assert diff.max() > 100 * TOLERANCE["f32"][0]


def test_target_layers_mean_layer_inputs_in_llama_cpp(llama_cpp, target):
    """GGUF value v = HF id + 1: llama.cpp's tap on the INPUT of target layer v
    equals HF hidden_states[v] = the output of layer v - 1 (what target_taps returns)."""
    import transformers

    tckpt, tgguf = target("qwen3")
    set_inp = _cpp_fn(llama_cpp, "_Z30llama_set_embeddings_layer_inpP13llama_contextjb", None,
                      [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool])
    get_inp = _cpp_fn(llama_cpp, "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                      ctypes.POINTER(ctypes.c_float), [ctypes.c_void_p, ctypes.c_uint32])
    tokens = [3, 99, 250, 7, 400, 12]
    hf_ids = [0, 2]
    model = _load_model(llama_cpp, tgguf)
    ctx = llama_cpp.llama_init_from_model(model, _ctx_params(llama_cpp))
    try:
        for v in (i + 1 for i in hf_ids):
            set_inp(ctx, v, True)
        token_array = (llama_cpp.llama_token * len(tokens))(*tokens)  # the batch borrows it
        batch = llama_cpp.llama_batch_get_one(token_array, len(tokens))
        assert llama_cpp.llama_decode(ctx, batch) == 0
        h = llama_cpp.llama_model_n_embd(model)
        got = np.concatenate([np.ctypeslib.as_array(get_inp(ctx, i + 1), shape=(len(tokens), h)).copy()
                              for i in hf_ids], axis=-1)
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tckpt, dtype=torch.float32, attn_implementation="eager")
    want = target_taps(hf.eval(), tokens, hf_ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want[:, :64] - want[:, 64:]).max() > 0.1  # the two taps really differ


# ---------------------------------------------------------------------------
# the reference itself
# ---------------------------------------------------------------------------

def test_reference_is_deterministic_and_shaped(drafter, target):
    tckpt, _ = target("qwen3")
    ckpt, _ = drafter("qwen3")
    ref = DFlashRef.from_dirs(ckpt, tckpt)
    feats = _features(7, 2 * ref.hidden_size)
    block = [1] + [ref.mask_token_id] * (ref.block_size - 1)
    a = ref.forward(block, feats, ctx_start_pos=11)
    b = ref.forward(block, feats, ctx_start_pos=11)
    c = DFlashRef.from_dirs(ckpt, tckpt).forward(block, feats, ctx_start_pos=11)
    assert a.shape == (ref.block_size, _config(tckpt)["vocab_size"]) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert np.isfinite(a).all() and 0.3 < a.std(axis=-1).min() < 10
    with pytest.raises(ValueError, match="context_features"):
        ref.forward(block, feats[:, :-1])


def test_reference_attention_semantics(drafter, target):
    """RoPE is relative (a common shift of all positions leaves logits alone);
    the context matters; attention is non-causal by default (the first block
    position sees later ones) and causal when the config says so."""
    tckpt, _ = target("qwen3")
    ref = DFlashRef.from_dirs(drafter("qwen3")[0], tckpt, dtype=torch.float64)
    feats = _features(4, 2 * ref.hidden_size, 3)
    block = [9, ref.mask_token_id, 33, ref.mask_token_id]
    base = ref.forward(block, feats, ctx_start_pos=0)
    np.testing.assert_allclose(ref.forward(block, feats, ctx_start_pos=123), base, atol=1e-6)
    moved = feats.copy()
    moved[1] += 1.0
    assert np.abs(ref.forward(block, moved) - base).max() > 1e-3
    later = [9, ref.mask_token_id, 34, ref.mask_token_id]
    assert np.abs(ref.forward(later, feats)[0] - base[0]).max() > 1e-4

    causal = DFlashRef.from_dirs(drafter("qwen3", is_causal=True)[0], tckpt, dtype=torch.float64)
    np.testing.assert_allclose(causal.forward(later, feats)[:2], causal.forward(block, feats)[:2], atol=1e-9)
    assert np.abs(causal.forward(later, feats)[2:] - causal.forward(block, feats)[2:]).max() > 1e-4


def test_reference_context_kv(drafter, target):
    """context_kv: per layer [n_ctx, n_kv, head_dim]; at position 0 RoPE is the
    identity, so K there is k_norm(k_proj(hidden_norm(fc(f)))) and V v_proj(...)."""
    tckpt, _ = target("qwen3")
    ref = DFlashRef.from_dirs(drafter("qwen3")[0], tckpt)
    feats = _features(3, 2 * ref.hidden_size)
    kv = ref.context_kv(feats, ctx_start_pos=0)
    assert len(kv) == ref.n_layer
    for k, v in kv:
        assert k.shape == v.shape == (3, ref.n_kv, ref.head_dim)
    w = ref.w
    f = torch.from_numpy(feats[:1])
    ctx = f @ w["fc.weight"].T
    ctx = ctx * torch.rsqrt(ctx.pow(2).mean(-1, keepdim=True) + ref.eps) * w["hidden_norm.weight"]
    k = (ctx @ w["layers.0.self_attn.k_proj.weight"].T).view(ref.n_kv, ref.head_dim)
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + ref.eps) * w["layers.0.self_attn.k_norm.weight"]
    np.testing.assert_allclose(kv[0][0][0], k.numpy(), atol=1e-5)
    shifted = ref.context_kv(feats, ctx_start_pos=5)
    np.testing.assert_allclose(shifted[0][1], kv[0][1], atol=0)  # V carries no RoPE
    assert np.abs(shifted[0][0] - kv[0][0]).max() > 1e-3


def test_round_like_gguf():
    w = torch.randn(4, 64)
    assert torch.equal(round_like_gguf(w, "f32"), w)
    assert torch.equal(round_like_gguf(w, "f16"), w.half().float())
    q = round_like_gguf(w, "q8_0")
    assert 0 < (q - w).abs().max() < 0.05
    odd = torch.randn(4, 40)
    assert torch.equal(round_like_gguf(odd, "q8_0"), odd.half().float())  # F16 fallback
    v = torch.randn(64)
    assert torch.equal(round_like_gguf(v, "q8_0"), v)  # 1-D stays F32


def test_target_taps_refuses_the_last_layer(target):
    import transformers

    tckpt, _ = target("qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tckpt, dtype=torch.float32).eval()
    taps = target_taps(hf, [1, 2, 3], [0, 2])
    assert taps.shape == (3, 2 * 64)
    with pytest.raises(ValueError, match="post-norm"):
        target_taps(hf, [1, 2, 3], [3])


def test_draft_vocab_key(drafter, target, tmp_path):
    """config.json draft_vocab becomes dflash.draft_vocab (INT32 array); a bad list is refused."""
    ckpt, path = drafter("qwen3", draft_vocab=[1, 4, 9])
    values, types, _ = _fields(path)
    assert values["dflash.draft_vocab"] == [1, 4, 9]
    assert types["dflash.draft_vocab"] == (VT.ARRAY, VT.INT32)
    _, plain = drafter("qwen3")
    assert "dflash.draft_vocab" not in _fields(plain)[0]
    tckpt, tgguf = target("qwen3")
    for bad, msg in (([4, 1], "strictly ascending"), ([], "non-empty list"), ([1, 10**6], "outside"),
                     (["a"], "non-empty list of token ids")):
        cfg = _config(ckpt)
        cfg["draft_vocab"] = bad
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=msg):
            convert_dflash_to_gguf(d, d / "x.gguf", target_gguf=tgguf)
