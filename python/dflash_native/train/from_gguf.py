"""GGUF -> PyTorch: our own GGUF files back into the HF checkpoints the trainers read.

The inverse of the converters for the files this package writes, so a shipped pair can be
fine-tuned without its (unkept) HF checkpoints:

- `drafter_checkpoint_from_gguf`: a `dflash` GGUF (convert_dflash.convert_dflash_to_gguf) -> a
  z-lab drafter directory (config.json + model.safetensors, what `DFlashDrafter.from_pretrained`
  and the converter read). F16 weights are widened to F32, so converting back gives the same
  tensors bit for bit.
- `target_checkpoint_from_gguf`: a `qwen35` target GGUF (convert.convert_hf_to_gguf) -> a
  Qwen3.5 HF checkpoint: F16 weights widened, norms stored as w + 1 back to w, ssm_a =
  -exp(A_log) back to A_log (float64 log, rounded once, or a float32 neighbour that maps back
  exactly; converting back gives ssm_a within 1 ulp), V heads untiled. The tokenizer is not in
  it: give the tokenizer directory (train/tokenizer.train_tokenizer is deterministic).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..convert.archs.gdn import neg_exp as _neg_exp
from ..convert_dflash import DFLASH_ARCH, target_layer_ids_from_gguf
from ..hf_formats import TRAINED_CONTEXT_KEY, drafter_config

__all__ = ["drafter_checkpoint_from_gguf", "target_checkpoint_from_gguf"]


class _Reader:
    """Key values and F32 tensors (numpy, HF row-major shape) of a GGUF file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"[from_gguf] '{self.path}' does not exist")
        self.r = gguf.GGUFReader(str(self.path))
        self.arch = self.value("general.architecture")
        self.tensors = {t.name: t for t in self.r.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        f = self.r.fields.get(key)
        return default if f is None else f.contents()

    def need(self, key: str) -> Any:
        v = self.value(key)
        if v is None:
            raise ValueError(f"[from_gguf] '{self.path}' has no key {key!r}")
        return v

    def f32(self, name: str) -> np.ndarray:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"[from_gguf] '{self.path}' has no tensor {name!r}")
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"[from_gguf] {name} is {t.tensor_type.name}: only F32 / F16 files can be read back")
        shape = tuple(int(n) for n in reversed(t.shape))
        return np.asarray(t.data).astype(np.float32).reshape(shape)


def _save(out_dir: Path, config: dict, state: dict[str, np.ndarray]) -> Path:
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# ---------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------

_DRAFTER_LAYER = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
                  "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
                  "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
                  "self_attn.k_norm.weight": "attn_k_norm", "post_attention_layernorm.weight": "ffn_norm",
                  "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
                  "mlp.down_proj.weight": "ffn_down"}


def drafter_checkpoint_from_gguf(drafter_gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                                 n_target_layers: int | None = None) -> Path:
    """out_dir/config.json + model.safetensors of the drafter in `drafter_gguf` (a file
    convert_dflash wrote). `n_target_layers` (config's num_target_layers, bookkeeping only):
    default the last tapped layer + 2. Returns out_dir."""
    r = _Reader(drafter_gguf)
    if r.arch != DFLASH_ARCH:
        raise ValueError(f"[from_gguf] '{r.path}' is a {r.arch!r} file, not a {DFLASH_ARCH!r} drafter")
    a = DFLASH_ARCH
    for key in ("logit_scale", "final_logit_softcapping", "embedding_scale", "attention.sliding_window"):
        if r.value(f"{a}.{key}") is not None:
            raise ValueError(f"[from_gguf] '{r.path}' sets {a}.{key}: not supported by the reader")
    if r.value(f"{a}.attention.causal"):
        raise ValueError(f"[from_gguf] '{r.path}' is a causal drafter: not supported")
    taps = target_layer_ids_from_gguf(r.need(f"{a}.target_layers"))
    n_layer = int(r.need(f"{a}.block_count"))
    head_dim = int(r.need(f"{a}.attention.key_length"))
    vocab = r.value("tokenizer.ggml.tokens")
    n_vocab = len(vocab) if vocab is not None else int(r.need("tokenizer.ggml.vocab_size"))
    eps = float(np.float32(r.need(f"{a}.attention.layer_norm_rms_epsilon")))
    cfg = drafter_config(vocab_size=n_vocab, hidden_size=int(r.need(f"{a}.embedding_length")),
                         intermediate_size=int(r.need(f"{a}.feed_forward_length")), num_layers=n_layer,
                         n_head=int(r.need(f"{a}.attention.head_count")),
                         n_kv=int(r.need(f"{a}.attention.head_count_kv")), head_dim=head_dim,
                         max_position_embeddings=int(r.need(f"{a}.context_length")),
                         rms_norm_eps=float(f"{eps:.7g}"), rope_theta=float(r.need(f"{a}.rope.freq_base")),
                         n_target_layers=n_target_layers or max(taps) + 2,
                         mask_token_id=int(r.need("tokenizer.ggml.mask_token_id")), target_layer_ids=taps,
                         block_size=int(r.need(f"{a}.block_size")), dtype="float32",
                         trained_context_length=r.value(f"{a}.{TRAINED_CONTEXT_KEY}"))
    draft_vocab = r.value(f"{a}.draft_vocab")
    if draft_vocab is not None:
        cfg["draft_vocab"] = [int(t) for t in draft_vocab]
    state = {"fc.weight": r.f32("fc.weight"), "hidden_norm.weight": r.f32("enc.output_norm.weight"),
             "norm.weight": r.f32("output_norm.weight")}
    for il in range(n_layer):
        for hf, g in _DRAFTER_LAYER.items():
            state[f"layers.{il}.{hf}"] = r.f32(f"blk.{il}.{g}.weight")
    return _save(Path(out_dir), cfg, state)


# ---------------------------------------------------------------------------
# the target (qwen35)
# ---------------------------------------------------------------------------

def _untile(x: np.ndarray, axis: int, n_k: int, v_per_k: int, head_dim: int, start: int = 0) -> np.ndarray:
    """The inverse of convert.archs.gdn.v_heads_grouped_to_tiled on entries start.. of `axis`."""
    if v_per_k == 1:
        return x
    head, tail = np.split(x, [start], axis=axis)
    shape = tail.shape
    y = tail.reshape(shape[:axis] + (v_per_k, n_k, head_dim) + shape[axis + 1:])
    y = np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)
    return np.concatenate([head, y], axis=axis)


def _a_log(ssm_a: np.ndarray) -> np.ndarray:
    """A_log with convert.archs.gdn.neg_exp(A_log) == ssm_a: the float32 nearest log(-ssm_a), or a
    neighbour within 4 ulps that maps back exactly where the nearest does not. Some ssm_a (written
    by an older float32 exp) have no such float32: those keep the nearest, 1 ulp off on the way back."""
    a = np.log(-ssm_a.astype(np.float64)).astype(np.float32)
    for i in np.flatnonzero(_neg_exp(a) != ssm_a):
        cands = [a[i]]
        for direction in (np.float32(-np.inf), np.float32(np.inf)):
            c = a[i]
            for _ in range(4):
                c = np.nextafter(c, direction)
                cands.append(c)
        hits = [c for c in cands if _neg_exp(np.array([c], np.float32))[0] == ssm_a[i]]
        if hits:
            a[i] = hits[0]
    return a


def _qwen35_config(r: _Reader) -> dict[str, Any]:
    a = "qwen35"
    n_layer = int(r.need(f"{a}.block_count"))
    recurrent = list(r.need(f"{a}.attention.recurrent_layers"))
    head_dim = int(r.need(f"{a}.attention.key_length"))
    n_v = int(r.need(f"{a}.ssm.time_step_rank"))
    sections = [int(s) for s in r.need(f"{a}.rope.dimension_sections")][:3]
    eps = float(np.float32(r.need(f"{a}.attention.layer_norm_rms_epsilon")))
    eos = r.value("tokenizer.ggml.eos_token_id")
    bos = r.value("tokenizer.ggml.bos_token_id", eos)
    pad = r.value("tokenizer.ggml.padding_token_id", eos)
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": int(r.tensors["token_embd.weight"].shape[1]), "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": "output.weight" not in r.tensors,
        "use_cache": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(r.need(f"{a}.rope.freq_base")),
                            "partial_rotary_factor": int(r.need(f"{a}.rope.dimension_count")) / head_dim,
                            "mrope_interleaved": True, "mrope_section": sections},
        "layer_types": ["linear_attention" if bool(x) else "full_attention" for x in recurrent],
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "dtype": "float32",
        "hidden_size": int(r.need(f"{a}.embedding_length")),
        "intermediate_size": int(r.need(f"{a}.feed_forward_length")), "num_hidden_layers": n_layer,
        "full_attention_interval": int(r.value(f"{a}.full_attention_interval", 4)),
        "num_attention_heads": int(r.need(f"{a}.attention.head_count")),
        "num_key_value_heads": int(r.need(f"{a}.attention.head_count_kv")), "head_dim": head_dim,
        "linear_num_key_heads": int(r.need(f"{a}.ssm.group_count")), "linear_num_value_heads": n_v,
        "linear_key_head_dim": int(r.need(f"{a}.ssm.state_size")),
        "linear_value_head_dim": int(r.need(f"{a}.ssm.inner_size")) // n_v,
        "linear_conv_kernel_dim": int(r.need(f"{a}.ssm.conv_kernel")),
        "rms_norm_eps": float(f"{eps:.7g}"), "max_position_embeddings": int(r.need(f"{a}.context_length")),
        "initializer_range": 0.02,
    }


def target_checkpoint_from_gguf(target_gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                                tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """out_dir/config.json + model.safetensors (+ the tokenizer files of `tokenizer_dir`) of the
    dense Qwen3.5 target in `target_gguf` (a file convert_hf_to_gguf wrote). Returns out_dir."""
    r = _Reader(target_gguf)
    if r.arch != "qwen35":
        raise ValueError(f"[from_gguf] '{r.path}' is a {r.arch!r} file: only dense qwen35 targets can be read back")
    cfg = _qwen35_config(r)
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    vpk = n_v // n_k
    key_dim = n_k * hk

    def minus_one(name: str) -> np.ndarray:
        return r.f32(name) - np.float32(1.0)

    p = "model."
    state = {p + "embed_tokens.weight": r.f32("token_embd.weight"), p + "norm.weight": minus_one("output_norm.weight")}
    if not cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = r.f32("output.weight")
    for il, kind in enumerate(cfg["layer_types"]):
        q, b = f"{p}layers.{il}.", f"blk.{il}."
        state[q + "input_layernorm.weight"] = minus_one(b + "attn_norm.weight")
        state[q + "post_attention_layernorm.weight"] = minus_one(b + "post_attention_norm.weight")
        for hf, g in (("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            state[q + hf + ".weight"] = r.f32(b + g + ".weight")
        if kind == "full_attention":
            for hf, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                state[q + f"self_attn.{hf}.weight"] = r.f32(b + g + ".weight")
            state[q + "self_attn.q_norm.weight"] = minus_one(b + "attn_q_norm.weight")
            state[q + "self_attn.k_norm.weight"] = minus_one(b + "attn_k_norm.weight")
            continue
        la = q + "linear_attn."
        conv = _untile(r.f32(b + "ssm_conv1d.weight"), 0, n_k, vpk, hv, 2 * key_dim)
        a_log = _a_log(r.f32(b + "ssm_a"))
        state.update({
            la + "in_proj_qkv.weight": _untile(r.f32(b + "attn_qkv.weight"), 0, n_k, vpk, hv, 2 * key_dim),
            la + "in_proj_z.weight": _untile(r.f32(b + "attn_gate.weight"), 0, n_k, vpk, hv),
            la + "in_proj_b.weight": _untile(r.f32(b + "ssm_beta.weight"), 0, n_k, vpk, 1),
            la + "in_proj_a.weight": _untile(r.f32(b + "ssm_alpha.weight"), 0, n_k, vpk, 1),
            la + "conv1d.weight": conv.reshape(conv.shape[0], 1, conv.shape[1]),
            la + "dt_bias": _untile(r.f32(b + "ssm_dt.bias"), 0, n_k, vpk, 1),
            la + "A_log": _untile(a_log, 0, n_k, vpk, 1),
            la + "norm.weight": r.f32(b + "ssm_norm.weight"),
            la + "out_proj.weight": _untile(r.f32(b + "ssm_out.weight"), 1, n_k, vpk, hv),
        })
    out = _save(Path(out_dir), cfg, state)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy2(f, out / f.name)
    return out
