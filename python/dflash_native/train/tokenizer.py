"""A byte-level BPE tokenizer in the Qwen3.5 layout, trained on the corpus's train split.

Layout as in `dflash_native.hf_formats.byte_level_bpe_tokenizer` (what our converter
reads): NFC normaliser, the Qwen3.5 regex Split (the converter maps exactly this
regex to llama.cpp's `qwen35` pre-tokenizer), ByteLevel without its own regex,
BPE over the 256 byte symbols plus learned merges, then the added special tokens
at the end of the vocabulary (as in Qwen's files): `<|endoftext|>` (document
separator, EOS of this base model), `<|im_start|>`, `<|im_end|>` (ChatML) and
`<|MASK|>` (the DFlash drafter's mask token).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Sequence

from ..hf_formats import (
    ENDOFTEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    MASK_TOKEN_TEXT,
    QWEN35_PRETOKENIZE_REGEX,
    write_tokenizer_config,
)
from . import corpus

__all__ = ["SPECIAL_TOKENS", "load_tokenizer", "train_tokenizer"]

SPECIAL_TOKENS: Sequence[str] = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN_TEXT)
EOS_TOKEN = ENDOFTEXT_TOKEN  # a base model: documents end with <|endoftext|>


def train_tokenizer(out_dir: str | os.PathLike[str], *, vocab_size: int = 4096, root: corpus.Root = None,
                    seed: int = 0, max_bytes: int | None = None, min_frequency: int = 2,
                    heldout_fraction: float = corpus.HELDOUT_FRACTION) -> Path:
    """Train the BPE on the train split of `root` (default: the standard library)
    and write out_dir/tokenizer.json + tokenizer_config.json; returns out_dir.

    `vocab_size` counts the special tokens (the BPE stops earlier when no pair
    occurs `min_frequency` times). BPE training itself has no randomness: the
    output depends only on the corpus files; `seed` only chooses which train
    files are read when `max_bytes` caps the text. Raises ValueError for a bad
    corpus (before any training) or a vocab_size too small for the 256 bytes."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ValueError(f"[train_tokenizer] vocab_size {vocab_size} < {n_min} (256 bytes + special tokens)")
    files = list(corpus.iter_files("train", root=root, heldout_fraction=heldout_fraction))
    if max_bytes is not None:
        random.Random(seed).shuffle(files)
        kept, n_bytes = [], 0
        for p in files:
            if kept and n_bytes + p.stat().st_size > max_bytes:
                break
            kept.append(p)
            n_bytes += p.stat().st_size
        files = sorted(kept)

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=min_frequency,
                                  show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for p in files:
            yield p.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer, length=len(files))
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # appended after the BPE vocabulary

    dst = Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"), pretty=False)
    added = json.loads(tok.to_str())["added_tokens"]
    write_tokenizer_config(dst, added, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    return dst


def load_tokenizer(tokenizer_dir: str | os.PathLike[str]):
    """The `tokenizers.Tokenizer` of a directory written by `train_tokenizer`."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"[train] {str(path)!r} does not exist; run train_tokenizer first")
    return Tokenizer.from_file(str(path))
