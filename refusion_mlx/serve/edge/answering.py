"""Answering a request, whichever API asked: done once for all of them.

An API's route validates its body (pydantic), then :meth:`Answering.answer`
makes the engine's request on a worker thread (the API's adapter makes a
draft, ``engine_request.finish`` the request), queues it, waits until the decoder has taken
it -- so a refusal is still a plain 4xx, never a half-written stream -- and
either collects the whole answer or streams it. The engine's events (final
text in answer order, tool calls, a step's commits, the end or an error)
reach the client through the API's :class:`Writer`, which only shapes them.
A client that leaves cancels its request.

On a stop the engine ends every request after the step in progress; a
handler whose request it has not ended ``STOP_WAIT`` s later (a step that
cannot end: a rank died mid-collective) answers "shutting down" itself,
before uvicorn's graceful shutdown (``GRACEFUL_SHUTDOWN`` s) would cancel it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..core.engine_request import ChatPrompt, Draft, EngineRequest, RequestTerms, finish
from ..core.job import Job
from ..core.outcome import Outcome
from ..core.refusal import Reason, Refusal
from ..core.tool_calls import ToolCall
from .http_errors import printable
from .json_answer import json_answer
from .lanes import Lanes
from .request_ids import request_id, tagged
from .security import KEY_SCOPE

log = logging.getLogger("refusion_mlx.server")

GRACEFUL_SHUTDOWN = 5  # seconds uvicorn waits for open requests on a stop, then cancels them
STOP_WAIT = 3.0  # seconds a request waits for the engine to end it once a stop is asked
COMPILED_KEPT = 16  # constraints kept compiled (tools, schemas, grammars), the most recently used
CLIENT_CHECK = 0.25  # seconds between two looks at whether a request's client is still there
# seconds a stream may go without a byte before its writer's keep-alive goes out: agents (Codex, Claude Code)
# give up on a stream silent for 300 s, and a call held back whole or a long prefill can take that long
KEEP_ALIVE = 15.0
# a stream still queued after this many seconds starts before its admission (its headers, its first
# events, then keep-alives), so a busy server's queue does not run out a client's idle timer; one admitted
# or refused sooner (a refusal at once is an HTTP status: the queue full, the KV budget) is as before
QUEUED_START = 2.0


class ClientGone(Exception):
    """The client closed its connection before the answer."""


@dataclass
class Said:
    """A run of an answer's text between its calls, with its tokens' entries (when asked)."""

    text: str = ""
    logprobs: list = field(default_factory=list)  # the tokens' entries (serve/protocols/openai_logprobs.py)


@dataclass
class Answer:
    """A whole answer: its text runs and calls in the order the model wrote
    them (``parts``, as a stream gives them out), and how it ended (the
    engine's "done" event, an :class:`~..core.outcome.Outcome`)."""

    parts: List[Union[Said, ToolCall]] = field(default_factory=list)
    done: Optional[Outcome] = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, Said))

    @property
    def calls(self) -> List[ToolCall]:
        return [p for p in self.parts if isinstance(p, ToolCall)]

    @property
    def logprobs(self) -> list:
        return [e for p in self.parts if isinstance(p, Said) for e in p.logprobs]


class Writer:
    """One API's shape of an answer. A stream is ``start()``, then for each
    event ``text``, ``tool_call`` or ``commits`` (a step's first text and the
    slots it committed), then ``done`` or ``error``: each returns the
    server-sent events to write (maybe none). ``answer`` is the body of a
    whole answer. Subclasses shape; they hold whatever state their events
    need. ``request``: the engine's request, set once it is made; ``cached``:
    the prompt tokens the prompt cache held, set once the engine started it;
    ``request_id``: the HTTP request's id (an Anthropic error event's)."""

    request: Optional[EngineRequest] = None
    cached: int = 0
    request_id: str = ""  # the HTTP request's id (.request_ids), set before the stream starts

    def start(self) -> str:
        return ""

    def text(self, text: str) -> str:
        raise NotImplementedError

    def tool_call(self, call: ToolCall) -> str:
        raise NotImplementedError

    def commits(self, text: str, commits: dict) -> str:
        return self.text(text) if text else ""

    def logprobs(self, text: str, entries: list) -> str:
        """Text with its tokens' log-probabilities (an API that shows them overrides this)."""
        return self.text(text) if text else ""

    def done(self, outcome: Outcome) -> str:
        raise NotImplementedError

    def error(self, refusal: Refusal) -> str:
        raise NotImplementedError

    def keep_alive(self) -> str:
        """What a stream sends after ``KEEP_ALIVE`` s of silence: an SSE comment (OpenAI's clients skip it);
        an API whose clients' idle timers count events only sends an event it takes as harmless."""
        return ": keep-alive\n\n"

    def answer(self, answer: Answer) -> Any:
        raise NotImplementedError


def data(obj) -> str:
    """A server-sent event with only data (OpenAI's chat and text completions)."""
    return f"data: {json.dumps(obj)}\n\n"


def event(name: str, obj) -> str:
    """A named server-sent event (the Responses and Messages APIs)."""
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n"


class Answering:
    """What the routes of every API share: the prompt's tokenization on the
    HTTP side, and the way from a request to its answer or stream."""

    def __init__(self, server):
        self.server, self.engine, self.config = server, server.engine, server.config
        self._compiled: "OrderedDict[tuple, object]" = OrderedDict()  # constraints compiled, least recent first
        self._compiled_lock = threading.Lock()
        self._lanes: Optional[Lanes] = None

    @property
    def lanes(self) -> Lanes:
        """The tokenizers' lanes (made from the engine's two once it has loaded them)."""
        if self._lanes is None:
            self._lanes = Lanes(*self.engine.http_tokenizers, stopping=lambda: self.engine.stopping_since is not None)
        return self._lanes

    async def off_loop(self, request: Request, work: Callable[[], Any]) -> Any:
        """``work`` (templates, tokenizing, compiling) on a worker thread, in the request's lane."""
        return await self.lanes.run(request.scope, work)

    @property
    def terms(self) -> RequestTerms:
        """What every request is made under (known once the model is loaded)."""
        return RequestTerms(self.tokenize, self.vocab_size, self.context, self.config.decoding,
                            takes_tools=self.engine.tool_format is not None, call_grammar=self.config.call_grammar,
                            compile=self.compile, max_tokens_given=self.config.max_tokens_given,
                            kv_cost=self.engine.kv_cost, max_kv_bytes=self.engine.max_kv_bytes)

    def compile(self, constraint):
        """A request's constraint compiled against the tokenizer (a DecodeError
        naming its field), once for its every request while it is among the
        last :data:`COMPILED_KEPT` (an agent sends the same tools each turn)."""
        from ...decode.grammar import compile_constraint

        key = (constraint.kind, constraint.source, constraint.name)
        with self._compiled_lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        lane = self.lanes.current()  # its tokenizer's lock held while the tokenizer is read, not while compiling
        made = compile_constraint(constraint, lane.tokenizer, self.vocab_size, lane.tokenizer.eos_token_id,
                                  lock=lane.lock, mask_id=getattr(self.engine.args, "mask_token_id", None))
        with self._compiled_lock:
            self._compiled[key] = made
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return made

    @property
    def context(self) -> int:
        return self.engine.args.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.engine.args.vocab_size

    def tokenize(self, source) -> List[int]:
        """A prompt's ids: a ChatPrompt through the chat template (within its
        limits: ``models.template_steps``), text as is, ids unchanged."""
        from ...decode.prompt import text_ids
        from ...decode.stream import chat_prompt

        if isinstance(source, list) and source and isinstance(source[0], int):
            return source
        lane = self.lanes.current()
        with lane.lock:
            tokenizer = lane.tokenizer
            if isinstance(source, (ChatPrompt, list)):
                prompt = source if isinstance(source, ChatPrompt) else ChatPrompt(source)
                options = {**(self.config.chat_template_config or {}), **(prompt.template_kwargs or {})}
                return chat_prompt(tokenizer, prompt.messages, tools=list(prompt.tools) or None,
                                   prefill=prompt.prefill, template_kwargs=options or None,
                                   add_generation_prompt=prompt.opened)
            return text_ids(tokenizer, source)

    def cache_owner(self, request: Request, user: Optional[str]) -> Optional[str]:
        """Whose prompt-cache entries a request continues and leaves (``--prompt-cache-scope``): the
        API key it presented and its ``user`` field, hashed; "" (everyone's) when the scope is
        shared; None (none at all) when it is private and the request names no user."""
        scope = self.config.prompt_cache_scope
        if scope == "shared":
            return ""
        if not user and scope == "private":
            return None
        key = request.scope.get(KEY_SCOPE, "")
        return hashlib.sha256(f"{key}|{user or ''}".encode()).hexdigest()[:24]

    async def answer(self, request: Request, make: Callable[[], Draft], writer: Writer, stream: bool,
                     user: Optional[str] = None):
        """Make the engine's request (``make``, the API's adapter, on a worker thread), run it, and
        answer with ``writer``: the whole answer, or its stream when ``stream``.
        ``user``: the request's own name of its end user (OpenAI's ``user``,
        Anthropic's ``metadata.user_id``), which partitions the prompt cache."""
        t0 = time.perf_counter()
        writer.request_id = request_id(request.scope)
        owner = self.cache_owner(request, user)
        writer.request = await self.off_loop(request, lambda: finish(make(), self.terms, owner))
        job = self.engine.submit(writer.request, asyncio.get_running_loop())
        try:
            await admission(job, self.engine, request, QUEUED_START if stream else None)
            writer.cached = job.cached
            headers = cut_header(writer.request)
            if stream:
                events = sse(job, self.engine, writer, t0, request.scope)
                weakref.finalize(events, job.cancelled.set)  # also if the stream never starts
                response = JobStream(job, events, headers)
                job = None  # the stream owns it now
                return response
            answer = await collect(job, self.engine, request)
            _log(request.url.path, t0, answer.done, request.scope)
            return await json_answer(lambda: writer.answer(answer), headers)
        except ClientGone:
            _log(request.url.path, t0, "client went away", request.scope)
            return Response(status_code=499)
        finally:
            if job is not None:
                job.cancelled.set()  # no-op once it finished; frees the generation when the client left


async def job_event(job: Job, engine, request: Optional[Request] = None, idle: Optional[float] = None) -> tuple:
    """The job's next event; a client that leaves meanwhile (``request``)
    cancels it; a stop the engine does not answer in ``STOP_WAIT`` s ends it;
    none for ``idle`` s: ("idle", None)."""
    quiet = None if idle is None else time.monotonic() + idle
    while True:
        # looked at every CLIENT_CHECK s, also while events keep coming (a fast decode never times out below)
        if request is not None and time.monotonic() - job.client_seen >= CLIENT_CHECK:
            job.client_seen = time.monotonic()
            if await request.is_disconnected():
                raise ClientGone()
        wait = CLIENT_CHECK if quiet is None else max(0.0, min(CLIENT_CHECK, quiet - time.monotonic()))
        try:
            return await asyncio.wait_for(job.events.get(), wait)
        except asyncio.TimeoutError:
            since = engine.stopping_since
            if since is not None and time.monotonic() - since > STOP_WAIT:
                return "error", Refusal(Reason.SHUTTING_DOWN, "the server is shutting down")
            if quiet is not None and time.monotonic() >= quiet:
                return "idle", None


async def admission(job: Job, engine, request: Request, within: Optional[float] = None) -> bool:
    """Wait for the job's admission (the decoder or the scorer took it; an error raised): True when it is
    still queued after ``within`` s (None: however long it waits)."""
    what, payload = await job_event(job, engine, request, idle=within)
    if what == "error":
        raise payload
    return what == "idle"


async def next_event(job: Job, engine, request: Request) -> tuple:
    """The job's next event (an error raised)."""
    item = await job_event(job, engine, request)
    if item[0] == "error":
        raise item[1]
    return item


async def collect(job: Job, engine, request: Request) -> Answer:
    """A job's whole answer, gathered from its events (a request that does not stream)."""
    answer = Answer()
    while answer.done is None:
        what, payload = await next_event(job, engine, request)
        if what in ("text", "commits", "logprobs"):
            text, entries = (payload, []) if what == "text" else (payload[0], payload[1] if what == "logprobs" else [])
            if text or entries:  # a stream's writer opens a text block for these alone
                if not answer.parts or not isinstance(answer.parts[-1], Said):
                    answer.parts.append(Said())
                answer.parts[-1].text += text
                answer.parts[-1].logprobs += entries
        elif what == "tool_call":
            answer.parts.append(payload)
        elif what == "done":
            answer.done = payload
    return answer


async def sse(job: Job, engine, writer: Writer, t0: float, scope):
    """The job's events as the writer shapes them, until the end or an error (``scope``: the request's)."""
    note: Any = "client went away"
    try:
        first = writer.start()
        if first:
            yield first
        sent = time.monotonic()
        while True:
            what, payload = await job_event(job, engine, idle=max(0.0, sent + KEEP_ALIVE - time.monotonic()))
            if what == "idle":  # nothing to say for a while (a call held back whole): keep the client waiting
                out = writer.keep_alive()
            elif what == "start":  # a stream that started while queued (QUEUED_START): admitted now
                writer.cached, out = job.cached, ""
            elif what == "error":
                note = payload.message
                out = writer.error(payload)
            elif what == "done":
                note = payload
                out = writer.done(payload)
            elif what == "commits":
                out = writer.commits(*payload)
            elif what == "logprobs":
                out = writer.logprobs(*payload)
            else:
                out = writer.text(payload) if what == "text" else writer.tool_call(payload)
            if out:
                yield out
                sent = time.monotonic()
            if what in ("error", "done"):
                break
    finally:
        job.cancelled.set()
        _log("stream", t0, note, scope)


CUT_HEADER = "X-Max-Tokens-Cut"


def cut_header(*requests: EngineRequest) -> dict:
    """``{CUT_HEADER: "ASKED -> GIVEN"}`` when the max_tokens of a request was cut to fit the context (of
    several, a list of prompts: the least any was given), else {}."""
    cut = [r for r in requests if r.asked_max_tokens is not None]
    if not cut:
        return {}
    return {CUT_HEADER: f"{cut[0].asked_max_tokens} -> {min(r.max_tokens for r in cut)}"}


class JobStream(StreamingResponse):
    """A job's server-sent events; however the response ends -- finished, or the
    client gone before the first chunk (its generator never started, so only
    the garbage collector would run its ``finally``) -- the job is cancelled
    (a no-op once it finished)."""

    def __init__(self, job: Job, events, headers: Optional[dict] = None):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()


def _log(what: str, t0: float, note: Optional[Any], scope) -> None:
    """The request's line in the server's log (``scope``: its ASGI scope, whose id ends the line)."""
    if isinstance(note, Outcome):
        note = note.brief()
    log.info("%s", tagged(f"{printable(what)} {time.perf_counter() - t0:.3f}s {note}", scope))
