"""Engine: the Python face of the C++ core. Argument handling and text; numbers run in C++."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import _core
from ._tokenizer import Tokenizer


@dataclass
class GenerationStats:
    n_prompt_tokens: int = 0
    n_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""  # "eos", "stop", "length" or "context"

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes from the prefill's logits; decode steps are the rest.
        n = max(self.n_generated - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["prefill_tok_s"] = self.prefill_tok_s
        d["decode_tok_s"] = self.decode_tok_s
        return d


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list)


class TextPiece(str):
    """A streamed piece of text; the last piece of a stream carries the GenerationResult."""

    result: GenerationResult | None = None


class Engine:
    """Runs a GGUF target model.

    >>> eng = Engine("model.gguf", n_ctx=2048)
    >>> eng.generate("def fib(n):", max_tokens=32).text
    """

    def __init__(
        self,
        target: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        kv_type: str = "f16",
        n_batch: int = 512,
        device: str = "cpu",
    ):
        path = Path(target)
        if not path.exists():
            raise ValueError(f"[load_gguf] no such file: '{path}'")
        if not isinstance(n_ctx, int) or n_ctx < 1:
            raise ValueError(f"[engine] n_ctx must be a positive int, got {n_ctx!r}")
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ValueError(f"[engine] n_threads must be a positive int or None, got {n_threads!r}")
        self.path = path
        self._core = _core.Target(str(path), n_ctx=n_ctx, n_threads=n_threads or 0, kv_type=kv_type,
                                  n_batch=n_batch, device=device)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(path)
        except ValueError:
            self.tokenizer = None  # token ids still work; text does not
        if self.tokenizer is not None and self.tokenizer.n_vocab > self._core.n_vocab:
            raise ValueError(f"[load_gguf] tokenizer has {self.tokenizer.n_vocab} tokens but the model's "
                             f"embedding has only {self._core.n_vocab} rows")
        self._lock = threading.Lock()

    # ---- properties -------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self._core.arch

    @property
    def n_ctx(self) -> int:
        return self._core.n_ctx

    @property
    def n_vocab(self) -> int:
        return self._core.n_vocab

    @property
    def n_threads(self) -> int:
        return self._core.n_threads

    @property
    def layer_types(self) -> list[str]:
        return list(self._core.layer_types)

    # ---- text -------------------------------------------------------------------------
    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"[tokenizer] '{self.path}' has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._tok().tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._tok().detokenize(tokens)

    # ---- scoring ----------------------------------------------------------------------
    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits float32 [n_tokens, n_vocab] of a fresh sequence; no state is kept."""
        toks = self._prompt_ids(tokens)
        with self._lock:
            self._core.reset()
            try:
                return self._core.decode(toks, all_logits=True)
            finally:
                self._core.reset()

    # ---- generation -------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        stream: bool = False,
    ) -> GenerationResult | Iterator[TextPiece]:
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"[generate] max_tokens must be an int >= 0, got {max_tokens!r}")
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(s for s in stop if s)
        toks = self._prompt_ids(prompt)
        if stop and self.tokenizer is None:
            raise ValueError("[generate] stop strings need a tokenizer; the model has none")
        gen = self._generate_iter(toks, max_tokens, stop)
        if stream:
            return gen
        last = None
        for last in gen:
            pass
        return last.result

    def chat(self, messages: Sequence[dict], **generate_kwargs):
        prompt = self._tok().apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt, **generate_kwargs)

    # ---- internals --------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            toks = self.tokenize(prompt)
        else:
            try:
                toks = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError("[generate] prompt must be a str or a sequence of token ids") from None
        if not toks:
            raise ValueError("[generate] empty prompt: give at least one token")
        if len(toks) > self.n_ctx:
            raise ValueError(f"[generate] prompt of {len(toks)} tokens is longer than n_ctx = {self.n_ctx}")
        bad = [t for t in toks if t < 0 or t >= self.n_vocab]
        if bad:
            raise ValueError(f"[generate] token id {bad[0]} is outside the vocabulary [0, {self.n_vocab})")
        return toks

    def _generate_iter(self, prompt: list[int], max_tokens: int, stop: tuple[str, ...]) -> Iterator[TextPiece]:
        stats = GenerationStats(n_prompt_tokens=len(prompt))
        out: list[int] = []
        text = ""
        emitted = 0
        dec = self.tokenizer.decoder() if self.tokenizer is not None else None
        hold = max((len(s) for s in stop), default=0)

        with self._lock:
            core = self._core
            core.reset()
            try:
                if max_tokens == 0:
                    stats.stop_reason = "length"
                else:
                    t0 = time.perf_counter()
                    logits = core.decode(prompt)
                    stats.prefill_s = time.perf_counter() - t0
                    t_dec = 0.0
                    while True:
                        tok = int(np.argmax(logits[-1]))
                        if self.tokenizer is not None and self.tokenizer.is_eog(tok):
                            stats.stop_reason = "eos"
                            break
                        out.append(tok)
                        if dec is not None:
                            text += dec.push(tok)
                            if stop:
                                cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
                                if cut >= 0:
                                    text = text[:cut]
                                    stats.stop_reason = "stop"
                                    break
                            safe = len(text) - hold
                            if safe > emitted:
                                piece = TextPiece(text[emitted:safe])
                                emitted = safe
                                yield piece
                        if len(out) >= max_tokens:
                            stats.stop_reason = "length"
                            break
                        if core.n_past >= core.n_ctx:
                            stats.stop_reason = "context"
                            break
                        t0 = time.perf_counter()
                        logits = core.decode([tok])
                        t_dec += time.perf_counter() - t0
                    stats.decode_s = t_dec
            finally:
                core.reset()
        if dec is not None and stats.stop_reason != "stop":
            text += dec.flush()
        stats.n_generated = len(out)
        last = TextPiece(text[emitted:])
        last.result = GenerationResult(text=text, tokens=out, stats=stats, prompt_tokens=list(prompt))
        yield last
