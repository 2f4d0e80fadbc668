"""The server's slots: one engine each, run by one worker thread; the pool that hands them out (a
request's prompt continuing a slot's held sequence picks that slot: the prompt cache), the bounded
queue of requests waiting for one, the jobs running on them, and the metrics of what they ran.
The pool lives on the event loop; a job's `run` on its slot's worker."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..engine import Engine, GenerationResult
from .protocol import ApiError


class Slot:
    """One engine and the single thread that runs all its calls (Engine's thread model: one owner)."""

    def __init__(self, index: int, engine: Engine):
        self.index, self.engine = index, engine
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slot{index}")
        self.last_used = 0.0

    def held(self) -> list[int]:
        held = self.engine._held  # the prompt cache's sequence (None: nothing reusable)
        return held[0] if held is not None else []


class Job:
    """A request running on a slot's worker: pieces go to the event loop through `queue`; setting
    `cancel` closes the engine's stream before its next step. `on_end(job)` runs on the event loop
    once the engine is done, before the response ends (it frees the slot: a client's next request
    finds it free, and its prompt cache)."""

    def __init__(self, slot: Slot, prompt: list[int], kw: dict, loop: asyncio.AbstractEventLoop, on_end):
        self.slot, self.prompt, self.kw, self.loop, self.on_end = slot, prompt, kw, loop, on_end
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.result: GenerationResult | None = None
        self.ended = False  # set on the worker before "end" is queued

    def run(self) -> None:  # on the slot's worker thread
        put = lambda item: self.loop.call_soon_threadsafe(self.queue.put_nowait, item)  # noqa: E731
        gen = None
        try:
            gen = self.slot.engine.generate(self.prompt, stream=True, cache_prompt=True, **self.kw)
            for piece in gen:
                if piece.result is not None:
                    self.result = piece.result
                put(("piece", piece))
                if self.cancel.is_set():
                    break
        except Exception as e:  # noqa: BLE001 - reported to the client
            put(("error", e))
        finally:
            if gen is not None:
                gen.close()  # a cancelled stream ends here: the engine is free for the next request
            self.ended = True
            self.loop.call_soon_threadsafe(self.on_end, self)  # runs before "end" reaches the queue
            put(("end", None))


class SlotPool:
    """Free slots, a bounded FIFO of waiting requests and the running jobs (event-loop side only)."""

    def __init__(self, engines: list[Engine], max_queue: int):
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.free = list(self.slots)
        self.waiting: list[asyncio.Future] = []
        self.max_queue = max_queue
        self.running: set[Job] = set()  # the jobs on the slots' workers (cancelled at shutdown)

    @property
    def n_busy(self) -> int:
        return len(self.slots) - len(self.free)

    def start(self, slot: Slot, prompt: list[int], kw: dict) -> Job:
        """Runs Engine.generate(prompt, **kw) on an acquired slot's worker; the slot comes back to
        the pool when the engine is done."""
        loop = asyncio.get_running_loop()
        job = Job(slot, prompt, kw, loop, self._job_ended)
        self.running.add(job)
        loop.run_in_executor(slot.worker, job.run)
        return job

    def _job_ended(self, job: Job) -> None:
        self.running.discard(job)
        self.release(job.slot)

    def cancel_all(self) -> None:
        """Every running job stops at its engine's next step."""
        for job in self.running:
            job.cancel.set()

    def close(self) -> None:
        """Waits for the workers (blocking: off the event loop), then frees the engines."""
        for s in self.slots:
            s.worker.shutdown(wait=True, cancel_futures=True)
            s.engine.close()

    def _pick(self, prompt: list[int]) -> Slot:
        def reuse(s: Slot) -> int:
            h = s.held()
            return len(h) if 0 < len(h) < len(prompt) and prompt[:len(h)] == h else 0

        # the longest reuse; else the slot holding least (the cheapest cache to lose), least recently used
        best = max(self.free, key=lambda s: (reuse(s), -len(s.held()), -s.last_used))
        self.free.remove(best)
        return best

    async def acquire(self, prompt: list[int]) -> Slot:
        if self.free and not self.waiting:
            return self._pick(prompt)
        if len(self.waiting) >= self.max_queue:
            raise ApiError(503, f"server busy: {len(self.slots)} slots busy and {len(self.waiting)} requests queued",
                           code="queue_full", kind="server_error")
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut in self.waiting:
                self.waiting.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed a slot just as the client left
            raise

    def release(self, slot: Slot) -> None:
        slot.last_used = time.monotonic()
        while self.waiting:
            fut = self.waiting.pop(0)
            if not fut.done():
                fut.set_result(slot)
                return
        self.free.append(slot)


# ---- metrics -----------------------------------------------------------------------------------

class Metrics:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.cached_tokens = self.generated = 0
        self.prefill_s = self.decode_s = self.draft_s = self.verify_s = self.rollback_s = 0.0
        self.acceptance: dict[int, int] = {}  # committed tokens per round -> rounds
        self.cancelled = 0

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def add(self, r: GenerationResult) -> None:
        s = r.stats
        self.prompt_tokens += s.n_prompt_tokens
        self.cached_tokens += s.n_cached_tokens
        self.generated += s.n_generated
        self.prefill_s += s.prefill_s
        self.decode_s += s.decode_s
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        self.rollback_s += s.rollback_s
        for k, n in enumerate(s.acceptance_histogram):
            if n:
                self.acceptance[k] = self.acceptance.get(k, 0) + n

    def text(self, pool: SlotPool) -> str:
        p = "dflash_"
        out = [f"# TYPE {p}requests_total counter"]
        for (ep, st), n in sorted(self.requests.items()):
            out.append(f'{p}requests_total{{endpoint="{ep}",status="{st}"}} {n}')
        for name, v, kind in [
            ("requests_cancelled_total", self.cancelled, "counter"),
            ("prompt_tokens_total", self.prompt_tokens, "counter"),
            ("prompt_tokens_cached_total", self.cached_tokens, "counter"),
            ("generated_tokens_total", self.generated, "counter"),
            ("prefill_seconds_total", self.prefill_s, "counter"),
            ("decode_seconds_total", self.decode_s, "counter"),
            ("draft_seconds_total", self.draft_s, "counter"),
            ("verify_seconds_total", self.verify_s, "counter"),
            ("rollback_seconds_total", self.rollback_s, "counter"),
            ("decode_tokens_per_second", self.generated / self.decode_s if self.decode_s > 0 else 0.0, "gauge"),
            ("slots", len(pool.slots), "gauge"),
            ("slots_busy", pool.n_busy, "gauge"),
            ("queue_length", len(pool.waiting), "gauge"),
        ]:
            out += [f"# TYPE {p}{name} {kind}", f"{p}{name} {v}"]
        # acceptance length (committed tokens per speculative round) as a cumulative histogram
        out.append(f"# TYPE {p}acceptance_length histogram")
        cum = total = 0
        for k in sorted(self.acceptance):
            cum += self.acceptance[k]
            total += k * self.acceptance[k]
            out.append(f'{p}acceptance_length_bucket{{le="{k}"}} {cum}')
        out += [f'{p}acceptance_length_bucket{{le="+Inf"}} {cum}', f"{p}acceptance_length_sum {total}",
                f"{p}acceptance_length_count {cum}"]
        return "\n".join(out) + "\n"
