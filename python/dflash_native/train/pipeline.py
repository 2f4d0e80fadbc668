"""`dflash-native train-drafter`: a DFlash drafter for any supported HF target, from local text.

Prompts are windows of the training split of the text (train/corpus.py: a directory, a file or
the Python standard library by default), tokenized with the target's own tokenizer; the target
continues each greedily and the drafter learns those continuations (train/drafter.py). With the
target's GGUF given, the continuations come from our engine on that file (the target the drafter
will serve, at its own precision, and ~10x faster than PyTorch's token-by-token decode); without
it, from the PyTorch model.
Everything that can be checked is checked before the target is loaded or any text is read.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

from . import corpus


def _target_layers(target_dir: Path) -> int:
    cfg_path = target_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"[train_drafter] '{target_dir}' has no config.json: give a Hugging Face target checkpoint")
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    if "num_hidden_layers" not in text:
        raise ValueError(f"[train_drafter] '{cfg_path}' has no num_hidden_layers")
    return int(text["num_hidden_layers"])


def check_request(target_dir: Path, data: corpus.Root, target_layer_ids: Sequence[int] | None) -> list[tuple[str, Path]]:
    """Fails fast: the target checkpoint, its tokenizer, the tap layers, the text."""
    n_layers = _target_layers(target_dir)
    if not (target_dir / "tokenizer.json").is_file():
        raise ValueError(f"[train_drafter] '{target_dir}' has no tokenizer.json")
    for i in target_layer_ids or ():
        if not 0 <= int(i) < n_layers - 1:
            raise ValueError(f"[train_drafter] target layer {i} is not a tap layer of this {n_layers}-layer target "
                             f"(taps are layer outputs 0 .. {n_layers - 2})")
    files = corpus.split_files(data)["train"]  # raises on a missing or empty corpus
    if not files:
        raise ValueError(f"[train_drafter] no training text in '{data}'")
    return files


def text_prompts(files: Sequence[tuple[str, Path]], tokenizer: Any, n: int, prompt_tokens: int,
                 seed: int = 0, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """`n` prompts of `prompt_tokens` tokens, each from a random line of a random file; with
    `max_prompt_tokens`, of a length drawn uniformly from [prompt_tokens, max_prompt_tokens]
    (continuations then start at contexts spread over that range: long-context training)."""
    longest = max(prompt_tokens, max_prompt_tokens or 0)
    rng = random.Random(seed)
    out: list[list[int]] = []
    texts = [p.read_text(encoding="utf-8", errors="replace") for _, p in files]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("[train_drafter] the training text is empty")
    for _ in range(50 * n):
        if len(out) == n:
            break
        text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        # no draw without a range: the recipe's prompts (and so the shipped pair) stay reproducible
        want = rng.randint(prompt_tokens, longest) if longest > prompt_tokens else prompt_tokens
        ids = tokenizer.encode("".join(lines[start:start + max(200, want)]), add_special_tokens=False).ids
        if len(ids) >= want:
            out.append(list(ids[:want]))
    if len(out) < n:
        raise ValueError(f"[train_drafter] the text yields only {len(out)} prompts of {prompt_tokens}.."
                         f"{longest} tokens")
    return out


def _prompt_mix(files, tok, n_prompts: int, prompt_tokens: int, max_new_tokens: int, context_length: int | None,
                long_share: float | None, seed: int) -> list[list[int]]:
    """Without `context_length`: `n_prompts` prompts of `prompt_tokens`. With N: round(n_prompts *
    long_share) long prompts, of lengths spread over [prompt_tokens, N - max_new_tokens] so that the
    continuations' anchors see contexts up to N (default share 1), then the short rest of
    `prompt_tokens`: the short-context regime keeps its share of the training, and the short
    prompts are the first ones the same seed draws without N."""
    if context_length is None:
        return text_prompts(files, tok, n_prompts, prompt_tokens, seed=seed)
    n_long = round(n_prompts * (1.0 if long_share is None else long_share))
    longest = max(prompt_tokens, context_length - max_new_tokens)
    # an all-long draw keeps the seed it always had; a mix draws its long prompts from the next one
    long_seed = seed if n_long == n_prompts else seed + 1
    long = text_prompts(files, tok, n_long, prompt_tokens, seed=long_seed, max_prompt_tokens=longest) if n_long else []
    short = text_prompts(files, tok, n_prompts - n_long, prompt_tokens, seed=seed) if n_prompts > n_long else []
    return short + long


def _length_summary(lengths: Sequence[int]) -> dict:
    s = sorted(lengths)
    return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "mean": sum(s) / len(s)}


def engine_continuations(target_gguf, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         n_threads: int | None = None) -> list[list[int]]:
    """prompt + `max_new_tokens` greedy tokens of our engine on `target_gguf` (AR, stopping early
    only at the end-of-generation token), one prompt at a time."""
    from ..engine import Engine

    longest = max(len(p) for p in prompts)
    eng = Engine(target_gguf, n_ctx=longest + max_new_tokens + 8, n_threads=n_threads)
    out = []
    for p in prompts:
        r = eng.generate([int(t) for t in p], max_tokens=max_new_tokens, speculative=False)
        out.append([int(t) for t in p] + list(r.tokens))
    return out


def run(target_dir, data, out_dir, *, n_prompts: int = 64, prompt_tokens: int = 64, max_new_tokens: int = 64,
        target_layer_ids: Sequence[int] | None = None, target_gguf=None, out_gguf=None, outtype: str = "f16",
        continuations: str | None = None, engine_threads: int | None = None, long_share: float | None = None,
        **train_kwargs) -> dict:
    """Check, sample prompts, generate the target's continuations, train, and (with out_gguf)
    convert. `continuations`: "engine" (our engine on `target_gguf`, the default when it is
    given) or "torch" (the PyTorch target). With train_kwargs' `context_length` N, a
    `long_share` of the prompts (default all) have lengths spread over [prompt_tokens,
    N - max_new_tokens] and the rest `prompt_tokens` (see `_prompt_mix`). Returns the recipe."""
    from .drafter import check_context_args, train_drafter

    target_dir = Path(target_dir)
    check_context_args(train_kwargs.get("context_length"), train_kwargs.get("window"))
    if long_share is not None and train_kwargs.get("context_length") is None:
        raise ValueError("[train_drafter] long_share needs context_length (the length long prompts spread up to)")
    if long_share is not None and not 0.0 <= long_share <= 1.0:
        raise ValueError(f"[train_drafter] long_share must be in [0, 1], got {long_share!r}")
    continuations = continuations or ("engine" if target_gguf is not None else "torch")
    if continuations not in ("engine", "torch"):
        raise ValueError(f"[train_drafter] continuations must be 'engine' or 'torch', got {continuations!r}")
    if continuations == "engine" and target_gguf is None:
        raise ValueError("[train_drafter] continuations='engine' needs the target's GGUF (target_gguf)")
    if target_gguf is not None and not Path(target_gguf).is_file():
        raise ValueError(f"[train_drafter] target GGUF '{target_gguf}' does not exist")
    files = check_request(target_dir, data, target_layer_ids)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    prompts = _prompt_mix(files, tok, n_prompts, prompt_tokens, max_new_tokens, train_kwargs.get("context_length"),
                          long_share, train_kwargs.get("seed", 0))
    t0 = time.perf_counter()
    if continuations == "engine":
        seqs = engine_continuations(target_gguf, prompts, max_new_tokens, n_threads=engine_threads)
        result = train_drafter(target_dir, out_dir, sequences=seqs, sequence_prompt_lengths=[len(p) for p in prompts],
                               max_new_tokens=max_new_tokens, target_layer_ids=target_layer_ids, **train_kwargs)
    else:
        result = train_drafter(target_dir, out_dir, prompts=prompts, max_new_tokens=max_new_tokens,
                               target_layer_ids=target_layer_ids, **train_kwargs)
    recipe = json.loads(Path(result.recipe).read_text())
    recipe.update(acceptance_before=result.acceptance_before, acceptance_after=result.acceptance_after,
                  final_loss=result.losses[-1] if result.losses else None, continuations=continuations,
                  n_prompts=n_prompts, prompt_tokens=prompt_tokens, long_share=long_share,
                  prompt_lengths=_length_summary([len(p) for p in prompts]),
                  pipeline_seconds=time.perf_counter() - t0)
    if out_gguf is not None:
        from ..convert_dflash import convert_dflash_to_gguf

        convert_dflash_to_gguf(out_dir, out_gguf, outtype=outtype, target_gguf=target_gguf)
        recipe["gguf"] = str(out_gguf)
    with open(Path(out_dir) / "recipe.json", "w", encoding="utf-8") as f:
        json.dump(recipe, f, indent=2)
    return recipe
