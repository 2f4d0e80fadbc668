"""Blocks several architectures share: copying a checkpoint tensor under its GGUF name, the
embedding and output head, the unused-tensor check, routed experts stacked per layer, the gated
shared expert, gated attention."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import gguf
from gguf import MODEL_TENSOR

from ..checkpoint import Checkpoint
from ..hparams import ModelSpec
from ..writer import SourceTensor, tensor_name


def text_prefix(ckpt: Checkpoint) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in ckpt.tensors) \
        else "model."


def copy(ckpt: Checkpoint, hf_name: str, gguf_name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None,
          *, shape: tuple[int, ...] | None = None, keep_f32: bool = False) -> SourceTensor:
    """A GGUF tensor read from one HF tensor, optionally transformed (shape-preserving
    unless `shape` says otherwise)."""
    src = ckpt.get(hf_name)

    def load() -> np.ndarray:
        data = src.load()
        return transform(data) if transform is not None else data

    return SourceTensor(gguf_name, shape if shape is not None else src.shape, load, keep_f32, hf_name)


def embedding_and_head(spec: ModelSpec, ckpt: Checkpoint, prefix: str,
                        norm: Callable[[np.ndarray], np.ndarray] | None) -> list[SourceTensor]:
    out = [copy(ckpt, prefix + "embed_tokens.weight", tensor_name(MODEL_TENSOR.TOKEN_EMBD)),
           copy(ckpt, prefix + "norm.weight", tensor_name(MODEL_TENSOR.OUTPUT_NORM), norm)]
    n_vocab, hidden = spec.vocab_size, int(spec.require("hidden_size"))
    if out[0].shape != (n_vocab, hidden):
        raise ValueError(f"[convert] {spec.src_dir}: {prefix}embed_tokens.weight has shape "
                         f"{list(out[0].shape)}, expected [{n_vocab}, {hidden}] from config.json")
    if not spec.tied:
        out.append(copy(ckpt, "lm_head.weight", tensor_name(MODEL_TENSOR.OUTPUT)))
        if out[-1].shape != (n_vocab, hidden):
            raise ValueError(f"[convert] {spec.src_dir}: lm_head.weight has shape {list(out[-1].shape)}, "
                             f"expected [{n_vocab}, {hidden}] from config.json")
    return out


def check_unused(ckpt: Checkpoint, prefix: str, out: Sequence[SourceTensor]) -> None:
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


# ---------------------------------------------------------------------------
# Qwen3-MoE (Qwen3 attention, routed experts in every layer)
# ---------------------------------------------------------------------------

def moe_dims(spec: ModelSpec) -> tuple[int, int, int]:
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


def _stacked(ckpt: Checkpoint, hf_names: Sequence[str], gguf_name: str, shape: tuple[int, ...]) -> SourceTensor:
    """One GGUF tensor [n_expert, ...] stacked from per-expert HF tensors, as llama.cpp stacks them."""
    srcs = [ckpt.get(n) for n in hf_names]
    for t in srcs:
        if t.shape != shape[1:]:
            raise ValueError(f"[convert] {ckpt.src_dir}: {t.name} has shape {list(t.shape)}, expected "
                             f"{list(shape[1:])} from config.json")
    return SourceTensor(gguf_name, shape, lambda: np.stack([t.load() for t in srcs]), hf_names=tuple(hf_names))


def moe_expert_tensors(spec: ModelSpec, ckpt: Checkpoint, p: str, il: int) -> list[SourceTensor]:
    """The routed experts of layer il (HF prefix `p` + "mlp."): the router `gate` -> ffn_gate_inp
    (kept F32, as llama.cpp keeps it), and the experts stacked into ffn_{gate,up}_exps
    [n_expert, n_ff_exp, n_embd] and ffn_down_exps [n_expert, n_embd, n_ff_exp] (numpy order; ggml
    ne reversed). Reads per-expert tensors (`experts.<e>.gate_proj.weight`, the hub layout) or
    transformers 5's fused `experts.gate_up_proj` [n_expert, 2 n_ff_exp, n_embd] / `experts.down_proj`."""
    n_expert, _, n_ff = moe_dims(spec)
    h = int(spec.require("hidden_size"))
    out = [copy(ckpt, p + "mlp.gate.weight", tensor_name(MODEL_TENSOR.FFN_GATE_INP, il), keep_f32=True)]
    if out[0].shape != (n_expert, h):
        raise ValueError(f"[convert] {ckpt.src_dir}: {p}mlp.gate.weight has shape {list(out[0].shape)}, expected "
                         f"[{n_expert}, {h}] from config.json")
    gate, up, down = (tensor_name(k, il) for k in (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP,
                                                      MODEL_TENSOR.FFN_DOWN_EXP))
    fused = p + "mlp.experts.gate_up_proj"
    if fused in ckpt:
        gu = copy(ckpt, fused, gate)
        if gu.shape != (n_expert, 2 * n_ff, h):
            raise ValueError(f"[convert] {ckpt.src_dir}: {fused} has shape {list(gu.shape)}, expected "
                             f"[{n_expert}, {2 * n_ff}, {h}] from config.json")
        out += [copy(ckpt, fused, gate, lambda x: np.ascontiguousarray(x[:, :n_ff]), shape=(n_expert, n_ff, h)),
                copy(ckpt, fused, up, lambda x: np.ascontiguousarray(x[:, n_ff:]), shape=(n_expert, n_ff, h))]
        dn = copy(ckpt, p + "mlp.experts.down_proj", down)
        if dn.shape != (n_expert, h, n_ff):
            raise ValueError(f"[convert] {ckpt.src_dir}: {dn.hf_name} has shape {list(dn.shape)}, expected "
                             f"[{n_expert}, {h}, {n_ff}] from config.json")
        return out + [dn]
    e = [f"{p}mlp.experts.{i}." for i in range(n_expert)]
    return out + [_stacked(ckpt, [x + "gate_proj.weight" for x in e], gate, (n_expert, n_ff, h)),
                  _stacked(ckpt, [x + "up_proj.weight" for x in e], up, (n_expert, n_ff, h)),
                  _stacked(ckpt, [x + "down_proj.weight" for x in e], down, (n_expert, h, n_ff))]


def shared_expert_moe_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """The expert keys of the archs with routed experts plus a shared expert (qwen35moe, qwen3next)."""
    n_expert, n_used, n_ff = moe_dims(spec)
    n_sh = int(spec.get("shared_expert_intermediate_size"))
    if n_sh <= 0:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: shared_expert_intermediate_size {n_sh} must be > 0")
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    writer.add_expert_feed_forward_length(n_ff)
    writer.add_expert_shared_feed_forward_length(n_sh)


def moe_shared_expert_tensors(spec: ModelSpec, ckpt: Checkpoint, p: str, il: int) -> list[SourceTensor]:
    """The shared expert of layer il (HF prefix `p` + "mlp.") -> ffn_{gate,up,down}_shexp, and its
    sigmoid gate `shared_expert_gate` [1, n_embd] -> ffn_gate_inp_shexp (kept F32, as llama.cpp keeps it)."""
    h, n_sh = int(spec.require("hidden_size")), int(spec.get("shared_expert_intermediate_size"))
    out = [copy(ckpt, p + "mlp.shared_expert_gate.weight", tensor_name(MODEL_TENSOR.FFN_GATE_INP_SHEXP, il),
                 keep_f32=True)]
    for hf_suffix, key, shape in (("gate_proj", MODEL_TENSOR.FFN_GATE_SHEXP, (n_sh, h)),
                                  ("up_proj", MODEL_TENSOR.FFN_UP_SHEXP, (n_sh, h)),
                                  ("down_proj", MODEL_TENSOR.FFN_DOWN_SHEXP, (h, n_sh))):
        out.append(copy(ckpt, f"{p}mlp.shared_expert.{hf_suffix}.weight", tensor_name(key, il)))
    for t, want in zip(out, [(1, h), (n_sh, h), (n_sh, h), (h, n_sh)]):
        if t.shape != want:
            raise ValueError(f"[convert] {ckpt.src_dir}: {t.hf_name} has shape {list(t.shape)}, expected "
                             f"{list(want)} from config.json")
    return out


def plus_one(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1.0)


def gated_attention_tensors(ckpt: Checkpoint, p: str, il: int) -> list[SourceTensor]:
    """A hybrid's (Qwen3.5, Qwen3-Next) gated attention layer: W_q rows per head [q | gate], q/k
    RMSNorm weights stored as 1 + w (HF's zero-centred norms)."""
    return [copy(ckpt, p + hf_suffix, tensor_name(key, il), fn) for hf_suffix, key, fn in (
        ("self_attn.q_proj.weight", MODEL_TENSOR.ATTN_Q, None),
        ("self_attn.k_proj.weight", MODEL_TENSOR.ATTN_K, None),
        ("self_attn.v_proj.weight", MODEL_TENSOR.ATTN_V, None),
        ("self_attn.o_proj.weight", MODEL_TENSOR.ATTN_OUT, None),
        ("self_attn.q_norm.weight", MODEL_TENSOR.ATTN_Q_NORM, plus_one),
        ("self_attn.k_norm.weight", MODEL_TENSOR.ATTN_K_NORM, plus_one),
    )]
