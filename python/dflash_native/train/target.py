"""Train a small Qwen3.5-architecture hybrid target from scratch on the local corpus.

The model is transformers' `Qwen3_5ForCausalLM` (`qwen3_5_text`): Gated DeltaNet
layers with one full-attention layer every `full_attention_interval`, untied
embeddings, vocabulary = tokenizer size rounded up to a multiple of 64. Each
corpus file is one document, followed by `<|endoftext|>`; the documents of a
split are concatenated into one token stream and training reads random windows
of `seq_len + 1` tokens from it (seeded). AdamW with linear warmup and cosine
decay to `min_lr_ratio * lr`, gradient clipping, float32 on the CPU.

The output directory is an HF checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that `convert_hf_to_gguf` converts and
`Engine` loads, plus `recipe.json`: every hyperparameter, seed, token count,
loss curve, final losses and the wall time.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..hf_formats import default_mrope_section, hybrid_layer_types
from . import corpus
from .schedule import warmup_cosine_lr
from .tokenizer import EOS_TOKEN, load_tokenizer

__all__ = ["DEFAULT_CONFIG", "make_config", "tokenize_split", "train_target"]

# ~8 M parameters without embeddings at hidden 320; Qwen3.5's shape ratios scaled down.
DEFAULT_CONFIG: Mapping[str, Any] = {
    "hidden_size": 320,
    "intermediate_size": 896,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "initializer_range": 0.02,
}


def make_config(n_tokenizer: int, special_ids: Mapping[str, int], **overrides: Any) -> dict[str, Any]:
    """config.json of a `qwen3_5_text` model (the keys of `DEFAULT_CONFIG`
    overridable, plus `layer_types` and `vocab_size`)."""
    unknown = set(overrides) - set(DEFAULT_CONFIG) - {"layer_types", "vocab_size"}
    if unknown:
        raise ValueError(f"[train_target] unknown config overrides {sorted(unknown)}; "
                         f"known: {sorted(DEFAULT_CONFIG)} + layer_types, vocab_size")
    c = {**DEFAULT_CONFIG, **overrides}
    if c["linear_key_head_dim"] != c["linear_value_head_dim"]:
        raise ValueError(f"[train_target] linear_key_head_dim {c['linear_key_head_dim']} != linear_value_head_dim "
                         f"{c['linear_value_head_dim']} (the GGUF GDN layout needs d_k == d_v)")
    vocab_size = int(c.get("vocab_size") or -(-n_tokenizer // 64) * 64)
    if vocab_size < n_tokenizer:
        raise ValueError(f"[train_target] vocab_size {vocab_size} < tokenizer size {n_tokenizer}")
    layer_types = c.get("layer_types") or hybrid_layer_types(c["num_hidden_layers"], c["full_attention_interval"])
    n_rot = int(c["head_dim"] * c["partial_rotary_factor"])
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(c["rope_theta"]),
                            "partial_rotary_factor": float(c["partial_rotary_factor"]), "mrope_interleaved": True,
                            "mrope_section": default_mrope_section(n_rot)},
        "layer_types": layer_types,
        "bos_token_id": special_ids[EOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[EOS_TOKEN],
        "dtype": "float32",
    }
    for key in DEFAULT_CONFIG:
        if key not in ("rope_theta", "partial_rotary_factor"):
            cfg[key] = c[key]
    return cfg


def tokenize_split(tok: Any, split: str, *, root: corpus.Root = None,
                   heldout_fraction: float = corpus.HELDOUT_FRACTION) -> np.ndarray:
    """One int32 stream: every file of `split` encoded, each followed by `<|endoftext|>`."""
    eos = tok.token_to_id(EOS_TOKEN)
    texts = [text for _, text in corpus.iter_texts(split, root=root, heldout_fraction=heldout_fraction)]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, dtype=np.int32))
        parts.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(parts)


def train_target(out_dir: str | os.PathLike[str], *, tokenizer_dir: str | os.PathLike[str], steps: int = 1000,
                 seq_len: int = 256, batch_size: int = 16, lr: float = 2e-3, warmup: int | None = None,
                 min_lr_ratio: float = 0.1, weight_decay: float = 0.1, grad_clip: float = 1.0, seed: int = 0,
                 n_threads: int | None = None, eval_every: int = 100, n_eval_batches: int = 8,
                 root: corpus.Root = None, heldout_fraction: float = corpus.HELDOUT_FRACTION,
                 log_every: int = 10, **config_overrides: Any) -> Path:
    """Train the target and write its checkpoint + recipe.json to `out_dir`; returns out_dir.

    `config_overrides` replace `DEFAULT_CONFIG` keys (or give `layer_types`).
    `warmup` defaults to 5% of `steps`. The held-out loss (mean over
    `n_eval_batches` fixed windows of the held-out split) is measured every
    `eval_every` steps and at the end. `n_threads` sets torch's thread count
    for the run (restored after); on a machine shared with other work 1 thread
    can be several times faster than 2 (torch's OpenMP barriers wait for the busy
    core; bench/train_target.py measures it). Raises ValueError before any work
    for a missing or empty corpus or a missing tokenizer."""
    import torch
    import transformers

    split = corpus.split_files(root, heldout_fraction=heldout_fraction)  # validates the corpus first
    if not split["heldout"]:
        raise ValueError("[train_target] the corpus has a single file: no held-out split to evaluate on")
    tok = load_tokenizer(tokenizer_dir)
    if steps < 1 or seq_len < 2 or batch_size < 1:
        raise ValueError(f"[train_target] need steps >= 1, seq_len >= 2, batch_size >= 1; got {steps}, {seq_len}, "
                         f"{batch_size}")
    warmup = max(1, int(0.05 * steps)) if warmup is None else max(1, warmup)
    prev_threads = torch.get_num_threads()
    if n_threads is not None:
        torch.set_num_threads(n_threads)
    try:
        transformers.logging.set_verbosity_error()
        t_start = time.perf_counter()
        cfg_dict = make_config(tok.get_vocab_size(), {EOS_TOKEN: tok.token_to_id(EOS_TOKEN)}, **config_overrides)
        corpus_kw = dict(root=root, heldout_fraction=heldout_fraction)
        train_ids, held_ids = (tokenize_split(tok, name, **corpus_kw) for name in ("train", "heldout"))
        for name, ids in (("train", train_ids), ("held-out", held_ids)):
            if len(ids) < seq_len + 2:
                raise ValueError(f"[train_target] the {name} split has {len(ids)} tokens, fewer than seq_len + 2 = "
                                 f"{seq_len + 2}")
        print(f"[train_target] tokens: train {len(train_ids):,}, held-out {len(held_ids):,} "
              f"({time.perf_counter() - t_start:.1f} s)", flush=True)

        torch.manual_seed(seed)
        model = _new_model(cfg_dict)
        opt = _optimizer(model, lr=lr, weight_decay=weight_decay)
        data = _Windows(train_ids, held_ids, seq_len=seq_len, batch_size=batch_size, n_eval_batches=n_eval_batches,
                        seed=seed)
        hyper = dict(steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, warmup=warmup,
                     min_lr_ratio=min_lr_ratio, weight_decay=weight_decay, grad_clip=grad_clip, seed=seed,
                     eval_every=eval_every)
        curve, evals, train_s = _train_loop(model, opt, data, steps=steps, lr=lr, warmup=warmup,
                                            min_lr_ratio=min_lr_ratio, grad_clip=grad_clip, eval_every=eval_every,
                                            log_every=log_every)

        dst = Path(out_dir)
        dst.mkdir(parents=True, exist_ok=True)
        model.eval()
        model.save_pretrained(dst, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(tokenizer_dir) / name, dst / name)
        recipe = _recipe(model, cfg_dict, tok, tokenizer_dir, split, data, hyper, curve, evals, train_s, t_start,
                         root=root, heldout_fraction=heldout_fraction)
        with open(dst / "recipe.json", "w", encoding="utf-8") as f:
            json.dump(recipe, f, indent=2)
        return dst
    finally:
        torch.set_num_threads(prev_threads)


def _new_model(cfg_dict: Mapping[str, Any]) -> Any:
    """A freshly initialised `Qwen3_5ForCausalLM` (torch's global seed decides the weights)."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.architectures = ["Qwen3_5ForCausalLM"]
    n_params, n_embed = _param_counts(model)
    print(f"[train_target] {type(model).__name__}: {n_params:,} parameters ({n_params - n_embed:,} without "
          f"embeddings), layers {cfg_dict['layer_types']}", flush=True)
    return model


def _param_counts(model: Any) -> tuple[int, int]:
    """(all parameters, those of the input and output embeddings)."""
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    return n_params, n_embed


def _optimizer(model: Any, *, lr: float, weight_decay: float) -> Any:
    """AdamW; matrices decay, vectors and the GDN conv kernels do not."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "conv1d" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _lm_loss(model: Any, batch: Any) -> Any:
    """Next-token cross-entropy of windows `batch` [n, seq_len + 1]."""
    import torch

    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


class _Windows:
    """Training reads random windows of seq_len + 1 tokens (seeded); the held-out loss
    is the mean over fixed windows spread evenly over the held-out split."""

    def __init__(self, train_ids: np.ndarray, held_ids: np.ndarray, *, seq_len: int, batch_size: int,
                 n_eval_batches: int, seed: int):
        import torch

        self.train = torch.from_numpy(train_ids.astype(np.int64))
        self.held = torch.from_numpy(held_ids.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.n_eval = n_eval_batches * batch_size
        self.eval_starts = torch.linspace(0, len(held_ids) - seq_len - 1, self.n_eval).long()

    def _stack(self, stream: Any, starts: Any) -> Any:
        import torch

        return torch.stack([stream[s: s + self.seq_len + 1] for s in starts.tolist()])

    def train_batch(self) -> Any:
        import torch

        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        return self._stack(self.train, starts)

    def heldout_loss(self, model: Any) -> float:
        import torch

        model.eval()
        with torch.no_grad():
            losses = [_lm_loss(model, self._stack(self.held, self.eval_starts[i: i + self.batch_size])).item()
                      for i in range(0, self.n_eval, self.batch_size)]
        model.train()
        return float(np.mean(losses))


def _train_loop(model: Any, opt: Any, data: _Windows, *, steps: int, lr: float, warmup: int, min_lr_ratio: float,
                grad_clip: float, eval_every: int,
                log_every: int) -> tuple[list[dict[str, float]], list[dict[str, float]], float]:
    """Train `steps` steps; returns the logged loss curve, the held-out losses and the training seconds."""
    import torch

    n_tokens_per_step = data.batch_size * data.seq_len

    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    model.train()
    t_train = time.perf_counter()
    loss_acc, n_acc = 0.0, 0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = warmup_cosine_lr(step, lr=lr, warmup=warmup, steps=steps, min_lr_ratio=min_lr_ratio)
        loss = _lm_loss(model, data.train_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        opt.step()
        loss_acc += loss.item()
        n_acc += 1
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - t_train
            cur_lr = opt.param_groups[0]["lr"]
            curve.append({"step": step + 1, "loss": loss_acc / n_acc, "lr": cur_lr, "grad_norm": grad_norm,
                          "elapsed_s": elapsed})
            print(f"[train_target] step {step + 1}/{steps} loss {loss_acc / n_acc:.4f} lr {cur_lr:.2e} "
                  f"|g| {grad_norm:.2f} {(step + 1) * n_tokens_per_step / elapsed:,.0f} tok/s", flush=True)
            loss_acc, n_acc = 0.0, 0
        if (step + 1) % eval_every == 0 and step + 1 != steps:
            evals.append({"step": step + 1, "heldout_loss": data.heldout_loss(model)})
            print(f"[train_target] step {step + 1} held-out loss {evals[-1]['heldout_loss']:.4f}", flush=True)
    train_s = time.perf_counter() - t_train
    evals.append({"step": steps, "heldout_loss": data.heldout_loss(model)})
    print(f"[train_target] final held-out loss {evals[-1]['heldout_loss']:.4f} "
          f"({steps * n_tokens_per_step / train_s:,.0f} tok/s over {train_s:.0f} s)", flush=True)
    return curve, evals, train_s


def _recipe(model: Any, cfg_dict: Mapping[str, Any], tok: Any, tokenizer_dir: Any, split: Mapping[str, list],
            data: _Windows, hyper: Mapping[str, Any], curve: list, evals: list, train_s: float, t_start: float, *,
            root: corpus.Root, heldout_fraction: float) -> dict[str, Any]:
    """recipe.json: every hyperparameter, seed, token count, loss curve, final losses, the wall time."""
    import torch
    import transformers

    n_params, n_embed = _param_counts(model)
    n_tokens_seen = hyper["steps"] * hyper["batch_size"] * hyper["seq_len"]
    corpus_root = "stdlib" if root is None else (str(root) if isinstance(root, (str, os.PathLike))
                                                 else [str(r) for r in root])
    return {
        "model": {"config": cfg_dict, "n_params": n_params, "n_params_without_embeddings": n_params - n_embed},
        "tokenizer": {"dir": str(tokenizer_dir), "n_tokens": tok.get_vocab_size()},
        "corpus": {"root": corpus_root, "heldout_fraction": heldout_fraction, "n_train_files": len(split["train"]),
                   "n_heldout_files": len(split["heldout"]), "n_train_tokens": int(len(data.train)),
                   "n_heldout_tokens": int(len(data.held))},
        "train": {"steps": hyper["steps"], "seq_len": hyper["seq_len"], "batch_size": hyper["batch_size"],
                  "lr": hyper["lr"], "warmup": hyper["warmup"], "schedule": "linear warmup, cosine decay",
                  "min_lr_ratio": hyper["min_lr_ratio"], "optimizer": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8,
                  "weight_decay": hyper["weight_decay"], "grad_clip": hyper["grad_clip"], "seed": hyper["seed"],
                  "n_threads": torch.get_num_threads(), "dtype": "float32", "n_tokens_seen": n_tokens_seen,
                  "eval_every": hyper["eval_every"], "n_eval_windows": data.n_eval},
        "results": {"final_train_loss": curve[-1]["loss"], "final_heldout_loss": evals[-1]["heldout_loss"],
                    "loss_curve": curve, "heldout_losses": evals, "train_s": train_s,
                    "tokens_per_s": n_tokens_seen / train_s, "wall_s": time.perf_counter() - t_start},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "machine": platform.machine()},
    }
