"""The server's routes and lifespan: `create_app` over one engine, `serve` (`dflash-native serve`).

A request's body is read on the event loop (a 413 past max_body_bytes), then checked and tokenized
on the prep pool (protocol.RequestReader); it waits for one of the engine's slots (slots.SlotPool),
runs as a job on a worker, batched with the other running jobs by the engine's scheduler, and is
answered whole or as server-sent events (protocol.Reply). A client that goes away is noticed while
it waits and while it runs: its job stops at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import Engine
from .protocol import ApiError, ParsedRequest, Reply, RequestReader
from .slots import Job, Metrics, SlotPool

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any context's worth of text, well below what hurts


def _check_max_body_bytes(max_body_bytes) -> None:
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"[serve] max_body_bytes must be an int >= 1, got {max_body_bytes!r}")


class _Server:
    """The state create_app's routes share: the slot pool, the prep pool, the request reader and the
    metrics. Every method but `_close` runs on the event loop."""

    def __init__(self, engine: Engine, model_name: str, max_queue: int, max_body_bytes: int):
        self.pool = SlotPool(engine, max_queue)
        # a request's model work before it has a slot (JSON, the chat template, tokenization) runs here,
        # never on the event loop: a long prompt must not stall /health or the running streams
        self.prep = ThreadPoolExecutor(max_workers=self.pool.n_slots + 1, thread_name_prefix="prep")
        self.reader = RequestReader(engine, model_name)
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics(self.pool.n_slots)
        self.model_name, self.max_body_bytes = model_name, max_body_bytes
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()),
                           "owned_by": "dflash-native"}

    # ---- a generation request: read, wait for a slot, run, answer --------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The request body, or a 413 as soon as it is known to be over max_body_bytes (from its
        Content-Length, else while it streams in)."""
        limit = self.max_body_bytes

        def too_large(n: str) -> ApiError:
            return ApiError(413, f"the request body has {n} bytes; this server takes at most {limit} "
                            f"(--max-body-bytes)", code="request_too_large")

        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large(length)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"more than {limit}")
                chunks.append(chunk)
        except ClientDisconnect:  # it went away while sending the body: nobody reads the answer
            raise ApiError(499, "the client went away before sending the whole request") from None
        return b"".join(chunks)

    async def _parse(self, request: Request, chat: bool) -> ParsedRequest:
        data = await self._read_body(request)
        return await asyncio.get_running_loop().run_in_executor(self.prep, self.reader.read, data, chat)

    def _shutting_down(self, endpoint: str) -> Response:
        self.metrics.count(endpoint, 503)
        return ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error").response()

    def _cancel(self, job: Job) -> None:
        """The client went away: the engine stops before its next step."""
        if not job.ended and not job.cancel.is_set():
            job.cancel.set()
            self.metrics.cancelled += 1

    async def handle(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            req = await self._parse(request, chat)
        except ApiError as e:
            self.metrics.count(endpoint, e.status)
            return e.response()
        except asyncio.CancelledError:  # the server is shutting down past its grace period
            return self._shutting_down(endpoint)
        # the body is read: the next ASGI message is http.disconnect, whenever the client goes away
        gone = asyncio.ensure_future(_disconnected(request))
        refused = await self._acquire(gone, endpoint)
        if refused is not None:
            return refused
        job = self.pool.start(req.prompt, req.kw)
        reply = Reply(req, self.model_name, self.tokenizer)
        if not req.stream:
            return await self._answer(job, reply, gone, endpoint)
        gone.cancel()  # from here StreamingResponse watches the client (its on_close runs when it goes)
        self.metrics.count(endpoint, 200)
        return _EventStream(self._events(job, reply), lambda: self._cancel(job))

    async def _acquire(self, gone: asyncio.Future, endpoint: str) -> Response | None:
        """Takes a slot for the request (None), or its response when it gets none: the client left
        while queued (499), the queue is full (503) or the server is shutting down (503)."""
        acq = asyncio.ensure_future(self.pool.acquire())
        try:
            await asyncio.wait({gone, acq}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is shutting down past its grace period: leave the queue
            acq.cancel()
            gone.cancel()
            await asyncio.gather(acq, return_exceptions=True)
            return self._shutting_down(endpoint)
        if not acq.done():  # the client left while queued: its place in the queue goes
            acq.cancel()
            await asyncio.gather(acq, return_exceptions=True)
            self.metrics.cancelled += 1
            self.metrics.count(endpoint, 499)
            return Response(status_code=499)
        try:
            return acq.result()  # None: a slot is ours
        except ApiError as e:
            gone.cancel()
            self.metrics.count(endpoint, e.status)
            return e.response()

    async def _answer(self, job: Job, reply: Reply, gone: asyncio.Future, endpoint: str) -> Response:
        """A request that is not streamed: the whole text, once the engine is done."""
        gone.add_done_callback(lambda t: None if t.cancelled() else self._cancel(job))
        text, err = [], None
        try:
            while True:
                kind, item = await job.queue.get()
                if kind == "piece":
                    text.append(item)
                elif kind == "error":
                    err = item
                else:
                    break
        except asyncio.CancelledError:  # the server is shutting down past its grace period
            self._cancel(job)
            return self._shutting_down(endpoint)
        finally:
            gone.cancel()
        if job.cancel.is_set():  # nobody is listening any more
            self.metrics.count(endpoint, 499)
            return Response(status_code=499)
        if err is not None or job.result is None:
            status = 400 if isinstance(err, ValueError) else 500
            self.metrics.count(endpoint, status)
            return ApiError(status, str(err), kind="invalid_request_error" if status == 400
                            else "server_error").response()
        self.metrics.add(job.result)
        self.metrics.count(endpoint, 200)
        return JSONResponse(reply.body("".join(text), job.result))

    async def _events(self, job: Job, reply: Reply):
        """A streamed request's server-sent events, as the engine's pieces come."""
        for c in reply.opening():
            yield c
        while True:
            kind, item = await job.queue.get()
            if kind == "end":
                break
            if kind == "error":
                yield reply.error_event(item)
                continue
            for c in reply.pieces(item):
                yield c
            if item.result is not None:
                self.metrics.add(item.result)
                for c in reply.closing(item.result):
                    yield c
        yield Reply.DONE

    # ---- the other routes, and shutdown ----------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            return ApiError(404, f"the model '{request.path_params['model']}' does not exist (this server serves "
                            f"'{self.model_name}')", "model", "model_not_found").response()
        return JSONResponse(self.model_card)

    async def health(self, request: Request) -> Response:
        pool = self.pool
        return JSONResponse({"status": "ok", "model": self.model_name, "slots": pool.n_slots,
                             "slots_busy": pool.n_busy, "queued": len(pool.waiting)})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.text(self.pool), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        yield
        # at shutdown, after uvicorn's grace period: requests still running stop at the engine's
        # next step, then the engine goes; waited for off the event loop, which the requests'
        # cancelled handlers still need
        self.pool.cancel_all()
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self.prep.shutdown(wait=True, cancel_futures=True)
        self.pool.close()


async def _http_error(request: Request, exc: HTTPException):  # 404 unknown path, 405 wrong method
    return JSONResponse({"error": {"message": f"{exc.detail}: {request.method} {request.url.path}",
                                   "type": "invalid_request_error", "param": None, "code": None}},
                        status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception):  # a bug: no traceback to the client
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").response()


def create_app(engine: Engine, *, model_name: str, max_queue: int = 64,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI app over `engine`: as many requests run at once as it has sequence slots
    (Engine(n_seq=N); one without a scheduler has one), the rest wait in a queue of `max_queue`.
    The app owns the engine: it is closed at shutdown. A request body over `max_body_bytes` is a 413."""
    if not isinstance(engine, Engine):
        raise TypeError(f"[serve] create_app takes one Engine (its n_seq slots serve requests at once), "
                        f"got {type(engine).__name__}")
    _check_max_body_bytes(max_body_bytes)
    s = _Server(engine, model_name, max_queue, max_body_bytes)
    app = Starlette(exception_handlers={HTTPException: _http_error, Exception: _server_error}, routes=[
        Route("/v1/completions", s.completions, methods=["POST"]),
        Route("/v1/chat/completions", s.chat_completions, methods=["POST"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/v1/models/{model:path}", s.model, methods=["GET"]),
        Route("/health", s.health, methods=["GET"]),
        Route("/metrics", s.metrics_text, methods=["GET"]),
    ], lifespan=s.lifespan)
    app.state.pool = s.pool
    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (after the request body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (a client that went away too)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            pass  # the server is shutting down past its grace period: the stream just ends
        finally:
            self._on_close()


def serve(target, *, drafter=None, host: str = "127.0.0.1", port: int = 8000, parallel: int = 1, queue: int = 64,
          model_name: str | None = None, n_threads: int | None = None, log_level: str = "warning",
          shutdown_timeout: float = 5.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, quiet: bool = False,
          **engine_kwargs: Any) -> None:
    """Load one engine with `parallel` sequence slots (Engine(n_seq=parallel): up to `parallel`
    requests run at once, batched into shared target passes, each one's output its output run
    alone) and serve it until interrupted (`dflash-native serve`). At Ctrl-C or SIGTERM running
    requests get `shutdown_timeout` seconds to finish; then they are cancelled (they stop at the
    engine's next step) and the server exits. A request body over `max_body_bytes` is refused
    (413). target / drafter may be hf:// names (dflash_native.hub), resolved once (quiet: without
    progress output); the model id is then the name's repository (and :TYPE) unless `model_name`
    is given. n_threads: None uses every core."""
    from pathlib import Path

    import uvicorn

    from ..hub import is_hub_name, parse as parse_hub_name, resolve_pair

    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1 or queue < 0 \
            or not shutdown_timeout >= 0:
        raise ValueError(f"[serve] parallel must be an int >= 1, queue >= 0 and shutdown_timeout >= 0, got "
                         f"{parallel!r}, {queue} and {shutdown_timeout}")
    _check_max_body_bytes(max_body_bytes)
    if is_hub_name(target):
        hn = parse_hub_name(target)
        model_name = model_name or hn.repo + (f":{hn.type}" if hn.type else "")
    target, drafter = resolve_pair(target, drafter, quiet=quiet)
    engine = Engine(target, drafter=drafter, n_threads=n_threads, n_seq=parallel, **engine_kwargs)
    app = create_app(engine, model_name=model_name or Path(target).stem, max_queue=queue,
                     max_body_bytes=max_body_bytes)
    print(f"[dflash-native serve] {Path(target).name}{' + ' + Path(drafter).name if drafter else ''}, "
          f"{parallel} slot(s) batched, {engine.n_threads} thread(s), on http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)
