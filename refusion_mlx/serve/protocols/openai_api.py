"""OpenAI's chat and text completions (``/v1/chat/completions``,
``/v1/completions``): their routes and the shape of their answers.

The bodies and their adapter into the engine's request are
:mod:`.openai_bodies`; the way from a request to its answer is
:mod:`..edge.answering`'s. A call the model made is ``message.tool_calls``
(``finish_reason: "tool_calls"``), streamed as one ``delta.tool_calls``
chunk per call, complete (its id, name and arguments).
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request

from ..core.outcome import Outcome
from ..core.refusal import Refusal
from ..core.slots import answer_blocks
from ..core.tool_calls import ToolCall
from ..edge.answering import Answer, Answering, Writer, data
from ..edge.http_errors import refusal_error
from .openai_bodies import ChatCompletionRequest, CompletionRequest, openai_request
from .openai_choices import answer_choices
from .openai_echo import legacy_logprobs
from .openai_logprobs import chat_logprobs, completion_logprobs


def tool_call_json(call: ToolCall, index: Optional[int] = None) -> dict:
    """A call as OpenAI's ``tool_calls`` entry (with ``index`` in a stream)."""
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **out} if index is not None else out


def openai_usage(done: Outcome) -> dict:
    """OpenAI's ``usage``, with ReFusion's figures (layout, forwards, tokens_per_forward) after it."""
    u = done.usage
    return {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.total,
            "prompt_tokens_details": {"cached_tokens": u.cached}, **u.refusion()}


class CompletionWriter(Writer):
    """A chat completion (``kind`` "chat") or a text completion ("text"), whole or as chunks."""

    def __init__(self, server, body, kind: str, index: int = 0, head: Optional[dict] = None):
        self.kind, self.index = kind, index  # index: the choice's, among a request's several
        stream = bool(body.stream)
        self.head = head or {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
                             "object": "text_completion" if kind == "text" else "chat.completion" + ".chunk" * stream,
                             "created": int(time.time()), "model": server.config.model_id,
                             "system_fingerprint": server.fingerprint}
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.calls = 0
        self.offset = 0  # text_offset of the next token (text completions' logprobs)

    def chunk(self, text: Optional[str], finish=None, role: bool = False, calls=None) -> dict:
        choice = {"index": self.index, "finish_reason": finish, "logprobs": None}
        if self.kind == "chat":
            choice["delta"] = {**({"role": "assistant"} if role else {}),
                               **({"content": text} if text is not None else {}),
                               **({"tool_calls": calls} if calls else {})}
        else:
            choice["text"] = text or ""
        # asked for, usage comes in a chunk of its own; each other chunk has it null, as OpenAI's
        return {**self.head, "choices": [choice], **({"usage": None} if self.include_usage else {})}

    def start(self) -> str:
        if self.request.include_commits:  # first, the answer's blocks, nothing committed yet
            return data({**self.chunk("", role=True), "commits": {"step": 0, "phase": "", "slots": [],
                                                                  "blocks": answer_blocks(self.request)}})
        return data(self.chunk("", role=True)) if self.kind == "chat" else ""

    def text(self, text: str) -> str:
        return data(self.chunk(text))

    def commits(self, text: str, commits: dict) -> str:
        return data({**self.chunk(text or None), "commits": commits})

    def logprobs(self, text: str, entries: list) -> str:
        """A chunk of text with its tokens' log-probabilities (``logprobs`` asked)."""
        out = self.chunk(text)
        out["choices"][0]["logprobs"] = (chat_logprobs(entries) if self.kind == "chat"
                                         else completion_logprobs(entries, self.offset))
        self.offset += sum(e["chars"] for e in entries)
        return data(out)

    def tool_call(self, call: ToolCall) -> str:
        self.calls += 1
        return data(self.chunk(None, calls=[tool_call_json(call, self.calls - 1)]))

    def scored(self, outcome: Outcome) -> str:
        """A scored prompt's chunk (echo): its text and ``logprobs``; "" for an answer."""
        if outcome.scored is None:
            return ""
        out = self.chunk(outcome.scored.text)
        out["choices"][0]["logprobs"] = legacy_logprobs(outcome.scored)
        return data(out)

    def done(self, outcome: Outcome) -> str:
        out = self.scored(outcome) + data(self.chunk(None, outcome.finish_reason))
        if self.include_usage:  # OpenAI's shape: usage in a chunk of its own, only when asked
            out += data({**self.head, "choices": [], "usage": openai_usage(outcome)})
        return out + "data: [DONE]\n\n"

    def error(self, refusal: Refusal) -> str:
        return data(refusal_error(refusal).body()) + "data: [DONE]\n\n"

    def answer(self, answer: Answer) -> dict:
        scored = answer.done.scored
        choice = {"index": self.index, "finish_reason": answer.done.finish_reason,
                  "logprobs": legacy_logprobs(scored) if scored is not None else None}
        if self.request is not None and self.request.logprobs is not None:
            choice["logprobs"] = (chat_logprobs if self.kind == "chat" else completion_logprobs)(answer.logprobs)
        if self.kind == "chat":
            message = {"role": "assistant", "content": answer.text if answer.text or not answer.calls else None,
                       "refusal": None, "annotations": []}  # as OpenAI's message has them: no refusal, no citations
            if answer.calls:
                message["tool_calls"] = [tool_call_json(c) for c in answer.calls]
            choice["message"] = message
        else:
            choice["text"] = scored.text if scored is not None else answer.text
        return {**self.head, "choices": [choice], "usage": openai_usage(answer.done)}


def add_routes(app: FastAPI, answering: Answering) -> None:
    """``POST /v1/chat/completions`` and ``/v1/completions`` (also without ``/v1``)."""
    server = answering.server

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await complete(request, body, "chat")

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request):
        return await complete(request, body, "text")

    async def complete(request: Request, body, kind: str):
        def make(index: int = 0):
            return openai_request(body, kind, answering.terms, index)

        prompts, n = len(body.prompt) if kind == "text" else 1, body.n or 1
        if prompts * n == 1:
            return await answering.answer(request, make, CompletionWriter(server, body, kind), bool(body.stream),
                                          body.user)
        return await answer_choices(answering, request, body, kind, make, prompts, n, CompletionWriter)
