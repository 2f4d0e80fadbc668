"""The DFlash drafter as a trainable PyTorch module (`DFlashDrafter`): the z-lab
`DFlashDraftModel` with the semantics of tests/reference/dflash_ref.py (context features through
`fc` and `hidden_norm`, per layer the block's Q/K/V beside the context's K/V, non-causal attention
over [context; block], the target's frozen embed_tokens and lm_head), with DFlash 2's and DSpark's
heads when its config has them (drafter_kinds.py). Its training recipe is in drafter.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..hf_formats import drafter_config
from .drafter_kinds import ConfidenceHead, DynamicConv, MarkovHead, Selector, check_kind, kind_config, kind_of

__all__ = ["DFlashDrafter"]

# ---------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------

class _RMSNorm(nn.Module):
    """Qwen3 RMSNorm: x / sqrt(mean(x^2) + eps) * w (plain w, not 1 + w)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, h: int, n_head: int, n_kv: int, head_dim: int, eps: float):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, head_dim
        self.q_proj = nn.Linear(h, n_head * head_dim, bias=False)
        self.k_proj = nn.Linear(h, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(h, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * head_dim, h, bias=False)
        self.q_norm = _RMSNorm(head_dim, eps)
        self.k_norm = _RMSNorm(head_dim, eps)


class _MLP(nn.Module):
    def __init__(self, h: int, ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, ff, bias=False)
        self.up_proj = nn.Linear(h, ff, bias=False)
        self.down_proj = nn.Linear(ff, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, h: int, ff: int, n_head: int, n_kv: int, head_dim: int, eps: float,
                 conv: tuple[int, int] | None = None):
        super().__init__()
        self.input_layernorm = _RMSNorm(h, eps)
        self.self_attn = _Attention(h, n_head, n_kv, head_dim, eps)
        self.post_attention_layernorm = _RMSNorm(h, eps)
        self.mlp = _MLP(h, ff)
        if conv is not None:  # DFlash 2: (kernel, group)
            self.attention_conv = DynamicConv(h, *conv)
            self.mlp_conv = DynamicConv(h, *conv)


def _rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer positions `pos` [...] (NeoX: both halves share a frequency)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim))
    ang = pos.to(torch.float64)[..., None] * inv_freq
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, T, heads, d]; cos / sin [S or 1, T, d]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos[:, :, None] + torch.cat([-x2, x1], -1) * sin[:, :, None]


_HEADS = ("candidate_selector.", "markov_head.", "confidence_head.")


class DFlashDrafter(nn.Module):
    """A z-lab DFlash drafter over a frozen target's embed_tokens / lm_head.

    `config` is the drafter's config.json (Qwen3 hparams + `dflash_config`);
    `embed_tokens` / `lm_head` [vocab, hidden] are the target's and are kept as
    non-persistent buffers: they are not trained and not saved. A DFlash 2 or DSpark config
    (drafter_kinds.kind_of) adds that kind's convolutions and selector, or Markov and
    confidence heads (train/drafter_kinds.py).
    """

    def __init__(self, config: Mapping[str, Any], embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        c = json.loads(json.dumps(dict(config)))
        dc = c.setdefault("dflash_config", {})
        self.config = c
        self.hidden_size = h = int(c["hidden_size"])
        self.n_layer = int(c["num_hidden_layers"])
        self.n_head = int(c["num_attention_heads"])
        self.n_kv = int(c.get("num_key_value_heads") or self.n_head)
        self.head_dim = int(c.get("head_dim") or h // self.n_head)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.target_layer_ids = [int(i) for i in dc["target_layer_ids"]]
        self.mask_token_id = int(dc["mask_token_id"])
        self.block_size = int(dc.get("block_size", 16))
        rope = dict(c.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"[DFlashDrafter] rope_type {rope.get('rope_type')!r} is not supported (default only)")
        self.rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        self.input_embedding_scale = float(dc.get("input_embedding_scale", c.get("input_embedding_scale", 1.0)))
        self.output_multiplier = float(dc.get("output_multiplier", c.get("output_multiplier", 1.0)))
        softcap = dc.get("final_logit_softcapping", c.get("final_logit_softcapping"))
        self.softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None
        if c.get("use_sliding_window") or c.get("is_causal") or dc.get("causal") or any(
                t != "full_attention" for t in c.get("layer_types") or []):
            raise ValueError("[DFlashDrafter] only non-causal full-attention drafters are supported")
        if self.n_head % self.n_kv:
            raise ValueError(f"[DFlashDrafter] num_attention_heads {self.n_head} is not a multiple of "
                             f"num_key_value_heads {self.n_kv}")
        if tuple(embed_tokens.shape[1:]) != (h,) or tuple(lm_head.shape[1:]) != (h,):
            raise ValueError(f"[DFlashDrafter] target embed_tokens {tuple(embed_tokens.shape)} / lm_head "
                             f"{tuple(lm_head.shape)} do not have the drafter's hidden size {h}")

        check_kind(c)
        self.kind = kind_of(c)
        # DSpark drafts from the anchor's row: rows 0 .. B-2 draft tokens 1 .. B-1
        self.first_draft_row = 0 if self.kind == "dspark" else 1
        self.block_rows = self.block_size - 1 + self.first_draft_row
        n_taps = len(self.target_layer_ids)
        ff = int(c["intermediate_size"])
        conv = (int(dc["conv_kernel_size"]), int(dc["conv_group_size"])) if self.kind == "dflash2" else None
        self.fc = nn.Linear(n_taps * h, h, bias=False)
        self.hidden_norm = _RMSNorm(h, self.eps)
        self.layers = nn.ModuleList(_Layer(h, ff, self.n_head, self.n_kv, self.head_dim, self.eps, conv)
                                    for _ in range(self.n_layer))
        self.norm = _RMSNorm(h, self.eps)
        self.register_buffer("embed_tokens", embed_tokens.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        n_vocab = int(c.get("vocab_size") or lm_head.shape[0])
        if self.kind == "dflash2":
            self.candidate_selector = Selector(h, n_vocab, int(dc["selector_rank"]), int(dc["selector_top_k"]), 0.02)
        if self.kind == "dspark":
            rank = int(c["markov_rank"])
            self.markov_head = MarkovHead(n_vocab, rank, 0.02)
            if c.get("confidence_head", True):
                self.confidence_head = ConfidenceHead(h, rank)

    # -- construction -----------------------------------------------------------

    @staticmethod
    def config_for_target(target_config: Any, *, target_layer_ids: Sequence[int], mask_token_id: int,
                          num_layers: int = 1, block_size: int = 16, kind: str = "dflash",
                          **overrides: Any) -> dict[str, Any]:
        """A drafter config.json of `kind` (drafter_kinds.KINDS) matching an HF target config
        (object or dict): hidden size, vocabulary, attention shape, FFN width, eps and RoPE base
        are the target's unless `overrides` says otherwise (a `dflash_config` override is merged
        into the generated one)."""
        t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        t = t.to_dict() if hasattr(t, "to_dict") else dict(t.get("text_config", t))
        n_target = int(t["num_hidden_layers"])
        bad = [i for i in target_layer_ids if not 0 <= int(i) < n_target - 1]
        if bad or not target_layer_ids:
            raise ValueError(f"[DFlashDrafter] target_layer_ids {list(target_layer_ids)} must be non-empty and "
                             f"in 0..{n_target - 2} (the last layer's HF hidden state is post-norm)")
        rope = t.get("rope_parameters") or {}
        h = int(t["hidden_size"])
        n_head = int(t["num_attention_heads"])
        cfg = drafter_config(vocab_size=t["vocab_size"], hidden_size=h, intermediate_size=t["intermediate_size"],
                             num_layers=num_layers, n_head=n_head, n_kv=int(t.get("num_key_value_heads") or n_head),
                             head_dim=int(t.get("head_dim") or h // n_head),
                             max_position_embeddings=t.get("max_position_embeddings", 4096),
                             rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                             rope_theta=rope.get("rope_theta", t.get("rope_theta", 10000.0)),
                             n_target_layers=n_target, mask_token_id=mask_token_id,
                             target_layer_ids=target_layer_ids, block_size=block_size, dtype="float32")
        overrides = dict(overrides)
        cfg["dflash_config"].update(overrides.pop("dflash_config", None) or {})
        cfg.update(overrides)
        if "num_hidden_layers" in overrides:
            cfg["layer_types"] = ["full_attention"] * int(cfg["num_hidden_layers"])
            cfg["max_window_layers"] = int(cfg["num_hidden_layers"])
        return kind_config(cfg, kind)

    @classmethod
    def for_target(cls, target: nn.Module, *, target_layer_ids: Sequence[int], mask_token_id: int,
                   num_layers: int = 1, block_size: int = 16, seed: int = 0, init_std: float = 0.02,
                   kind: str = "dflash", **overrides: Any) -> "DFlashDrafter":
        """A freshly initialised drafter of `kind` for an HF causal LM `target` (linear
        weights N(0, init_std), norms 1; the kinds' heads as drafter_kinds initialises them),
        sharing its embed_tokens / lm_head."""
        cfg = cls.config_for_target(target.config, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                    num_layers=num_layers, block_size=block_size, kind=kind, **overrides)
        embed, head = _target_embeddings(target)
        model = cls(cfg, embed, head)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():  # the kinds' heads keep their own inits (drafter_kinds)
                if p.ndim == 2 and not name.startswith(_HEADS) and "_conv." not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * init_std)
        return model

    @classmethod
    def from_pretrained(cls, drafter_dir: str | os.PathLike[str], target: nn.Module) -> "DFlashDrafter":
        """Load a z-lab style checkpoint (tensor names with or without `model.`)."""
        from safetensors.torch import load_file

        d = Path(drafter_dir)
        with open(d / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
        embed, head = _target_embeddings(target)
        model = cls(cfg, embed, head)
        state = load_file(str(d / "model.safetensors"))
        state = {k[len("model."):] if k.startswith("model.") else k: v.float() for k, v in state.items()}
        model.load_state_dict(state, strict=True)
        return model

    def save_pretrained(self, out_dir: str | os.PathLike[str]) -> Path:
        """config.json (`DFlashDraftModel`, `dflash_config`) and model.safetensors
        (fc, hidden_norm, norm, layers.N.*; no embed_tokens / lm_head)."""
        from safetensors.torch import save_file

        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "config.json", "w", encoding="utf-8") as f:
            json.dump(self.config, f, indent=2)
        state = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    # -- forward ----------------------------------------------------------------

    def hidden(self, features: torch.Tensor, block_tokens: torch.Tensor, block_pos: torch.Tensor,
               mask: torch.Tensor | None, ctx_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [S, M, H] of M block rows per sequence.

        features [S, L, n_taps*H]: context features at positions `ctx_pos` [S, L]
        (default 0..L-1); block_tokens / block_pos [S, M]; mask [S, M, L+M] bool
        (True = query row may attend to that key; keys are [context; block]) or
        None for all-visible (a single block over its whole context).
        """
        S, L = features.shape[:2]
        M = block_tokens.shape[1]
        dt = self.fc.weight.dtype
        if ctx_pos is None:
            ctx_pos = torch.arange(L, device=features.device).expand(S, L)
        x = self.embed_tokens[block_tokens].to(dt) * self.input_embedding_scale     # [S, M, H]
        ctx = self.hidden_norm(self.fc(features.to(dt)))                           # [S, L, H]
        cos_c, sin_c = _rope_cos_sin(ctx_pos, self.head_dim, self.rope_theta, dt)
        cos_b, sin_b = _rope_cos_sin(block_pos, self.head_dim, self.rope_theta, dt)
        attn_mask = None if mask is None else mask[:, None]                         # [S, 1, M, L+M]
        group = self.n_head // self.n_kv
        conv = self.kind == "dflash2"
        for layer in self.layers:
            a = layer.self_attn
            hb = layer.input_layernorm(x)
            if conv:  # DFlash 2: the block rows convolved before and after each sub-layer
                ca = layer.attention_conv.coefficients(hb)
                hb = layer.attention_conv(hb, ca, 0, self.block_rows)
            q = _rope(a.q_norm(a.q_proj(hb).view(S, M, self.n_head, self.head_dim)), cos_b, sin_b)
            kc = _rope(a.k_norm(a.k_proj(ctx).view(S, L, self.n_kv, self.head_dim)), cos_c, sin_c)
            kb = _rope(a.k_norm(a.k_proj(hb).view(S, M, self.n_kv, self.head_dim)), cos_b, sin_b)
            vc = a.v_proj(ctx).view(S, L, self.n_kv, self.head_dim)
            vb = a.v_proj(hb).view(S, M, self.n_kv, self.head_dim)
            k = torch.cat([kc, kb], 1).transpose(1, 2)                              # [S, n_kv, L+M, d]
            v = torch.cat([vc, vb], 1).transpose(1, 2)
            if group > 1:  # query head j reads KV head j // group
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=attn_mask)   # [S, n_head, M, d]
            o = a.o_proj(o.transpose(1, 2).reshape(S, M, self.n_head * self.head_dim))
            x = x + (layer.attention_conv(o, ca, 1, self.block_rows) if conv else o)
            f = layer.post_attention_layernorm(x)
            if conv:
                cm = layer.mlp_conv.coefficients(f)
                x = x + layer.mlp_conv(layer.mlp(layer.mlp_conv(f, cm, 0, self.block_rows)), cm, 1, self.block_rows)
            else:
                x = x + layer.mlp(f)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """The draft head of rows hidden [n, H]: lm_head, DSpark's Markov bias after the tokens
        prev [n] (required for a DSpark drafter), then the output multiplier and soft cap."""
        out = hidden @ self.lm_head.to(hidden.dtype).T
        if self.kind == "dspark":
            if prev is None:
                raise ValueError("[DFlashDrafter] a DSpark drafter's logits need the previous tokens")
            out = out + self.markov_head.bias(prev)[0]
        out = out * self.output_multiplier
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def block_drafts(self, rows: torch.Tensor, anchor: int) -> tuple[list[int], torch.Tensor]:
        """The greedy drafts of one block's drafting rows (hidden [B-1, H]) after `anchor`, as
        the engine drafts them, and the logits they came from [B-1, V]: the argmax (DFlash), the
        selector's path (DFlash 2), or the Markov chain (DSpark, each row biased by the draft
        before it)."""
        if self.kind == "dspark":
            toks, out, prev = [], [], int(anchor)
            for r in range(rows.shape[0]):
                out.append(self.logits(rows[r:r + 1], torch.tensor([prev]))[0])
                prev = int(out[-1].argmax())
                toks.append(prev)
            return toks, torch.stack(out)
        logits = self.logits(rows)
        if self.kind == "dflash2":
            return self.candidate_selector.walk(rows, logits, anchor), logits
        return logits.argmax(-1).tolist(), logits

    def block_hidden(self, block_tokens: Sequence[int], context_features: Any, ctx_start_pos: int = 0) -> torch.Tensor:
        """Hidden states [R, H] of one block of R rows at positions ctx_start_pos + n_ctx ..,
        attending to all of `context_features` [n_ctx, n_taps*H] (positions ctx_start_pos ..)."""
        f = torch.as_tensor(context_features, dtype=torch.float32)[None]
        n_ctx = f.shape[1]
        tokens = torch.as_tensor(list(block_tokens), dtype=torch.long)[None]
        blk_pos = torch.arange(ctx_start_pos + n_ctx, ctx_start_pos + n_ctx + tokens.shape[1])[None]
        ctx_pos = torch.arange(ctx_start_pos, ctx_start_pos + n_ctx)[None]
        return self.hidden(f, tokens, blk_pos, None, ctx_pos)[0]

    def draft_logits(self, block_tokens: Sequence[int], context_features: Any, ctx_start_pos: int = 0) -> torch.Tensor:
        """Logits [B, vocab] of one DFlash block: `block_hidden`'s rows through the head
        (DFlashRef.forward's contract)."""
        return self.logits(self.block_hidden(block_tokens, context_features, ctx_start_pos))

    def draft(self, anchor: int, context_features: Any, ctx_start_pos: int = 0) -> list[int]:
        """The B-1 greedy drafts after `anchor` (`block_drafts` on the block [anchor, MASK...])."""
        rows = self.block_hidden([int(anchor)] + [self.mask_token_id] * (self.block_rows - 1), context_features,
                                 ctx_start_pos)
        return self.block_drafts(rows[self.first_draft_row:], anchor)[0]


def _target_embeddings(target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    embed = target.get_input_embeddings().weight.detach()
    out = target.get_output_embeddings()
    head = embed if out is None else out.weight.detach()
    return embed, head


# ---------------------------------------------------------------------------
# data: greedy continuations and taps from the HF target
# ---------------------------------------------------------------------------

