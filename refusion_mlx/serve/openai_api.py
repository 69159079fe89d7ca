"""OpenAI's chat and text completions (``/v1/chat/completions``,
``/v1/completions``): their routes and the shape of their answers.

The bodies and their adapter into the engine's request are
:mod:`.schemas`; the way from a request to its answer is
:mod:`.answering`'s. A call the model made is ``message.tool_calls``
(``finish_reason: "tool_calls"``), streamed as one ``delta.tool_calls``
chunk per call, complete (its id, name and arguments).
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request

from .answering import Answer, Answering, Writer, data
from .http_errors import refusal_error
from .refusal import Refusal
from .schemas import ChatCompletionRequest, CompletionRequest, openai_request
from .slots import answer_blocks
from .tool_calls import ToolCall


def tool_call_json(call: ToolCall, index: Optional[int] = None) -> dict:
    """A call as OpenAI's ``tool_calls`` entry (with ``index`` in a stream)."""
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **out} if index is not None else out


class CompletionWriter(Writer):
    """A chat completion (``kind`` "chat") or a text completion ("text"), whole or as chunks."""

    def __init__(self, server, body, kind: str):
        self.kind = kind
        stream = bool(body.stream)
        self.head = {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
                     "object": "text_completion" if kind == "text" else "chat.completion" + ".chunk" * stream,
                     "created": int(time.time()), "model": server.config.model_id,
                     "system_fingerprint": server.fingerprint}
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.calls = 0

    def chunk(self, text: Optional[str], finish=None, role: bool = False, calls=None) -> dict:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.kind == "chat":
            choice["delta"] = {**({"role": "assistant"} if role else {}),
                               **({"content": text} if text is not None else {}),
                               **({"tool_calls": calls} if calls else {})}
        else:
            choice["text"] = text or ""
        return {**self.head, "choices": [choice]}

    def start(self) -> str:
        if self.request.include_commits:  # first, the answer's blocks, nothing committed yet
            return data({**self.chunk("", role=True), "commits": {"step": 0, "phase": "", "slots": [],
                                                                  "blocks": answer_blocks(self.request)}})
        return data(self.chunk("", role=True)) if self.kind == "chat" else ""

    def text(self, text: str) -> str:
        return data(self.chunk(text))

    def commits(self, text: str, commits: dict) -> str:
        return data({**self.chunk(text or None), "commits": commits})

    def tool_call(self, call: ToolCall) -> str:
        self.calls += 1
        return data(self.chunk(None, calls=[tool_call_json(call, self.calls - 1)]))

    def done(self, outcome: dict) -> str:
        usage, last = outcome["usage"], self.chunk(None, outcome["finish_reason"])
        if self.include_usage:  # OpenAI's shape: usage in a chunk of its own
            return data(last) + data({**self.head, "choices": [], "usage": usage}) + "data: [DONE]\n\n"
        return data({**last, "usage": usage}) + "data: [DONE]\n\n"

    def error(self, refusal: Refusal) -> str:
        return data(refusal_error(refusal).body()) + "data: [DONE]\n\n"

    def answer(self, answer: Answer) -> dict:
        choice = {"index": 0, "finish_reason": answer.done["finish_reason"], "logprobs": None}
        if self.kind == "chat":
            message = {"role": "assistant", "content": answer.text if answer.text or not answer.calls else None}
            if answer.calls:
                message["tool_calls"] = [tool_call_json(c) for c in answer.calls]
            choice["message"] = message
        else:
            choice["text"] = answer.text
        return {**self.head, "choices": [choice], "usage": answer.done["usage"]}


def add_routes(app: FastAPI, answering: Answering) -> None:
    """``POST /v1/chat/completions`` and ``/v1/completions`` (also without ``/v1``)."""
    server, config = answering.server, answering.config

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await complete(request, body, "chat")

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request):
        return await complete(request, body, "text")

    async def complete(request: Request, body, kind: str):
        def make():
            return openai_request(body, kind, answering.tokenize, defaults=config.decoding,
                                  context=answering.context, vocab_size=answering.vocab_size,
                                  takes_tools=answering.takes_tools)

        return await answering.answer(request, make, CompletionWriter(server, body, kind), bool(body.stream),
                                      body.user)
