"""Several choices in one OpenAI request: a list of prompts on
``/v1/completions`` (one choice per prompt) and ``n`` > 1 (independent
answers per prompt), choice ``index`` = prompt * n + sample.

Every choice is its own engine request, all submitted at once, so the
engine decodes them in one batch (continuous batching); ``n`` answers of
one prompt share its prefilled rows (the first prefills it, the others are
admitted once its rows are in: :meth:`..caches.prompt_cache.PromptCache.waits`).
A refusal of any choice refuses the request (a plain 4xx, nothing decoded
kept); once admitted, the answers are collected together, or streamed as
their chunks come, each chunk naming its choice's index (a stream starts
once its first choice is admitted: one that fails after is an error event).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, List, Optional

from fastapi import Request
from fastapi.responses import Response

from ..core.engine_request import EngineRequest, finish
from ..core.outcome import Outcome
from ..core.refusal import Reason, Refusal
from ..edge import answering as edge
from ..edge.json_answer import json_answer
from ..edge.answering import ClientGone, JobStream, _log, collect, cut_header, data, job_event
from .openai_bodies import MAX_PROMPTS
from .openai_echo import check_work


def usage_of(outcomes: List[Outcome], n: int) -> dict:
    """The request's usage: completion tokens of every choice; each prompt's tokens once (n samples share it)."""
    usages = [o.usage for o in outcomes]
    prompt = sum(u.prompt for u in usages[::n])
    completion = sum(u.completion for u in usages)
    cached = sum(u.cached for u in usages[::n])
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if all(u.layout is not None for u in usages):  # ReFusion's figures, as one answer's usage has them
        forwards = sum(u.forwards for u in usages)
        decoded = sum(u.tokens_per_forward * u.forwards for u in usages)
        out.update(layout=dict(usages[0].layout), forwards=forwards,
                   tokens_per_forward=round(decoded / forwards, 4) if forwards else 0.0)
    return out


async def answer_choices(answering, request: Request, body, kind: str, make: Callable, prompts: int, n: int,
                         writer_class):
    """Answer ``prompts`` x ``n`` choices: ``make(index)`` makes each prompt's
    draft (its ``n`` samples' requests differ in their seeds: seed + sample);
    ``writer_class`` shapes each choice (its index)."""
    if prompts * n > MAX_PROMPTS:
        raise Refusal(Reason.INVALID_VALUE, f"n: {prompts} prompts x n {n} is over {MAX_PROMPTS} choices", "n")
    t0 = time.perf_counter()
    owner = answering.cache_owner(request, body.user)  # whose prompt-cache entries they may use (as one request)

    def made() -> List[EngineRequest]:
        terms, out = answering.terms, []
        for p in range(prompts):
            draft = make(p)
            out += [finish(draft, terms, owner, k) for k in range(n)]
        scored = [r for r in out if r.scoring is not None]
        check_work([r.scoring.work(len(r.prompt_ids)) for r in scored],
                   "mc_num" if any(r.scoring.estimator == "mc" for r in scored) else "prompt")
        return out

    requests = await answering.off_loop(request, made)
    engine, loop = answering.engine, asyncio.get_running_loop()
    jobs = engine.submit_all(requests, loop)  # all queued or none (a Refusal)
    try:
        # admitted: the decoder (or the scorer) took it. A stream starts at its first choice's admission, the
        # others' chunks following as they come: waiting for every choice's held a stream of more choices
        # than --max-batch until its last were admitted, near the end of the whole answer
        for job in jobs[:1] if body.stream else jobs:  # a stream queued past QUEUED_START starts anyway
            await edge.admission(job, engine, request, edge.QUEUED_START if body.stream else None)
    except BaseException as e:
        for job in jobs:
            job.cancelled.set()
        if isinstance(e, ClientGone):  # it left while its choices waited in the queue
            _log(request.url.path, t0, "client went away", request.scope)
            return Response(status_code=499)
        raise
    first = writer_class(answering.server, body, kind)
    writers = [writer_class(answering.server, body, kind, i, first.head) for i in range(len(jobs))]
    for w, r in zip(writers, requests):
        w.request = r
    if body.stream:
        return JobStream(_Jobs(jobs), _stream(jobs, writers, engine, n, t0, request.scope), cut_header(*requests))
    try:
        answers = await asyncio.gather(*(collect(job, engine, request) for job in jobs))
    except ClientGone:
        _log(request.url.path, t0, "client went away", request.scope)
        return Response(status_code=499)
    finally:
        for job in jobs:
            job.cancelled.set()
    _log(request.url.path, t0, f"{len(jobs)} choices", request.scope)

    def build() -> dict:
        bodies = [w.answer(a) for w, a in zip(writers, answers)]
        return {**bodies[0], "choices": [b["choices"][0] for b in bodies],
                "usage": usage_of([a.done for a in answers], n)}

    return await json_answer(build, cut_header(*requests))


class _Jobs:
    """The choices' jobs as one, for :class:`JobStream` (cancelling cancels them all)."""

    def __init__(self, jobs):
        self.cancelled = self
        self.jobs = jobs

    def set(self) -> None:
        for job in self.jobs:
            job.cancelled.set()


async def _stream(jobs, writers, engine, n: int, t0: float, scope):
    """The choices' chunks as they come, each with its index; then the usage and [DONE] (``scope``: the
    request's, for its log line)."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i, job):
        while True:
            item = await job_event(job, engine)
            await merged.put((i, item))
            if item[0] in ("error", "done"):
                return

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    outcomes: List[Optional[Outcome]] = [None for _ in jobs]
    note = "client went away"
    try:
        for w in writers:
            start = w.start()
            if start:
                yield start
        left, sent = len(jobs), time.monotonic()
        while left:
            try:
                i, (what, payload) = await asyncio.wait_for(merged.get(), sent + edge.KEEP_ALIVE - time.monotonic())
            except asyncio.TimeoutError:  # no choice has anything to say for a while: keep the client waiting
                yield writers[0].keep_alive()
                sent = time.monotonic()
                continue
            sent = time.monotonic()
            w = writers[i]
            if what == "error":
                note = payload.message
                yield w.error(payload)
                return
            if what == "done":
                outcomes[i], left = payload, left - 1
                yield w.scored(payload) + data(w.chunk(None, payload.finish_reason))
            elif what == "text":
                yield w.text(payload)
            elif what == "commits" and payload[0]:
                yield w.text(payload[0])
            elif what == "logprobs":
                yield w.logprobs(*payload)
            elif what == "tool_call":
                yield w.tool_call(payload)
        usage = usage_of(outcomes, n)
        if writers[0].include_usage:
            yield data({**writers[0].head, "choices": [], "usage": usage})
        note = f"{len(jobs)} choices"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for job in jobs:
            job.cancelled.set()
        _log("stream", t0, note, scope)
