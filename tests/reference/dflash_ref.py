"""A plain PyTorch DFlash drafter forward, written from the z-lab modeling code's
semantics (z-lab/dflash `dflash/model.py`: `DFlashDraftModel`,
`Qwen3DFlashAttention`), on an HF drafter checkpoint plus the target's
embed_tokens / lm_head. No transformers, no code shared with the converter or
the engine: it reads safetensors with the `safetensors` package.

One drafter forward, for a block of B tokens `[last committed, MASK x (B-1)]`
and n_ctx positions of context features (the target's hidden states at the
tap layers, `hidden_states[i + 1]` for i in target_layer_ids, concatenated):

    x       = embed_tokens[block] * input_embedding_scale          [B, H]
    ctx     = hidden_norm(fc(features))                            [n_ctx, H]   (no attn_norm on ctx)
    positions: context p0 .. p0+n_ctx-1, block p0+n_ctx .. p0+n_ctx+B-1 (p0 = ctx_start_pos)
    per layer:
        h   = input_layernorm(x)
        q   = rope(q_norm(q_proj(h)))                              per head, block positions
        k   = rope(k_norm(k_proj([ctx; h])))                       per KV head, context + block positions
        v   = v_proj([ctx; h])                                     (no norm on v)
        a   = softmax(q k^T / sqrt(head_dim) + mask) v             GQA: query head j reads KV head j // (n_head / n_kv)
        x   = x + o_proj(a)
        x   = x + down(silu(gate(post_attention_layernorm(x))) * up(...))
    logits  = lm_head(norm(x)) * output_multiplier, then softcap if set

RMSNorm is Qwen3's `x / sqrt(mean(x^2) + eps) * w`. RoPE is NeoX style
(rotate_half: dim i pairs with dim i + head_dim/2), inv_freq = theta^(-2i/d)
over the whole head. The mask is empty (non-causal, every query sees every
context and block key) unless the layer is causal or sliding, as z-lab
resolves it: sliding layers (`layer_types`, window kept only with
`use_sliding_window`) are causal unless `is_causal` is set; causal means key
position <= query position; a window w keeps |q - k| < w (q - k < w when causal).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["DFlashRef", "round_like_gguf", "target_taps"]


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------

def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            return [d / name for name in sorted(set(json.load(f)["weight_map"].values()))]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in {d}")
    return files


def _load_tensors(d: Path, wanted: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(d):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if wanted is None or name in wanted:
                    out[name] = f.get_tensor(name).float()
    return out


def round_like_gguf(w: torch.Tensor, outtype: str) -> torch.Tensor:
    """A 2-D weight rounded the way a GGUF of `outtype` stores it (rows of the
    HF weight are ggml rows; Q8_0 falls back to F16 when rows are not whole
    32-blocks). 1-D tensors are returned unchanged (the GGUF keeps them F32)."""
    if w.ndim != 2 or outtype == "f32":
        return w
    if outtype == "f16":
        return w.to(torch.float16).float()
    if outtype == "bf16":
        return w.to(torch.bfloat16).float()
    if outtype == "q8_0":
        if w.shape[1] % 32 != 0:
            return w.to(torch.float16).float()
        import gguf

        q8 = gguf.GGMLQuantizationType.Q8_0
        a = w.detach().float().numpy()
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8)))
    raise ValueError(f"unknown outtype {outtype!r}")


def _read_config(d: Path) -> dict[str, Any]:
    with open(d / "config.json", encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------

def _yarn(inv_freq: torch.Tensor, d: int, base: float, rope: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071, with HF's defaults): pair i keeps its frequency below the
    correction dim of beta_fast rotations over the original context, is divided by `factor`
    above beta_slow's, on a linear ramp between (bounds rounded outwards); cos/sin are scaled by
    attention_factor, by default 1 + 0.1 ln(factor)."""
    factor = float(rope["factor"])
    orig = float(rope["original_max_position_embeddings"])

    def corr_dim(n_rot: float) -> float:  # the dim whose wavelength fits n_rot times in orig
        return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(float(rope.get("beta_fast") or 32))), 0)
    hi = min(math.ceil(corr_dim(float(rope.get("beta_slow") or 1))), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / max(hi - lo, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    mscale = rope.get("attention_factor")
    if mscale is None:
        mscale = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(mscale)


class DFlashRef:
    """The z-lab drafter forward on explicit weights (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any], weights: Mapping[str, torch.Tensor], embed_tokens: torch.Tensor,
                 lm_head: torch.Tensor, *, dtype: torch.dtype = torch.float32):
        self.config = dict(config)
        self.dtype = dtype
        c = self.config
        dc = c.get("dflash_config") or {}
        self.hidden_size = int(c["hidden_size"])
        self.n_layer = int(c["num_hidden_layers"])
        self.n_head = int(c["num_attention_heads"])
        self.n_kv = int(c.get("num_key_value_heads") or self.n_head)
        self.head_dim = int(c.get("head_dim") or self.hidden_size // self.n_head)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.target_layer_ids = list(dc.get("target_layer_ids", c.get("target_layer_ids")))
        self.mask_token_id = dc.get("mask_token_id", c.get("mask_token_id"))
        self.block_size = int(dc.get("block_size", c.get("block_size", 16)))
        self.input_embedding_scale = float(dc.get("input_embedding_scale", c.get("input_embedding_scale", 1.0)))
        self.output_multiplier = float(dc.get("output_multiplier", c.get("output_multiplier", 1.0)))
        softcap = dc.get("final_logit_softcapping", c.get("final_logit_softcapping"))
        self.softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None

        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        self.rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        d = self.head_dim
        # per frequency pair i: angle = pos * inv_freq[i]; cos/sin times rope_mscale
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.rope_mscale = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope["factor"])
        elif rope_type == "yarn":
            inv_freq, self.rope_mscale = _yarn(inv_freq, d, self.rope_theta, rope)
        elif rope_type != "default":
            raise NotImplementedError(f"DFlashRef: rope_type {rope_type!r}")
        self.inv_freq = inv_freq

        # Qwen3Config: sliding_window only with use_sliding_window; default layer_types from max_window_layers.
        window = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
        layer_types = c.get("layer_types") or [
            "sliding_attention" if window is not None and i >= int(c.get("max_window_layers", 28)) else "full_attention"
            for i in range(self.n_layer)]
        is_causal = c.get("is_causal", dc.get("causal"))
        self.layer_causal = [(t == "sliding_attention") if is_causal is None else bool(is_causal) for t in layer_types]
        self.layer_window = [window if t == "sliding_attention" else None for t in layer_types]

        strip = "model." if any(k.startswith("model.") for k in weights) else ""
        self.w = {k[len(strip):] if k.startswith(strip) else k: v.to(dtype) for k, v in weights.items()}
        self.embed_tokens = embed_tokens.to(dtype)
        self.lm_head = lm_head.to(dtype)
        n_taps = len(self.target_layer_ids)
        if tuple(self.w["fc.weight"].shape) != (self.hidden_size, n_taps * self.hidden_size):
            raise ValueError(f"fc.weight {tuple(self.w['fc.weight'].shape)} != "
                             f"({self.hidden_size}, {n_taps} * {self.hidden_size})")
        if self.embed_tokens.shape[1] != self.hidden_size or self.lm_head.shape[1] != self.hidden_size:
            raise ValueError("target embed_tokens / lm_head hidden size != drafter hidden size")

    @classmethod
    def from_dirs(cls, drafter_dir: str | Path, target_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                  weights_as: str = "f32", target_weights_as: str | None = None) -> "DFlashRef":
        """Drafter weights from `drafter_dir`, embed_tokens / lm_head from the HF
        target in `target_dir` (lm_head = embed_tokens when tied). `weights_as`
        rounds the drafter's 2-D weights like a GGUF of that outtype stores them,
        `target_weights_as` (default: the same) the target's two matrices."""
        drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
        config = _read_config(drafter_dir)
        weights = {k: round_like_gguf(v, weights_as) for k, v in _load_tensors(drafter_dir).items()}

        tcfg = _read_config(target_dir)
        text = tcfg.get("text_config", tcfg) if isinstance(tcfg.get("text_config"), dict) else tcfg
        tied = bool(tcfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        names = ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "lm_head.weight"]
        t = _load_tensors(target_dir, names)
        embed = t.get("model.embed_tokens.weight", t.get("model.language_model.embed_tokens.weight"))
        if embed is None:
            raise ValueError(f"{target_dir}: no embed_tokens")
        head = embed if tied or "lm_head.weight" not in t else t["lm_head.weight"]
        tw = weights_as if target_weights_as is None else target_weights_as
        return cls(config, weights, round_like_gguf(embed, tw), round_like_gguf(head, tw), dtype=dtype)

    # -- pieces ---------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] at absolute positions pos [n]; NeoX pairing."""
        d = self.head_dim
        ang = pos.to(torch.float64)[:, None] * self.inv_freq[None, :]   # [n, d/2]
        cos = (torch.cat([ang.cos(), ang.cos()], -1) * self.rope_mscale).to(self.dtype)[:, None, :]
        sin = (torch.cat([ang.sin(), ang.sin()], -1) * self.rope_mscale).to(self.dtype)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name].T

    def _context(self, features: torch.Tensor) -> torch.Tensor:
        return self._rms(self._lin("fc.weight", features), self.w["hidden_norm.weight"])

    def _kv(self, il: int, src: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"layers.{il}.self_attn."
        k = self._lin(p + "k_proj.weight", src).view(-1, self.n_kv, self.head_dim)
        v = self._lin(p + "v_proj.weight", src).view(-1, self.n_kv, self.head_dim)
        k = self._rope(self._rms(k, self.w[p + "k_norm.weight"]), pos)
        return k, v

    def _mask(self, il: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        causal, window = self.layer_causal[il], self.layer_window[il]
        if not causal and window is None:
            return None
        diff = q_pos[:, None] - k_pos[None, :]
        visible = torch.ones_like(diff, dtype=torch.bool)
        if causal:
            visible &= diff >= 0
        if window is not None:
            visible &= diff < window
            if not causal:
                visible &= -diff < window
        return visible

    def _as_tensor(self, x: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(dtype)
        return torch.as_tensor(np.asarray(x), dtype=dtype)

    # -- public ---------------------------------------------------------------

    def context_kv(self, context_features: Any, ctx_start_pos: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per drafter layer, the context K (after k_norm and RoPE) and V, each
        [n_ctx, n_kv, head_dim]: what a feature ring holds per committed position."""
        with torch.no_grad():
            f = self._as_tensor(context_features, self.dtype)
            ctx = self._context(f)
            pos = torch.arange(ctx_start_pos, ctx_start_pos + f.shape[0])
            return [tuple(t.float().numpy().copy() for t in self._kv(il, ctx, pos)) for il in range(self.n_layer)]

    def hidden(self, block_tokens: Sequence[int], context_features: Any, ctx_start_pos: int = 0) -> torch.Tensor:
        """The final-normed drafter hidden states [B, H] (before lm_head)."""
        tokens = self._as_tensor(block_tokens, torch.long).view(-1)
        f = self._as_tensor(context_features, self.dtype)
        if f.ndim != 2 or f.shape[1] != len(self.target_layer_ids) * self.hidden_size:
            raise ValueError(f"context_features must be [n_ctx, {len(self.target_layer_ids)} * {self.hidden_size}], "
                             f"got {tuple(f.shape)}")
        n_ctx, n_block = f.shape[0], tokens.shape[0]
        ctx_pos = torch.arange(ctx_start_pos, ctx_start_pos + n_ctx)
        blk_pos = torch.arange(ctx_start_pos + n_ctx, ctx_start_pos + n_ctx + n_block)
        k_pos = torch.cat([ctx_pos, blk_pos])
        group = self.n_head // self.n_kv
        with torch.no_grad():
            x = self.embed_tokens[tokens] * self.input_embedding_scale
            ctx = self._context(f)
            for il in range(self.n_layer):
                p = f"layers.{il}."
                h = self._rms(x, self.w[p + "input_layernorm.weight"])
                q = self._lin(p + "self_attn.q_proj.weight", h).view(n_block, self.n_head, self.head_dim)
                q = self._rope(self._rms(q, self.w[p + "self_attn.q_norm.weight"]), blk_pos)
                k, v = self._kv(il, torch.cat([ctx, h]), k_pos)                        # [n_ctx + B, n_kv, d]
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)   # [n_head, B, n_ctx + B]
                mask = self._mask(il, blk_pos, k_pos)
                if mask is not None:
                    scores = scores.masked_fill(~mask[None], float("-inf"))
                a = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(n_block, -1)
                x = x + self._lin(p + "self_attn.o_proj.weight", a)
                h = self._rms(x, self.w[p + "post_attention_layernorm.weight"])
                g = self._lin(p + "mlp.gate_proj.weight", h)
                u = self._lin(p + "mlp.up_proj.weight", h)
                x = x + self._lin(p + "mlp.down_proj.weight", torch.nn.functional.silu(g) * u)
            return self._rms(x, self.w["norm.weight"])

    def forward(self, block_tokens: Sequence[int], context_features: Any, ctx_start_pos: int = 0) -> np.ndarray:
        """Drafter logits [B, vocab] (float32) for `block_tokens` at positions
        ctx_start_pos + n_ctx .. + B - 1, attending to `context_features`
        [n_ctx, n_taps * H] at positions ctx_start_pos .. + n_ctx - 1."""
        with torch.no_grad():
            logits = self.hidden(block_tokens, context_features, ctx_start_pos) @ self.lm_head.T
            logits = logits * self.output_multiplier
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logits.float().numpy().copy()

    __call__ = forward


# ---------------------------------------------------------------------------
# taps from an HF target
# ---------------------------------------------------------------------------

def target_taps(hf_target_model: torch.nn.Module, tokens: Sequence[int], target_layer_ids: Sequence[int]) -> np.ndarray:
    """The drafter's context features for `tokens`: HF `hidden_states[i + 1]`
    (the output of target layer i) for each i in target_layer_ids,
    concatenated per position in that order -> float32 [n_tokens, n_taps * H].

    Refuses the target's last layer: HF's hidden_states[n_layers] is the
    final-normed state, not that layer's output."""
    n_layers = int(hf_target_model.config.get_text_config().num_hidden_layers)
    bad = [i for i in target_layer_ids if not 0 <= i < n_layers - 1]
    if bad:
        raise ValueError(f"target_taps: layer ids {bad} outside 0..{n_layers - 2} (the last layer's HF hidden "
                         f"state is post-norm)")
    with torch.no_grad():
        out = hf_target_model(torch.tensor([list(tokens)], dtype=torch.long), output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[i + 1][0].float() for i in target_layer_ids], dim=-1).numpy().copy()
