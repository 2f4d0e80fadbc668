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
from ._memory import out_of_memory
from ._tokenizer import Tokenizer


@dataclass
class GenerationStats:
    n_prompt_tokens: int = 0
    n_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""  # "eos", "stop", "length" or "context"
    # speculative decoding (zero / empty for AR)
    speculative: bool = False
    block_size: int = 0
    rounds: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # [k] = rounds that committed k tokens
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    verified_tokens: int = 0  # tokens through the verify passes (B per round without a draft_cutoff)
    gated_at: int = -1  # with Engine(gate=True): tokens generated when the gate switched to AR, else -1

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per round (accepted drafts + bonus), 1..B."""
        n = sum(self.acceptance_histogram)
        return sum(k * c for k, c in enumerate(self.acceptance_histogram)) / n if n else 0.0

    @property
    def mean_verified_length(self) -> float:
        """Tokens per verify pass (`last` + the drafts kept by the draft_cutoff), 1..B."""
        n = sum(self.acceptance_histogram)
        return self.verified_tokens / n if n else 0.0

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
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["mean_verified_length"] = self.mean_verified_length
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


GATE_MIN_ROUNDS = 4


class Engine:
    """Runs a GGUF target model, with a DFlash drafter for speculative decoding when given one.

    >>> eng = Engine("target.gguf", drafter="drafter.gguf", n_ctx=2048)
    >>> eng.generate("def fib(n):", max_tokens=32).text

    Greedy speculative output equals the AR output of the same engine (generate(...,
    speculative=False)), token for token.
    """

    def __init__(
        self,
        target: str | os.PathLike,
        *,
        drafter: str | os.PathLike | None = None,
        block_size: int | None = None,
        feature_ring_capacity: int = 4096,
        drafter_window: int | None = None,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        kv_type: str = "f16",
        n_batch: int = 512,
        device: str = "cpu",
        rollback: str = "tape",
        gate: bool = False,
        draft_cutoff: float = 0.0,
        matmul: str = "own",
        draft_vocab: bool = True,
    ):
        """rollback: "tape" (GDN tape replay). "snapshot" and "redecode" are the baselines the
        benchmarks compare against (per-token state snapshots; re-running the kept tokens).

        gate: measure AR speed once per request (one exact AR step) and, after GATE_MIN_ROUNDS
        rounds, finish the request in AR when speculation commits tokens more slowly than AR
        (output is the same either way; only speed changes).

        draft_cutoff: verify a round's drafts d_1..d_k only while the product of the drafter's
        top-1 probabilities stays >= draft_cutoff (0: verify all B-1). Where verify cost grows
        with the block (CPUs), cutting doubtful drafts saves more than it loses; the output is the
        same. Settable later as `engine.draft_cutoff`.

        draft_vocab: when the drafter's GGUF names a draft vocabulary (dflash.draft_vocab: the
        tokens its training data's target continuations used), draft over those rows of the
        lm_head only, as EAGLE-3 does: a cheaper draft, and a target token outside them only
        ends that round's accepted run. False: always the whole vocabulary. Output is the same.
        Settable later as `engine.draft_vocab`.

        matmul: weight matmuls on the CPU. "own": the package's batch-invariant kernel (F16/F32
        weights; other types fall back to ggml), under which a verify pass computes every token
        bit for bit as the AR step does. "ggml": ggml_mul_mat everywhere (benchmark baseline)."""
        path = Path(target)
        if not path.exists():
            raise ValueError(f"[load_gguf] no such file: '{path}'")
        if not isinstance(n_ctx, int) or n_ctx < 1:
            raise ValueError(f"[engine] n_ctx must be a positive int, got {n_ctx!r}")
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ValueError(f"[engine] n_threads must be a positive int or None, got {n_threads!r}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 2):
            raise ValueError(f"[engine] block_size must be an int >= 2, got {block_size!r}")
        if drafter_window is not None and (not isinstance(drafter_window, int) or drafter_window < 1):
            raise ValueError(f"[engine] drafter_window must be a positive int or None, got {drafter_window!r}")
        if not isinstance(feature_ring_capacity, int) or feature_ring_capacity < 1:
            raise ValueError(f"[engine] feature_ring_capacity must be a positive int, got {feature_ring_capacity!r}")
        draft_cutoff = _checked_cutoff(draft_cutoff)
        if drafter is not None and not Path(drafter).exists():
            raise ValueError(f"[load_gguf] no such drafter file: '{drafter}'")
        self.path = path
        self.drafter_path = Path(drafter) if drafter is not None else None
        max_verify = 0
        if drafter is not None:
            max_verify = block_size or _drafter_block_size(drafter)
        self._core = _core.Target(str(path), n_ctx=n_ctx, n_threads=n_threads or 0, kv_type=kv_type,
                                  n_batch=max(n_batch, max_verify), device=device, max_verify=max_verify,
                                  rollback=rollback, matmul=matmul)
        self._spec = None
        if drafter is not None:
            self._spec = _core.Spec(self._core, str(drafter), block_size=block_size or 0,
                                    ring_capacity=feature_ring_capacity, window=drafter_window or 0,
                                    draft_cutoff=draft_cutoff, draft_vocab=bool(draft_vocab))
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(path)
        except ValueError:
            self.tokenizer = None  # token ids still work; text does not
        if self.tokenizer is not None and self.tokenizer.n_vocab > self._core.n_vocab:
            raise ValueError(f"[load_gguf] tokenizer has {self.tokenizer.n_vocab} tokens but the model's "
                             f"embedding has only {self._core.n_vocab} rows")
        self._lock = threading.Lock()
        # Benchmarks' acceptance-controlled mode and tests: f(prompt, generated, B) -> the B-1 draft
        # tokens to verify instead of the drafter's (which still runs), or None.
        self._draft_override = None
        self.gate = bool(gate)
        self._gate_ar_tok_s = None  # tests: a fixed AR speed for the gate instead of measuring one

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

    @property
    def block_size(self) -> int:
        """Tokens verified per speculative round (0 without a drafter)."""
        return self._spec.block_size if self._spec is not None else 0

    @property
    def draft_cutoff(self) -> float:
        """See __init__: the confidence cut on a round's drafts (0 = verify all)."""
        return self._spec.draft_cutoff if self._spec is not None else 0.0

    @draft_cutoff.setter
    def draft_cutoff(self, value: float) -> None:
        value = _checked_cutoff(value)
        if self._spec is None:
            raise ValueError("[engine] draft_cutoff needs a drafter")
        with self._lock:
            self._spec.draft_cutoff = value

    @property
    def draft_vocab(self) -> bool:
        """See __init__: drafts over the drafter's draft vocabulary (when its GGUF has one)."""
        return bool(self._spec is not None and self._spec.use_draft_vocab)

    @draft_vocab.setter
    def draft_vocab(self, value: bool) -> None:
        if self._spec is None:
            raise ValueError("[engine] draft_vocab needs a drafter")
        with self._lock:
            self._spec.use_draft_vocab = bool(value)

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
        speculative: bool | None = None,
    ) -> GenerationResult | Iterator[TextPiece]:
        """Greedy generation. speculative=None uses the drafter when there is one;
        speculative=False runs plain AR on the same engine (the lossless baseline)."""
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"[generate] max_tokens must be an int >= 0, got {max_tokens!r}")
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(s for s in stop if s)
        toks = self._prompt_ids(prompt)
        if stop and self.tokenizer is None:
            raise ValueError("[generate] stop strings need a tokenizer; the model has none")
        if speculative and self._spec is None:
            raise ValueError("[generate] speculative=True needs an Engine created with a drafter")
        spec = self._spec is not None if speculative is None else bool(speculative)
        gen = self._generate_iter(toks, max_tokens, stop, spec)
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

    def _generate_iter(self, prompt: list[int], max_tokens: int, stop: tuple[str, ...], spec: bool) -> Iterator[TextPiece]:
        stats = GenerationStats(n_prompt_tokens=len(prompt), speculative=spec)
        out: list[int] = []
        text = ""
        emitted = 0
        dec = self.tokenizer.decoder() if self.tokenizer is not None else None
        hold = max((len(s) for s in stop), default=0)

        def emit(tokens):
            """Appends committed tokens; returns (pieces to yield, finished)."""
            nonlocal text, emitted
            pieces = []
            for tok in tokens:
                if self.tokenizer is not None and self.tokenizer.is_eog(tok):
                    stats.stop_reason = "eos"
                    return pieces, True
                out.append(tok)
                if dec is not None:
                    text += dec.push(tok)
                    if stop:
                        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
                        if cut >= 0:
                            text = text[:cut]
                            stats.stop_reason = "stop"
                            return pieces, True
                    safe = len(text) - hold
                    if safe > emitted:
                        pieces.append(TextPiece(text[emitted:safe]))
                        emitted = safe
                if len(out) >= max_tokens:
                    stats.stop_reason = "length"
                    return pieces, True
            return pieces, False

        with self._lock:
            core = self._core
            core.reset()
            try:
                if max_tokens == 0:
                    stats.stop_reason = "length"
                else:
                    t0 = time.perf_counter()
                    if spec:
                        tok = int(self._spec.prefill(prompt))
                    else:
                        tok = int(core.decode_greedy(prompt))
                    stats.prefill_s = time.perf_counter() - t0
                    pieces, done = emit([tok])
                    yield from pieces
                    t_dec = 0.0
                    B = self._spec.block_size if spec else 1
                    hist = [0] * (B + 1)
                    ar_tok_s = self._gate_ar_tok_s
                    spec_tokens, spec_s = 0, 0.0
                    while not done:
                        room = core.n_ctx - core.n_past
                        if room <= 0:
                            stats.stop_reason = "context"
                            break
                        t0 = time.perf_counter()
                        if spec and self.gate and ar_tok_s is None:
                            # gate probe: one exact AR step, features pushed so the drafter stays in step
                            logits, taps = core.decode([tok], taps=self._spec.tap_layers)
                            self._spec.push_features(taps, core.n_past - 1)
                            committed = [int(np.argmax(logits[-1]))]
                            ar_tok_s = 1.0 / max(time.perf_counter() - t0, 1e-9)
                        elif spec and room >= 2:
                            Bc = min(B, room)
                            forced = self._draft_override(prompt, out, Bc) if self._draft_override else None
                            r = self._spec.round(tok, Bc, forced)
                            committed = r["committed"]
                            hist[len(committed)] += 1
                            stats.draft_s += r["draft_s"]
                            stats.verify_s += r["verify_s"]
                            stats.rollback_s += r["rollback_s"]
                            stats.verified_tokens += r["n_verified"]
                            spec_tokens += len(committed)
                            spec_s += time.perf_counter() - t0
                            if (self.gate and sum(hist) >= GATE_MIN_ROUNDS and
                                    spec_tokens / max(spec_s, 1e-9) < ar_tok_s):
                                spec = False  # finish this request in AR
                                stats.gated_at = len(out) + len(committed)
                        else:
                            committed = [int(core.decode_greedy([tok]))]
                        t_dec += time.perf_counter() - t0
                        tok = committed[-1]
                        pieces, done = emit(committed)
                        yield from pieces
                    stats.decode_s = t_dec
                    if stats.speculative:
                        stats.block_size = B
                        stats.rounds = sum(hist)
                        stats.acceptance_histogram = hist
            finally:
                core.reset()
        if dec is not None and stats.stop_reason != "stop":
            text += dec.flush()
        stats.n_generated = len(out)
        last = TextPiece(text[emitted:])
        last.result = GenerationResult(text=text, tokens=out, stats=stats, prompt_tokens=list(prompt))
        yield last


def _checked_cutoff(value) -> float:
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"[engine] draft_cutoff must be a number in [0, 1], got {value!r}")
    return float(value)


def _drafter_block_size(path) -> int:
    """dflash.block_size of a drafter GGUF (16 when absent), read before the engine is built."""
    from gguf import GGUFReader

    try:
        r = GGUFReader(str(path))
    except Exception as e:
        if out_of_memory(e):
            raise MemoryError(f"[load_gguf] out of memory reading the drafter '{path}': {e}") from None
        raise ValueError(f"[load_gguf] '{path}' is not a readable GGUF drafter: {e}") from None
    f = r.fields.get("dflash.block_size")
    return int(f.parts[-1][0]) if f is not None else 16
