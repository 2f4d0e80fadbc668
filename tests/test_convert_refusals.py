"""Converters refuse what the engine would refuse, by name, with ValueError (CLI exit 2), never a
traceback; and they read the configs the installed transformers writes (issues 33, 38)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import dflash_native as dn
from dflash_native import cli
from dflash_native.random_models import make_random_checkpoint, make_random_drafter_checkpoint


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))  # NaN as the bare NaN token, as Python's json writes it


@pytest.mark.parametrize("key,value", [("num_attention_heads", -4), ("head_dim", 0), ("rope_theta", math.nan),
                                       ("rms_norm_eps", -1e-6), ("hidden_size", 32.5)])
def test_bad_target_hyperparameters(tmp_path, capsys, key, value):
    src = make_random_checkpoint(tmp_path / "ckpt", "qwen3")
    _edit_json(src / "config.json", **{key: value})
    with pytest.raises(ValueError, match=key):
        dn.convert_hf_to_gguf(src, tmp_path / "out.gguf")
    assert cli.main(["convert", str(src), str(tmp_path / "out.gguf")]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_tokenizer_model_not_an_object(tmp_path):
    src = make_random_checkpoint(tmp_path / "ckpt", "qwen3")
    _edit_json(src / "tokenizer.json", model=5)
    with pytest.raises(ValueError, match="'model'"):
        dn.convert_hf_to_gguf(src, tmp_path / "out.gguf")


def test_none_paths_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="src_dir"):
        dn.convert_hf_to_gguf(None, None)
    with pytest.raises(ValueError, match="src"):
        dn.quantize(None, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="src_dir"):
        dn.convert_dflash_to_gguf(None, None)


def _drafter(tmp_path, **overrides) -> Path:
    return make_random_drafter_checkpoint(tmp_path / "drafter", hidden_size=32, n_target_layers=2, mask_token_id=3,
                                          vocab_size=64, **overrides)


@pytest.mark.parametrize("overrides,field", [
    (dict(block_size=1000), "block_size"),
    (dict(head_dim=0), "head_dim"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(rope_theta=math.nan), "rope_theta"),
])
def test_bad_drafter_fields(tmp_path, overrides, field):
    if "block_size" in overrides:
        src = _drafter(tmp_path)
        d = json.loads((src / "config.json").read_text())
        d.setdefault("dflash_config", {})["block_size"] = overrides["block_size"]
        (src / "config.json").write_text(json.dumps(d))
    else:
        src = _drafter(tmp_path)
        _edit_json(src / "config.json", **overrides)
    with pytest.raises(ValueError, match=field):
        dn.convert_dflash_to_gguf(src, tmp_path / "d.gguf")


def test_qwen3moe_config_saved_by_transformers(tmp_path):
    """transformers 5 saves the expert count as num_local_experts: the converter read num_experts
    and fell back to 128 experts. A config the installed transformers wrote converts to a GGUF with
    the checkpoint's expert count; a config without any expert count is refused by name."""
    transformers = pytest.importorskip("transformers")
    src = make_random_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    ours = json.loads((src / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    cfg = transformers.Qwen3MoeConfig(**{k: ours[k] for k in keys if k in ours},
                                      bos_token_id=ours["bos_token_id"], eos_token_id=ours["eos_token_id"])
    saved = tmp_path / "saved"
    cfg.save_pretrained(saved)
    (src / "config.json").write_text((saved / "config.json").read_text())
    out = dn.convert_hf_to_gguf(src, tmp_path / "moe.gguf")
    from gguf import GGUFReader

    r = GGUFReader(out)
    f = r.fields["qwen3moe.expert_count"]
    assert int(f.parts[f.data[0]][0]) == ours["num_experts"]

    d = json.loads((src / "config.json").read_text())
    d.pop("num_local_experts", None)
    d.pop("num_experts", None)
    (src / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="num_experts"):
        dn.convert_hf_to_gguf(src, tmp_path / "moe2.gguf")


def test_generate_with_closed_stdout(monkeypatch, capsys):
    """`dflash-native generate ... >&-`: sys.stdout is None; a one-line error and exit 2 (it was an
    AttributeError traceback and exit 1)."""
    monkeypatch.setattr(sys, "stdout", None)
    rc = cli.main(["generate", "--target", "nonexistent.gguf", "--prompt", "x"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "stdout is closed" in err and "Traceback" not in err


def test_ctrl_c_while_main_imports(monkeypatch, capsys):
    """Ctrl-C while main's imports (gguf, numpy, the converters) load: exit 130, no traceback."""
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["generate", "--target", "x"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_token_ids_must_be_a_sequence():
    pair = cli.default_pair()
    if pair is None:
        pytest.skip("no embedded default pair in this install")
    with dn.Engine(pair[0], n_ctx=64, n_threads=1) as eng:
        for bad in ({1, 2, 3}, {1: 2}, frozenset({4})):
            with pytest.raises(ValueError, match="sequence"):
                eng.generate(bad, max_tokens=1)


_ARCHS = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def _saved_by_transformers(src: Path, tmp: Path) -> dict:
    """src's config.json rewritten by the installed transformers: its config class (AutoConfig for
    the checkpoint's model_type) built from the keys it knows, saved with save_pretrained."""
    transformers = pytest.importorskip("transformers")
    ours = json.loads((src / "config.json").read_text())
    known = set(transformers.AutoConfig.for_model(ours["model_type"]).to_dict())
    if "num_experts" in ours and "num_local_experts" in known:
        ours["num_local_experts"] = ours["num_experts"]
    cfg = transformers.AutoConfig.for_model(ours["model_type"], **{k: v for k, v in ours.items()
                                                                  if k in known and k != "model_type"})
    cfg.architectures = ours["architectures"]
    cfg.save_pretrained(tmp)
    return json.loads((tmp / "config.json").read_text())


def _metadata(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(path)
    return {name: [p.tolist() for p in (f.parts[i] for i in f.data)] for name, f in r.fields.items()
            if name != "general.name" and not name.startswith("GGUF.")}


@pytest.mark.parametrize("arch", _ARCHS)
def test_configs_saved_by_transformers_convert_alike(tmp_path, arch):
    """Every architecture's config as the installed transformers saves it converts to the same GGUF
    metadata as the config the tests write by hand: the keys the config classes leave out (e.g.
    Qwen3-MoE's head_dim, Qwen3.5-MoE's norm_topk_prob) are derived as transformers' modelling
    derives them, not filled with another default (a Qwen3-MoE config got head_dim 128 before)."""
    src = make_random_checkpoint(tmp_path / "ckpt", arch)
    ref = _metadata(dn.convert_hf_to_gguf(src, tmp_path / "ours.gguf"))
    saved = _saved_by_transformers(src, tmp_path / "saved")
    (src / "config.json").write_text(json.dumps(saved))
    assert _metadata(dn.convert_hf_to_gguf(src, tmp_path / "theirs.gguf")) == ref


@pytest.mark.parametrize("arch", _ARCHS)
def test_a_missing_hyperparameter_is_refused_by_name(tmp_path, arch):
    """Drop each hyperparameter the architecture needs from a config saved by transformers: the
    converter names it (ValueError), never fills a default."""
    from dflash_native.convert import _REQUIRED, _MODEL_TYPES

    src = make_random_checkpoint(tmp_path / "ckpt", arch)
    saved = _saved_by_transformers(src, tmp_path / "saved")
    required = list(_REQUIRED[_MODEL_TYPES[saved["model_type"]]])
    for key in required + ["rope_theta"]:
        d = json.loads(json.dumps(saved))
        if key == "rope_theta":
            d["rope_parameters"].pop("rope_theta")
            d.pop("rope_theta", None)
        else:
            assert key in d or (key == "num_experts" and "num_local_experts" in d), (key, sorted(d))
            d.pop(key, None)
            if key == "num_experts":
                d.pop("num_local_experts", None)
        (src / "config.json").write_text(json.dumps(d))
        with pytest.raises(ValueError, match=f"missing key '{key}'"):
            dn.convert_hf_to_gguf(src, tmp_path / "out.gguf")
