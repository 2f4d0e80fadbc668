"""The server's slots: the sequence slots of one engine (Engine(n_seq=N): the core's scheduler batches
the requests running on them into shared target passes), one worker thread per slot calling
generate; the pool that counts them out, the bounded queue of requests waiting for one, the jobs
running on them, and the metrics of what they ran. Which slot a request runs on, and so its
prompt cache (the slot whose held sequence is the longest prefix of its prompt), the core picks.
The pool lives on the event loop; a job's `run` on a worker."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from ..engine import Engine, GenerationResult
from .protocol import ApiError


def n_slots(engine: Engine) -> int:
    """The engine's sequence slots: its scheduler's (n_seq > 1), else one."""
    sched = engine._sched
    return sched.n_slots if sched is not None else 1


class Job:
    """A request running on a worker: pieces go to the event loop through `queue`; setting
    `cancel` closes the engine's stream before its next step (its ticket stops, and its slot in the
    core frees at the scheduler's next step). `on_end(job)` runs on the event loop once the engine is
    done, before the response ends (it frees the pool's slot: a client's next request finds it free,
    and its prompt cache)."""

    def __init__(self, engine: Engine, prompt: list[int], kw: dict, loop: asyncio.AbstractEventLoop, on_end):
        self.engine, self.prompt, self.kw, self.loop, self.on_end = engine, prompt, kw, loop, on_end
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.result: GenerationResult | None = None
        self.ended = False  # set on the worker before "end" is queued

    def run(self) -> None:  # on a worker thread
        put = lambda item: self.loop.call_soon_threadsafe(self.queue.put_nowait, item)  # noqa: E731
        gen = None
        try:
            gen = self.engine.generate(self.prompt, stream=True, cache_prompt=True, **self.kw)
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
                gen.close()  # a cancelled stream ends here: its slot is free for the next request
            self.ended = True
            self.loop.call_soon_threadsafe(self.on_end, self)  # runs before "end" reaches the queue
            put(("end", None))


class SlotPool:
    """One engine's slots: how many are busy, a bounded FIFO of waiting requests and the running
    jobs (event-loop side only), and the workers that run the jobs."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine = engine
        self.n_slots = n_slots(engine)
        self.worker = ThreadPoolExecutor(max_workers=self.n_slots, thread_name_prefix="slot")
        self.n_busy = 0
        self.waiting: list[asyncio.Future] = []
        self.max_queue = max_queue
        self.running: set[Job] = set()  # the jobs on the workers (cancelled at shutdown)

    def start(self, prompt: list[int], kw: dict) -> Job:
        """Runs Engine.generate(prompt, **kw) on a worker, in the slot acquire() took; the slot
        comes back to the pool when the engine is done."""
        loop = asyncio.get_running_loop()
        job = Job(self.engine, prompt, kw, loop, self._job_ended)
        self.running.add(job)
        loop.run_in_executor(self.worker, job.run)
        return job

    def _job_ended(self, job: Job) -> None:
        self.running.discard(job)
        self.release()

    def cancel_all(self) -> None:
        """Every running job stops at the engine's next step."""
        for job in self.running:
            job.cancel.set()

    def close(self) -> None:
        """Waits for the workers (blocking: off the event loop), then frees the engine."""
        self.worker.shutdown(wait=True, cancel_futures=True)
        self.engine.close()

    async def acquire(self) -> None:
        """Takes a slot, waiting in the queue while all are busy (503 when it is full)."""
        if self.n_busy < self.n_slots and not self.waiting:
            self.n_busy += 1
            return
        if len(self.waiting) >= self.max_queue:
            raise ApiError(503, f"server busy: {self.n_slots} slots busy and {len(self.waiting)} requests queued",
                           code="queue_full", kind="server_error")
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self.waiting:
                self.waiting.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release()  # handed a slot just as the client left
            raise

    def release(self) -> None:
        """A slot comes free: the first waiting request takes it over."""
        while self.waiting:
            fut = self.waiting.pop(0)
            if not fut.done():
                fut.set_result(None)
                return
        self.n_busy -= 1


# ---- metrics -----------------------------------------------------------------------------------

class Metrics:
    def __init__(self, n_slots: int = 1):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.cached_tokens = self.generated = 0
        self.prefill_s = self.decode_s = self.draft_s = self.verify_s = self.rollback_s = 0.0
        self.acceptance: dict[int, int] = {}  # committed tokens per round -> rounds
        # per sequence slot: requests ended there, and their acceptance histograms summed
        self.slot_requests = [0] * n_slots
        self.slot_acceptance: list[dict[int, int]] = [{} for _ in range(n_slots)]
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
        self.slot_requests[s.slot] += 1
        for k, n in enumerate(s.acceptance_histogram):
            if n:
                self.acceptance[k] = self.acceptance.get(k, 0) + n
                self.slot_acceptance[s.slot][k] = self.slot_acceptance[s.slot].get(k, 0) + n

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
            ("slots", pool.n_slots, "gauge"),
            ("slots_busy", pool.n_busy, "gauge"),
            ("queue_length", len(pool.waiting), "gauge"),
            # the CPU graphs' threads now, and how often a busy machine lowered them
            ("cpu_threads", pool.engine._core.threads_now, "gauge"),
            ("cpu_thread_reductions_total", pool.engine._core.thread_reductions, "counter"),
        ]:
            out += [f"# TYPE {p}{name} {kind}", f"{p}{name} {v}"]
        # acceptance length (committed tokens per speculative round) as a cumulative histogram
        out += _histogram(f"{p}acceptance_length", self.acceptance)
        # per slot: requests, rounds, the tokens they committed and their mean (the acceptance length)
        rows = [(k, self.slot_requests[k], sum(h.values()), sum(a * n for a, n in h.items()))
                for k, h in enumerate(self.slot_acceptance)]
        for name, col, kind in [("slot_requests_total", 1, "counter"), ("slot_rounds_total", 2, "counter"),
                                ("slot_round_tokens_total", 3, "counter")]:
            out.append(f"# TYPE {p}{name} {kind}")
            out += [f'{p}{name}{{slot="{r[0]}"}} {r[col]}' for r in rows]
        out.append(f"# TYPE {p}slot_acceptance_length gauge")
        out += [f'{p}slot_acceptance_length{{slot="{k}"}} {t / n if n else 0.0}' for k, _, n, t in rows]
        # the scheduler's batched target passes (Engine(n_seq > 1)): how many, their tokens, the
        # steps run alone (a request's last AR step), the long prompts' chunks run alone, the tree
        # verifies in the passes, the engine's steps and their seconds, the steps the batch's
        # controller made AR for every request and its mode changes, and the passes by batch
        # width (requests in the pass)
        sched = pool.engine._sched
        if sched is not None:
            ps = sched.pass_stats
            for name, v in [("batch_passes_total", ps["passes"]), ("batch_tokens_total", ps["tokens"]),
                            ("batch_solo_steps_total", ps["solo_steps"]),
                            ("batch_prefill_chunks_total", ps["prefill_chunks"]),
                            ("batch_tree_verifies_total", ps["tree_verifies"]),
                            ("batch_steps_total", ps["steps"]), ("batch_step_seconds_total", ps["step_s"]),
                            ("batch_controller_ar_steps_total", ps["batch_ar_steps"]),
                            ("batch_controller_switches_total", ps["batch_switches"])]:
                out += [f"# TYPE {p}{name} counter", f"{p}{name} {v}"]
            out += _histogram(f"{p}batch_width", dict(enumerate(ps["width"])), range(1, len(ps["width"])))
            mean = sum(w * n for w, n in enumerate(ps["width"])) / ps["passes"] if ps["passes"] else 0.0
            out += [f"# TYPE {p}batch_width_mean gauge", f"{p}batch_width_mean {mean}"]
        return "\n".join(out) + "\n"


def _histogram(name: str, counts: dict[int, int], buckets=None) -> list[str]:
    """A Prometheus histogram of integer observations (value -> count), cumulative by value: a
    bucket per value in `buckets` (None: per value observed)."""
    out = [f"# TYPE {name} histogram"]
    cum = total = 0
    for k in sorted(counts) if buckets is None else buckets:
        cum += counts.get(k, 0)
        total += k * counts.get(k, 0)
        out.append(f'{name}_bucket{{le="{k}"}} {cum}')
    return out + [f'{name}_bucket{{le="+Inf"}} {cum}', f"{name}_sum {total}", f"{name}_count {cum}"]
