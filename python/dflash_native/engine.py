"""Engine: the Python face of the C++ core. Argument handling and text; numbers run in C++.

Over 600 lines, as the one home of the public Engine and its per-request text layer (_Run: stop
strings, streamed pieces, the result), which reads the engine's state; a fifth of the file is
the docstrings users read (Engine.__init__, over 80 lines, is 50 lines of argument documentation
over its checks). The argument checks themselves are in _args.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import _core
from ._args import (as_bool as _bool, as_int as _int, as_opt_int as _opt_int,
                    as_path as _path, as_real as _real, as_sampling as _sampling, as_stop_strings as _stop_strings,
                    as_str as _str, as_token_ids as _token_ids)
from ._tokenizer import NoVocabulary, Tokenizer
from .constraint import Constraint, GrammarEngine, as_constraint
from .hub import is_hub_name

log = logging.getLogger("dflash_native")


@dataclass
class GenerationStats:
    n_prompt_tokens: int = 0
    n_generated: int = 0
    n_cached_tokens: int = 0  # leading prompt tokens the prompt cache reused (not prefilled again)
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
    verified_tokens: int = 0  # tokens through the verify passes (B per round without a draft_cutoff; tree: nodes + root)
    # the controller (Engine(gate=True)): tokens it committed by AR steps (its first step, its
    # periodic AR cost probes and its fall-backs), and its switches between AR and speculation
    ar_steps: int = 0
    controller_switches: int = 0
    # why the engine's drafter failed (a draft with NaN / inf logits), "" while it is healthy: the
    # engine then decodes AR, with AR's output, for the rest of its life (warned once, and logged)
    drafter_failure: str = ""
    seed: int | None = None  # the sampling seed (drawn when generate got seed=None); None when greedy
    # the instruction set the own CPU kernels ran (dflash_native.isa(): "avx512f", "avx2", "portable",
    # "... (capped)" under DFLASH_NATIVE_ISA / set_isa), then after "; " the weight types whose matmul
    # this engine measured faster at another level (Engine.matmul_dispatch: "avx512f; matmul q4_K x1
    # avx2"), so that timings from different ISAs are never mixed
    isa: str = ""
    # generate(constraint=...): seconds in the grammar engine (masks, accepts, rollbacks) and masks made
    constraint_s: float = 0.0
    n_masks: int = 0
    slot: int = 0  # the sequence slot the request ran on (Engine(n_seq > 1): the scheduler's choice)

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per round (accepted drafts + bonus), 1..B; AR steps are not rounds."""
        n = sum(self.acceptance_histogram)
        return sum(k * c for k, c in enumerate(self.acceptance_histogram)) / n if n else 0.0

    @property
    def mean_verified_length(self) -> float:
        """Tokens per verify pass (`last` + the drafts kept by the draft_cutoff), 1..B."""
        n = sum(self.acceptance_histogram)
        return self.verified_tokens / n if n else 0.0

    @property
    def prefill_tok_s(self) -> float:
        n = self.n_prompt_tokens - self.n_cached_tokens  # the tokens the prefill ran
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

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


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probabilities (generate(..., logprobs=N)): `logprob` is the
    token's natural-log probability and `top` the N most probable tokens as (token id, logprob),
    most probable first (ties: the lower id), under the distribution the token was chosen from:
    sampled (temperature > 0), softmax(kept logits / temperature) over the tokens top_k, top_p and
    min_p keep (fewer than N entries when they keep fewer); greedy (temperature 0), the
    log-softmax of the raw logits (vLLM's default; greedy ignores the filters). Computed in the
    core from the logits row the token was chosen from, so AR and speculative decoding (chain or
    tree, greedy or sampled) report the same values bit for bit."""

    token: int
    logprob: float
    top: list[tuple[int, float]]

    @classmethod
    def _of(cls, lp: "_core.TokenLogprobs") -> "TokenLogprobs":
        return cls(int(lp.token), float(lp.logprob), list(zip(lp.top_tokens, lp.top_logprobs)))


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list)
    # one per token of `tokens` when generate() got logprobs=N; None otherwise
    logprobs: list[TokenLogprobs] | None = None


class StreamPiece(str):
    """What generate(..., stream=True) yields: a piece of the generated text (a str). Every piece
    but the last has `result` None; the last piece (possibly empty) carries the request's
    GenerationResult, so a stream needs no second call for its tokens and stats."""

    result: GenerationResult | None = None


TextPiece = StreamPiece  # the earlier name, kept for existing callers


class Engine:
    """Runs a GGUF target model, with a DFlash drafter for speculative decoding when given one.

    >>> with Engine("target.gguf", drafter="drafter.gguf", n_ctx=2048) as eng:
    ...     eng.generate("def fib(n):", max_tokens=32).text

    Speculative output equals the AR output of the same engine (generate(...,
    speculative=False)), token for token: greedy, and sampled at the same seed.

    Threads: one engine runs one request at a time. A call from another thread waits until the
    running call or stream is finished (or closed); a new call from the thread that left a stream
    unfinished supersedes that stream (resuming it raises RuntimeError). close() (or leaving a
    `with` block) frees the model and its buffers at once.
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
        gate: bool = True,
        draft_cutoff: float = 0.0,
        draft_vocab: bool = True,
        verify: str = "chain",
        tree_budget: int = 32,
        use_mmap: bool = True,
        n_seq: int = 1,
        quiet: bool = False,
    ):
        """target, drafter: GGUF paths, or model names hf://ORG/REPO[@REVISION][:TYPE] (a GGUF
        repository's file, or a Hugging Face checkpoint downloaded, converted and quantized once
        into a local cache: dflash_native.hub). quiet: no progress output while names resolve.

        block_size: tokens verified per round, 2..64 (None: the drafter's trained block size).
        n_threads: None (or 0) uses every core.

        gate: the speculation controller (csrc/spec/controller.h). Per request it times AR steps, draft
        passes and verify passes of each size, keeps the drafter's acceptance rate per confidence
        level over a sliding window of rounds, and chooses every step: how many of a round's
        drafts to verify (the most expected tokens per second), or AR steps when speculation
        commits tokens more slowly than AR, probing speculation again later (with a doubling
        back-off). The output is the same either way; only speed changes. False: fixed settings,
        every step a round of block_size (cut by draft_cutoff). Settable later as `engine.gate`.

        draft_cutoff: verify a round's drafts d_1..d_k only while the product of the drafter's
        top-1 probabilities stays >= draft_cutoff (0: no such cap). With the controller it caps
        the controller's choice. Where verify cost grows with the block (CPUs), cutting doubtful
        drafts saves more than it loses; the output is the same. Settable later as
        `engine.draft_cutoff`.

        draft_vocab: when the drafter's GGUF names a draft vocabulary (dflash.draft_vocab: the
        tokens its training data's target continuations used), draft over those rows of the
        lm_head only, as EAGLE-3 does: a cheaper draft, and a target token outside them only
        ends that round's accepted run. False: always the whole vocabulary. Output is the same.
        Settable later as `engine.draft_vocab`.

        verify: "chain" (each round verifies `last` + the top-1 drafts) or "tree": each round
        verifies, in one target pass, the best-first tree of at most `tree_budget` candidate
        tokens that the drafter's per-position top-K distributions give (ranked by the product of
        their probabilities; draft_cutoff is then a minimum path score), and commits the longest
        path the target agrees with plus its bonus token. Output is AR's, bit for bit, either way.
        tree_budget: 1..63 (the root makes 64, the most tokens one verify takes). Under the gate
        the controller picks AR or speculation per step and, per tree round, how many of the
        best-first tree's nodes to verify (tree_budget at most); gate=False: the whole budget.

        use_mmap: on the CPU the target's and drafter's weights are the GGUF files' pages, mapped
        read-only (read ahead at load): no second copy of the weights in memory, and processes
        that map the same file share its pages. False reads them into memory of their own instead
        (which may take transparent huge pages). A GPU device always loads its own copy.

        n_seq: sequence slots (on the CPU or a device). With more than one, generate() calls from several threads run
        at once, batched: each engine step runs one target pass over every active request's work
        (a round's verify, an AR step) through the core's scheduler (csrc/engine/scheduler.h),
        and requests join and leave between steps. Each request's output is the one it gets run
        alone, bit for bit. Each slot has its own caches, feature ring, controller and prompt
        cache; memory_report() counts them all. An n_seq whose caches do not fit raises MemoryError.

        Weight matmuls on the CPU run the package's batch-invariant kernel (F16/F32 weights; other
        types fall back to ggml), under which a verify pass computes every token bit for bit as the
        AR step does; GDN layers roll back by tape replay. The baselines the benchmarks compare
        these against are reached through Engine.for_benchmark.

        Arguments are type-checked here (so that none reaches the core as a raw TypeError);
        what their values may be (ranges, files, names) the C++ core checks, raising ValueError."""
        w = "engine"
        quiet = _bool(w, "quiet", quiet)
        if is_hub_name(target) or is_hub_name(drafter):
            from .hub import resolve_pair

            target, drafter = resolve_pair(target, drafter, quiet=quiet)
        target = _path(w, "target", target)
        drafter = None if drafter is None else _path(w, "drafter", drafter)
        block_size = _opt_int(w, "block_size", block_size) or 0  # 0: the drafter's
        feature_ring_capacity = _int(w, "feature_ring_capacity", feature_ring_capacity)
        drafter_window = _opt_int(w, "drafter_window", drafter_window)
        if drafter_window is not None and drafter_window < 1:  # the core reads 0 as "no window"
            raise ValueError(f"[engine] drafter_window must be a positive int or None, got {drafter_window}")
        n_ctx = _int(w, "n_ctx", n_ctx)
        n_threads = _opt_int(w, "n_threads", n_threads, bits=32) or 0  # 0: all cores
        n_batch = _int(w, "n_batch", n_batch)
        kv_type, device = _str(w, "kv_type", kv_type), _str(w, "device", device)
        gate = _bool(w, "gate", gate)
        draft_cutoff = _real(w, "draft_cutoff", draft_cutoff)
        draft_vocab = _bool(w, "draft_vocab", draft_vocab)
        verify = _str(w, "verify", verify)
        tree_budget = _int(w, "tree_budget", tree_budget)
        use_mmap = _bool(w, "use_mmap", use_mmap)
        n_seq = _int(w, "n_seq", n_seq, bits=32)
        if verify not in ("chain", "tree"):
            raise ValueError(f"[engine] verify must be 'chain' or 'tree', got {verify!r}")
        if verify == "tree" and drafter is None:
            raise ValueError("[engine] verify='tree' needs a drafter")
        if verify == "tree" and not 1 <= tree_budget <= _core.MAX_VERIFY - 1:
            raise ValueError(f"[engine] tree_budget must be in [1, {_core.MAX_VERIFY - 1}] (the verify capacity "
                             f"{_core.MAX_VERIFY} minus the root), got {tree_budget}")
        self.verify = verify

        self.path = Path(target)
        self.drafter_path = Path(drafter) if drafter is not None else None
        self._load(target, drafter, block_size,
                   dict(n_ctx=n_ctx, n_threads=n_threads, kv_type=kv_type, n_batch=n_batch, device=device,
                        use_mmap=use_mmap, n_seq=n_seq),
                   dict(ring_capacity=feature_ring_capacity, window=drafter_window or 0, draft_cutoff=draft_cutoff,
                        draft_vocab=draft_vocab, controller=gate, tree_budget=tree_budget if verify == "tree" else 0))
        # _cv guards the core: held while the core computes, never across a yield. _owner is the
        # call or stream whose sequence is in the core (see _claim).
        self._cv = threading.Condition(threading.RLock())
        self._owner: _Claim | None = None
        self._pid = os.getpid()  # the process whose threads run the graphs (see _live)
        # The prompt cache (generate(cache_prompt=True)): the token sequence the core holds after
        # the last request that ended normally, and whether the Spec's ring is in step with it.
        self._held: tuple[list[int], bool] | None = None
        # Benchmarks' acceptance-controlled mode and tests: f(prompt, generated, B) -> the B-1 draft
        # tokens to verify instead of the drafter's (which still runs), or None.
        self._draft_override = None
        self._grammars: GrammarEngine | None = None  # built at the first constraint
        # n_seq > 1: the core's scheduler runs the requests (_stream_batched); _inflight counts
        # them (eval() and close() wait for none)
        self._sched = None
        self._inflight = 0
        if n_seq > 1:
            tok = self.tokenizer._core if self.tokenizer is not None else None
            self._sched = _core.Scheduler(self._core, self._spec, tok)

    _drafter_warned = False

    def _warn_drafter_failed(self, why: str) -> None:
        """Once per engine: its drafter failed (the core now decodes AR, with AR's output)."""
        if self._drafter_warned:
            return
        self._drafter_warned = True
        log.warning("%s", why)
        warnings.warn(why, RuntimeWarning, stacklevel=4)

    def _load(self, target: str, drafter: str | None, block_size: int, target_kw: dict, spec_kw: dict) -> None:
        """The core's Target, its Spec when there is a drafter, and the tokenizer (checked args)."""
        max_verify = 0
        if drafter is not None:
            max_verify = block_size or _core.drafter_block_size(drafter)
            if spec_kw.get("tree_budget"):  # a tree verifies its root and up to tree_budget nodes
                max_verify = max(max_verify, spec_kw["tree_budget"] + 1)
        self._core = self._new_target(target, max_verify=max_verify, **target_kw)
        self._spec = None
        if drafter is not None:
            self._spec = _core.Spec(self._core, drafter, block_size=block_size, **spec_kw)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.path)
        except NoVocabulary:
            self.tokenizer = None  # token ids still work; text does not (a broken vocabulary raises)
        if self.tokenizer is not None and self.tokenizer.n_vocab > self._core.n_vocab:
            raise ValueError(f"[load_gguf] tokenizer has {self.tokenizer.n_vocab} tokens but the model's "
                             f"embedding has only {self._core.n_vocab} rows")

    def _new_target(self, path: str, **target_kw) -> "_core.Target":
        """The core's Target (the strategy seam: Engine.for_benchmark's engine builds a baseline's)."""
        return _core.Target(path, **target_kw)

    @classmethod
    def for_benchmark(cls, target: str | os.PathLike, *, rollback: str = "tape", matmul: str = "own",
                      **engine_kwargs) -> "Engine":
        """An Engine on one of the baselines the benchmarks measure against (not for serving):
        rollback="snapshot" (per-token GDN state snapshots) or "redecode" (re-running the kept
        tokens) instead of "tape" (tape replay); matmul="ggml" (ggml_mul_mat everywhere, which
        rounds a batch differently from single steps) instead of "own". The other arguments are
        Engine's. A bad mode raises ValueError. The strategies are chosen when its Target is built
        (_core.testing.baseline_target); the product constructor reads no baseline setting."""
        return _BenchmarkEngine(target, _str("engine", "rollback", rollback), _str("engine", "matmul", matmul),
                                **engine_kwargs)

    # ---- lifetime ---------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Free the model, its caches and the drafter now (not when the garbage collector gets to
        them). Waits for another thread's running call or stream to finish (RuntimeError after
        `timeout` seconds, when given); a stream this thread left unfinished is ended. Using the
        engine afterwards raises RuntimeError; closing again does nothing."""
        if timeout is not None:
            timeout = _real("close", "timeout", timeout)
            if not timeout >= 0:  # NaN too: its deadline would never pass
                raise ValueError(f"[close] timeout must be None or a number of seconds >= 0, got {timeout}")
        with self._cv:
            if self._core is None:
                return
            self._claim("close()", timeout)
            self._owner = None
            self._sched = None  # first: it keeps the Spec and the Target alive
            self._spec = None  # then: the Spec keeps its Target alive
            self._core = None
            tok, self.tokenizer = self.tokenizer, None
            if tok is not None:
                tok.close()
            self._cv.notify_all()  # waiting calls wake up and raise "closed"

    @property
    def closed(self) -> bool:
        return self._core is None

    def __enter__(self) -> "Engine":
        self._live()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self, compute: bool = False):
        """The core, or RuntimeError when the engine is closed; compute=True (a call that runs the
        model): also when this is a forked child of the process that made the engine, where a graph
        would wait for ever on worker threads (ggml's OpenMP pool) that fork() did not copy."""
        core = self._core
        if core is None:
            raise RuntimeError("[engine] this Engine is closed")
        if compute and os.getpid() != self._pid:
            raise RuntimeError(f"[engine] this Engine was made in process {self._pid}, and this process "
                               f"({os.getpid()}) is a fork() of it: ggml's worker threads do not survive fork(), so "
                               f"it cannot run here. Make engines in the process that uses them, started with "
                               f"multiprocessing's 'spawn' or 'forkserver' method")
        return core

    # ---- properties -------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self._live().arch

    @property
    def n_ctx(self) -> int:
        return self._live().n_ctx

    @property
    def n_vocab(self) -> int:
        return self._live().n_vocab

    @property
    def n_threads(self) -> int:
        return self._live().n_threads

    @property
    def layer_types(self) -> list[str]:
        return list(self._live().layer_types)

    @property
    def block_size(self) -> int:
        """Tokens verified per speculative round (0 without a drafter)."""
        self._live()
        spec = self._spec
        return spec.block_size if spec is not None else 0

    @property
    def draft_cutoff(self) -> float:
        """See __init__: the confidence cut on a round's drafts (0 = verify all)."""
        self._live()
        spec = self._spec
        return spec.draft_cutoff if spec is not None else 0.0

    @draft_cutoff.setter
    def draft_cutoff(self, value: float) -> None:
        # A setting, not a request: it waits only for a running step, and a paused stream goes on
        # under the new value from its next round (the output is the same under any value).
        value = _real("engine", "draft_cutoff", value)
        with self._cv:
            self._live()
            if self._spec is None:
                raise ValueError("[engine] draft_cutoff needs a drafter")
            self._spec.draft_cutoff = value

    @property
    def gate(self) -> bool:
        """See __init__: the speculation controller is on (False: fixed settings)."""
        self._live()
        spec = self._spec
        return bool(spec is not None and spec.controller)

    @gate.setter
    def gate(self, value: bool) -> None:
        value = _bool("engine", "gate", value)
        with self._cv:  # as draft_cutoff's setter
            self._live()
            if self._spec is None:
                raise ValueError("[engine] gate needs a drafter")
            self._spec.controller = value

    @property
    def draft_vocab(self) -> bool:
        """See __init__: drafts over the drafter's draft vocabulary (when its GGUF has one)."""
        self._live()
        spec = self._spec
        return bool(spec is not None and spec.use_draft_vocab)

    @draft_vocab.setter
    def draft_vocab(self, value: bool) -> None:
        value = _bool("engine", "draft_vocab", value)
        with self._cv:  # as draft_cutoff's setter
            self._live()
            if self._spec is None:
                raise ValueError("[engine] draft_vocab needs a drafter")
            self._spec.use_draft_vocab = value

    # ---- text -------------------------------------------------------------------------
    def _tok(self) -> Tokenizer:
        self._live()
        if self.tokenizer is None:
            raise ValueError(f"[tokenizer] '{self.path}' has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._tok().tokenize(text)  # the tokenizer refuses anything but a str

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._tok().detokenize(_token_ids("detokenize", tokens))  # the tokenizer checks the range

    def matmul_dispatch(self) -> list[dict]:
        """The instruction set each weight type's matmul runs at, as this engine measured it at load
        (csrc/kernels/cpu/matmul/dispatch.h). One dict per weight type and column count (1: a decode step; 16: a
        verify or draft block): `type`, `columns`, the matrix timed (`tensor`, its first `rows` rows
        of `K`), `seconds` (the fastest run at each level tried), `chosen` (the fastest; the CPU's best
        unless another beat it by more than 5%), `in_use` (`chosen`, held under any cap set later) and
        `wall_seconds` (what measuring it cost the load).
        Empty when nothing was measured: a CPU with one level, a level chosen by DFLASH_NATIVE_ISA or
        set_isa, DFLASH_NATIVE_TUNE=0, ggml's kernels (for_benchmark(matmul="ggml")), or the GPU. The choice changes speed only: every
        level computes the same bits."""
        with self._cv:
            return list(self._live().matmul_dispatch())

    @property
    def device(self) -> str:
        """The ggml device this engine's graphs run on: "CPU", "CUDA0", "Vulkan0", "RPC0", ..."""
        with self._cv:
            return self._live().device

    def memory_report(self) -> dict[str, int]:
        """What this engine holds in memory, in bytes, by part (csrc/runtime/session.h: memory_usage):

        - target_weights_mapped, drafter_weights_mapped: weights used in place from the mapped GGUF
          files (page-cache pages shared with the file, resident once touched; see use_mmap);
        - target_weights_copied, drafter_weights_copied: weights in memory of their own: the few
          norm and vector tensors stored as F16/BF16/Q8_0 and converted to F32 at load, the draft
          vocabulary's lm_head rows, or every weight when the file is not mapped (use_mmap=False,
          device="gpu");
        - kv_cache: attention K/V for n_ctx positions (scales with n_ctx and kv_type);
        - gdn_state, gdn_tape: the GDN layers' recurrent + conv state, and the tape of one verify;
        - feature_ring: the drafter's context K/V (ring capacity + one block of scratch);
        - feature_queue: host memory of the target's taps queued for the ring (a long AR stretch
          queues a row per step, up to 1.125x the ring capacity, n_taps * n_embd floats a row);
        - compute_target, compute_drafter: the compute buffers of the graph plans cached so far
          (target forward passes; draft and ring-push graphs), which grow as new graph shapes run;
        - total: the sum of the above;
        - on_device: of the total, the bytes held by the engine's device (`Engine.device`) when it
          is not the CPU: the weights, caches, tape, ring and the device's compute buffers (0 on
          the CPU).

        Parts the engine does not have (a drafter, GDN layers) are 0. With n_seq > 1 the caches,
        rings and queues are every slot's, and "slots" lists each slot's kv_cache, gdn_state,
        gdn_tape, feature_ring and feature_queue, and on_device: of these, the bytes the device
        holds (its caches and ring; 0 on the CPU)."""
        with self._cv:
            return dict(self._live().memory_report(self._spec, self._sched))

    # ---- structured output ------------------------------------------------------------
    def _grammar_engine(self) -> GrammarEngine:
        # not under _cv: the server's request parsing compiles here while a slot computes
        g = self._grammars
        if g is None:
            g = self._grammars = _shared_grammar_engine(self._tok(), self.path, self._live().n_vocab)
        return g

    def check_constraint(self, constraint: "Constraint | dict") -> None:
        """Compiles a constraint (see generate) for this engine's vocabulary, as generate would:
        ValueError naming what cannot be compiled (the server's 400 before it answers)."""
        c = as_constraint(constraint)
        if c is not None:
            self._grammar_engine().compile(c)

    # ---- scoring ----------------------------------------------------------------------
    def eval(self, tokens: str | Sequence[int]) -> np.ndarray:
        """Logits float32 [n_tokens, n_vocab] of a fresh sequence; no state is kept."""
        toks = self._prompt_ids(tokens, "eval")
        with self._cv:
            claim = self._claim("eval()")
            try:
                return self._live(compute=True).decode(toks, all_logits=True)
            finally:
                self._release(claim)

    # ---- generation -------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        stop: str | Sequence[str] | None = (),
        stream: bool = False,
        speculative: bool | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        logprobs: int | None = None,
        cache_prompt: bool = False,
        constraint: "Constraint | dict | None" = None,
    ) -> GenerationResult | Iterator[StreamPiece]:
        """Generation, greedy by default. speculative=None uses the drafter when there is one;
        speculative=False runs plain AR on the same engine (the lossless baseline).

        temperature > 0 samples: the filters top_k (0: off), top_p (in (0, 1], 1: off) and min_p
        (in [0, 1), 0: off), in llama.cpp's order, then a draw from softmax(kept logits /
        temperature) with noise fixed by (seed, position, token). Speculative output equals AR
        output at the same seed, token for token. seed=None draws a fresh seed, reported in
        result.stats.seed; temperature=0 is greedy (the other settings are checked, then unused).

        logprobs=N (0..MAX_LOGPROBS = 20): result.logprobs holds a TokenLogprobs per generated token
        (its log-probability and the N most probable alternatives; see TokenLogprobs for what
        greedy and sampled report), the same with and without the drafter. None: not computed.

        stream=True returns an iterator of StreamPiece; the request starts at its first next(),
        where a prompt the core rejects (empty, too long, ids outside the vocabulary) raises.

        cache_prompt=True: when the prompt starts with the whole sequence the core holds from this
        engine's previous request (its prompt and every committed token but the last; multi-turn
        chat), only the rest of the prompt is prefilled, continuing the KV cursor, GDN and conv
        states and the feature ring (stats.n_cached_tokens says how many tokens were reused).
        Otherwise, or after eval(), an error or a stream that did not finish, a cold start. The
        output equals a cold start's bit for bit when every prefill chunk is at most 64 tokens
        (n_batch <= 64, or short prompts); else the near-tie rule (docs/architecture.md).

        constraint: structured output (dflash_native.constraint): JsonSchema(schema) (or the schema
        dict itself), JsonSchema() for any JSON object, Regex(pattern) or Grammar(ebnf). Every token
        is chosen from logits masked by the grammar (needs xgrammar: the `structured` extra); the
        output is constrained AR's, bit for bit, with and without the drafter, greedy or sampled,
        chain or tree. The grammar ends generation with an end-of-generation token once complete
        (stop_reason "eos"); max_tokens may end it first. One that cannot be compiled: ValueError.
        result.stats.constraint_s is the time spent in the grammar engine."""
        self._live(compute=True)
        max_tokens = _int("generate", "max_tokens", max_tokens)
        if max_tokens < 0:
            raise ValueError(f"[generate] max_tokens must be >= 0, got {max_tokens}")
        stop = _stop_strings(stop)
        stream = _bool("generate", "stream", stream)
        cache_prompt = _bool("generate", "cache_prompt", cache_prompt)
        if speculative is not None:
            speculative = _bool("generate", "speculative", speculative)
        sampling = _sampling(temperature, top_k, top_p, min_p, seed, logprobs)
        toks = self._prompt_ids(prompt, "generate")
        if stop and self.tokenizer is None:
            raise ValueError("[generate] stop strings need a tokenizer; the model has none")
        if speculative and self._spec is None:
            raise ValueError("[generate] speculative=True needs an Engine created with a drafter")
        spec = self._spec is not None if speculative is None else speculative
        c = as_constraint(constraint)
        matcher = self._grammar_engine().matcher(c) if c is not None else None
        run = _Run(self, toks, max_tokens, stop, spec, sampling, cache_prompt, matcher)
        gen = self._stream_batched(run) if self._sched is not None else self._stream(run)
        if stream:
            return gen
        last = None
        for last in gen:
            pass
        return last.result

    def chat(self, messages: Sequence[dict], **generate_kwargs):
        """generate() on the messages rendered by the GGUF's chat template: a list of
        {"role": str, "content": str}."""
        prompt = self._tok().apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt, **generate_kwargs)

    # ---- internals --------------------------------------------------------------------
    def _prompt_ids(self, prompt, where: str) -> list[int]:
        """Token ids of a str or of a sequence of ints. What the ids may be (non-empty, in the
        vocabulary, within n_ctx) the core checks when it runs them."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        return _token_ids(where, prompt)

    def _claim(self, what: str, timeout: float | None = None, keep: bool = False) -> "_Claim":
        """Makes a new call the owner of the core's sequence (caller holds _cv) and resets it
        (keep=True: leaves the sequence for the call's prompt cache to continue or reset).
        Another thread's call or stream is waited for; a stream this thread left unfinished (or
        one whose thread has ended) is superseded: resuming it raises."""
        me = threading.current_thread()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            core = self._live()
            owner = self._owner
            if owner is None and self._inflight == 0:
                break
            if owner is None:  # the scheduler's requests (n_seq > 1) hold the core
                wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if wait <= 0:
                    raise RuntimeError(f"[engine] {what}: other threads' requests are still running on this Engine "
                                       f"after {timeout:g} s")
                self._cv.wait(wait)
                continue
            if owner.thread is me or not owner.thread.is_alive():
                owner.superseded_by = what
                break
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                raise RuntimeError(f"[engine] {what}: another thread is still using this Engine after {timeout:g} s")
            self._cv.wait(wait)  # woken by _release; the timeout re-checks the owner's thread
        claim = _Claim(me)
        self._owner = claim
        if getattr(self, "_sched", None) is not None:  # the call runs on the target's slots outside the scheduler
            self._sched.forget_held()
        if not keep:
            self._held = None
            core.reset()
        return claim

    def _take_held(self, prompt: list[int], spec: bool) -> int:
        """(caller owns the core) How many leading prompt tokens the core holds from the previous
        request, reusable as they are: its whole sequence, a strict prefix of the prompt (a token
        must run for the logits); a speculative request also needs the ring in step. 0: cold."""
        held, self._held = self._held, None  # in flight: a request that fails leaves nothing held
        if held is None or (spec and not held[1]):
            return 0
        seq = held[0]
        return len(seq) if 0 < len(seq) < len(prompt) and prompt[:len(seq)] == seq else 0

    def _resume(self, claim: "_Claim"):
        """Before a stream's step (caller holds _cv): its core, or RuntimeError when it lost it."""
        core = self._live(compute=True)
        if claim.superseded_by is not None:
            raise RuntimeError(f"[generate] this stream was superseded by a later {claim.superseded_by} on the same "
                               f"Engine from the same thread; finish or close() a stream before the next call")
        claim.thread = threading.current_thread()
        return core

    def _release(self, claim: "_Claim") -> None:
        with self._cv:
            if self._owner is claim:
                self._owner = None
                self._cv.notify_all()

    def _stream(self, run: "_Run") -> Iterator[StreamPiece]:
        # The core is locked while a step computes and free while the pieces are yielded, so a
        # caller that abandons the stream (break, an exception) cannot lock the engine up.
        claim = None
        try:
            self._live(compute=True)  # a stream made before a fork(), started in the child
            with self._cv:
                claim = self._claim("generate()", keep=run.cache_prompt)
                pieces = run.start(self._take_held(run.prompt, run.spec) if run.cache_prompt else 0)
            while True:
                for piece in pieces:
                    if claim.superseded_by is not None:
                        break  # _resume below raises
                    yield piece
                if run.done and claim.superseded_by is None:
                    break
                with self._cv:
                    self._resume(claim)
                    pieces = run.step()
            with self._cv:
                if self._owner is claim:
                    self._held = run.held()
        finally:
            if claim is not None:
                self._release(claim)
        yield run.final_piece()


    def _stream_batched(self, run: "_Run") -> Iterator[StreamPiece]:
        # n_seq > 1: the request is a ticket of the core's scheduler; whichever thread waits runs
        # the next step for every request (the core's lock, not _cv, orders them).
        with self._cv:
            self._live(compute=True)
            while self._owner is not None:  # eval() or close() holds the core
                self._cv.wait(0.5)
                self._live(compute=True)
            self._inflight += 1
            sched = self._sched
        try:
            pieces = run.start_ticket(sched)
            while True:
                yield from pieces
                if run.done:
                    break
                pieces = run.step()
        finally:
            if not run.done and run.req is not None:
                run.req.stop()  # an abandoned stream: its slot frees at the next step
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
        run.drain()
        yield run.final_piece()


class _Claim:
    """A call's or a stream's hold on the engine's sequence (Engine._claim)."""

    __slots__ = ("thread", "superseded_by")

    def __init__(self, thread: threading.Thread):
        self.thread = thread  # the thread that ran its last step
        self.superseded_by: str | None = None


class _BenchmarkEngine(Engine):
    """Engine.for_benchmark's engine: an Engine whose Target runs the given rollback strategy
    (runtime/rollback.h) and matmul kind."""

    def __init__(self, target, rollback: str, matmul: str, **engine_kwargs):
        self._baselines = dict(rollback=rollback, matmul=matmul)
        super().__init__(target, **engine_kwargs)

    def _new_target(self, path: str, **target_kw) -> "_core.Target":
        return _core.testing.baseline_target(path, **self._baselines, **target_kw)


class _Run:
    """One request's text layer (greedy or sampled) over the core's request loop (_core.Request,
    csrc/engine/request.h: the prefill, AR steps or rounds, the token-level stops and the stats):
    committed tokens become text pieces, cut at stop strings. Every step runs under Engine._cv."""

    def __init__(self, eng: Engine, prompt: list[int], max_tokens: int, stop: tuple[str, ...], spec: bool,
                 sampling: "_core.Sampling | None" = None, cache_prompt: bool = False, constraint=None):
        self.eng, self.prompt, self.max_tokens, self.stop, self.spec = eng, prompt, max_tokens, stop, spec
        # None: greedy without logprobs (the argmax in the graph); temperature 0: greedy with them,
        # or under a constraint (the argmax of the masked rows, on the host)
        if constraint is not None and sampling is None:
            sampling = _core.Sampling(0.0)
        self.sampling = sampling
        self.constraint = constraint  # constraint.Matcher: the core masks and advances it
        sampled = sampling is not None and sampling.temperature > 0
        self.cache_prompt = cache_prompt  # Engine.generate(cache_prompt=...): continue / leave a held sequence
        self.stats = GenerationStats(n_prompt_tokens=len(prompt), speculative=spec,
                                     seed=sampling.seed if sampled else None, isa=eng._live().isa)
        self.want_lp = sampling is not None and sampling.logprobs >= 0
        self.out: list[int] = []
        self.lps: list[TokenLogprobs] = []  # one per token of `out` when want_lp
        self.text = ""
        self.emitted = 0
        self.dec = eng.tokenizer.decoder() if eng.tokenizer is not None else None
        self.hold = max((len(s) for s in stop), default=0)
        self.req: "_core.Request | None" = None  # made by start(), on the engine's core
        self.stopped = False  # a stop string ended the request

    @property
    def done(self) -> bool:
        return self.req is not None and (self.stopped or self.req.done)

    def emit(self, tokens: list[int], lps: list) -> list[StreamPiece]:
        """Appends the tokens the core emitted (and their core TokenLogprobs when the request wants
        them); returns the text pieces now safe to show (a stop string ends the request)."""
        pieces = []
        for i, t in enumerate(tokens):
            self.out.append(t)
            if self.want_lp:
                self.lps.append(TokenLogprobs._of(lps[i]))
            if self.dec is not None:
                # a stop string not found before can only end in the new text: search from there
                # (not the whole text again per token, which grew quadratic in long generations)
                start = max(len(self.text) - self.hold + 1, 0)
                self.text += self.dec.push(t)
                if self.stop:
                    cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
                    if cut >= 0:
                        self.text = self.text[:cut]
                        self.stopped = True
                        self.req.stop()
                        return pieces
                safe = len(self.text) - self.hold
                if safe > self.emitted:
                    pieces.append(StreamPiece(self.text[self.emitted:safe]))
                    self.emitted = safe
        return pieces

    def start(self, n_cached: int = 0) -> list[StreamPiece]:
        """The prefill (also for max_tokens=0: the core checks the prompt); n_cached: the leading
        prompt tokens the core already holds (Engine._take_held), else a cold start."""
        eng = self.eng
        tok = eng.tokenizer._core if eng.tokenizer is not None else None
        self.req = _core.Request(eng._core, eng._spec if self.spec else None, tok, self.spec,
                                 tree=self.spec and eng.verify == "tree", sampling=self.sampling,
                                 max_tokens=self.max_tokens, exact_max_tokens=self.cache_prompt,
                                 constraint=self.constraint)
        if self.spec and eng._draft_override is not None and self.constraint is None:
            # tests, benchmarks: the B-1 drafts to verify; a tree round puts them first in the drafter's
            # top-K. Unconstrained requests only (the core refuses a forced draft under a constraint).
            override, prompt = eng._draft_override, self.prompt
            self.req.set_draft_source(lambda out, B: override(prompt, out, B) or [])
        return self.emit(*self.req.start(self.prompt, n_cached))

    def start_ticket(self, sched) -> list[StreamPiece]:
        """start() through the core's scheduler (Engine(n_seq > 1)): the request queues for a slot
        (with cache_prompt, one whose prompt cache holds a prefix of the prompt); its first tokens."""
        eng = self.eng
        source = None
        if self.spec and eng._draft_override is not None and self.constraint is None:
            override, prompt = eng._draft_override, self.prompt
            source = lambda out, B: override(prompt, out, B) or []  # noqa: E731
        self.req = sched.submit(self.prompt, self.spec, tree=self.spec and eng.verify == "tree",
                                sampling=self.sampling, max_tokens=self.max_tokens,
                                exact_max_tokens=self.cache_prompt, constraint=self.constraint,
                                cache_prompt=self.cache_prompt, draft_source=source)
        return self.emit(*self.req.next())

    def step(self) -> list[StreamPiece]:
        """One AR step or one speculative round (a scheduler's ticket: the tokens of the steps
        since the last call)."""
        if isinstance(self.req, _core.Request):
            pieces = self.emit(*self.req.step())
            failure = self.req.stats["drafter_failure"]
        else:
            pieces = self.emit(*self.req.next())
            failure = self.req.stats["drafter_failure"] if self.req.done else ""
        if failure:
            self.eng._warn_drafter_failed(failure)
        return pieces

    def drain(self) -> None:
        """A ticket stopped by a stop string: wait for its end (the tokens after the stop are dropped)."""
        if self.req is not None and not isinstance(self.req, _core.Request):
            while not self.req.done:
                self.req.next()

    def held(self) -> tuple[list[int], bool]:
        """What the core holds after this request: its sequence, and whether the ring is in step."""
        return self.prompt + self.req.committed[:-1], self.req.ring_in_step

    def final_piece(self) -> StreamPiece:
        """The rest of the text, carrying the GenerationResult."""
        stats = self.stats
        if self.req is not None:
            core = self.req.stats
            for key in ("n_cached_tokens", "prefill_s", "decode_s", "ar_steps", "draft_s", "verify_s", "rollback_s",
                        "verified_tokens", "controller_switches", "drafter_failure", "slot"):
                setattr(stats, key, core[key])
            stats.stop_reason = "stop" if self.stopped else self.req.stop_reason
            if stats.speculative:
                stats.block_size = self.req.block_size
                stats.rounds = core["rounds"]
                stats.acceptance_histogram = core["acceptance_histogram"]
        if self.constraint is not None:
            stats.constraint_s, stats.n_masks = self.constraint.mask_s, self.constraint.n_masks
        if self.dec is not None and stats.stop_reason != "stop":
            self.text += self.dec.flush()
        stats.n_generated = len(self.out)
        last = StreamPiece(self.text[self.emitted:])
        last.result = GenerationResult(text=self.text, tokens=self.out, stats=stats, prompt_tokens=list(self.prompt),
                                       logprobs=self.lps if self.want_lp else None)
        return last


_GRAMMARS: dict = {}  # (path, size, mtime_ns, n_vocab) -> GrammarEngine: engines of one file share one
_GRAMMARS_LOCK = threading.Lock()


def _shared_grammar_engine(tok: Tokenizer, path: Path, n_vocab: int) -> GrammarEngine:
    try:
        st = os.stat(path)
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns, n_vocab)
    except OSError:
        return GrammarEngine(tok, n_vocab)
    with _GRAMMARS_LOCK:
        g = _GRAMMARS.get(key)
        if g is None:
            g = _GRAMMARS[key] = GrammarEngine(tok, n_vocab)
        return g
