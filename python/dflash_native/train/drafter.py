"""Training a DFlash drafter (arXiv 2602.06036) against a frozen Hugging Face target.

`DFlashDrafter` is the z-lab drafter (`DFlashDraftModel`) as a trainable
PyTorch module with the semantics of tests/reference/dflash_ref.py: context
features = the target's hidden states at `target_layer_ids` (HF
`hidden_states[i + 1]`), `ctx = hidden_norm(fc(features))`; per layer the
block's Q/K/V come from `input_layernorm(x)`, the context's K/V from `ctx`
(no norm), q_norm / k_norm, NeoX RoPE at absolute positions, non-causal
attention over [context; block], SwiGLU MLP; `norm` then the TARGET's frozen
lm_head (the block embeds with the target's frozen embed_tokens).

The objective (the paper's): on the target's own greedy continuations, pick
random anchor positions a; the block is `[x_a, MASK x (B-1)]` at positions
a .. a+B-1, it sees the context features of positions < a and itself
(bidirectionally), and block row i (1..B-1) is trained to predict x_{a+i}
with cross-entropy weighted by w_i = exp(-(i-1)/gamma), normalised over the
labelled rows. All anchors of all sequences in a batch run in one forward:
per sequence the queries are the N*B block rows, the keys are the L
context positions (K/V computed once per layer and shared by every anchor)
followed by the N*B block rows, under a boolean mask that is a prefix of the
context (positions < a_j; with a `window` W only a_j - W <= p < a_j, the
engine's drafter window) plus the anchor's own block (block-diagonal). The
checkpoint records the most context positions a block attended to
(dflash_config.trained_context_length): the engine's default drafter window.

`train_drafter` runs the whole recipe: load the target, generate its greedy
continuations, tap the hidden states once per sequence, train with AdamW and
write a z-lab style checkpoint (config.json + model.safetensors, the layout
`convert_dflash.convert_dflash_to_gguf` reads) and `recipe.json`.

`kind="dflash2"` / `"dspark"`: the same module with DFlash 2's convolutions and selector or
DSpark's anchor-first block, Markov and confidence heads, and their losses (train/drafter_kinds.py).

The module itself is in drafter_model.py (re-exported here). This file stays over 600 lines on
purpose: it is one recipe (data, objective, the training loop, the checkpoint), read top to bottom.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..hf_formats import (MASK_TOKEN_TEXT, MAX_TRAINED_CONTEXT, TRAINED_CONTEXT_KEY, default_target_layer_ids,
                          mask_token_id_of)
from .drafter_kinds import KINDS, confidence_loss, kind_of, selector_loss
from .drafter_model import DFlashDrafter
from .schedule import warmup_cosine_lr

__all__ = ["DFlashDrafter", "TrainResult", "block_batch", "context_window_mask", "distill_kl", "dflash_loss",
           "greedy_continuations", "target_features", "train_drafter"]

IGNORE = -100


def greedy_continuations(target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         seed: int = 0, stop_at_eos: bool = False) -> list[list[int]]:
    """prompt + the target's greedy continuation (argmax of its logits, with its
    KV / recurrent cache), `max_new_tokens` tokens per prompt, one prompt at a
    time (no padding, so hybrid GDN targets are exact). No generation_config
    processor touches the logits; with `stop_at_eos` a continuation ends after
    the first EOS token (the target config's eos_token_id), else it runs on."""
    torch.manual_seed(seed)  # greedy is deterministic; the seed pins anything a target might sample
    eos: set[int] = set()
    if stop_at_eos:
        e = getattr(target.config.get_text_config(), "eos_token_id", None)
        eos = set(e) if isinstance(e, (list, tuple)) else ({int(e)} if e is not None else set())
    out: list[list[int]] = []
    with torch.no_grad():
        for p in prompts:
            seq = [int(t) for t in p]
            if not seq:
                raise ValueError("[greedy_continuations] empty prompt")
            res = target(torch.tensor([seq], dtype=torch.long), use_cache=True)
            for _ in range(max_new_tokens):
                nxt = int(res.logits[0, -1].argmax())
                seq.append(nxt)
                if nxt in eos or len(seq) - len(p) == max_new_tokens:
                    break
                res = target(torch.tensor([[nxt]], dtype=torch.long), past_key_values=res.past_key_values,
                             use_cache=True)
            out.append(seq)
    return out


def target_features(target: nn.Module, tokens: Sequence[int], target_layer_ids: Sequence[int], *,
                    final: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """float32 [n_tokens, n_taps*H]: HF hidden_states[i + 1] for i in target_layer_ids, concatenated.
    With `final`, also the final (post-norm) hidden state [n_tokens, H], whose product with the
    lm_head is the target's logits: the soft labels of the distillation term at H floats a token."""
    with torch.no_grad():
        out = target(torch.tensor([list(tokens)], dtype=torch.long), output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1][0].float() for i in target_layer_ids], -1)
    return (taps, out.hidden_states[-1][0].float()) if final else taps


# ---------------------------------------------------------------------------
# the objective
# ---------------------------------------------------------------------------

def block_batch(tokens: Sequence[Sequence[int]], anchors: Sequence[Sequence[int]], block_size: int,
                mask_token_id: int, window: int | None = None,
                ctx_start: Sequence[int] | None = None, first_draft_row: int = 1) -> dict[str, torch.Tensor]:
    """The tensors of one training forward for S sequences with N anchors each
    (a sequence with fewer anchors is padded with dummy blocks whose labels are
    ignored).

    block_tokens / block_pos / labels [S, N*B]: row j*B+i is block j's row i,
    token x_a (i = 0) or MASK, position a+i, label x_{a+i} for i >= 1 while a+i
    is inside the sequence (else IGNORE; row 0 is always IGNORE).
    ctx_pos [S, L]: the context positions the features cover, ctx_start[s] + 0..L-1 (default
    from 0; a later start skips positions no window reaches, L = the longest len - start).
    mask [S, N*B, L+N*B]: context key p visible iff p < a_j (and a_j - window <= p
    with a `window`: `context_window_mask`); block keys of the same block only.
    prev [S, N*B]: for each labelled row the sequence's token before its label (the anchor for
    the first), what DFlash 2's selector and DSpark's Markov head condition on.
    `first_draft_row` 0 (DSpark): blocks of B-1 rows [x_a, MASK x (B-2)] at positions a ..
    a+B-2, row i labelled x_{a+i+1}; everything above holds with B-1 rows for B.
    """
    first = int(first_draft_row)
    B = block_size - 1 + first
    S = len(tokens)
    start = torch.zeros(S, dtype=torch.long) if ctx_start is None else torch.as_tensor(list(ctx_start), dtype=torch.long)
    L = max(len(t) - int(st) for t, st in zip(tokens, start))
    N = max(1, max(len(a) for a in anchors))
    block_tokens = torch.full((S, N * B), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros((S, N * B), dtype=torch.long)
    labels = torch.full((S, N * B), IGNORE, dtype=torch.long)
    prev = torch.zeros((S, N * B), dtype=torch.long)
    anchor_t = torch.zeros((S, N), dtype=torch.long)
    for s, (seq, anc) in enumerate(zip(tokens, anchors)):
        seq_t = torch.as_tensor(list(seq), dtype=torch.long)
        for j, a in enumerate(anc):
            if not 1 <= a < len(seq) - 1:
                raise ValueError(f"[block_batch] anchor {a} outside 1..{len(seq) - 2} for a sequence of {len(seq)}")
            if (0 if window is None else max(0, a - window)) < start[s]:
                raise ValueError(f"[block_batch] anchor {a} sees context before ctx_start {int(start[s])}")
            anchor_t[s, j] = a
            r = j * B
            block_tokens[s, r] = seq_t[a]
            block_pos[s, r:r + B] = torch.arange(a, a + B)
            n_lab = min(block_size - 1, len(seq) - 1 - a)
            labels[s, r + first:r + first + n_lab] = seq_t[a + 1:a + 1 + n_lab]
            prev[s, r + first:r + first + n_lab] = seq_t[a:a + n_lab]
        for j in range(len(anc), N):  # dummy blocks: position 0, token MASK, no context, no labels
            block_pos[s, j * B:(j + 1) * B] = torch.arange(B)
    ctx_pos = start[:, None] + torch.arange(L)                                                   # [S, L]
    ctx_vis = context_window_mask(anchor_t.repeat_interleave(B, 1), ctx_pos, window)            # [S, N*B, L]
    blk = torch.arange(N * B) // B
    blk_vis = (blk[:, None] == blk[None, :]).expand(S, N * B, N * B)
    return {"block_tokens": block_tokens, "block_pos": block_pos, "labels": labels, "ctx_pos": ctx_pos,
            "mask": torch.cat([ctx_vis, blk_vis], -1), "prev": prev}


def context_window_mask(anchors: torch.Tensor, ctx_pos: torch.Tensor | int, window: int | None) -> torch.Tensor:
    """bool [*anchors.shape, L]: context position p is visible to a block anchored at a iff
    a - window <= p < a (p < a without a window). `ctx_pos`: the positions [S, L] of the
    context features (an int n: positions 0..n-1). The engine's ring window is the same set:
    a draft at n_past = a attends to the committed positions >= n_past - window, every block
    row alike (csrc/spec/spec.cpp run_draft), so training and inference see the same context."""
    p = torch.arange(ctx_pos) if isinstance(ctx_pos, int) else ctx_pos[:, None, :]
    a = anchors[..., None]
    vis = p < a
    if window is not None:
        vis &= p >= a - int(window)
    return vis


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[B]: 0 for row 0, exp(-(i-1)/gamma) for row i >= 1 (all 1 when gamma is None)."""
    i = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if gamma is None else torch.exp(-(i - 1) / float(gamma))
    w[0] = 0.0
    return w


def distill_kl(target_logits: torch.Tensor, drafter_logits: torch.Tensor,
               vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[n]: KL(p_target || p_drafter) per row at temperature 1, p = softmax over the last axis of
    logits [n, V], restricted to and renormalised over the token ids `vocab` when given (the
    drafter's draft vocabulary: the tokens it can propose)."""
    if vocab is not None:
        target_logits, drafter_logits = target_logits[:, vocab], drafter_logits[:, vocab]
    log_t = F.log_softmax(target_logits.float(), -1)
    log_d = F.log_softmax(drafter_logits.float(), -1)
    return (log_t.exp() * (log_t - log_d)).sum(-1)


def dflash_loss(drafter: DFlashDrafter, features: torch.Tensor, batch: Mapping[str, torch.Tensor],
                gamma: float | None, *, target_hidden: torch.Tensor | None = None, w_ce: float = 1.0,
                w_kl: float = 0.0, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Position-weighted block loss over every labelled block row of `batch` (from
    `block_batch`) given context `features` [S, L, n_taps*H]: w_ce * CE(label) + w_kl *
    KL(p_target || p_drafter) per row, weighted by w_i and normalised by sum w_i.
    `target_hidden` [n, H] (needed when w_kl > 0): the target's final hidden state at the position
    before each labelled row (row-major order of labels != IGNORE), so target_hidden @ lm_head.T
    are the logits the target predicted that row's token with; `vocab`: see `distill_kl`.
    A DSpark drafter's logits are Markov-biased by each row's `prev` token (teacher forcing), and
    its confidence head adds `confidence_loss`; a DFlash 2 drafter adds `selector_loss` (both
    in drafter_kinds). Returns (loss, stats): stats has the unweighted mean CE (and KL, the
    selector's / confidence's loss) and the top-1 accuracy over labelled rows."""
    R = drafter.block_rows
    labels = batch["labels"]
    hidden = drafter.hidden(features, batch["block_tokens"], batch["block_pos"], batch["mask"], batch.get("ctx_pos"))
    valid = labels != IGNORE                                                       # [S, N*R]
    rows = hidden[valid]                                                           # [n, H]: only labelled rows
    prev = batch["prev"][valid]                                                    # [n]
    logits = drafter.logits(rows, prev if drafter.kind == "dspark" else None)
    ce = F.cross_entropy(logits, labels[valid], reduction="none")
    w = position_weights(drafter.block_size, gamma)[1 - drafter.first_draft_row:]
    w = w.repeat(labels.shape[1] // R)[None].expand_as(labels)[valid]
    per_row = w_ce * ce
    stats: dict[str, float] = {}
    if w_kl:
        if target_hidden is None or target_hidden.shape[0] != rows.shape[0]:
            raise ValueError(f"[dflash_loss] w_kl > 0 needs target_hidden with one row per labelled row "
                             f"({rows.shape[0]})")
        with torch.no_grad():
            target_logits = target_hidden.to(rows.dtype) @ drafter.lm_head.to(rows.dtype).T   # [n, vocab]
        kl = distill_kl(target_logits, logits, vocab)
        per_row = per_row + w_kl * kl
        stats["kl"] = kl.mean().item()
    loss = (w * per_row).sum() / w.sum()
    if drafter.kind == "dflash2":
        sel, stats["selector_hit"] = selector_loss(drafter.candidate_selector, rows, logits, labels[valid], prev, w)
        loss = loss + sel
        stats["selector"] = sel.item()
    if hasattr(drafter, "confidence_head"):
        conf = confidence_loss(drafter.confidence_head, rows, drafter.markov_head.bias(prev)[1], logits, labels[valid])
        loss = loss + conf
        stats["confidence"] = conf.item()
    with torch.no_grad():
        acc = (logits.argmax(-1) == labels[valid]).float().mean().item()
    return loss, {"ce": ce.mean().item(), "acc": acc, "n_rows": int(valid.sum()), **stats}


def draft_vocabulary(continuations: Sequence[Sequence[int]], size: int) -> list[int]:
    """The `size` most frequent tokens of `continuations` (ties: the smaller id), ascending: what
    the target writes where the drafter drafts. Fewer when fewer distinct tokens occur."""
    counts = collections.Counter(int(t) for seq in continuations for t in seq)
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(top)


def _anchor_range(n_tokens: int, min_anchor: int) -> range:
    return range(max(1, min_anchor), n_tokens - 1)


def acceptance_on(drafter: DFlashDrafter, tokens: Sequence[Sequence[int]], features: Sequence[torch.Tensor] | "_Features",
                  anchors: Sequence[Sequence[int]], window: int | None = None) -> float:
    """Mean acceptance length (1 + leading drafts equal to the sequence's next tokens; 1..B)
    of the drafter's greedy blocks at `anchors` (`DFlashDrafter.block_drafts`: the argmax, the
    selector's path or the Markov chain), where the sequences are the target's greedy
    continuations. `features`: per sequence its taps from position 0 (a list of tensors) or a
    `_Features`."""
    B, R, first = drafter.block_size, drafter.block_rows, drafter.first_draft_row
    feats = features if isinstance(features, _Features) else _Features(list(features), [0] * len(features))
    total, n = 0.0, 0
    with torch.no_grad():
        for i, (seq, anc) in enumerate(zip(tokens, anchors)):
            if not anc:
                continue
            start = _ctx_start(anc, window)
            batch = block_batch([seq], [anc], B, drafter.mask_token_id, window, [start], first)
            f = feats.window(i, start, batch["ctx_pos"].shape[1])[None]
            hid = drafter.hidden(f, batch["block_tokens"], batch["block_pos"], batch["mask"], batch["ctx_pos"])
            hid = hid[0].view(-1, R, hid.shape[-1])[:, first:]                    # [N, B-1, H]: the drafting rows
            lab = batch["labels"][0].view(-1, R)[:, first:]
            for j in range(len(anc)):
                pred = drafter.block_drafts(hid[j], seq[anc[j]])[0]
                k = 1
                while k < B and lab[j, k - 1] != IGNORE and pred[k - 1] == lab[j, k - 1]:
                    k += 1
                total += k
                n += 1
    return total / max(n, 1)


def _ctx_start(anchors: Sequence[int], window: int | None) -> int:
    """The first context position any of `anchors` sees under `window` (0 without one)."""
    return 0 if window is None else max(0, min(anchors) - int(window))


@dataclass
class _Features:
    """The target's taps of every training sequence, kept only from `offsets[i]` on: with a
    window W, anchors from m on never see positions before m - W, so a 4K-token sequence whose
    continuation starts at m keeps W + its continuation rows (1536 x 4K full rows would be
    ~30 GB at 4 taps x 320 floats)."""
    rows: list[torch.Tensor]     # float32 [n_i - offsets[i], n_taps*H]
    offsets: list[int]
    finals: list[torch.Tensor] | None = None  # float32 [n_i - offsets[i], H]: the target's final hidden state

    @classmethod
    def of(cls, target: nn.Module, data: Sequence[Sequence[int]], min_anchor: Sequence[int],
           target_layer_ids: Sequence[int], window: int | None, log_every: int = 0,
           final: bool = False) -> "_Features":
        """With `final`, also the final hidden states (the distillation term's soft labels)."""
        rows, offsets, finals = [], [], []
        for i, (seq, m) in enumerate(zip(data, min_anchor)):
            off = _ctx_start([m], window)
            taps = target_features(target, seq, target_layer_ids, final=final)
            if final:
                taps, last = taps
                finals.append(last[off:].clone())
            rows.append(taps[off:].clone())
            offsets.append(off)
            if log_every and (i + 1) % (50 * log_every) == 0:
                print(f"[train_drafter] target taps of {i + 1}/{len(data)} sequences", flush=True)
        return cls(rows, offsets, finals if final else None)

    def final_at(self, i: int, positions: torch.Tensor) -> torch.Tensor:
        """[n, H]: sequence i's final hidden states at `positions` [n]."""
        if self.finals is None:
            raise ValueError("[train_drafter] the target's final hidden states were not kept")
        return self.finals[i][positions - self.offsets[i]]

    def window(self, i: int, start: int, n: int) -> torch.Tensor:
        """[n, n_taps*H]: sequence i's taps at positions start .. start+n-1, zero past its end."""
        lo = start - self.offsets[i]
        if lo < 0:
            raise ValueError(f"[train_drafter] taps of sequence {i} start at {self.offsets[i]}, asked from {start}")
        f = self.rows[i][lo:lo + n]
        return F.pad(f, (0, 0, 0, n - f.shape[0]))


# ---------------------------------------------------------------------------
# the recipe
# ---------------------------------------------------------------------------

@dataclass
class TrainResult:
    losses: list[float]                 # weighted loss per step
    accuracies: list[float]             # top-1 accuracy of the labelled block rows per step
    checkpoint: Path
    recipe: Path
    steps_per_s: float
    anchors_per_s: float
    acceptance_before: float            # mean acceptance length on the training anchors, before / after
    acceptance_after: float
    extra: dict[str, Any] = field(default_factory=dict)


def _load_target(target: str | os.PathLike[str] | nn.Module) -> nn.Module:
    if isinstance(target, nn.Module):
        return target.eval()
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def _default_mask_token_id(target_dir: Path | None) -> int:
    if target_dir is not None and (target_dir / "tokenizer.json").is_file():
        try:
            return mask_token_id_of(target_dir)
        except ValueError:
            pass
    raise ValueError(f"[train_drafter] mask_token_id not given and the target's tokenizer has no {MASK_TOKEN_TEXT} "
                     f"token")


# Long by its interface: the signature (one keyword per recipe setting) and the docstring that
# documents each take half its lines; the body is the pipeline's steps, each a call.
def train_drafter(target_dir: str | os.PathLike[str] | nn.Module, out_dir: str | os.PathLike[str], *,
                  prompts: Sequence[Sequence[int] | str] | None = None,
                  sequences: Sequence[Sequence[int]] | None = None,
                  sequence_prompt_lengths: Sequence[int] | None = None,
                  max_new_tokens: int = 64,
                  target_layer_ids: Sequence[int] | None = None,
                  num_layers: int = 1,
                  block_size: int = 16,
                  mask_token_id: int | None = None,
                  anchors_per_seq: int = 8,
                  seqs_per_step: int = 4,
                  steps: int = 100,
                  lr: float = 3e-3,
                  weight_decay: float = 0.0,
                  warmup: int = 10,
                  grad_clip: float = 1.0,
                  gamma: float | None = 7.0,
                  seed: int = 0,
                  n_threads: int | None = None,
                  init_std: float = 0.02,
                  drafter_overrides: Mapping[str, Any] | None = None,
                  draft_vocab_size: int = 0,
                  context_length: int | None = None,
                  window: int | None = None,
                  w_ce: float = 1.0,
                  w_kl: float = 0.0,
                  init_from: str | os.PathLike[str] | None = None,
                  kind: str = "dflash",
                  log_every: int = 0) -> TrainResult:
    """Train a DFlash drafter for the HF target in `target_dir` (or a loaded
    causal LM) and write it to `out_dir` (config.json, model.safetensors,
    recipe.json).

    Data: `sequences` (token ids the target produced; anchors anywhere, or from
    `sequence_prompt_lengths[i]` on when given) and/or
    `prompts` (token ids or text, tokenized with the target's tokenizer),
    which are extended with `max_new_tokens` of the target's greedy
    continuation (anchors only in the continuation, where the engine drafts).
    Each step samples `seqs_per_step` sequences and `anchors_per_seq` anchors
    per sequence, all trained in one forward. AdamW, linear warmup then cosine
    decay. `gamma` is the decay of the position weights (None: uniform).
    `target_layer_ids` default: z-lab's spread (hf_formats.default_target_layer_ids).
    `draft_vocab_size` > 0: config.json also gets "draft_vocab", the (at most) that many most
    frequent tokens of the continuations (`draft_vocabulary`), which the engine drafts over.
    `context_length` N: the context the sequences span (the pipeline draws prompts up to
    N - max_new_tokens long); recorded in the recipe, and the window when `window` is not given.
    `window` W (default N): every block attends to at most the W context positions before it
    (the engine's drafter window, same semantics), wherever its anchor lies in a long sequence;
    the target's taps are kept only from W before a sequence's first anchor on.
    config.json records the context the drafter attended to at most, min(W, the longest
    anchor's context) (without W: the longest anchor's context), as
    dflash_config.trained_context_length: the engine's default drafter window.
    Loss per labelled row: `w_ce` * CE(the sequence's token) + `w_kl` * KL(p_target || p_drafter),
    the target's distribution there at T = 1 (over the draft vocabulary when there is one), from
    the same target forward as the taps (`dflash_loss`, `distill_kl`).
    `init_from`: start from this drafter (a GGUF this package wrote, or a checkpoint directory)
    instead of a fresh one: its taps, layers, block size and mask token replace the arguments,
    and its draft vocabulary is kept (joined with this data's `draft_vocab_size` most frequent
    tokens when that is > 0).
    `kind`: "dflash", "dflash2" (dynamic convolutions and the candidate selector) or "dspark"
    (Markov and confidence heads): the drafter's architecture and its extra losses
    (train/drafter_kinds.py); an `init_from` drafter must be of the same kind.
    Returns the loss history and throughput (TrainResult).
    Over 80 lines: the signature (one keyword per recipe setting) and this docstring are most of it;
    the steps themselves are helpers (_training_sequences, _Features, _train_steps, _write_recipe).
    """
    if n_threads is not None:
        torch.set_num_threads(int(n_threads))
    _check_train_args(block_size, prompts, sequences, draft_vocab_size, context_length, window)
    if kind not in KINDS:
        raise ValueError(f"[train_drafter] kind must be one of {KINDS}, got {kind!r}")
    if kind != "dflash" and draft_vocab_size:
        raise ValueError(f"[train_drafter] a {kind} drafter drafts over the whole vocabulary: draft_vocab_size must "
                         f"be 0, got {draft_vocab_size}")
    if not (w_ce >= 0 and w_kl >= 0 and w_ce + w_kl > 0):
        raise ValueError(f"[train_drafter] w_ce and w_kl must be >= 0, not both 0; got {w_ce!r}, {w_kl!r}")
    window = context_length if window is None else window
    init_cfg = _init_config(init_from) if init_from is not None else None
    if init_cfg is not None:
        dc = init_cfg["dflash_config"]
        target_layer_ids, mask_token_id = dc["target_layer_ids"], dc["mask_token_id"]
        num_layers, block_size = int(init_cfg["num_hidden_layers"]), int(dc.get("block_size", block_size))
        if kind_of(init_cfg) != kind:
            raise ValueError(f"[train_drafter] init_from '{init_from}' is a {kind_of(init_cfg)} drafter, not {kind}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    target, target_path, target_layer_ids, mask_token_id = _frozen_target(target_dir, num_layers, target_layer_ids,
                                                                          mask_token_id)
    data, min_anchor = _training_sequences(target, target_path, prompts, sequences, sequence_prompt_lengths,
                                           max_new_tokens, seed)
    feats = _Features.of(target, data, min_anchor, target_layer_ids, window, log_every, final=bool(w_kl))
    t_data = time.perf_counter() - t0

    if init_cfg is not None:
        drafter = _initial_drafter(init_from, target)
    else:
        drafter = DFlashDrafter.for_target(target, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                           num_layers=num_layers, block_size=block_size, seed=seed,
                                           init_std=init_std, kind=kind, **dict(drafter_overrides or {}))
    draft_vocab = sorted(set(drafter.config.get("draft_vocab") or []))
    if draft_vocab_size:
        new = draft_vocabulary([s[m:] for s, m in zip(data, min_anchor)], draft_vocab_size)
        draft_vocab = sorted(set(draft_vocab) | set(new))
    vocab = torch.tensor(draft_vocab, dtype=torch.long) if draft_vocab else None
    anchors = _AnchorSampler(data, min_anchor, anchors_per_seq, gen)
    # A fixed evaluation set of anchors (the training distribution) for acceptance before/after.
    eval_anchors = [anchors.sample(i) for i in range(len(data))]
    acc_before = acceptance_on(drafter, data, feats, eval_anchors, window)
    losses, accs, n_anchors, t_train = _train_steps(drafter, data, feats, anchors, steps=steps,
                                                    seqs_per_step=seqs_per_step, lr=lr, weight_decay=weight_decay,
                                                    warmup=warmup, grad_clip=grad_clip, gamma=gamma, window=window,
                                                    log_every=log_every, w_ce=w_ce, w_kl=w_kl, vocab=vocab)
    drafter.eval()
    acc_after = acceptance_on(drafter, data, feats, eval_anchors, window)
    trained_context = anchors.longest_context() if window is None else min(window, anchors.longest_context())
    drafter.config["dflash_config"][TRAINED_CONTEXT_KEY] = trained_context

    if draft_vocab:
        drafter.config["draft_vocab"] = draft_vocab
    out = drafter.save_pretrained(out_dir)
    settings = {
        "target": str(target_path) if target_path is not None else type(target).__name__,
        "target_layer_ids": list(target_layer_ids), "num_layers": num_layers, "block_size": block_size,
        "mask_token_id": int(mask_token_id), "anchors_per_seq": anchors_per_seq, "seqs_per_step": seqs_per_step,
        "steps": steps, "lr": lr, "weight_decay": weight_decay, "warmup": warmup, "grad_clip": grad_clip,
        "gamma": gamma, "seed": seed, "n_threads": torch.get_num_threads(), "init_std": init_std,
        "max_new_tokens": max_new_tokens, "drafter_overrides": dict(drafter_overrides or {}),
        "draft_vocab_size": draft_vocab_size, "context_length": context_length, "window": window,
        "trained_context_length": trained_context,
        "w_ce": w_ce, "w_kl": w_kl, "init_from": None if init_from is None else str(init_from), "kind": kind,
    }
    return _write_recipe(out, settings, n_draft_vocab=len(draft_vocab), data=data, t_data=t_data, t_train=t_train,
                         n_anchors=n_anchors, acc_before=acc_before, acc_after=acc_after, losses=losses, accs=accs)


def _init_config(init_from: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json of the drafter `init_from` (a GGUF file or a checkpoint directory)."""
    p = Path(init_from)
    if p.is_dir() and (p / "config.json").is_file():
        return json.loads((p / "config.json").read_text())
    if p.is_file():
        import tempfile

        from .from_gguf import drafter_checkpoint_from_gguf

        with tempfile.TemporaryDirectory() as d:
            return json.loads((drafter_checkpoint_from_gguf(p, d) / "config.json").read_text())
    raise ValueError(f"[train_drafter] init_from '{p}' is neither a drafter GGUF nor a checkpoint directory")


def _initial_drafter(init_from: str | os.PathLike[str], target: nn.Module) -> DFlashDrafter:
    """DFlashDrafter from `init_from` (GGUF or checkpoint directory) over `target`'s embeddings."""
    p = Path(init_from)
    if p.is_dir():
        return DFlashDrafter.from_pretrained(p, target)
    import tempfile

    from .from_gguf import drafter_checkpoint_from_gguf

    n_target = int(target.config.get_text_config().num_hidden_layers)
    with tempfile.TemporaryDirectory() as d:
        return DFlashDrafter.from_pretrained(drafter_checkpoint_from_gguf(p, d, n_target_layers=n_target), target)


def _check_train_args(block_size: int, prompts, sequences, draft_vocab_size, context_length, window) -> None:
    if block_size < 2:
        raise ValueError(f"[train_drafter] block_size must be >= 2, got {block_size}")
    if prompts is None and sequences is None:
        raise ValueError("[train_drafter] give prompts and/or sequences")
    if not isinstance(draft_vocab_size, int) or draft_vocab_size < 0:
        raise ValueError(f"[train_drafter] draft_vocab_size must be an int >= 0, got {draft_vocab_size!r}")
    check_context_args(context_length, window)


def check_context_args(context_length: int | None, window: int | None) -> None:
    """context_length N and window W: ints in [1, MAX_TRAINED_CONTEXT] or None, W <= N."""
    for name, v in (("context_length", context_length), ("window", window)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_TRAINED_CONTEXT):
            raise ValueError(f"[train_drafter] {name} must be an int in [1, {MAX_TRAINED_CONTEXT}] or None, got {v!r}")
    if window is not None and context_length is not None and window > context_length:
        raise ValueError(f"[train_drafter] window {window} is longer than context_length {context_length}: "
                         f"no block can see more context than the sequences span")


def _frozen_target(target_dir, num_layers: int, target_layer_ids: Sequence[int] | None,
                   mask_token_id: int | None) -> tuple[nn.Module, Path | None, Sequence[int], int]:
    """The target (no gradients), its directory (None for a loaded module), and the tap layers and
    mask token id, defaulted from it where not given."""
    target_path = None if isinstance(target_dir, nn.Module) else Path(target_dir)
    target = _load_target(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    n_target_layers = int(target.config.get_text_config().num_hidden_layers)
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n_target_layers, num_layers)
    if mask_token_id is None:
        mask_token_id = _default_mask_token_id(target_path)
    return target, target_path, target_layer_ids, mask_token_id


_KIND_OBJECTIVES = {
    "dflash": "",
    "dflash2": ("; + the selector's CE over each row's top-k lattice row (teacher-forced predecessor, rows whose "
                "token is a candidate), position-weighted"),
    "dspark": ("; the logits Markov-biased by the sequence's previous token (teacher forcing); + the confidence "
               "head's BCE against the row's top-1 being its token (detached inputs)"),
}


def _write_recipe(out: Path, settings: Mapping[str, Any], *, n_draft_vocab: int, data: Sequence[Sequence[int]],
                  t_data: float, t_train: float, n_anchors: int, acc_before: float, acc_after: float,
                  losses: list[float], accs: list[float]) -> TrainResult:
    """out/recipe.json: the settings, the data, the throughput, acceptance and loss history."""
    steps = settings["steps"]
    recipe = {
        "objective": ("dflash block loss w_ce * CE + w_kl * KL(p_target || p_drafter) (T = 1, over the draft "
                      "vocabulary when there is one), position weights exp(-(i-1)/gamma) normalised"
                      if settings.get("w_kl") else
                      "dflash block CE, position weights exp(-(i-1)/gamma) normalised")
                     + _KIND_OBJECTIVES[settings.get("kind", "dflash")],
        **settings,
        "n_draft_vocab": n_draft_vocab,
        "n_sequences": len(data), "n_tokens": sum(len(s) for s in data),
        "data_seconds": t_data, "train_seconds": t_train,
        "steps_per_s": steps / t_train if t_train > 0 else 0.0,
        "anchors_per_s": n_anchors / t_train if t_train > 0 else 0.0,
        "acceptance_before": acc_before, "acceptance_after": acc_after,
        "losses": losses, "accuracies": accs,
    }
    with open(out / "recipe.json", "w", encoding="utf-8") as f:
        json.dump(recipe, f, indent=2)
    return TrainResult(losses=losses, accuracies=accs, checkpoint=out, recipe=out / "recipe.json",
                       steps_per_s=recipe["steps_per_s"], anchors_per_s=recipe["anchors_per_s"],
                       acceptance_before=acc_before, acceptance_after=acc_after,
                       extra={"data_seconds": t_data, "train_seconds": t_train})


def _training_sequences(target: nn.Module, target_path: Path | None,
                        prompts: Sequence[Sequence[int] | str] | None, sequences: Sequence[Sequence[int]] | None,
                        sequence_prompt_lengths: Sequence[int] | None, max_new_tokens: int,
                        seed: int) -> tuple[list[list[int]], list[int]]:
    """The training sequences and, per sequence, its first allowed anchor: `sequences` as given
    (from `sequence_prompt_lengths[i]`, else 1), then each prompt + the target's greedy
    continuation (from the prompt's end). Sequences too short for any anchor are dropped."""
    data: list[list[int]] = []
    min_anchor: list[int] = []
    if sequence_prompt_lengths is not None and len(sequence_prompt_lengths) != len(sequences or []):
        raise ValueError("[train_drafter] sequence_prompt_lengths needs one entry per sequence")
    for i, s in enumerate(sequences or []):
        data.append([int(t) for t in s])
        min_anchor.append(1 if sequence_prompt_lengths is None else int(sequence_prompt_lengths[i]))
    if prompts:
        ids = _prompt_ids(prompts, target_path)
        for p, full in zip(ids, greedy_continuations(target, ids, max_new_tokens, seed=seed)):
            data.append(full)
            min_anchor.append(len(p))
    keep = [i for i, s in enumerate(data) if len(_anchor_range(len(s), min_anchor[i])) > 0]
    if not keep:
        raise ValueError("[train_drafter] no sequence is long enough for an anchor")
    return [data[i] for i in keep], [min_anchor[i] for i in keep]


def _prompt_ids(prompts: Sequence[Sequence[int] | str], target_path: Path | None) -> list[list[int]]:
    """Token ids of each prompt; text is tokenized with the target's tokenizer (loaded on first use)."""
    ids: list[list[int]] = []
    tok = None
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                import transformers

                tok = transformers.AutoTokenizer.from_pretrained(str(target_path))
            ids.append(tok(p)["input_ids"])
        else:
            ids.append([int(t) for t in p])
    return ids


class _AnchorSampler:
    """Random anchors of sequence i: up to `anchors_per_seq` distinct positions of its anchor
    range, sorted, drawn from the run's generator."""

    def __init__(self, data: Sequence[Sequence[int]], min_anchor: Sequence[int], anchors_per_seq: int,
                 gen: torch.Generator):
        self.data, self.min_anchor, self.anchors_per_seq, self.gen = data, min_anchor, anchors_per_seq, gen

    def longest_context(self) -> int:
        """The most context positions any anchor can have: an anchor a sees positions < a."""
        return max(_anchor_range(len(s), m)[-1] for s, m in zip(self.data, self.min_anchor))

    def sample(self, i: int) -> list[int]:
        r = _anchor_range(len(self.data[i]), self.min_anchor[i])
        k = min(self.anchors_per_seq, len(r))
        return sorted(r[j] for j in torch.randperm(len(r), generator=self.gen)[:k].tolist())


def _train_steps(drafter: DFlashDrafter, data: Sequence[Sequence[int]], feats: "_Features",
                 anchors: _AnchorSampler, *, steps: int, seqs_per_step: int, lr: float, weight_decay: float,
                 warmup: int, grad_clip: float, gamma: float | None, window: int | None,
                 log_every: int, w_ce: float = 1.0, w_kl: float = 0.0,
                 vocab: torch.Tensor | None = None) -> tuple[list[float], list[float], int, float]:
    """AdamW over `steps` steps of `seqs_per_step` random sequences with their random anchors, all
    in one forward per step, each block attending to at most `window` context positions (None:
    all before it); the loss is `dflash_loss` with w_ce / w_kl (the KL's soft labels from
    `feats`' final hidden states, over `vocab`). Returns (losses, accuracies, anchors trained,
    seconds)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    block_size = drafter.block_size
    losses: list[float] = []
    accs: list[float] = []
    n_anchors = 0
    drafter.train()
    t1 = time.perf_counter()
    for step in range(steps):
        idx = torch.randperm(len(data), generator=anchors.gen)[:seqs_per_step].tolist()
        step_anchors = [anchors.sample(i) for i in idx]
        starts = [_ctx_start(a, window) for a in step_anchors]
        batch = block_batch([data[i] for i in idx], step_anchors, block_size, drafter.mask_token_id, window, starts,
                            drafter.first_draft_row)
        f = torch.stack([feats.window(i, st, batch["ctx_pos"].shape[1]) for i, st in zip(idx, starts)])
        for g in opt.param_groups:
            g["lr"] = warmup_cosine_lr(step, lr=lr, warmup=warmup, steps=steps)
        target_hidden = _target_hidden(feats, idx, batch, drafter.first_draft_row) if w_kl else None
        loss, stats = dflash_loss(drafter, f, batch, gamma, target_hidden=target_hidden, w_ce=w_ce, w_kl=w_kl,
                                  vocab=vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(float(loss.item()))
        accs.append(stats["acc"])
        n_anchors += sum(len(a) for a in step_anchors)
        if log_every and (step % log_every == 0 or step == steps - 1):
            kl = f" kl {stats['kl']:.4f}" if "kl" in stats else ""
            print(f"[train_drafter] step {step:5d} loss {losses[-1]:.4f} ce {stats['ce']:.4f}{kl} acc {stats['acc']:.3f}",
                  flush=True)
    return losses, accs, n_anchors, time.perf_counter() - t1


def _target_hidden(feats: "_Features", idx: Sequence[int], batch: Mapping[str, torch.Tensor],
                   first_draft_row: int = 1) -> torch.Tensor:
    """[n, H]: for each labelled row of `batch` (row-major, as dflash_loss takes them) the
    target's final hidden state at the position before its label (row a+i predicts x_{a+i}, which
    the target predicted at a+i-1; a DSpark row a+i predicts x_{a+i+1})."""
    valid = batch["labels"] != IGNORE
    return torch.cat([feats.final_at(i, batch["block_pos"][s][valid[s]] - first_draft_row)
                      for s, i in enumerate(idx)])
