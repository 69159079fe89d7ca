"""The HTTP layer: FastAPI routes over the engine.

Handlers run on uvicorn's event loop: pydantic validates the body, a worker
thread makes the engine's request of it (the API's adapter,
``schemas.openai_request``, then ``engine_request.resolve``), the engine
queues it as a Job and the handler awaits its events. Every error -- a
refusal of the request's resolution or of the engine included -- is OpenAI's
envelope ``{"error": {message, type, param, code}}`` (:mod:`.http_errors`);
a stream carries only final text, in answer order, as server-sent events.

On a stop the engine ends every request after the step in progress; a
handler whose request it has not ended ``STOP_WAIT`` s later (a step that
cannot end: a rank died mid-collective) answers "shutting down" itself,
before uvicorn's graceful shutdown (``GRACEFUL_SHUTDOWN`` s) would cancel it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from typing import List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .._version import __version__
from .http_errors import APIError, as_api_error, error_response, refusal_error
from .job import Job
from .metrics import CONTENT_TYPE, exposition, gauges
from .page import add_page
from .refusal import Reason, Refusal
from .slots import answer_blocks
from .schemas import ChatCompletionRequest, CompletionRequest, openai_request

log = logging.getLogger("refusion_mlx.server")

GRACEFUL_SHUTDOWN = 5  # seconds uvicorn waits for open requests on a stop, then cancels them
STOP_WAIT = 3.0  # seconds a request waits for the engine to end it once a stop is asked


class ClientGone(Exception):
    """The client closed its connection before the answer."""


class BodyLimit:
    """ASGI middleware: a POST needs a Content-Length within the limit (411,
    413); its body is read as JSON whatever the Content-Type (``curl -d``)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        length = dict(headers).get(b"content-length")  # a number: h11 refuses others
        if length is None:
            error = APIError(411, "a Content-Length header is required", code="length_required")
        elif int(length) > self.max_bytes:
            left, deadline = min(int(length), 64 << 20), time.monotonic() + 5
            while left > 0 and time.monotonic() < deadline:  # read it, or the client sees a reset, not the 413
                message = await receive()
                left = left - len(message.get("body", b"")) if message.get("more_body") else 0
            error = APIError(413, f"the request body is {int(length)} bytes; the limit is {self.max_bytes}",
                             code="request_too_large")
        else:
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
            return await self.app(scope, receive, send)
        await error_response(error)(scope, receive, send)


def create_app(server) -> FastAPI:
    """The FastAPI app of a RefusionServer (its engine and its ServerConfig: model id, defaults, limits)."""
    engine, config = server.engine, server.config
    app = FastAPI(title="refusion-mlx", version=__version__,
                  description="OpenAI-compatible server for a ReFusion model (batched, with a prompt cache).")
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["Authorization", "Content-Type"])

    async def on_error(request: Request, exc: Exception):
        error = as_api_error(request, exc)
        engine.metrics.http_error(error.status)
        return error_response(error)

    for exc in (APIError, Refusal, HTTPException, RequestValidationError):
        app.add_exception_handler(exc, on_error)

    def card() -> dict:
        return {"id": config.model_id, "object": "model", "created": server.created, "owned_by": "refusion-mlx"}

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != config.model_id:
            raise APIError(404, f"model {name!r} is not served here (this server serves {config.model_id!r})",
                           "model", "model_not_found")
        return card()

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health():
        """Queue, batch, counters, KV reservations and the prompt cache's size; 503 when the
        engine is stopping, dead, or stuck in a step past the watchdog."""
        ok, status = engine.health()
        return JSONResponse({"status": status, "model": config.model_id, **engine.snapshot()}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        """The Prometheus text format (names prefixed ``refusion_``)."""
        return PlainTextResponse(exposition(engine.metrics, gauges(engine.snapshot(), engine.health()[0])), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await complete(request, body, "chat")

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request):
        return await complete(request, body, "text")

    def tokenize(source) -> List[int]:
        from ..decode.stream import chat_prompt

        if isinstance(source, list) and isinstance(source[0], int):
            return source
        with engine.tokenizer_lock:
            if isinstance(source, list):
                return chat_prompt(engine.http_tokenizer, source)
            return list(engine.http_tokenizer.encode(source))

    def to_request(body, kind):
        return openai_request(body, kind, tokenize, defaults=config.decoding,
                              context=engine.args.max_position_embeddings, vocab_size=engine.args.vocab_size)

    async def job_event(job: Job, request: Optional[Request] = None) -> tuple:
        """The job's next event; a client that leaves meanwhile (``request``)
        cancels it; a stop the engine does not answer in ``STOP_WAIT`` s ends it."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), 0.25)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise ClientGone() from None
                since = engine.stopping_since
                if since is not None and time.monotonic() - since > STOP_WAIT:
                    return "error", Refusal(Reason.SHUTTING_DOWN, "the server is shutting down")

    async def next_event(job: Job, request: Request) -> tuple:
        """The job's next event (an error raised)."""
        event = await job_event(job, request)
        if event[0] == "error":
            raise event[1]
        return event

    async def complete(request: Request, body, kind: str):
        t0 = time.perf_counter()
        job = engine.submit(await run_in_threadpool(to_request, body, kind), asyncio.get_running_loop())
        stream = bool(body.stream)
        head = {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
                "object": "text_completion" if kind == "text" else "chat.completion" + ".chunk" * stream,
                "created": int(time.time()), "model": config.model_id, "system_fingerprint": server.fingerprint}
        try:
            await next_event(job, request)  # admitted to the batch: the decoder took it
            if stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = sse(job, kind, head, t0, include_usage)
                weakref.finalize(events, job.cancelled.set)  # also if the stream never starts
                response = JobStream(job, events)
                job = None  # the stream owns it now
                return response
            pieces, event = [], ("start", None)
            while event[0] != "done":
                event = await next_event(job, request)
                pieces += [event[1]] if event[0] == "text" else []
            done, text = event[1], "".join(pieces)
            choice = {"index": 0, "finish_reason": done["finish_reason"], "logprobs": None,
                      **({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})}
            _log(request.url.path, t0, done)
            return {**head, "choices": [choice], "usage": done["usage"]}
        except ClientGone:
            _log(request.url.path, t0, "client went away")
            return Response(status_code=499)
        finally:
            if job is not None:
                job.cancelled.set()  # no-op once it finished; frees the generation when the client left

    async def sse(job: Job, kind: str, head: dict, t0: float, include_usage: bool):
        """One chunk per piece of final text, in order; the finish (and usage); [DONE]."""
        def chunk(text, finish=None, role: bool = False) -> dict:
            choice = {"index": 0, "finish_reason": finish, "logprobs": None}
            if kind == "chat":
                choice["delta"] = {**({"role": "assistant"} if role else {}),
                                   **({"content": text} if text is not None else {})}
            else:
                choice["text"] = text or ""
            return {**head, "choices": [choice]}

        note = "client went away"
        try:
            if job.request.include_commits:  # first, the answer's blocks, nothing committed yet
                yield data({**chunk("", role=True), "commits": {"step": 0, "phase": "", "slots": [],
                                                                 "blocks": answer_blocks(job.request)}})
            elif kind == "chat":
                yield data(chunk("", role=True))
            while True:
                what, payload = await job_event(job)
                if what == "text":
                    yield data(chunk(payload))
                elif what == "commits":  # a step's text (maybe none yet) and the slots it committed
                    yield data({**chunk(payload[0] or None), "commits": payload[1]})
                elif what == "error":
                    note = payload.message
                    yield data(refusal_error(payload).body())
                    break
                elif what == "done":
                    note, usage, last = payload, payload["usage"], chunk(None, payload["finish_reason"])
                    if include_usage:  # OpenAI's shape: usage in a chunk of its own
                        yield data(last) + data({**head, "choices": [], "usage": usage})
                    else:
                        yield data({**last, "usage": usage})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()
            _log("stream", t0, note)

    add_page(app, server)  # the web chat at /
    return app


class JobStream(StreamingResponse):
    """A job's server-sent events; however the response ends -- finished, or the
    client gone before the first chunk (its generator never started, so only
    the garbage collector would run its ``finally``) -- the job is cancelled
    (a no-op once it finished)."""

    def __init__(self, job: Job, events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()


def data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _log(what: str, t0: float, note) -> None:
    if isinstance(note, dict):
        u, s = note["usage"], note["stats"]
        note = (f"prompt={u['prompt_tokens']} cached={u['prompt_tokens_details']['cached_tokens']} "
                f"completion={u['completion_tokens']} finish={note['finish_reason']}"
                + (f" steps={s['steps']} tokens/forward={s['tokens_per_forward']:.2f}" if s else ""))
    log.info("%s %.3fs %s", what, time.perf_counter() - t0, note)
