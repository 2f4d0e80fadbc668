"""Hugging Face checkpoint -> GGUF conversion for DFlash target models.

Supported: Llama 3.x (`LlamaForCausalLM`, GGUF arch `llama`), Qwen3
(`Qwen3ForCausalLM`, GGUF arch `qwen3`), Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF arch
`qwen3moe`, experts stacked per layer), Qwen3.5-MoE (`Qwen3_5MoeForCausalLM` /
`qwen3_5_moe_text` and the multimodal layout, GGUF arch `qwen35moe`: Qwen3.5's
layers with routed experts and a gated shared expert) and Qwen3.5 text
models (`Qwen3_5ForCausalLM` / `qwen3_5_text`, and the multimodal
`Qwen3_5ForConditionalGeneration` / `qwen3_5`, whose text weights sit under
`model.language_model.` and whose hparams sit under `text_config`; GGUF arch
`qwen35`), and Qwen3-Next (`Qwen3NextForCausalLM` / `qwen3_next`, GGUF arch
`qwen3next`: the hybrid layout with fused GDN projections and routed experts plus
a gated shared expert in every layer).

The output follows llama.cpp's own converter (conversion/qwen.py in the
llama.cpp that llama-cpp-python 0.3.36 vendors) key for key and tensor for
tensor, so llama.cpp loads it and the native engine can share its loader
conventions. The transforms that are not plain renames:

- Qwen3.5 RMSNorms compute `x * (1 + w)`; we store `w + 1` for every norm but
  the GDN output norm `linear_attn.norm`, which is already multiplicative.
- `A_log` is stored as `ssm_a = -exp(A_log)`; `dt_bias` becomes `ssm_dt.bias`.
- `conv1d.weight` [C, 1, K] is squeezed to [C, K] (ggml ne = [K, C]) and kept F32.
- Qwen3.5's GDN value heads are reordered from grouped-by-key-head order to tiled order
  when n_v_heads != n_k_heads, so ggml can broadcast q/k heads by tiling.
- Qwen3-Next's `in_proj_qkvz` (rows per key head [q, k, v x r, z x r]) is split into
  `attn_qkv` [q all heads, k all heads, v all heads] and `attn_gate` [z], as llama.cpp's
  Qwen3NextModel does; its value heads stay grouped (no reorder) and `in_proj_ba` is kept
  fused (`ssm_ba`).
- Llama's W_q / W_k rows are permuted per head from HF's rotate-half order to the
  interleaved order of llama.cpp's NORM RoPE; `rope_type: llama3` becomes the
  `rope_freqs` tensor of per-frequency divisors.

Safetensors are read directly (header JSON + memmap), so no torch is needed.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

import gguf
from gguf import GGMLQuantizationType, LlamaFileType, MODEL_TENSOR, TokenType

from .hf_formats import GPT2_PRE_TOKENIZER, MASK_TOKEN_TEXTS, PRE_TOKENIZERS, default_mrope_section, hybrid_layer_types

__all__ = ["OUTTYPES", "convert_hf_to_gguf"]

logger = logging.getLogger(__name__)

# outtype -> (type for tensors that are allowed to be narrowed, general.file_type)
OUTTYPES: Mapping[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


def convert_hf_to_gguf(src_dir: str | os.PathLike[str], dst_path: str | os.PathLike[str],
                       *, outtype: str = "f16") -> Path:
    """Convert the HF checkpoint in `src_dir` to a GGUF file at `dst_path`.

    `outtype` is one of "f32", "f16", "bf16", "q8_0". As in llama.cpp, 1-D
    tensors, norms, biases, `ssm_a` and `ssm_conv1d` stay F32, and a tensor
    whose row length is not a multiple of 32 falls back from Q8_0 to F16.
    Returns the path written. Raises ValueError for a missing directory or
    config.json, an unsupported architecture, missing tensors or an unknown
    outtype.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"[convert] unknown outtype {outtype!r}; expected one of {sorted(OUTTYPES)}")
    src = as_path("convert", "src_dir", src_dir)
    dst_path = as_path("convert", "dst_path", dst_path)
    if not src.is_dir():
        raise ValueError(f"[convert] checkpoint directory {str(src)!r} does not exist")
    spec = _load_model_spec(src)
    ckpt = _Checkpoint(src)

    arch_kv, arch_tensors = _ARCH_WRITERS[spec.gguf_arch]
    tensors = arch_tensors(spec, ckpt)

    def write_kv(writer: gguf.GGUFWriter) -> None:
        arch_kv(writer, spec)
        _add_tokenizer_kv(writer, src, spec.vocab_size, spec.config)

    return _convert_tensors(src, Path(dst_path), spec.gguf_arch, tensors, outtype, write_kv)


def _convert_tensors(src: Path, dst: Path, arch: str, tensors: Sequence["_SourceTensor"], outtype: str,
                     write_arch_kv: Callable[[gguf.GGUFWriter], None]) -> Path:
    """The part every converter shares: the per-tensor type plan for `outtype`, the general
    keys, the architecture's keys (write_arch_kv), then the tensors."""
    qtype_out, file_type = OUTTYPES[outtype]
    planned = [_PlannedTensor(t.name, t.shape, _pick_qtype(t.name, t.shape, qtype_out, t.keep_f32), t.load)
               for t in tensors]

    def write_kv(writer: gguf.GGUFWriter) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(src.resolve().name)
        write_arch_kv(writer)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return _write_gguf(dst, arch, write_kv, planned)


# ---------------------------------------------------------------------------
# safetensors reading (no torch)
# ---------------------------------------------------------------------------

_ST_DTYPES: Mapping[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to F32 by a 16-bit shift on load
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class _StTensor:
    """One tensor inside a .safetensors file, loaded lazily through a memmap."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `path`

    def load(self) -> np.ndarray:
        """The tensor as a C-contiguous float32 array (a fresh copy)."""
        np_dtype = _ST_DTYPES.get(self.dtype)
        if np_dtype is None:
            raise ValueError(f"[convert] {self.path}: tensor {self.name!r} has dtype {self.dtype}; "
                             f"supported: {sorted(_ST_DTYPES)}")
        count = math.prod(self.shape)
        if count == 0:
            return np.zeros(self.shape, dtype=np.float32)
        raw = np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=(count,))
        if self.dtype == "BF16":
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out = raw.astype(np.float32)
        del raw
        return out.reshape(self.shape)


def _read_safetensors_header(path: Path) -> dict[str, _StTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"[convert] {path}: not a safetensors file (shorter than 8 bytes)")
        n_header = int.from_bytes(prefix, "little")
        if n_header <= 0 or 8 + n_header > size:
            raise ValueError(f"[convert] {path}: corrupt safetensors header length {n_header}")
        try:
            header = json.loads(f.read(n_header))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"[convert] {path}: corrupt safetensors header: {e}") from None
    base = 8 + n_header
    out: dict[str, _StTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        itemsize = _ST_ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise ValueError(f"[convert] {path}: tensor {name!r} has {end - begin} bytes, "
                             f"expected {math.prod(shape) * itemsize} for {dtype}{list(shape)}")
        if base + end > size:
            raise ValueError(f"[convert] {path}: tensor {name!r} runs past the end of the file")
        out[name] = _StTensor(path, name, dtype, shape, base + begin)
    return out


class _Checkpoint:
    """All tensors of a HF checkpoint directory: model.safetensors, a sharded
    model.safetensors.index.json, or (without an index) every *.safetensors."""

    def __init__(self, src_dir: Path):
        self.src_dir = src_dir
        index_path = src_dir / "model.safetensors.index.json"
        if index_path.is_file():
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f).get("weight_map", {})
            if not weight_map:
                raise ValueError(f"[convert] {index_path}: empty or missing 'weight_map'")
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not (src_dir / fname).is_file():
                    raise ValueError(f"[convert] {index_path}: shard {fname!r} does not exist")
        elif (src_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in src_dir.glob("*.safetensors"))
            if not files:
                raise ValueError(f"[convert] no model.safetensors, model.safetensors.index.json "
                                 f"or *.safetensors in {str(src_dir)!r}")
        self.tensors: dict[str, _StTensor] = {}
        for fname in files:
            self.tensors.update(_read_safetensors_header(src_dir / fname))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> _StTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"[convert] {self.src_dir}: missing tensor {name!r}")
        return t


# ---------------------------------------------------------------------------
# tensor dtype policy and GGUF writing (shared with the drafter converter)
# ---------------------------------------------------------------------------

@dataclass
class _SourceTensor:
    """A GGUF tensor before its storage type is chosen.

    `shape` is the numpy (row-major) shape; ggml's ne is its reverse, so the
    last entry is the row length that quantization blocks run along.
    """

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]  # float32 data in the final layout
    keep_f32: bool = False  # llama.cpp keeps it F32 whatever the outtype (e.g. ssm_conv1d)
    hf_name: str = ""  # the checkpoint tensor it comes from, for bookkeeping
    hf_names: tuple[str, ...] = ()  # or the tensors it is stacked from (MoE experts)


@dataclass
class _PlannedTensor:
    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    load: Callable[[], np.ndarray]


def _pick_qtype(name: str, shape: Sequence[int], qtype_out: GGMLQuantizationType,
                keep_f32: bool = False) -> GGMLQuantizationType:
    """llama.cpp's storage rule (ModelBase.prepare_tensors): 1-D tensors, norms,
    non-`.weight` tensors and the listed exceptions stay F32; everything else
    takes the outtype, with Q8_0 falling back to F16 when rows are not whole blocks."""
    if keep_f32 or len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return GGMLQuantizationType.F32
    if qtype_out == GGMLQuantizationType.Q8_0:
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype_out]
        if shape[-1] % block_size != 0:
            return GGMLQuantizationType.F16
    return qtype_out


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 data -> the bytes (or f32/f16 array) GGUF stores for `qtype`."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        return data
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _nbytes(shape: Sequence[int], qtype: GGMLQuantizationType) -> int:
    return math.prod(gguf.quants.quant_shape_to_byte_shape(tuple(shape), qtype))


def _write_gguf(dst_path: Path, arch: str, write_kv: Callable[[gguf.GGUFWriter], None],
                tensors: Sequence[_PlannedTensor]) -> Path:
    """Write a GGUF file, streaming one tensor at a time so that peak memory is
    one tensor, not the model. Writes to a temporary name and renames at the end."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"[convert] duplicate GGUF tensor names: {dup}")
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = dst_path.with_name(dst_path.name + ".tmp")
    writer = gguf.GGUFWriter(path=None, arch=arch)
    try:
        write_kv(writer)
        for t in tensors:
            # tensor_dtype float32 + raw_dtype keeps `shape` as the logical shape.
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(t.shape, t.qtype),
                                   raw_dtype=t.qtype)
        total, shared, expert, n_expert = writer.get_total_parameter_count()
        if total > 0:  # general.size_label, as llama.cpp's converter derives it ("115K", "8x120K")
            writer.add_size_label(gguf.size_label(total, shared, expert, n_expert))
        writer.write_header_to_file(path=tmp_path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            data = t.load()
            if tuple(data.shape) != tuple(t.shape):
                raise ValueError(f"[convert] tensor {t.name!r}: shape {list(data.shape)} != planned {list(t.shape)}")
            writer.write_tensor_data(_encode(data, t.qtype))
        writer.close()
        os.replace(tmp_path, dst_path)
    except BaseException:
        writer.close()
        tmp_path.unlink(missing_ok=True)
        raise
    return dst_path


def _tensor_name(key: MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    name = gguf.TENSOR_NAMES[key]
    if bid is not None:
        name = name.format(bid=bid)
    return name + suffix


# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------

@dataclass
class _ModelSpec:
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
_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen3_5_text": "qwen35", "qwen3_5": "qwen35",
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
_REQUIRED = {
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


def _apply_hf_rules(arch: str, text: dict[str, Any]) -> None:
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
    for key in _REQUIRED[arch]:
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
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise ValueError(f"[{where}] {name} must be a path (str, bytes or os.PathLike), got {type(value).__name__}")
    return Path(os.fsdecode(os.fspath(value)))


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


def _load_model_spec(src: Path) -> _ModelSpec:
    config = read_config_json(src, "convert")
    config_path = src / "config.json"
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    gguf_arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None) or _MODEL_TYPES.get(model_type)
    if gguf_arch is None:
        raise ValueError(f"[convert] {config_path}: unsupported architecture {archs} (model_type "
                         f"{model_type!r}); supported: {sorted(_ARCHS)} / model_type {sorted(_MODEL_TYPES)}")

    text = config
    if isinstance(config.get("text_config"), dict):
        text = {**config["text_config"]}
        # top-level keys the text config leaves out (e.g. tie_word_embeddings) still apply
        for key in ("tie_word_embeddings",):
            if key in config and key not in text:
                text[key] = config[key]
    text = dict(text)
    _apply_hf_rules(gguf_arch, text)
    check_hparams("convert", config_path, text)
    _require_hparams(gguf_arch, config_path, text)
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return _ModelSpec(src, gguf_arch, config, text, tied)


def _rope_parameters(spec: _ModelSpec) -> dict[str, Any]:
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


def _add_rope_scaling(writer: gguf.GGUFWriter, spec: _ModelSpec, rp: Mapping[str, Any]) -> None:
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


def _common_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
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


# ---------------------------------------------------------------------------
# Qwen3
# ---------------------------------------------------------------------------

def _qwen3_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    _common_kv(writer, spec)
    rp = _rope_parameters(spec)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    _add_rope_scaling(writer, spec, rp)


def _text_prefix(ckpt: _Checkpoint) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in ckpt.tensors) \
        else "model."


def _copy(ckpt: _Checkpoint, hf_name: str, gguf_name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
          *, shape: tuple[int, ...] | None = None, keep_f32: bool = False) -> _SourceTensor:
    """A GGUF tensor read from one HF tensor, optionally transformed (shape-preserving
    unless `shape` says otherwise)."""
    src = ckpt.get(hf_name)

    def load() -> np.ndarray:
        data = src.load()
        return transform(data) if transform is not None else data

    return _SourceTensor(gguf_name, shape if shape is not None else src.shape, load, keep_f32, hf_name)


def _embedding_and_head(spec: _ModelSpec, ckpt: _Checkpoint, prefix: str,
                        norm: Callable[[np.ndarray], np.ndarray] | None) -> list[_SourceTensor]:
    out = [_copy(ckpt, prefix + "embed_tokens.weight", _tensor_name(MODEL_TENSOR.TOKEN_EMBD)),
           _copy(ckpt, prefix + "norm.weight", _tensor_name(MODEL_TENSOR.OUTPUT_NORM), norm)]
    n_vocab, hidden = spec.vocab_size, int(spec.require("hidden_size"))
    if out[0].shape != (n_vocab, hidden):
        raise ValueError(f"[convert] {spec.src_dir}: {prefix}embed_tokens.weight has shape "
                         f"{list(out[0].shape)}, expected [{n_vocab}, {hidden}] from config.json")
    if not spec.tied:
        out.append(_copy(ckpt, "lm_head.weight", _tensor_name(MODEL_TENSOR.OUTPUT)))
        if out[-1].shape != (n_vocab, hidden):
            raise ValueError(f"[convert] {spec.src_dir}: lm_head.weight has shape {list(out[-1].shape)}, "
                             f"expected [{n_vocab}, {hidden}] from config.json")
    return out


def _check_unused(ckpt: _Checkpoint, prefix: str, out: Sequence[_SourceTensor]) -> None:
    """Refuse tensors of the text model that we would silently drop. Vision
    (`model.visual.`) and MTP (`mtp.`) tensors lie outside the prefix and are skipped."""
    used = {t.hf_name for t in out} | {n for t in out for n in t.hf_names}
    used.add("lm_head.weight")  # dropped on purpose when tied
    extra = sorted(n for n in ckpt.tensors
                   if n not in used and (n.startswith(prefix) or n == "lm_head.weight")
                   and not n.endswith(".rotary_emb.inv_freq"))
    if extra:
        shown = ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
        raise ValueError(f"[convert] {ckpt.src_dir}: unexpected tensors for this architecture: {shown}")


# HF Qwen3 decoder-layer tensor suffix -> GGUF tensor (targets and DFlash drafters alike)
QWEN3_LAYER_TENSORS: Mapping[str, MODEL_TENSOR] = {
    "input_layernorm.weight": MODEL_TENSOR.ATTN_NORM,
    "self_attn.q_proj.weight": MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj.weight": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj.weight": MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj.weight": MODEL_TENSOR.ATTN_OUT,
    "self_attn.q_norm.weight": MODEL_TENSOR.ATTN_Q_NORM,
    "self_attn.k_norm.weight": MODEL_TENSOR.ATTN_K_NORM,
    "post_attention_layernorm.weight": MODEL_TENSOR.FFN_NORM,
    "mlp.gate_proj.weight": MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj.weight": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj.weight": MODEL_TENSOR.FFN_DOWN,
}


def _qwen3_tensors(spec: _ModelSpec, ckpt: _Checkpoint) -> list[_SourceTensor]:
    prefix = _text_prefix(ckpt)
    out = _embedding_and_head(spec, ckpt, prefix, None)
    for il in range(int(spec.require("num_hidden_layers"))):
        for hf_suffix, key in QWEN3_LAYER_TENSORS.items():
            out.append(_copy(ckpt, f"{prefix}layers.{il}.{hf_suffix}", _tensor_name(key, il)))
    _check_unused(ckpt, prefix, out)
    return out


# ---------------------------------------------------------------------------
# Qwen3-MoE (Qwen3 attention, routed experts in every layer)
# ---------------------------------------------------------------------------

def _moe_dims(spec: _ModelSpec) -> tuple[int, int, int]:
    """(n_expert, n_expert_used, n_ff_expert), checked."""
    where = spec.src_dir / "config.json"
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if spec.get(key) is None:
            also = " (or num_local_experts)" if key == "num_experts" else ""
            raise ValueError(f"[convert] {where}: missing key {key!r}{also}: the MoE layers' size has no default")
    n_expert, n_used = int(spec.get("num_experts")), int(spec.get("num_experts_per_tok"))
    n_ff = int(spec.get("moe_intermediate_size"))
    if not (1 <= n_used <= n_expert) or n_ff <= 0:
        raise ValueError(f"[convert] {where}: num_experts_per_tok ({n_used}) must be in [1, num_experts "
                         f"({n_expert})] and moe_intermediate_size ({n_ff}) > 0")
    return n_expert, n_used, n_ff


def _qwen3moe_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    """llama.cpp's Qwen3MoeModel keys, plus `expert_weights_norm` (HF norm_topk_prob; a llama.cpp key
    that its qwen3moe graph does not read: it always renormalises)."""
    _qwen3_kv(writer, spec)
    where = spec.src_dir / "config.json"
    if int(spec.get("decoder_sparse_step")) != 1 or spec.get("mlp_only_layers"):
        raise ValueError(f"[convert] {where}: dense layers among the MoE ones (decoder_sparse_step "
                         f"{spec.get('decoder_sparse_step')}, mlp_only_layers {spec.get('mlp_only_layers')}) "
                         f"are not supported (llama.cpp's qwen3moe has experts in every layer)")
    n_expert, n_used, n_ff = _moe_dims(spec)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    writer.add_expert_feed_forward_length(n_ff)
    writer.add_expert_weights_norm(bool(spec.get("norm_topk_prob")))


def _stacked(ckpt: _Checkpoint, hf_names: Sequence[str], gguf_name: str, shape: tuple[int, ...]) -> _SourceTensor:
    """One GGUF tensor [n_expert, ...] stacked from per-expert HF tensors, as llama.cpp stacks them."""
    srcs = [ckpt.get(n) for n in hf_names]
    for t in srcs:
        if t.shape != shape[1:]:
            raise ValueError(f"[convert] {ckpt.src_dir}: {t.name} has shape {list(t.shape)}, expected "
                             f"{list(shape[1:])} from config.json")
    return _SourceTensor(gguf_name, shape, lambda: np.stack([t.load() for t in srcs]), hf_names=tuple(hf_names))


def moe_expert_tensors(spec: _ModelSpec, ckpt: _Checkpoint, p: str, il: int) -> list[_SourceTensor]:
    """The routed experts of layer il (HF prefix `p` + "mlp."): the router `gate` -> ffn_gate_inp
    (kept F32, as llama.cpp keeps it), and the experts stacked into ffn_{gate,up}_exps
    [n_expert, n_ff_exp, n_embd] and ffn_down_exps [n_expert, n_embd, n_ff_exp] (numpy order; ggml
    ne reversed). Reads per-expert tensors (`experts.<e>.gate_proj.weight`, the hub layout) or
    transformers 5's fused `experts.gate_up_proj` [n_expert, 2 n_ff_exp, n_embd] / `experts.down_proj`."""
    n_expert, _, n_ff = _moe_dims(spec)
    h = int(spec.require("hidden_size"))
    out = [_copy(ckpt, p + "mlp.gate.weight", _tensor_name(MODEL_TENSOR.FFN_GATE_INP, il), keep_f32=True)]
    if out[0].shape != (n_expert, h):
        raise ValueError(f"[convert] {ckpt.src_dir}: {p}mlp.gate.weight has shape {list(out[0].shape)}, expected "
                         f"[{n_expert}, {h}] from config.json")
    gate, up, down = (_tensor_name(k, il) for k in (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP,
                                                      MODEL_TENSOR.FFN_DOWN_EXP))
    fused = p + "mlp.experts.gate_up_proj"
    if fused in ckpt:
        gu = _copy(ckpt, fused, gate)
        if gu.shape != (n_expert, 2 * n_ff, h):
            raise ValueError(f"[convert] {ckpt.src_dir}: {fused} has shape {list(gu.shape)}, expected "
                             f"[{n_expert}, {2 * n_ff}, {h}] from config.json")
        out += [_copy(ckpt, fused, gate, lambda x: np.ascontiguousarray(x[:, :n_ff]), shape=(n_expert, n_ff, h)),
                _copy(ckpt, fused, up, lambda x: np.ascontiguousarray(x[:, n_ff:]), shape=(n_expert, n_ff, h))]
        dn = _copy(ckpt, p + "mlp.experts.down_proj", down)
        if dn.shape != (n_expert, h, n_ff):
            raise ValueError(f"[convert] {ckpt.src_dir}: {dn.hf_name} has shape {list(dn.shape)}, expected "
                             f"[{n_expert}, {h}, {n_ff}] from config.json")
        return out + [dn]
    e = [f"{p}mlp.experts.{i}." for i in range(n_expert)]
    return out + [_stacked(ckpt, [x + "gate_proj.weight" for x in e], gate, (n_expert, n_ff, h)),
                  _stacked(ckpt, [x + "up_proj.weight" for x in e], up, (n_expert, n_ff, h)),
                  _stacked(ckpt, [x + "down_proj.weight" for x in e], down, (n_expert, h, n_ff))]


def _qwen3moe_tensors(spec: _ModelSpec, ckpt: _Checkpoint) -> list[_SourceTensor]:
    prefix = _text_prefix(ckpt)
    out = _embedding_and_head(spec, ckpt, prefix, None)
    for il in range(int(spec.require("num_hidden_layers"))):
        p = f"{prefix}layers.{il}."
        for hf_suffix, key in QWEN3_LAYER_TENSORS.items():
            if not hf_suffix.startswith("mlp."):
                out.append(_copy(ckpt, p + hf_suffix, _tensor_name(key, il)))
        out += moe_expert_tensors(spec, ckpt, p, il)
    _check_unused(ckpt, prefix, out)
    return out


# ---------------------------------------------------------------------------
# Llama (Llama 3.x dense)
# ---------------------------------------------------------------------------

def _llama_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    """llama.cpp's LlamaModel keys: the common ones, vocab_size, rope.dimension_count = head_dim.
    Llama 3.1's `llama3` RoPE scaling is a tensor (rope_freqs), not a key."""
    _common_kv(writer, spec)
    if spec.get("mlp_bias"):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: mlp_bias=true is not supported")
    rp = _rope_parameters(spec)
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: partial_rotary_factor "
                         f"{rp['partial_rotary_factor']} is not supported for Llama (llama.cpp rotates the whole head)")
    if rp["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: unsupported rope_type {rp['rope_type']!r} "
                         f"for Llama (supported: default, llama3)")
    writer.add_vocab_size(spec.vocab_size)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    writer.add_rope_dimension_count(int(spec.get("head_dim")))


def llama3_rope_factors(spec: _ModelSpec) -> np.ndarray | None:
    """F32 [head_dim / 2]: the divisors of each RoPE frequency under `rope_type: llama3` (None for
    other rope types), as llama.cpp's converter computes rope_freqs: 1 for wavelengths below
    original_max_position_embeddings / high_freq_factor, `factor` above ... / low_freq_factor,
    smoothly interpolated between (HF's _compute_llama3_parameters divides the frequencies alike).
    original_max_position_embeddings is read from the rope parameters as HF does (llama.cpp reads
    only a top-level key, default 8192: the same on every published Llama 3.x config)."""
    rp = _rope_parameters(spec)
    if rp["rope_type"] != "llama3":
        return None
    dim = int(spec.get("head_dim"))
    base = float(rp["rope_theta"])
    where = spec.src_dir / "config.json"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if rp.get(key) is None:
            raise ValueError(f"[convert] {where}: llama3 rope scaling needs {key!r} in rope_parameters")
    factor = float(rp["factor"])
    low, high = float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    old_ctx = float(rp["original_max_position_embeddings"])
    if not (factor > 0 and high > low > 0 and old_ctx > 0):
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: llama3 rope scaling needs factor > 0 and "
                         f"high_freq_factor > low_freq_factor > 0 (got {factor}, {high}, {low})")
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0,
                   np.where(wavelen > old_ctx / low, factor, 1.0 / ((1.0 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def llama_qk_permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of W_q / W_k [n_head * head_dim, n_in] from HF's rotate-half order (pairs (i, i + d/2)
    of a head) to the interleaved order (pairs (2i, 2i + 1)) of llama.cpp's NORM RoPE, as its
    LlamaModel.permute does."""
    if x.shape[0] % (2 * n_head) != 0:
        raise ValueError(f"[convert] Llama q/k permute: {x.shape[0]} rows are not {n_head} heads of even size")
    return np.ascontiguousarray(
        x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2)).reshape(x.shape)


# HF Llama decoder-layer tensor suffix -> GGUF tensor (q/k are permuted on the way)
LLAMA_LAYER_TENSORS: Mapping[str, MODEL_TENSOR] = {
    k: v for k, v in QWEN3_LAYER_TENSORS.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}


def _llama_tensors(spec: _ModelSpec, ckpt: _Checkpoint) -> list[_SourceTensor]:
    prefix = _text_prefix(ckpt)
    out = _embedding_and_head(spec, ckpt, prefix, None)
    n_head, n_kv = int(spec.require("num_attention_heads")), int(spec.get("num_key_value_heads"))
    factors = llama3_rope_factors(spec)
    if factors is not None:
        out.append(_SourceTensor(_tensor_name(MODEL_TENSOR.ROPE_FREQS), factors.shape, lambda: factors))
    for il in range(int(spec.require("num_hidden_layers"))):
        for hf_suffix, key in LLAMA_LAYER_TENSORS.items():
            fn = None
            if hf_suffix == "self_attn.q_proj.weight":
                fn = lambda x: llama_qk_permute(x, n_head)  # noqa: E731
            elif hf_suffix == "self_attn.k_proj.weight":
                fn = lambda x: llama_qk_permute(x, n_kv)  # noqa: E731
            out.append(_copy(ckpt, f"{prefix}layers.{il}.{hf_suffix}", _tensor_name(key, il), fn))
    _check_unused(ckpt, prefix, out)
    return out


# ---------------------------------------------------------------------------
# Qwen3.5 (hybrid Gated DeltaNet + gated full attention)
# ---------------------------------------------------------------------------

def _qwen35_layer_types(spec: _ModelSpec) -> list[str]:
    n_layer = int(spec.require("num_hidden_layers"))
    layer_types = spec.get("layer_types")
    if layer_types is None:
        return hybrid_layer_types(n_layer, int(spec.require("full_attention_interval")))
    if len(layer_types) != n_layer:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: layer_types has {len(layer_types)} "
                         f"entries, num_hidden_layers is {n_layer}")
    bad = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: unsupported layer_types {bad}")
    return list(layer_types)


def _full_attention_interval(layer_types: Sequence[str]) -> int | None:
    """The interval k with layer i full iff (i+1) % k == 0, if the pattern has one."""
    for k in range(1, len(layer_types) + 2):
        if hybrid_layer_types(len(layer_types), k) == list(layer_types):
            return k
    return None


def _text_mrope_sections(n_rot: int, head_dim: int, given: Sequence[int] | None) -> list[int]:
    """`rope.dimension_sections` for a text model.

    For text every section gets the same position, so the sections only have
    to keep ggml's interleaved M-RoPE from ever picking the 4th ("e") position,
    which llama.cpp sets to 0 for text, and satisfy sum(sections) <= head_dim
    (a GGML_ASSERT). HF's value (default [11, 11, 10]) is kept when it does so;
    otherwise the equal split of the n_rot/2 rotated pairs is used.
    """
    n_pairs = n_rot // 2

    def text_safe(s: Sequence[int]) -> bool:
        total = sum(s)
        if total <= 0 or total > head_dim:
            return False
        for k in range(n_pairs):
            sector = k % total
            if not (sector < 3 * s[sector % 3]):
                return False
        return True

    if given is not None:
        sections = [int(x) for x in given][:4]
        sections += [0] * (4 - len(sections))
        if text_safe(sections[:3]) and sections[3] == 0:
            return sections
    derived = default_mrope_section(n_rot) + [0]
    if not text_safe(derived[:3]):
        derived = [max(1, derived[0]), derived[1], derived[2], 0]
    return derived


@dataclass(frozen=True)
class _GdnDims:
    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        return self.n_v_heads // self.n_k_heads


def _gdn_dims(spec: _ModelSpec) -> _GdnDims:
    d = _GdnDims(int(spec.get("linear_num_key_heads")), int(spec.get("linear_num_value_heads")),
                 int(spec.get("linear_key_head_dim")), int(spec.get("linear_value_head_dim")),
                 int(spec.get("linear_conv_kernel_dim")))
    where = spec.src_dir / "config.json"
    if d.n_k_heads <= 0 or d.n_v_heads % d.n_k_heads != 0:
        raise ValueError(f"[convert] {where}: linear_num_value_heads ({d.n_v_heads}) must be a multiple "
                         f"of linear_num_key_heads ({d.n_k_heads})")
    if d.head_k_dim != d.head_v_dim:
        raise ValueError(f"[convert] {where}: linear_key_head_dim ({d.head_k_dim}) != linear_value_head_dim "
                         f"({d.head_v_dim}); llama.cpp's qwen35 (ggml_gated_delta_net) needs them equal")
    return d


def v_heads_grouped_to_tiled(x: np.ndarray, axis: int, n_k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """Reorder value heads along `axis` from HF's grouped order
    [k0: v0..v(r-1), k1: v0..v(r-1), ...] to ggml's tiled order
    [v0 of k0, v0 of k1, ..., v1 of k0, ...] (head j*n_k + i holds HF head i*r + j)."""
    axis = axis % x.ndim
    shape = x.shape
    if shape[axis] != n_k_heads * v_per_k * head_dim:
        raise ValueError(f"[convert] V-head reorder: axis {axis} has {shape[axis]} entries, expected "
                         f"{n_k_heads} x {v_per_k} x {head_dim}")
    y = x.reshape(shape[:axis] + (n_k_heads, v_per_k, head_dim) + shape[axis + 1:])
    y = np.swapaxes(y, axis, axis + 1)
    return np.ascontiguousarray(y).reshape(shape)


def _neg_exp(x: np.ndarray) -> np.ndarray:
    """ssm_a = -exp(A_log) in float64, then rounded once: the F32 result is the same on every machine
    (NumPy's F32 exp differs by SIMD path) and is torch's (HF's, llama.cpp's converter's) within 1 ulp."""
    return (-np.exp(x.astype(np.float64))).astype(np.float32)


def _gdn_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    """The hybrids' (Qwen3.5, Qwen3-Next) GDN keys and layer pattern."""
    d = _gdn_dims(spec)
    writer.add_ssm_conv_kernel(d.conv_kernel)
    writer.add_ssm_state_size(d.head_k_dim)
    writer.add_ssm_group_count(d.n_k_heads)
    writer.add_ssm_time_step_rank(d.n_v_heads)
    writer.add_ssm_inner_size(d.value_dim)
    layer_types = _qwen35_layer_types(spec)
    # The per-layer array is what llama.cpp reads first; the interval is its fallback.
    writer.add_array(f"{spec.gguf_arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in layer_types])
    interval = _full_attention_interval(layer_types)
    if interval is not None:
        writer.add_full_attention_interval(interval)


def _qwen35_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    _common_kv(writer, spec)
    rp = _rope_parameters(spec)
    head_dim = int(spec.get("head_dim"))
    n_rot = int(head_dim * float(rp["partial_rotary_factor"]))
    writer.add_rope_dimension_sections(_text_mrope_sections(n_rot, head_dim, rp.get("mrope_section")))
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    _add_rope_scaling(writer, spec, rp)
    writer.add_rope_dimension_count(n_rot)

    _gdn_kv(writer, spec)


def _qwen35moe_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    """Qwen3.5's keys plus the experts' (llama.cpp's Qwen3_5MoeTextModel): HF's router always
    renormalises its top-k, as llama.cpp's qwen35moe graph does."""
    _qwen35_kv(writer, spec)
    _shared_expert_moe_kv(writer, spec)


def _shared_expert_moe_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    """The expert keys of the archs with routed experts plus a shared expert (qwen35moe, qwen3next)."""
    n_expert, n_used, n_ff = _moe_dims(spec)
    n_sh = int(spec.get("shared_expert_intermediate_size"))
    if n_sh <= 0:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: shared_expert_intermediate_size {n_sh} must be > 0")
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    writer.add_expert_feed_forward_length(n_ff)
    writer.add_expert_shared_feed_forward_length(n_sh)


def moe_shared_expert_tensors(spec: _ModelSpec, ckpt: _Checkpoint, p: str, il: int) -> list[_SourceTensor]:
    """The shared expert of layer il (HF prefix `p` + "mlp.") -> ffn_{gate,up,down}_shexp, and its
    sigmoid gate `shared_expert_gate` [1, n_embd] -> ffn_gate_inp_shexp (kept F32, as llama.cpp keeps it)."""
    h, n_sh = int(spec.require("hidden_size")), int(spec.get("shared_expert_intermediate_size"))
    out = [_copy(ckpt, p + "mlp.shared_expert_gate.weight", _tensor_name(MODEL_TENSOR.FFN_GATE_INP_SHEXP, il),
                 keep_f32=True)]
    for hf_suffix, key, shape in (("gate_proj", MODEL_TENSOR.FFN_GATE_SHEXP, (n_sh, h)),
                                  ("up_proj", MODEL_TENSOR.FFN_UP_SHEXP, (n_sh, h)),
                                  ("down_proj", MODEL_TENSOR.FFN_DOWN_SHEXP, (h, n_sh))):
        out.append(_copy(ckpt, f"{p}mlp.shared_expert.{hf_suffix}.weight", _tensor_name(key, il)))
    for t, want in zip(out, [(1, h), (n_sh, h), (n_sh, h), (h, n_sh)]):
        if t.shape != want:
            raise ValueError(f"[convert] {ckpt.src_dir}: {t.hf_name} has shape {list(t.shape)}, expected "
                             f"{list(want)} from config.json")
    return out


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1.0)


def _qwen35_tensors(spec: _ModelSpec, ckpt: _Checkpoint) -> list[_SourceTensor]:
    prefix = _text_prefix(ckpt)
    out = _embedding_and_head(spec, ckpt, prefix, _plus_one)
    d = _gdn_dims(spec)
    reorder = d.v_per_k > 1

    def tile(axis: int, head_dim: int, start: int = 0) -> Callable[[np.ndarray], np.ndarray]:
        """Reorder V heads along `axis`, leaving the first `start` entries (q and k) alone."""
        def f(x: np.ndarray) -> np.ndarray:
            if not reorder:
                return x
            head, tail = np.split(x, [start], axis=axis)
            tail = v_heads_grouped_to_tiled(tail, axis, d.n_k_heads, d.v_per_k, head_dim)
            return np.concatenate([head, tail], axis=axis)
        return f

    def conv1d(x: np.ndarray) -> np.ndarray:
        # [C, 1, K] -> [C, K]; ggml's ssm_conv1d has ne = [K, C]
        return tile(0, d.head_v_dim, 2 * d.key_dim)(x.reshape(x.shape[0], x.shape[-1]))

    for il, layer_type in enumerate(_qwen35_layer_types(spec)):
        p = f"{prefix}layers.{il}."
        out.append(_copy(ckpt, p + "input_layernorm.weight", _tensor_name(MODEL_TENSOR.ATTN_NORM, il), _plus_one))
        if layer_type == "full_attention":
            out += _gated_attention_tensors(ckpt, p, il)
        else:
            conv = ckpt.get(p + "linear_attn.conv1d.weight")
            if conv.shape != (d.conv_dim, 1, d.conv_kernel):
                raise ValueError(f"[convert] {ckpt.src_dir}: {conv.name} has shape {list(conv.shape)}, expected "
                                 f"[{d.conv_dim}, 1, {d.conv_kernel}] from config.json")
            out += [
                _copy(ckpt, p + "linear_attn.in_proj_qkv.weight", _tensor_name(MODEL_TENSOR.ATTN_QKV, il),
                      tile(0, d.head_v_dim, 2 * d.key_dim)),
                _copy(ckpt, p + "linear_attn.in_proj_z.weight", _tensor_name(MODEL_TENSOR.ATTN_GATE, il),
                      tile(0, d.head_v_dim)),
                _copy(ckpt, p + "linear_attn.in_proj_b.weight", _tensor_name(MODEL_TENSOR.SSM_BETA, il), tile(0, 1)),
                _copy(ckpt, p + "linear_attn.in_proj_a.weight", _tensor_name(MODEL_TENSOR.SSM_ALPHA, il), tile(0, 1)),
                _copy(ckpt, p + "linear_attn.conv1d.weight", _tensor_name(MODEL_TENSOR.SSM_CONV1D, il), conv1d,
                      shape=(d.conv_dim, d.conv_kernel), keep_f32=True),
                _copy(ckpt, p + "linear_attn.dt_bias", _tensor_name(MODEL_TENSOR.SSM_DT, il, ".bias"), tile(0, 1)),
                _copy(ckpt, p + "linear_attn.A_log", _tensor_name(MODEL_TENSOR.SSM_A, il, ""),
                      lambda x, t=tile(0, 1): _neg_exp(t(x))),
                _copy(ckpt, p + "linear_attn.norm.weight", _tensor_name(MODEL_TENSOR.SSM_NORM, il)),
                _copy(ckpt, p + "linear_attn.out_proj.weight", _tensor_name(MODEL_TENSOR.SSM_OUT, il),
                      tile(1, d.head_v_dim)),
            ]
        out.append(_copy(ckpt, p + "post_attention_layernorm.weight",
                         _tensor_name(MODEL_TENSOR.ATTN_POST_NORM, il), _plus_one))
        if spec.gguf_arch == "qwen35moe":
            out += moe_expert_tensors(spec, ckpt, p, il) + moe_shared_expert_tensors(spec, ckpt, p, il)
            continue
        for hf_suffix, key in (("mlp.gate_proj.weight", MODEL_TENSOR.FFN_GATE),
                               ("mlp.up_proj.weight", MODEL_TENSOR.FFN_UP),
                               ("mlp.down_proj.weight", MODEL_TENSOR.FFN_DOWN)):
            out.append(_copy(ckpt, p + hf_suffix, _tensor_name(key, il)))
    _check_unused(ckpt, prefix, out)
    return out


# ---------------------------------------------------------------------------
# Qwen3-Next (Qwen3.5's hybrid layout with fused GDN projections, NeoX partial RoPE, and routed
# experts plus a gated shared expert in every layer)
# ---------------------------------------------------------------------------

def _qwen3next_kv(writer: gguf.GGUFWriter, spec: _ModelSpec) -> None:
    """llama.cpp's Qwen3NextModel keys (Qwen2MoeModel's expert keys, the ssm keys, the layer pattern,
    `rope.dimension_count` = head_dim x partial_rotary_factor), plus `expert_weights_norm` (HF
    norm_topk_prob; llama.cpp's qwen3next graph always renormalises and does not read it)."""
    _common_kv(writer, spec)
    where = spec.src_dir / "config.json"
    rp = _rope_parameters(spec)
    writer.add_rope_freq_base(float(rp["rope_theta"]))
    _add_rope_scaling(writer, spec, rp)
    head_dim = int(spec.get("head_dim"))
    n_rot = int(head_dim * float(rp["partial_rotary_factor"]))
    if n_rot <= 0 or n_rot % 2 != 0:
        raise ValueError(f"[convert] {where}: head_dim x partial_rotary_factor = {n_rot} must be even and > 0")
    writer.add_rope_dimension_count(n_rot)

    _gdn_kv(writer, spec)

    if int(spec.get("decoder_sparse_step")) != 1 or spec.get("mlp_only_layers"):
        raise ValueError(f"[convert] {where}: dense layers among the MoE ones (decoder_sparse_step "
                         f"{spec.get('decoder_sparse_step')}, mlp_only_layers {spec.get('mlp_only_layers')}) "
                         f"are not supported (llama.cpp's qwen3next has experts in every layer)")
    _shared_expert_moe_kv(writer, spec)
    writer.add_expert_weights_norm(bool(spec.get("norm_topk_prob")))


def qwen3next_split_qkvz(x: np.ndarray, d: _GdnDims) -> tuple[np.ndarray, np.ndarray]:
    """HF's in_proj_qkvz [(2 d_k + 2 r d_v) n_k, n_embd], rows per key head [q | k | v x r | z x r],
    -> (attn_qkv rows [q all heads | k all heads | v all heads], attn_gate rows [z all heads]) as
    llama.cpp's Qwen3NextModel splits it; value heads keep their grouped order."""
    h = x.shape[-1]
    per_head = 2 * d.head_k_dim + 2 * d.v_per_k * d.head_v_dim
    y = x.reshape(d.n_k_heads, per_head, h)
    q, k, v, z = np.split(y, np.cumsum([d.head_k_dim, d.head_k_dim, d.v_per_k * d.head_v_dim])[:3], axis=1)
    flat = [np.ascontiguousarray(t).reshape(-1, h) for t in (q, k, v, z)]
    return np.concatenate(flat[:3], axis=0), flat[3]


def _gated_attention_tensors(ckpt: _Checkpoint, p: str, il: int) -> list[_SourceTensor]:
    """A hybrid's (Qwen3.5, Qwen3-Next) gated attention layer: W_q rows per head [q | gate], q/k
    RMSNorm weights stored as 1 + w (HF's zero-centred norms)."""
    return [_copy(ckpt, p + hf_suffix, _tensor_name(key, il), fn) for hf_suffix, key, fn in (
        ("self_attn.q_proj.weight", MODEL_TENSOR.ATTN_Q, None),
        ("self_attn.k_proj.weight", MODEL_TENSOR.ATTN_K, None),
        ("self_attn.v_proj.weight", MODEL_TENSOR.ATTN_V, None),
        ("self_attn.o_proj.weight", MODEL_TENSOR.ATTN_OUT, None),
        ("self_attn.q_norm.weight", MODEL_TENSOR.ATTN_Q_NORM, _plus_one),
        ("self_attn.k_norm.weight", MODEL_TENSOR.ATTN_K_NORM, _plus_one),
    )]


def _qwen3next_tensors(spec: _ModelSpec, ckpt: _Checkpoint) -> list[_SourceTensor]:
    prefix = _text_prefix(ckpt)
    out = _embedding_and_head(spec, ckpt, prefix, _plus_one)
    d = _gdn_dims(spec)
    h = int(spec.require("hidden_size"))

    for il, layer_type in enumerate(_qwen35_layer_types(spec)):
        p = f"{prefix}layers.{il}."
        out.append(_copy(ckpt, p + "input_layernorm.weight", _tensor_name(MODEL_TENSOR.ATTN_NORM, il), _plus_one))
        if layer_type == "full_attention":
            out += _gated_attention_tensors(ckpt, p, il)
        else:
            a = p + "linear_attn."
            want = {"in_proj_qkvz.weight": (2 * d.key_dim + 2 * d.value_dim, h),
                    "in_proj_ba.weight": (2 * d.n_v_heads, h),
                    "conv1d.weight": (d.conv_dim, 1, d.conv_kernel)}
            for name, shape in want.items():
                t = ckpt.get(a + name)
                if t.shape != shape:
                    raise ValueError(f"[convert] {ckpt.src_dir}: {t.name} has shape {list(t.shape)}, expected "
                                     f"{list(shape)} from config.json")
            out += [
                _copy(ckpt, a + "in_proj_qkvz.weight", _tensor_name(MODEL_TENSOR.ATTN_QKV, il),
                      lambda x: qwen3next_split_qkvz(x, d)[0], shape=(d.conv_dim, h)),
                _copy(ckpt, a + "in_proj_qkvz.weight", _tensor_name(MODEL_TENSOR.ATTN_GATE, il),
                      lambda x: qwen3next_split_qkvz(x, d)[1], shape=(d.value_dim, h)),
                # per key head [b x r | a x r]: the engine splits it, as llama.cpp's graph does
                _copy(ckpt, a + "in_proj_ba.weight", _tensor_name(MODEL_TENSOR.SSM_BETA_ALPHA, il)),
                _copy(ckpt, a + "conv1d.weight", _tensor_name(MODEL_TENSOR.SSM_CONV1D, il),
                      lambda x: x.reshape(x.shape[0], x.shape[-1]), shape=(d.conv_dim, d.conv_kernel), keep_f32=True),
                _copy(ckpt, a + "dt_bias", _tensor_name(MODEL_TENSOR.SSM_DT, il, ".bias")),
                _copy(ckpt, a + "A_log", _tensor_name(MODEL_TENSOR.SSM_A, il, ""), _neg_exp),
                _copy(ckpt, a + "norm.weight", _tensor_name(MODEL_TENSOR.SSM_NORM, il)),
                _copy(ckpt, a + "out_proj.weight", _tensor_name(MODEL_TENSOR.SSM_OUT, il)),
            ]
        out.append(_copy(ckpt, p + "post_attention_layernorm.weight",
                         _tensor_name(MODEL_TENSOR.ATTN_POST_NORM, il), _plus_one))
        out += moe_expert_tensors(spec, ckpt, p, il) + moe_shared_expert_tensors(spec, ckpt, p, il)
    _check_unused(ckpt, prefix, out)
    return out


# GGUF arch -> (hparam keys writer, tensor planner)
_ARCH_WRITERS: Mapping[str, tuple[Callable[[gguf.GGUFWriter, _ModelSpec], None],
                                  Callable[[_ModelSpec, _Checkpoint], list[_SourceTensor]]]] = {
    "llama": (_llama_kv, _llama_tensors),
    "qwen3moe": (_qwen3moe_kv, _qwen3moe_tensors),
    "qwen3": (_qwen3_kv, _qwen3_tensors),
    "qwen35": (_qwen35_kv, _qwen35_tensors),
    "qwen35moe": (_qwen35moe_kv, _qwen35_tensors),
    "qwen3next": (_qwen3next_kv, _qwen3next_tensors),
}


# ---------------------------------------------------------------------------
# tokenizer metadata
# ---------------------------------------------------------------------------

_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _iter_pre_tokenizers(node: Any) -> Iterator[dict[str, Any]]:
    if not isinstance(node, dict):
        return
    if node.get("type") == "Sequence":
        for child in node.get("pretokenizers", []):
            yield from _iter_pre_tokenizers(child)
    else:
        yield node


def _tokenizer_pre(tok: dict[str, Any], where: Path) -> str:
    """tokenizer.ggml.pre for tokenizer.json's pre-tokenizer, as llama.cpp names the one that
    implements it: one regex Split (before a ByteLevel without its own regex) whose regex is
    Qwen2's, Qwen3.5's or Llama 3's; or a lone ByteLevel with its GPT-2 regex (`gpt-2`)."""
    pre = list(_iter_pre_tokenizers(tok.get("pre_tokenizer")))
    byte_levels = [p for p in pre if p.get("type") == "ByteLevel"]
    if not byte_levels:
        raise ValueError(f"[convert] {where}: only byte-level BPE tokenizers are supported "
                         f"(no ByteLevel pre-tokenizer)")
    if any(p.get("add_prefix_space") for p in byte_levels):
        raise ValueError(f"[convert] {where}: ByteLevel add_prefix_space=true is not supported "
                         f"(llama.cpp's byte-level BPE adds no prefix space)")
    others = sorted({str(p.get("type")) for p in pre} - {"ByteLevel", "Split"})
    if others:
        raise ValueError(f"[convert] {where}: unsupported pre-tokenizers {others}")
    splits = [p for p in pre if p.get("type") == "Split"]
    own_regex = [p for p in byte_levels if p.get("use_regex", True)]
    if not splits and len(pre) == 1 and own_regex:
        return GPT2_PRE_TOKENIZER
    if len(splits) != 1 or "Regex" not in splits[0].get("pattern", {}) or own_regex:
        raise ValueError(f"[convert] {where}: expected one regex Split pre-tokenizer and a ByteLevel without "
                         f"its own regex (or a lone GPT-2 ByteLevel), found {len(splits)} Split(s) and "
                         f"{len(own_regex)} ByteLevel(s) with use_regex")
    regex = splits[0]["pattern"]["Regex"]
    name = PRE_TOKENIZERS.get(regex)
    if name is None:
        known = ", ".join(f"{v} ({k!r})" for k, v in PRE_TOKENIZERS.items())
        raise ValueError(f"[convert] {where}: unknown pre-tokenizer regex {regex!r}; supported: {known}, "
                         f"and a lone GPT-2 ByteLevel ({GPT2_PRE_TOKENIZER})")
    return name


def _looks_special(text: str) -> bool:
    """llama.cpp's TextModel.does_token_look_special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _merge_strings(merges: Sequence[Any], where: Path) -> list[str]:
    out = []
    for m in merges:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, (list, tuple)) and len(m) == 2:
            # a space inside a part is written as U+0120+... the way gguf's SpecialVocab does
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m))
        else:
            raise ValueError(f"[convert] {where}: unknown merges entry {m!r}")
    return out


def _add_tokenizer_kv(writer: gguf.GGUFWriter, src: Path, vocab_size: int, config: Mapping[str, Any]) -> None:
    """The `tokenizer.*` keys of `src`'s tokenizer.json / tokenizer_config.json, as
    llama.cpp's converter writes them for a byte-level BPE (`gpt2` model)."""
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        logger.warning("[convert] %s: no tokenizer.json; writing a GGUF without a vocabulary", src)
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(vocab_size)
        return
    with open(tok_path, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model", {}) if isinstance(tok, dict) else None
    if not isinstance(model, dict):
        raise ValueError(f"[convert] {tok_path}: 'model' must be a JSON object (the tokenizer model), got "
                         f"{str(model)[:80]}")
    if model.get("type") != "BPE":
        raise ValueError(f"[convert] {tok_path}: tokenizer model {model.get('type')!r} is not supported (BPE only)")
    pre = _tokenizer_pre(tok, tok_path)
    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    tokens, types = _token_list(model, added, vocab_size, tok_path)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merge_strings(model.get("merges", []), tok_path))

    tok_config = _read_json_object(src / "tokenizer_config.json")
    if writer.arch == "llama" and isinstance(tok_config.get("add_prefix_space"), bool):
        writer.add_add_space_prefix(tok_config["add_prefix_space"])  # as llama.cpp's LlamaModel copies it
    for typ, tid in _special_token_ids(tok_config, config, added, vocab_size).items():
        getattr(writer, f"add_{typ}_token_id")(tid)
    for typ, value in _add_special_flags(tok, tok_config).items():
        getattr(writer, f"add_add_{typ}_token")(value)
    template = _chat_template(src, tok_config)
    if isinstance(template, (str, list)):
        writer.add_chat_template(template)


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_list(model: Mapping[str, Any], added: Mapping[int, Mapping[str, Any]], vocab_size: int,
                tok_path: Path) -> tuple[list[str], list[int]]:
    """Token texts and types for ids 0 .. vocab_size-1: BPE vocabulary, added tokens
    (CONTROL when special or special-looking, else USER_DEFINED), `[PAD<i>]` for unused ids."""
    id_to_text: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
    for i, a in added.items():
        id_to_text[i] = a["content"]
    if id_to_text and max(id_to_text) >= vocab_size:
        raise ValueError(f"[convert] {tok_path}: token id {max(id_to_text)} >= vocab_size {vocab_size} of config.json")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        text = id_to_text.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            if added[i].get("special", False) or _looks_special(text):
                types.append(TokenType.CONTROL)
            else:
                types.append(TokenType.USER_DEFINED)
                text = text.replace("\u2581", " ")  # llama.cpp pre-normalises user-defined spaces
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(TokenType.NORMAL)
    return tokens, types


def _special_token_ids(tok_config: Mapping[str, Any], config: Mapping[str, Any],
                       added: Mapping[int, Mapping[str, Any]], vocab_size: int) -> dict[str, int]:
    """Special ids as gguf's SpecialVocab resolves them: tokenizer_config.json's
    `<typ>_token` text looked up among the added tokens, then config.json's
    `<typ>_token_id` (also under text_config); the first valid one wins. A mask
    token with one of the usual spellings is found without either."""
    content_to_id = {a["content"]: i for i, a in sorted(added.items())}
    special_ids: dict[str, int] = {}
    for typ in _SPECIAL_TYPES:
        entry = tok_config.get(f"{typ}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text in content_to_id:
            special_ids[typ] = content_to_id[text]
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for typ in _SPECIAL_TYPES:
        tid = config.get(f"{typ}_token_id", text_config.get(f"{typ}_token_id"))
        if typ not in special_ids and isinstance(tid, int) and 0 <= tid < vocab_size:
            special_ids[typ] = tid
    if "mask" not in special_ids:
        mask = next((content_to_id[t] for t in MASK_TOKEN_TEXTS if t in content_to_id), None)
        if mask is not None:
            special_ids["mask"] = mask
    return special_ids


def _add_special_flags(tok: Mapping[str, Any], tok_config: Mapping[str, Any]) -> dict[str, bool]:
    """add_bos/add_eos/add_sep as gguf's SpecialVocab reads them: a ByteLevel post-processor adds
    nothing; a TemplateProcessing one (Llama 3: `<|begin_of_text|> $A`) adds BOS when its single
    template starts with the BOS token, EOS when it ends with the EOS token;
    tokenizer_config.json's `add_<typ>_token` overrides both."""
    def text(entry: Any) -> Any:
        return entry.get("content") if isinstance(entry, dict) else entry

    add_special: dict[str, bool] = {}
    post = tok.get("post_processor") or {}
    for proc in post.get("processors", [post]):
        if proc.get("type") == "ByteLevel":
            add_special.update(bos=False, eos=False)
        elif proc.get("type") == "TemplateProcessing":
            single = proc.get("single") or []
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                last = single[-1].get("SpecialToken", {}).get("id")
                if first:
                    add_special["bos"] = first == text(tok_config.get("bos_token")) or not tok_config
                if last:
                    add_special["eos"] = last == text(tok_config.get("eos_token")) or not tok_config
    for typ in ("bos", "eos", "sep"):
        value = tok_config.get(f"add_{typ}_token")
        if isinstance(value, bool):
            add_special[typ] = value
    return add_special


def _chat_template(src: Path, tok_config: Mapping[str, Any]) -> Any:
    """tokenizer_config.json's chat_template, else chat_template.jinja, else chat_template.json."""
    template = tok_config.get("chat_template")
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (src / "chat_template.json").is_file():
        template = _read_json_object(src / "chat_template.json").get("chat_template")
    return template
