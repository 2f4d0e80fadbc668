"""A checkpoint's config.json as a `ModelSpec`: which GGUF architecture it is, the text model's
hyperparameters (each architecture's required keys refused by name when missing; the values
transformers' modelling derives, derived), and the keys every architecture writes alike (block
count, heads, RoPE and its scaling)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import gguf

from .. import _args


# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------

@dataclass
class ModelSpec:
    src_dir: Path
    gguf_arch: str            # "llama" | "qwen3" | "qwen3moe" | "qwen35" | "qwen35moe" | "qwen3next"
    config: dict[str, Any]    # the full config.json
    text: dict[str, Any]      # the text model's hparams (config or config["text_config"])
    tied: bool                # tie_word_embeddings

    def get(self, key: str, default: Any = None) -> Any:
        return self.text.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.text:
            raise ValueError(f"[convert] {self.src_dir / 'config.json'}: missing key {key!r}")
        return self.text[key]

    @property
    def vocab_size(self) -> int:
        return int(self.require("vocab_size"))


# HF architecture / model_type -> GGUF arch
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5ForConditionalGeneration": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen35moe",
    "Qwen3NextForCausalLM": "qwen3next",
}
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen3_5_text": "qwen35", "qwen3_5": "qwen35",
                "qwen3_5_moe_text": "qwen35moe", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}

# What each architecture's config.json must state: a missing one is refused by name, never filled
# with a default (which would convert a different model). The keys below are those the
# transformers 5.24 config classes save (tests/test_convert_refusals.py builds each config with the
# installed transformers and drops each key in turn).
_COMMON_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "max_position_embeddings", "rms_norm_eps")
_HYBRID_REQUIRED = ("head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_num_key_heads", "linear_num_value_heads")
_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
REQUIRED = {
    "llama": _COMMON_REQUIRED + ("intermediate_size",),
    "qwen3": _COMMON_REQUIRED + ("intermediate_size", "head_dim"),
    "qwen3moe": _COMMON_REQUIRED + _MOE_REQUIRED + ("norm_topk_prob", "decoder_sparse_step"),
    "qwen35": _COMMON_REQUIRED + _HYBRID_REQUIRED + ("intermediate_size",),
    "qwen35moe": _COMMON_REQUIRED + _HYBRID_REQUIRED + _MOE_REQUIRED + ("shared_expert_intermediate_size",),
    "qwen3next": _COMMON_REQUIRED + _HYBRID_REQUIRED + _MOE_REQUIRED
    + ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "shared_expert_intermediate_size"),
}
# Keys that switch a feature on, whose absence means the feature is off in every config class of
# these architectures (the converter refuses each feature it cannot state when it is on).
_ABSENT_MEANS_OFF = {"attention_bias": False, "mlp_bias": False, "use_sliding_window": False, "mlp_only_layers": [],
                     "tie_word_embeddings": False}


def apply_hf_rules(arch: str, text: dict[str, Any]) -> None:
    """The values transformers' modelling code derives when a config leaves a key out (rules, not
    defaults): the KV heads are the attention heads; Llama's and Qwen3-MoE's head_dim is
    hidden_size / num_attention_heads (Qwen3MoeConfig saves no head_dim); Qwen3.5-MoE always
    renormalizes its top-k router weights (its config has no norm_topk_prob)."""
    if text.get("num_experts") is None and text.get("num_local_experts") is not None:
        # transformers 5 saves Qwen3-MoE's expert count as num_local_experts (4.x: num_experts)
        text["num_experts"] = text["num_local_experts"]
    if text.get("num_key_value_heads") is None and text.get("num_attention_heads") is not None:
        text["num_key_value_heads"] = text["num_attention_heads"]
    if (arch in ("llama", "qwen3moe") and text.get("head_dim") is None and text.get("num_attention_heads")
            and text.get("hidden_size")):
        text["head_dim"] = int(text["hidden_size"]) // int(text["num_attention_heads"])
    if arch == "qwen35moe":
        text["norm_topk_prob"] = True
    for key, off in _ABSENT_MEANS_OFF.items():
        text.setdefault(key, off)


def _require_hparams(arch: str, config_path: Path, text: Mapping[str, Any]) -> None:
    """ValueError naming the first hyperparameter `arch` needs that the config does not state."""
    for key in REQUIRED[arch]:
        if text.get(key) is None:
            raise ValueError(f"[convert] {config_path}: missing key {key!r} (a {arch} config states it; "
                             f"the converter does not guess it)")
    rp = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rp, dict) or (rp.get("rope_theta") is None and text.get("rope_theta") is None):
        raise ValueError(f"[convert] {config_path}: missing key 'rope_theta' (in rope_parameters or at the top level)")
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        if rp.get("partial_rotary_factor") is None and text.get("partial_rotary_factor") is None:
            raise ValueError(f"[convert] {config_path}: missing key 'partial_rotary_factor' (in rope_parameters)")
        if text.get("layer_types") is None and text.get("full_attention_interval") is None:
            raise ValueError(f"[convert] {config_path}: missing key 'layer_types' (or full_attention_interval)")


def read_config_json(src: Path, where: str) -> dict[str, Any]:
    """src/config.json as a dict; ValueError naming `where` and the file when it is missing, not
    valid JSON (or UTF-8), or not a JSON object."""
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"[{where}] {str(src)!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"[{where}] {path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"[{where}] {path}: expected a JSON object")
    return config


def as_path(where: str, name: str, value) -> Path:
    """A path argument as a Path; anything else (None included) is a ValueError naming it."""
    return Path(_args.as_path(where, name, value))


# architecture hyperparameters: ints that must be >= 1 when present, and reals that must be finite
# and > 0 (a GGUF with head_dim 0 or a NaN epsilon converts, then no engine can load it)
_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "num_experts",
                  "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval")
_POSITIVE_REALS = ("rms_norm_eps", "rope_theta")


def check_hparams(where: str, path, hp: Mapping[str, Any]) -> None:
    """ValueError naming the first hyperparameter of `hp` that is present (not None) and out of range."""
    for key in _POSITIVE_INTS:
        v = hp.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"[{where}] {path}: {key} must be an int >= 1, got {v!r}")
    rp = hp.get("rope_parameters")
    for key in _POSITIVE_REALS:
        for v in (hp.get(key), rp.get(key) if isinstance(rp, dict) else None):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"[{where}] {path}: {key} must be a finite number > 0, got {v!r}")


def load_model_spec(src: Path) -> ModelSpec:
    config = read_config_json(src, "convert")
    config_path = src / "config.json"
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    gguf_arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None) or MODEL_TYPES.get(model_type)
    if gguf_arch is None:
        raise ValueError(f"[convert] {config_path}: unsupported architecture {archs} (model_type "
                         f"{model_type!r}); supported: {sorted(_ARCHS)} / model_type {sorted(MODEL_TYPES)}")

    text = config
    if isinstance(config.get("text_config"), dict):
        text = {**config["text_config"]}
        # top-level keys the text config leaves out (e.g. tie_word_embeddings) still apply
        for key in ("tie_word_embeddings",):
            if key in config and key not in text:
                text[key] = config[key]
    text = dict(text)
    apply_hf_rules(gguf_arch, text)
    check_hparams("convert", config_path, text)
    _require_hparams(gguf_arch, config_path, text)
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return ModelSpec(src, gguf_arch, config, text, tied)


def rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """transformers 5 `rope_parameters`, or the older `rope_scaling` + top-level keys."""
    rp = dict(spec.get("rope_parameters") or spec.get("rope_scaling") or {})
    if "rope_type" not in rp and "type" in rp:
        rp["rope_type"] = rp["type"]
    rp.setdefault("rope_type", "default")
    if "rope_theta" not in rp:
        rp["rope_theta"] = spec.require("rope_theta")
    if "partial_rotary_factor" not in rp and spec.get("partial_rotary_factor") is not None:
        rp["partial_rotary_factor"] = spec.get("partial_rotary_factor")
    return rp


def add_rope_scaling(writer: gguf.GGUFWriter, spec: ModelSpec, rp: Mapping[str, Any]) -> None:
    """`rope.scaling.*` as llama.cpp's converter writes them (conversion/base.py,
    `set_gguf_parameters`): linear -> type + factor; yarn -> type, factor,
    original_context_length and the yarn keys the config sets. A config whose
    function those keys cannot state is refused (the engine would run it unscaled)."""
    rope_type = rp["rope_type"]
    factor = rp.get("factor")
    where = spec.src_dir / "config.json"
    if rope_type == "default":
        return
    if rope_type not in ("linear", "yarn"):
        raise ValueError(f"[convert] {where}: unsupported rope_type {rope_type!r} (supported: default, linear, yarn)")
    if factor is None or not float(factor) > 0:
        raise ValueError(f"[convert] {where}: {rope_type} rope scaling needs a factor > 0, got {factor!r}")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rope_type == "linear" else gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(factor))
    if rope_type == "linear":
        return
    if rp.get("truncate", True) is not True:
        raise ValueError(f"[convert] {where}: yarn with truncate=false is not supported (ggml rounds the "
                         f"correction range to whole dims, as HF's default truncate=true does)")
    attention_factor = rp.get("attention_factor", rp.get("attn_factor"))
    if attention_factor is None and rp.get("mscale") and rp.get("mscale_all_dim"):
        raise ValueError(f"[convert] {where}: yarn with mscale and mscale_all_dim (and no attention_factor) is not "
                         f"supported")
    # HF's default original_max_position_embeddings is max_position_embeddings, as llama.cpp's
    # loader defaults original_context_length to context_length
    orig = rp.get("original_max_position_embeddings") or spec.get("max_position_embeddings")
    writer.add_rope_scaling_orig_ctx_len(int(orig))
    for value, add in ((rp.get("extrapolation_factor"), writer.add_rope_scaling_yarn_ext_factor),
                       (attention_factor, writer.add_rope_scaling_yarn_attn_factor),
                       (rp.get("beta_fast"), writer.add_rope_scaling_yarn_beta_fast),
                       (rp.get("beta_slow"), writer.add_rope_scaling_yarn_beta_slow)):
        if value is not None:
            add(float(value))


def common_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    writer.add_block_count(int(spec.require("num_hidden_layers")))
    writer.add_context_length(int(spec.get("max_position_embeddings")))
    writer.add_embedding_length(int(spec.require("hidden_size")))
    if spec.gguf_arch != "qwen35moe" or spec.get("intermediate_size") is not None:
        writer.add_feed_forward_length(int(spec.require("intermediate_size")))
    writer.add_head_count(int(spec.require("num_attention_heads")))
    writer.add_head_count_kv(int(spec.get("num_key_value_heads")))
    writer.add_layer_norm_rms_eps(float(spec.get("rms_norm_eps")))
    writer.add_key_length(int(spec.get("head_dim")))
    writer.add_value_length(int(spec.get("head_dim")))
    if spec.get("use_sliding_window"):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: use_sliding_window=true is not "
                         f"supported (llama.cpp's qwen3/qwen35 graphs have no sliding-window layers)")
    if spec.get("attention_bias"):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: attention_bias=true is not "
                         f"supported (llama.cpp's graph has no attn_output bias)")
