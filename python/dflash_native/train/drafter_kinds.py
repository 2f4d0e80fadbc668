"""The extra heads of the DFlash 2 and DSpark drafters, trainable, with their losses.

The graphs are llama.cpp's (src/models/dflash.cpp, which csrc/models/dflash.cpp follows), in
the z-lab / SpecForge checkpoint layout that convert_dflash.py reads:

- DFlash 2 (`DFlash2DraftModel`, dflash_config conv_kernel_size K, conv_group_size g,
  selector_rank R, selector_top_k k). Per layer two `DynamicConv`s (attention_conv, mlp_conv):
  a causal depthwise convolution along the block's rows, tap t of row i reading row i - t of
  the same block (zero before its start), weight = base_kernel[side, t] (per channel) +
  kernel_projection(x_i)[side, t, group] (per token and channel group). Side 0 convolves the
  sub-layer's normed input, side 1 its output, both with the coefficients of the input. The
  `Selector` (candidate_selector) scores, for block row r, its top-k candidates c_j given the
  predecessor token p (the anchor for the first draft, else the path's previous token):
  score_j = logit(c_j) + successor[c_j] . (predecessor[p] * hidden_projection(h_r)); the draft
  is the greedy path (walk_lattice in the engine).
- DSpark (`DSparkDraftModel`, vanilla Markov head, sample_from_anchor): the block is
  [anchor, MASK x (B-2)] and row r drafts token r + 1 (`first_draft_row` 0); each row's logits
  get + markov_w2(markov_w1[prev_r]), prev_0 the anchor and prev_r the previous draft (greedy
  chain). The optional confidence head is sigmoid(proj [h_r; markov_w1[prev_r]] + b).

Losses (teacher-forced: the previous token is the sequence's own, which is the drafted one
whenever the row can still be accepted):
- DFlash 2: the DFlash block loss on the lm_head logits (the convolutions train through it)
  plus `selector_loss`: cross-entropy over each labelled row's top-k lattice row, target the
  sequence's token, predecessor the sequence's previous token, for the rows whose token is
  among the k candidates (the others cannot be drafted by the selector), position-weighted.
- DSpark: the DFlash block loss on the Markov-biased logits, plus `confidence_loss`: binary
  cross-entropy of the confidence against "the biased logits' argmax is the row's token" (the
  row's acceptance given an accepted prefix), on detached inputs so that it does not move the
  drafter.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..convert_dflash import DFLASH2_KEYS
from ..hf_formats import set_drafter_kind

__all__ = ["KINDS", "DynamicConv", "MarkovHead", "Selector", "confidence_loss", "kind_config", "kind_of",
           "selector_loss"]

KINDS = ("dflash", "dflash2", "dspark")
# dflash_config of a trained DFlash 2 drafter unless given (the group size is capped at the hidden size)
DFLASH2_TRAIN_DEFAULTS: Mapping[str, int] = {"conv_kernel_size": 2, "conv_group_size": 64, "selector_rank": 64,
                                             "selector_top_k": 8}
DSPARK_MARKOV_RANK = 64


def kind_of(config: Mapping[str, Any]) -> str:
    """'dflash2' when dflash_config has the selector keys, 'dspark' for a DSpark export, else 'dflash'."""
    if any(k in (config.get("dflash_config") or {}) for k in DFLASH2_KEYS):
        return "dflash2"
    if any("DSpark" in a for a in config.get("architectures") or []) or "markov_rank" in config:
        return "dspark"
    return "dflash"


def kind_config(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """`config` (a DFlash drafter's config.json) made a `kind` drafter's: architectures, DFlash 2's
    four dflash_config sizes (DFLASH2_TRAIN_DEFAULTS where not given) or DSpark's Markov rank,
    confidence head and anchor-first block (where not given)."""
    if kind not in KINDS:
        raise ValueError(f"[train_drafter] kind must be one of {KINDS}, got {kind!r}")
    h = int(config["hidden_size"])
    sizes = {k: min(v, h) if k == "conv_group_size" else v for k, v in DFLASH2_TRAIN_DEFAULTS.items()}
    set_drafter_kind(config, kind, dflash2=sizes, markov_rank=DSPARK_MARKOV_RANK, where="train_drafter")
    if kind == "dspark":
        config.setdefault("sample_from_anchor", True)
    return config


def check_kind(config: Mapping[str, Any]) -> None:
    """DFlash 2's sizes as llama.cpp's loader checks them; DSpark's head options this trainer has."""
    kind, h = kind_of(config), int(config["hidden_size"])
    if kind == "dflash2":
        dc = config["dflash_config"]
        missing = [k for k in DFLASH2_KEYS if k not in dc]
        if missing:
            raise ValueError(f"[DFlashDrafter] a DFlash 2 drafter needs dflash_config {missing}")
        if any(not isinstance(dc[k], int) or dc[k] <= 0 for k in DFLASH2_KEYS):
            raise ValueError(f"[DFlashDrafter] dflash_config {[dc[k] for k in DFLASH2_KEYS]} must be positive ints")
        if h % dc["conv_group_size"]:
            raise ValueError(f"[DFlashDrafter] hidden_size {h} is not a multiple of conv_group_size "
                             f"{dc['conv_group_size']}")
        if h < dc["selector_top_k"] * (dc["selector_top_k"] + 1):
            raise ValueError(f"[DFlashDrafter] hidden_size {h} < selector_top_k * (selector_top_k + 1) (llama.cpp's "
                             f"selector lattice rows)")
    if kind == "dspark":
        if config.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"[DFlashDrafter] markov_head_type {config['markov_head_type']!r}: only 'vanilla'")
        if config.get("sample_from_anchor", True) is not True:
            raise ValueError("[DFlashDrafter] only anchor-first DSpark drafters (sample_from_anchor true) are trained")
        if config.get("draft_vocab"):
            raise ValueError("[DFlashDrafter] a DSpark drafter drafts over the whole vocabulary (no draft_vocab)")
    if kind == "dflash2" and config.get("draft_vocab"):
        raise ValueError("[DFlashDrafter] a DFlash 2 drafter drafts over the whole vocabulary (no draft_vocab)")


# ---------------------------------------------------------------------------
# DFlash 2
# ---------------------------------------------------------------------------

class DynamicConv(nn.Module):
    """Block-local causal depthwise convolution with static per-channel and per-token
    per-group taps (HF `attention_conv` / `mlp_conv`). Starts as the identity (tap 0 = 1, the
    other taps and the projection 0), so a fresh DFlash 2 drafter drafts as DFlash does."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.n_groups, self.group = kernel, hidden // group, group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)                                         # [2, K, H]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.n_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, M, H] -> the per-token taps [S, M, 2, K, n_groups]."""
        return self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, self.n_groups)

    def forward(self, x: torch.Tensor, coeffs: torch.Tensor, side: int, rows: int) -> torch.Tensor:
        """x [S, M, H] (M = blocks of `rows` rows), coeffs from `coefficients` -> [S, M, H]."""
        S, M, H = x.shape
        xb = x.view(S, M // rows, rows, H)
        c = coeffs[:, :, side].view(S, M // rows, rows, self.kernel, self.n_groups, 1)
        base = self.base_kernel[side].view(self.kernel, self.n_groups, self.group)
        out = torch.zeros_like(xb)
        for t in range(min(self.kernel, rows)):
            prev = F.pad(xb[:, :, :rows - t], (0, 0, t, 0))                          # row i reads row i - t
            w = (c[:, :, :, t] + base[t]).reshape(S, M // rows, rows, H)
            out = out + w * prev
        return out.view(S, M, H)


class Selector(nn.Module):
    """DFlash 2's candidate selector (HF `candidate_selector`): token codebooks [V, R] for the
    predecessor and the successor and hidden_projection [R, H]."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int, init_std: float):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * rank ** -0.25)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * rank ** -0.25)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=init_std)

    def scores(self, h: torch.Tensor, logits: torch.Tensor, pred: torch.Tensor,
               cand: torch.Tensor) -> torch.Tensor:
        """[n, k]: the scores of candidates cand [n, k] of rows with hidden h [n, H] and logits
        [n, V] after predecessor tokens pred [n]."""
        cond = self.predecessor_codebook[pred] * self.hidden_projection(h)           # [n, R]
        return logits.gather(1, cand) + torch.einsum("nr,nkr->nk", cond, self.successor_codebook[cand])

    def walk(self, h: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
        """The greedy path of one block's draft rows (h [n, H], logits [n, V]) after `anchor`."""
        cand = logits.topk(self.top_k, -1).indices
        out, pred = [], int(anchor)
        for r in range(h.shape[0]):
            s = self.scores(h[r:r + 1], logits[r:r + 1], torch.tensor([pred]), cand[r:r + 1])[0]
            pred = int(cand[r, int(s.argmax())])
            out.append(pred)
        return out


def selector_loss(selector: Selector, h: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  prev: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Position-weighted CE of the lattice rows (h [n, H], logits [n, V], label and predecessor
    tokens [n], weights w [n]) whose label is one of the top-k candidates; returns (loss, the
    share of rows that had it). h and the logits are detached: the selector learns to rerank
    what the backbone proposes, and the backbone learns from the block loss alone."""
    h, logits = h.detach(), logits.detach()
    cand = logits.topk(selector.top_k, -1).indices                                   # [n, k]
    hit = cand == labels[:, None]
    keep = hit.any(-1)
    if not bool(keep.any()):
        return selector.successor_codebook.sum() * 0.0, 0.0
    s = selector.scores(h[keep], logits[keep], prev[keep], cand[keep])
    ce = F.cross_entropy(s, hit[keep].float().argmax(-1), reduction="none")
    return (w[keep] * ce).sum() / w[keep].sum(), float(keep.float().mean())


# ---------------------------------------------------------------------------
# DSpark
# ---------------------------------------------------------------------------

class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head (HF `markov_head`): markov_w1 [V, R] embeds the previous
    token, markov_w2 [V, R] maps it to a logit bias. markov_w2 starts at 0 (no bias)."""

    def __init__(self, vocab: int, rank: int, init_std: float):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=max(init_std, rank ** -0.5))
        nn.init.zeros_(self.markov_w2.weight)

    def bias(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [n] -> (the logit bias [n, V], markov_w1[prev] [n, R])."""
        e = self.markov_w1(prev)
        return self.markov_w2(e), e


class ConfidenceHead(nn.Module):
    """DSpark's confidence head (HF `confidence_head.proj` [1, H + R] with bias)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The acceptance logit [n] of rows h [n, H] after previous-token embeddings e [n, R]."""
        return self.proj(torch.cat([h, e], -1))[:, 0]


def confidence_loss(head: ConfidenceHead, h: torch.Tensor, e: torch.Tensor, logits: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
    """BCE of the confidence against `argmax(logits) == labels`, on detached inputs."""
    accepted = (logits.detach().argmax(-1) == labels).float()
    return F.binary_cross_entropy_with_logits(head(h.detach(), e.detach()), accepted)
