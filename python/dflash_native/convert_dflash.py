"""Hugging Face DFlash / DFlash 2 drafter checkpoint -> GGUF (arch `dflash`).

Input: a z-lab style `DFlashDraftModel` or `DFlash2DraftModel` directory (config.json with
`model_type: qwen3` and `dflash_config.{target_layer_ids, mask_token_id,
block_size}`, older files a top-level `block_size`; safetensors with `fc`,
`hidden_norm`, `norm` and Qwen3 decoder layers, no `embed_tokens` / `lm_head`:
those come from the target at run time).

The output follows llama.cpp's own converter (conversion/qwen.py,
`DFlashModel`, in the llama.cpp vendored by llama-cpp-python 0.3.36) key for
key and tensor for tensor, so llama.cpp loads it as a drafter and the native
engine reads the same file. The transforms that are not plain renames:

- `dflash.target_layers = target_layer_ids + 1`: HF id i taps the OUTPUT of
  target layer i (`hidden_states[i + 1]`), which llama.cpp reads as the input
  of layer i + 1.
- `hidden_norm` -> `enc.output_norm`, `norm` -> `output_norm`,
  `post_attention_layernorm` -> `blk.N.ffn_norm`. Norm weights are stored as
  they are: the drafter is a Qwen3 model, whose RMSNorm is `x * w` (the
  Qwen3.5 `x * (1 + w)` rule and its `w + 1` storage do not apply, even for a
  Qwen3.5 target).
- For an M-RoPE target (Qwen3.5) llama.cpp writes degenerate rope sections
  `[head_dim / 2, 0, 0, 0]`: all rotary pairs take the token position, which is
  plain NeoX RoPE. We do the same when the target (directory or GGUF) is known.

DFlash 2 (dflash_config `conv_kernel_size`, `conv_group_size`, `selector_rank`,
`selector_top_k`, all four) adds those keys as `dflash.<key>` and the per-layer
`attention_conv` / `mlp_conv` and the `candidate_selector` tensors under llama.cpp's
names (DFLASH2_LAYER_NAMES, DFLASH2_GLOBAL_NAMES); the base kernels, which have no
`.weight` suffix, stay F32 as llama.cpp's converter keeps them.
`dflash_config.attention_value_scale` becomes `dflash.attention.value_scale`.

The tokenizer is carried so llama.cpp can load the drafter on its own and
find `tokenizer.ggml.mask_token_id`: copied key for key from `target_gguf`
when given (llama.cpp's converter likewise takes the target's tokenizer),
else built from tokenizer.json in the drafter directory (or `target_dir`).

Over 600 lines as one architecture's converter (the drafter's three checkpoint layouts, DFlash,
DFlash 2 and DSpark, with their keys, tensors and tokenizer), as convert/archs/<arch>.py is one
per target architecture; what it shares with those comes from convert/ by public names.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import gguf
from gguf import GGUFValueType, MODEL_TENSOR

from .convert.archs.qwen3 import QWEN3_LAYER_TENSORS
from .convert.checkpoint import Checkpoint
from .convert.hparams import ModelSpec, add_rope_scaling, apply_hf_rules, as_path, check_hparams, read_config_json, rope_parameters
from .convert.tokenizer import add_tokenizer_kv
from .convert.writer import OUTTYPES, Progress, SourceTensor, convert_tensors, tensor_name
from .hf_formats import (MAX_TRAINED_CONTEXT, TRAINED_CONTEXT_KEY, dflash2_tensor_shapes, drafter_tensor_shapes,
                         dspark_tensor_shapes)

__all__ = ["DFLASH_ARCH", "DflashSpec", "convert_dflash_to_gguf", "gguf_tensor_plan", "load_dflash_spec",
           "target_layer_ids_from_gguf"]

logger = logging.getLogger(__name__)

DFLASH_ARCH = "dflash"

# dflash_config / config keys that change the drafter's math in ways this
# converter and the native engine do not implement (SpecForge-style uniform SWA).
_UNSUPPORTED_DFLASH_KEYS = ("use_swa", "swa_window_size")
# DFlash 2's dflash_config keys (llama.cpp writes them as dflash.<key>, u32); all or none
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DSpark with a DFlash (Qwen3) backbone: llama.cpp's DSparkModel registers these two for it
DSPARK_ARCHS = ("DSparkDraftModel", "Qwen3DSparkModel")
DRAFTER_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel") + DSPARK_ARCHS
# DSpark's tensors: HF name (no `model.` prefix) -> llama.cpp's GGUF name
DSPARK_NAMES = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}

MAX_BLOCK_SIZE = 64  # the engine's most tokens per verify (_core.MAX_VERIFY; csrc/runtime/session.h k_max_block_size)

# What a drafter's config.json must state (a Qwen3 config as transformers saves it): a missing one is
# refused by name, never filled with a default. What transformers' modelling derives is derived
# (hparams.apply_hf_rules: the KV heads; absent feature flags off); head_dim, when absent, is
# hidden_size / num_attention_heads, as z-lab's DFlashDraftModel takes it.
DRAFTER_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings", "rms_norm_eps", "hidden_act")

# llama.cpp's LLM_TENSOR_FC / LLM_TENSOR_ENC_OUTPUT_NORM (PyPI gguf 0.19 has no FC)
FC_NAME = "fc.weight"
ENC_OUTPUT_NORM_NAME = "enc.output_norm.weight"


class DflashSpec:
    """A validated DFlash drafter config: the hparams the GGUF needs, with
    every required key present (refused by name when not) and every DFlash field resolved."""

    def __init__(self, src_dir: Path, config: dict[str, Any]):
        self.src_dir = src_dir
        self.config = config
        self.where = src_dir / "config.json"
        self.hp: dict[str, Any] = self._qwen3_hparams()
        self.dspark: bool = any(a in DSPARK_ARCHS for a in config.get("architectures") or [])
        self.sample_from_anchor: bool | None = self._dspark_options() if self.dspark else None
        self.has_confidence_head = False  # DSpark: set from the checkpoint by _dflash_tensors
        self.dflash_config: dict[str, Any] = self._dflash_config()
        self.target_layer_ids: list[int] = self._target_layer_ids()
        self.mask_token_id: int = self._mask_token_id()
        self.block_size: int = self._block_size()
        self.trained_context_length: int | None = self._trained_context_length()
        n_target = config.get("num_target_layers")
        self.num_target_layers: int | None = int(n_target) if n_target is not None else None
        self.dflash2: dict[str, int] | None = self._dflash2()
        self._check_layer_options()
        self.rope: dict[str, Any] = self._rope()
        self._resolve_attention_layout()

    def _qwen3_hparams(self) -> dict[str, Any]:
        """The config's hyperparameters (DRAFTER_REQUIRED refused by name when missing), after checking it
        is a DFlashDraftModel over Qwen3."""
        config, where = self.config, self.where
        archs = config.get("architectures") or []
        if not any(a in DRAFTER_ARCHS for a in archs):
            raise ValueError(f"[convert_dflash] {where}: architectures {archs} is not a DFlashDraftModel or "
                             f"DFlash2DraftModel")
        model_type = config.get("model_type")
        if model_type not in (None, "qwen3"):
            raise ValueError(f"[convert_dflash] {where}: model_type {model_type!r}; a DFlash drafter is a "
                             f"Qwen3 model (model_type 'qwen3')")
        hp: dict[str, Any] = dict(config)
        apply_hf_rules("qwen3", hp)
        for key in DRAFTER_REQUIRED:
            if hp.get(key) is None:
                raise ValueError(f"[convert_dflash] {where}: missing key {key!r} (a drafter config states it; the "
                                 f"converter does not guess it)")
        if hp.get("use_sliding_window"):  # the window, and which layers take it (layer_types or max_window_layers)
            needed = ("sliding_window",) + (("max_window_layers",) if hp.get("layer_types") is None else ())
            for key in needed:
                if hp.get(key) is None:
                    raise ValueError(f"[convert_dflash] {where}: use_sliding_window is true but {key!r} is missing")
        check_hparams("convert_dflash", where, hp)
        if hp.get("head_dim") is None:
            hp["head_dim"] = int(hp["hidden_size"]) // int(hp["num_attention_heads"])
        check_hparams("convert_dflash", where, hp)  # head_dim, when computed
        return hp

    def _dspark_options(self) -> bool:
        """A DSpark export of the DFlash lineage (llama.cpp's DSparkModel): its Markov head must be
        vanilla and its vocabulary the target's; returns sample_from_anchor (default true). Its
        target_layer_ids / mask_token_id may sit at the top level (normalized into dflash_config)."""
        cfg, where = self.config, self.where
        for key in ("transformer_layer_config", "aux_hidden_state_layer_ids"):
            if key in cfg:
                raise ValueError(f"[convert_dflash] {where}: {key!r}: EAGLE-3 style DSpark exports are not supported")
        if (kind := cfg.get("markov_head_type", "vanilla")) != "vanilla":
            raise ValueError(f"[convert_dflash] {where}: markov_head_type {kind!r} is not supported (only 'vanilla')")
        n_draft = cfg.get("draft_vocab_size")
        if n_draft is not None and int(n_draft) != int(cfg.get("vocab_size", n_draft)):
            raise ValueError(f"[convert_dflash] {where}: draft_vocab_size {n_draft} < vocab_size (llama.cpp's d2t "
                             f"reduced draft vocabulary) is not supported")
        if "dflash_config" not in cfg:
            cfg["dflash_config"] = {k: cfg[k] for k in ("target_layer_ids", "mask_token_id", "block_size") if k in cfg}
        anchor = cfg.get("sample_from_anchor", True)
        if not isinstance(anchor, bool):
            raise ValueError(f"[convert_dflash] {where}: sample_from_anchor must be true or false, got {anchor!r}")
        return anchor

    def _dflash_config(self) -> dict[str, Any]:
        dc = self.config.get("dflash_config")
        if not isinstance(dc, dict):
            raise ValueError(f"[convert_dflash] {self.where}: missing 'dflash_config' (target_layer_ids, "
                             f"mask_token_id, block_size)")
        bad = [k for k in _UNSUPPORTED_DFLASH_KEYS if k in dc or k in self.config]
        if bad:
            raise ValueError(f"[convert_dflash] {self.where}: unsupported DFlash options {bad}")
        return dc

    def _dflash2(self) -> dict[str, int] | None:
        """DFlash 2's conv and selector sizes (dflash_config), checked as llama.cpp's loader checks
        them; None for a DFlash drafter. As in llama.cpp's converter, the keys decide, not the
        architectures entry."""
        dc, where = self.dflash_config, self.where
        present = [k for k in DFLASH2_KEYS if k in dc]
        if not present:
            if "DFlash2DraftModel" in (self.config.get("architectures") or []):
                raise ValueError(f"[convert_dflash] {where}: a DFlash2DraftModel needs dflash_config "
                                 f"{list(DFLASH2_KEYS)}")
            return None
        if len(present) != len(DFLASH2_KEYS):
            raise ValueError(f"[convert_dflash] {where}: dflash_config has {present} but not "
                             f"{[k for k in DFLASH2_KEYS if k not in dc]} (DFlash 2 needs all four)")
        out = {}
        for k in DFLASH2_KEYS:
            v = dc[k]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"[convert_dflash] {where}: dflash_config.{k} must be a positive int, got {v!r}")
            out[k] = v
        h, top_k = int(self.hp["hidden_size"]), out["selector_top_k"]
        if h % out["conv_group_size"]:
            raise ValueError(f"[convert_dflash] {where}: hidden_size {h} is not a multiple of conv_group_size "
                             f"{out['conv_group_size']}")
        if h < top_k * (top_k + 1):
            raise ValueError(f"[convert_dflash] {where}: hidden_size {h} < selector_top_k * (selector_top_k + 1) "
                             f"= {top_k * (top_k + 1)} (llama.cpp's selector lattice rows)")
        if "vocab_size" not in self.config:
            raise ValueError(f"[convert_dflash] {where}: a DFlash 2 drafter needs vocab_size (its selector codebooks)")
        return out

    def _target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in ids):
            raise ValueError(f"[convert_dflash] {self.where}: dflash_config.target_layer_ids must be a non-empty "
                             f"list of ints, got {ids!r}")
        if min(ids) < 0:
            raise ValueError(f"[convert_dflash] {self.where}: negative target layer id in {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"[convert_dflash] {self.where}: repeated target layer id in {ids}")
        return list(ids)

    def _mask_token_id(self) -> int:
        config, where = self.config, self.where
        mask = self.dflash_config.get("mask_token_id", config.get("mask_token_id"))
        if mask is None:
            raise ValueError(f"[convert_dflash] {where}: missing dflash_config.mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
            raise ValueError(f"[convert_dflash] {where}: mask_token_id must be a non-negative int, got {mask!r}")
        if "vocab_size" in config and mask >= int(config["vocab_size"]):
            raise ValueError(f"[convert_dflash] {where}: mask_token_id {mask} >= vocab_size {config['vocab_size']}")
        return mask

    def _block_size(self) -> int:
        block_size = self.dflash_config.get("block_size", self.config.get("block_size", 16))
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 2 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"[convert_dflash] {self.where}: block_size must be an int in [2, {MAX_BLOCK_SIZE}] (the "
                             f"last committed token plus at least one mask; the engine verifies at most "
                             f"{MAX_BLOCK_SIZE} tokens a round), got {block_size!r}")
        return block_size

    def _trained_context_length(self) -> int | None:
        n = self.dflash_config.get(TRAINED_CONTEXT_KEY)
        if n is None:
            return None
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TRAINED_CONTEXT:
            raise ValueError(f"[convert_dflash] {self.where}: dflash_config.{TRAINED_CONTEXT_KEY} must be an int in "
                             f"[1, {MAX_TRAINED_CONTEXT}], got {n!r}")
        return n

    def _check_layer_options(self) -> None:
        """Refuse Qwen3 options the dflash graph does not have."""
        where = self.where
        if self.hp.get("attention_bias"):
            raise ValueError(f"[convert_dflash] {where}: attention_bias=true is not supported (llama.cpp's "
                             f"dflash graph has no attention biases)")
        if self.hp.get("hidden_act") != "silu":
            raise ValueError(f"[convert_dflash] {where}: hidden_act {self.hp.get('hidden_act')!r} is not "
                             f"supported (SwiGLU with silu only)")
        if self.config.get("rope_is_neox_style", True) is not True:
            raise ValueError(f"[convert_dflash] {where}: rope_is_neox_style=false (interleaved RoPE) is not "
                             f"supported")

    def _rope(self) -> dict[str, Any]:
        """RoPE parameters; a partial_rotary_factor ropes the first head_dim * factor dims of each
        head (llama.cpp's converter writes that as rope.dimension_count)."""
        rope = rope_parameters(self._model_spec())
        prf = float(rope.get("partial_rotary_factor", 1.0))
        n_rot = int(self.head_dim * prf)
        if not 0.0 < prf <= 1.0 or n_rot < 2 or n_rot % 2:
            raise ValueError(f"[convert_dflash] {self.where}: partial_rotary_factor {prf} gives {n_rot} rotated dims "
                             f"of head_dim {self.head_dim} (must be even, >= 2)")
        self.n_rot: int | None = n_rot if prf != 1.0 else None
        return rope

    def _model_spec(self) -> ModelSpec:
        return ModelSpec(self.src_dir, DFLASH_ARCH, self.config, self.hp, False)

    def _resolve_attention_layout(self) -> None:
        """Per-layer sliding window and causality, as z-lab's modeling code
        resolves them: Qwen3Config keeps `sliding_window` only when
        `use_sliding_window`; `layer_types` defaults to sliding for layers >=
        max_window_layers when it does; a layer is causal iff it is a sliding
        layer, unless `is_causal` (or `dflash_config.causal`) says otherwise."""
        n_layer = int(self.hp["num_hidden_layers"])
        window = self.hp.get("sliding_window") if self.hp.get("use_sliding_window") else None
        layer_types = self.hp.get("layer_types")
        if layer_types is None:
            layer_types = ["sliding_attention" if window is not None and i >= int(self.hp["max_window_layers"])
                           else "full_attention" for i in range(n_layer)]
        if len(layer_types) != n_layer:
            raise ValueError(f"[convert_dflash] {self.where}: layer_types has {len(layer_types)} entries, "
                             f"num_hidden_layers is {n_layer}")
        bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"[convert_dflash] {self.where}: unsupported layer_types {bad}")
        self.layer_types: list[str] = list(layer_types)
        self.is_swa: list[bool] = [t == "sliding_attention" for t in layer_types]
        self.sliding_window: int | None = int(window) if window is not None and any(self.is_swa) else None

        causal = self.config.get("is_causal")
        if causal is None:
            causal = self.dflash_config.get("causal")
        if causal is not None:
            self.causal = bool(causal)
        elif all(self.is_swa) or not any(self.is_swa):
            self.causal = all(self.is_swa)
        else:
            raise ValueError(f"[convert_dflash] {self.where}: sliding layers are causal and full layers are not "
                             f"unless is_causal is set; GGUF's single dflash.attention.causal cannot hold a mix")

    @property
    def hidden_size(self) -> int:
        return int(self.hp["hidden_size"])

    @property
    def n_layer(self) -> int:
        return int(self.hp["num_hidden_layers"])

    @property
    def head_dim(self) -> int:
        return int(self.hp["head_dim"])


def load_dflash_spec(src_dir: str | os.PathLike[str]) -> DflashSpec:
    """Read and validate `src_dir/config.json` of a DFlash drafter."""
    src = as_path("convert_dflash", "src_dir", src_dir)
    if not src.is_dir():
        raise ValueError(f"[convert_dflash] checkpoint directory {str(src)!r} does not exist")
    return DflashSpec(src, read_config_json(src, "convert_dflash"))


# ---------------------------------------------------------------------------
# the target: what the drafter must agree with
# ---------------------------------------------------------------------------

class _TargetInfo:
    """Hidden size, layer count, vocabulary size and M-RoPE use of the target,
    from its GGUF or its HF config.json."""

    def __init__(self, where: str, hidden: int, n_layer: int, n_vocab: int | None, mrope: bool):
        self.where, self.hidden, self.n_layer, self.n_vocab, self.mrope = where, hidden, n_layer, n_vocab, mrope

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: Path) -> "_TargetInfo":
        fields = reader.fields

        def value(key: str) -> Any:
            f = fields.get(key)
            return None if f is None else f.contents()

        arch = value("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"[convert_dflash] target GGUF {path}: no general.architecture")
        if arch == DFLASH_ARCH:
            raise ValueError(f"[convert_dflash] target GGUF {path} is itself a DFlash drafter")
        hidden, n_layer = value(f"{arch}.embedding_length"), value(f"{arch}.block_count")
        if hidden is None or n_layer is None:
            raise ValueError(f"[convert_dflash] target GGUF {path}: missing {arch}.embedding_length or "
                             f"{arch}.block_count")
        tokens = fields.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens.data) if tokens is not None else None
        sections = value(f"{arch}.rope.dimension_sections")
        mrope = bool(sections) and any(int(s) != 0 for s in sections)
        return cls(f"target GGUF {path}", int(hidden), int(n_layer), n_vocab, mrope)

    @classmethod
    def from_dir(cls, target_dir: Path) -> "_TargetInfo":
        path = target_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"[convert_dflash] target directory {str(target_dir)!r} has no config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        text = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return cls(f"target {path}", int(text["hidden_size"]), int(text["num_hidden_layers"]),
                   int(text["vocab_size"]) if "vocab_size" in text else None, "mrope_section" in rope)

    def check(self, spec: DflashSpec) -> None:
        if self.hidden != spec.hidden_size:
            raise ValueError(f"[convert_dflash] drafter hidden size {spec.hidden_size} != hidden size "
                             f"{self.hidden} of the {self.where}")
        _check_layer_ids(spec, self.n_layer, self.where)
        n_vocab = spec.config.get("vocab_size")
        if n_vocab is not None and self.n_vocab is not None and int(n_vocab) != self.n_vocab:
            raise ValueError(f"[convert_dflash] drafter vocab_size {n_vocab} != vocabulary size {self.n_vocab} "
                             f"of the {self.where}")
        if self.n_vocab is not None and spec.mask_token_id >= self.n_vocab:
            raise ValueError(f"[convert_dflash] mask_token_id {spec.mask_token_id} is outside the vocabulary "
                             f"({self.n_vocab}) of the {self.where}")


def _check_layer_ids(spec: DflashSpec, n_target_layers: int, where: str) -> None:
    ids = spec.target_layer_ids
    if max(ids) >= n_target_layers:
        raise ValueError(f"[convert_dflash] target_layer_ids {ids} reach past the {n_target_layers} layers "
                         f"of the {where}")
    if max(ids) == n_target_layers - 1:
        # HF's hidden_states[n_layers] is the final-normed state, not the last
        # layer's output; llama.cpp taps layer inputs and has no layer n_layers.
        raise ValueError(f"[convert_dflash] target_layer_ids {ids} tap the last layer of the {where}: HF "
                         f"gives its output after the final norm, which llama.cpp's layer-input taps "
                         f"(target_layers = id + 1) cannot reproduce")


# ---------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------

def convert_dflash_to_gguf(src_dir: str | os.PathLike[str], dst_path: str | os.PathLike[str], *,
                           outtype: str = "f16", target_gguf: str | os.PathLike[str] | None = None,
                           target_dir: str | os.PathLike[str] | None = None, name: str | None = None,
                           progress: Progress | None = None) -> Path:
    """Convert the DFlash drafter checkpoint in `src_dir` to a GGUF file at `dst_path`.

    `outtype` is one of "f32", "f16", "bf16", "q8_0", with the target converter's dtype
    policy: 1-D tensors and norms stay F32, a Q8_0 tensor whose rows are not
    whole blocks falls back to F16. `target_gguf` (the target model's GGUF) or
    `target_dir` (its HF directory) is optional: when given, the drafter is
    checked against it (hidden size, tapped layers, vocabulary) and its
    tokenizer is carried into the drafter GGUF. `name` and `progress` are
    convert_hf_to_gguf's (general.name; a per-tensor callback). Returns the path written.
    Raises ValueError for a missing directory or config.json, a config that is
    not a DFlashDraftModel, missing or invalid DFlash fields, missing,
    misshapen or unexpected tensors, a drafter/target mismatch or an unknown
    outtype.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"[convert_dflash] unknown outtype {outtype!r}; expected one of {sorted(OUTTYPES)}")
    spec = load_dflash_spec(src_dir)
    src = spec.src_dir
    dst_path = as_path("convert_dflash", "dst_path", dst_path)
    if target_gguf is not None:
        target_gguf = as_path("convert_dflash", "target_gguf", target_gguf)
    if target_dir is not None:
        target_dir = as_path("convert_dflash", "target_dir", target_dir)

    target_reader: gguf.GGUFReader | None = None
    target: _TargetInfo | None = None
    if target_gguf is not None:
        tpath = Path(target_gguf)
        if not tpath.is_file():
            raise ValueError(f"[convert_dflash] target GGUF {str(tpath)!r} does not exist")
        try:
            target_reader = gguf.GGUFReader(tpath)
        except Exception as e:  # the reader raises assorted errors on a bad file
            raise ValueError(f"[convert_dflash] target GGUF {tpath}: cannot read it: {e}") from None
        target = _TargetInfo.from_gguf(target_reader, tpath)
    elif target_dir is not None:
        target = _TargetInfo.from_dir(Path(target_dir))
    if target is not None:
        target.check(spec)
    elif spec.num_target_layers is not None:
        _check_layer_ids(spec, spec.num_target_layers, "target (num_target_layers in the drafter config)")

    if (src / "mask_embedding.pt").is_file():
        raise ValueError(f"[convert_dflash] {src}: mask_embedding.pt (a drafter's own mask-token embedding, "
                         f"patched into the target's embeddings by llama.cpp's converter) is not supported")
    tensors = _dflash_tensors(spec, Checkpoint(src))

    def write_kv(writer: gguf.GGUFWriter) -> None:
        _dflash_kv(writer, spec, mrope_target=target is not None and target.mrope)
        _dflash_tokenizer_kv(writer, spec, target_reader,
                             Path(target_dir) if target_dir is not None else None)

    return convert_tensors(src, Path(dst_path), DFLASH_ARCH, tensors, outtype, write_kv, name=name,
                           progress=progress)


def _dflash_kv(writer: gguf.GGUFWriter, spec: DflashSpec, *, mrope_target: bool) -> None:
    hp = spec.hp
    arch = DFLASH_ARCH
    writer.add_block_count(spec.n_layer)
    writer.add_context_length(int(hp["max_position_embeddings"]))
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(int(hp["intermediate_size"]))
    writer.add_head_count(int(hp["num_attention_heads"]))
    writer.add_head_count_kv(int(hp["num_key_value_heads"]))
    writer.add_layer_norm_rms_eps(float(hp["rms_norm_eps"]))
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(float(spec.rope["rope_theta"]))
    add_rope_scaling(writer, spec._model_spec(), spec.rope)
    if spec.n_rot is not None:
        writer.add_uint32(f"{arch}.rope.dimension_count", spec.n_rot)
    if mrope_target:
        writer.add_array(f"{arch}.rope.dimension_sections", [spec.head_dim // 2, 0, 0, 0])

    writer.add_key_value(f"{arch}.target_layers", [i + 1 for i in spec.target_layer_ids],
                         GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    writer.add_uint32(f"{arch}.block_size", spec.block_size)
    writer.add_bool(f"{arch}.attention.causal", spec.causal)
    if spec.sliding_window is not None:
        writer.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
        writer.add_array(f"{arch}.attention.sliding_window_pattern", spec.is_swa)

    if spec.trained_context_length is not None:
        # ours (llama.cpp ignores it): the engine's default drafter window. Not llama.cpp's
        # attention.sliding_window: that one slides per query row, this one is anchored at the block
        writer.add_uint32(f"{arch}.{TRAINED_CONTEXT_KEY}", spec.trained_context_length)

    draft_vocab = _draft_vocab(spec)
    if draft_vocab:
        # ours (llama.cpp ignores it): the token ids drafts are drawn from; see drafter.h
        writer.add_key_value(f"{arch}.draft_vocab", draft_vocab, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)

    if spec.dflash2 is not None:
        for k, v in spec.dflash2.items():
            writer.add_uint32(f"{arch}.{k}", v)
    if spec.dspark:
        writer.add_bool(f"{arch}.sample_from_anchor", bool(spec.sample_from_anchor))
        writer.add_bool(f"{arch}.has_confidence_head", bool(spec.has_confidence_head))
    value_scale = spec.dflash_config.get("attention_value_scale")
    if value_scale is not None:
        writer.add_float32(f"{arch}.attention.value_scale", float(value_scale))

    # What z-lab's compute_logits / noise embedding apply; llama.cpp reads the
    # same keys (LLM_KV_LOGIT_SCALE, _FINAL_LOGIT_SOFTCAPPING, _EMBEDDING_SCALE).
    dc, cfg = spec.dflash_config, spec.config
    output_multiplier = dc.get("output_multiplier", cfg.get("output_multiplier"))
    if output_multiplier is not None:
        writer.add_float32(f"{arch}.logit_scale", float(output_multiplier))
    softcap = dc.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    if softcap is not None and float(softcap) > 0:
        writer.add_float32(f"{arch}.final_logit_softcapping", float(softcap))
    embedding_scale = dc.get("input_embedding_scale", cfg.get("input_embedding_scale"))
    if embedding_scale is not None:
        writer.add_float32(f"{arch}.embedding_scale", float(embedding_scale))


def _draft_vocab(spec: DflashSpec) -> list[int]:
    """config.json "draft_vocab" (dflash_native.train: the tokens of the target continuations the
    drafter learned): strictly ascending ids inside the vocabulary; [] when absent."""
    ids = spec.config.get("draft_vocab", spec.dflash_config.get("draft_vocab"))
    if ids is None:
        return []
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"[convert_dflash] {spec.where}: draft_vocab must be a non-empty list of token ids")
    n_vocab = spec.config.get("vocab_size")
    for a, b in zip(ids, ids[1:]):
        if b <= a:
            raise ValueError(f"[convert_dflash] {spec.where}: draft_vocab must be strictly ascending ({b} after {a})")
    if ids[0] < 0 or (n_vocab is not None and ids[-1] >= int(n_vocab)):
        raise ValueError(f"[convert_dflash] {spec.where}: draft_vocab id outside [0, {n_vocab})")
    return [int(i) for i in ids]


_MASK_KEY = gguf.Keys.Tokenizer.MASK_ID


def _dflash_tokenizer_kv(writer: gguf.GGUFWriter, spec: DflashSpec, target_reader: gguf.GGUFReader | None,
                         target_dir: Path | None) -> None:
    """The vocabulary, so that llama.cpp can load the drafter and read its mask
    token: the target GGUF's `tokenizer.*` keys, else tokenizer.json from the
    drafter directory or `target_dir`. The mask id is always the drafter's."""
    n_vocab = int(spec.config.get("vocab_size", 0)) or None
    if target_reader is not None:
        _copy_tokenizer_kv(writer, target_reader)
    else:
        tok_dir = next((d for d in (spec.src_dir, target_dir) if d is not None and (d / "tokenizer.json").is_file()),
                       None)
        if tok_dir is None:
            logger.warning("[convert_dflash] %s: no tokenizer.json and no target given; llama.cpp will load the "
                           "drafter without a vocabulary (and so without its mask token)", spec.src_dir)
            writer.add_tokenizer_model("none")
            if n_vocab is not None:
                writer.add_vocab_size(n_vocab)
        else:
            if n_vocab is None:
                raise ValueError(f"[convert_dflash] {spec.where}: missing key 'vocab_size' (needed to write the "
                                 f"tokenizer from {tok_dir / 'tokenizer.json'})")
            tok_config = spec.config if tok_dir == spec.src_dir else _read_json(tok_dir / "config.json")
            add_tokenizer_kv(writer, tok_dir, n_vocab, tok_config)
    writer.kv_data[0].pop(_MASK_KEY, None)  # the tokenizer may name a mask of its own
    writer.add_mask_token_id(spec.mask_token_id)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _copy_tokenizer_kv(writer: gguf.GGUFWriter, reader: gguf.GGUFReader) -> None:
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, value, vtype, sub_type=sub)
        else:
            writer.add_key_value(key, value, vtype)


def _hf_tensor_shapes(spec: DflashSpec) -> dict[str, tuple[int, ...]]:
    shapes = drafter_tensor_shapes(hidden=spec.hidden_size, n_taps=len(spec.target_layer_ids), n_layer=spec.n_layer,
                                   n_head=int(spec.hp["num_attention_heads"]),
                                   n_kv=int(spec.hp["num_key_value_heads"]), head_dim=spec.head_dim,
                                   n_ff=int(spec.hp["intermediate_size"]))
    if spec.dflash2 is not None:
        shapes.update(dflash2_tensor_shapes(hidden=spec.hidden_size, n_layer=spec.n_layer,
                                            n_vocab=int(spec.config["vocab_size"]),
                                            **{k: v for k, v in spec.dflash2.items() if k != "selector_top_k"}))
    return shapes


# DFlash 2's tensors: HF name (no `model.` prefix; {il} the layer) -> llama.cpp's GGUF name
# (gguf-py constants: DFLASH_ATTN_CONV_BASE ... DFLASH_SELECTOR_HIDDEN). The base kernels have no
# `.weight` suffix, which keeps them F32 in llama.cpp's converter whatever the outtype.
DFLASH2_LAYER_NAMES = {
    "attention_conv.base_kernel": "blk.{il}.attn_conv_base",
    "attention_conv.kernel_projection.weight": "blk.{il}.attn_conv_proj.weight",
    "mlp_conv.base_kernel": "blk.{il}.ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "blk.{il}.ffn_conv_proj.weight",
}
DFLASH2_GLOBAL_NAMES = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}


def _gguf_names(n_layer: int, dflash2: bool = False) -> dict[str, str]:
    """HF tensor name (no `model.` prefix) -> GGUF name, in llama.cpp's order (globals, then layers)."""
    names = {"fc.weight": FC_NAME, "hidden_norm.weight": ENC_OUTPUT_NORM_NAME,
             "norm.weight": tensor_name(MODEL_TENSOR.OUTPUT_NORM)}
    if dflash2:
        names.update(DFLASH2_GLOBAL_NAMES)
    for il in range(n_layer):
        for hf_suffix, key in QWEN3_LAYER_TENSORS.items():
            names[f"layers.{il}.{hf_suffix}"] = tensor_name(key, il)
        if dflash2:
            for hf_suffix, name in DFLASH2_LAYER_NAMES.items():
                names[f"layers.{il}.{hf_suffix}"] = name.format(il=il)
    return names


def _dflash_tensors(spec: DflashSpec, ckpt: Checkpoint) -> list[SourceTensor]:
    """GGUF tensors in llama.cpp's order (globals, then layers), with shapes
    checked against config.json. Checkpoints name tensors `fc.weight` (z-lab)
    or `model.fc.weight`; both are accepted."""
    prefix = "model." if any(n.startswith("model.") for n in ckpt.tensors) else ""
    shapes = _hf_tensor_shapes(spec)
    dims = (f"n_taps={len(spec.target_layer_ids)}, hidden={spec.hidden_size}, heads="
            f"{int(spec.hp['num_attention_heads'])}/{int(spec.hp['num_key_value_heads'])}, head_dim={spec.head_dim}, "
            f"ffn={int(spec.hp['intermediate_size'])}")
    out: list[SourceTensor] = []
    for hf_name, gguf_name in _gguf_names(spec.n_layer, spec.dflash2 is not None).items():
        src = _checked_tensor(ckpt, prefix + hf_name, shapes[hf_name], f"from config.json ({dims})")
        out.append(SourceTensor(gguf_name, shapes[hf_name], src.load, not gguf_name.endswith(".weight"), prefix + hf_name))

    if spec.dspark:
        out += _dspark_tensors(spec, ckpt, prefix)
    used = {t.hf_name for t in out}
    extra = sorted(n for n in ckpt.tensors if n not in used and not n.endswith(".rotary_emb.inv_freq"))
    if extra:
        shown = ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
        raise ValueError(f"[convert_dflash] {ckpt.src_dir}: unexpected tensors for a DFlash drafter: {shown}")
    return out


def _checked_tensor(ckpt: Checkpoint, name: str, shape, why: str):
    """ckpt's tensor `name`; ValueError when it is missing or its shape is not `shape` (`why`: where
    the expected shape comes from)."""
    if name not in ckpt:
        raise ValueError(f"[convert_dflash] {ckpt.src_dir}: missing tensor {name!r}")
    src = ckpt.get(name)
    if src.shape != shape:
        raise ValueError(f"[convert_dflash] {ckpt.src_dir}: {name} has shape {list(src.shape)}, expected "
                         f"{list(shape)} {why}")
    return src


def _dspark_tensors(spec: DflashSpec, ckpt: Checkpoint, prefix: str) -> list[SourceTensor]:
    """The Markov head (its rank from markov_w1's shape) and the optional confidence head; sets
    spec.has_confidence_head."""
    w1 = prefix + "markov_head.markov_w1.weight"
    if w1 not in ckpt:
        raise ValueError(f"[convert_dflash] {ckpt.src_dir}: missing tensor {w1!r} (a DSpark drafter's Markov head)")
    rank = int(ckpt.get(w1).shape[-1])
    spec.has_confidence_head = prefix + "confidence_head.proj.weight" in ckpt
    shapes = dspark_tensor_shapes(hidden=spec.hidden_size, n_vocab=int(spec.config["vocab_size"]), markov_rank=rank,
                                  confidence=spec.has_confidence_head)
    out = []
    for hf_name, shape in shapes.items():
        src = _checked_tensor(ckpt, prefix + hf_name, shape, f"(vocab_size, hidden_size and markov_w1's rank {rank})")
        out.append(SourceTensor(DSPARK_NAMES[hf_name], shape, src.load, False, prefix + hf_name))
    return out


def gguf_tensor_plan(spec: DflashSpec) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF tensor name -> (ggml ne, always F32) that a drafter with `spec` has.
    The contract the native loader and the tests check a file against: ne is
    the HF shape reversed, and 1-D tensors (the norms) always stay F32."""
    shapes = _hf_tensor_shapes(spec)
    return {gguf_name: (tuple(reversed(shapes[hf_name])), len(shapes[hf_name]) == 1 or not gguf_name.endswith(".weight"))
            for hf_name, gguf_name in _gguf_names(spec.n_layer, spec.dflash2 is not None).items()}


def target_layer_ids_from_gguf(values: Sequence[int]) -> list[int]:
    """`dflash.target_layers` -> HF target_layer_ids (index of the target layer
    whose output is tapped)."""
    return [int(v) - 1 for v in values]
