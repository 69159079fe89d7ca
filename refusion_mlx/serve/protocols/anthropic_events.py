"""Anthropic's Messages API answer: the message and its stream's events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta``, ``message_stop``; ``error`` if it fails).

The answer's text is a ``text`` block, each call a ``tool_use`` block (its
arguments as ``input``, streamed as one ``input_json_delta``), in the order
the model wrote them. ``stop_reason``: ``end_turn``, ``max_tokens``,
``stop_sequence`` (with ``stop_sequence``) or ``tool_use``. ``usage``:
``input_tokens`` are those prefilled, ``cache_read_input_tokens`` those the
prompt cache held (Anthropic counts them apart), ``cache_creation_input_tokens``
0 (every prompt is cached when it finishes, at no extra cost), with ReFusion's
figures (layout, forwards, tokens_per_forward).
"""

from __future__ import annotations

import uuid
from typing import Optional

from ..core.outcome import Outcome
from ..core.refusal import Refusal
from ..core.slots import answer_blocks
from ..core.tool_calls import ToolCall
from ..edge.answering import Answer, Writer, event
from ..edge.http_errors import refusal_error

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def usage(done: Outcome) -> dict:
    u = done.usage
    return {"input_tokens": u.prompt - u.cached, "output_tokens": u.completion, "cache_read_input_tokens": u.cached,
            "cache_creation_input_tokens": 0, **u.refusion()}


def stop_reason(done: Outcome) -> str:
    if done.finish_reason == "stop" and done.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS[done.finish_reason]


def tool_use(call: ToolCall, streaming: bool = False) -> dict:
    """A call as a tool_use block (its id as Anthropic writes them); streaming: input comes as deltas."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": {} if streaming else call.args}


class MessagesWriter(Writer):
    """A message, whole or as Anthropic's stream events."""

    def __init__(self, server):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = server.config.model_id
        self.index = -1  # the content block being streamed
        self.open: Optional[str] = None  # its type

    def message(self, content: list, done: Optional[Outcome]) -> dict:
        prompt = len(self.request.prompt_ids)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(done) if done else None,
                "stop_sequence": done.stop_sequence if done else None,
                "usage": usage(done) if done else {"input_tokens": prompt - self.cached, "output_tokens": 0,
                                                   "cache_read_input_tokens": self.cached,
                                                   "cache_creation_input_tokens": 0}}

    def answer(self, answer: Answer) -> dict:
        content = [tool_use(p) if isinstance(p, ToolCall) else {"type": "text", "text": p.text}
                   for p in answer.parts if isinstance(p, ToolCall) or p.text]  # in the order written
        return self.message(content, answer.done)

    def start(self) -> str:
        out = event("message_start", {"type": "message_start", "message": self.message([], None)})
        if self.request.include_commits:  # the answer's blocks, nothing committed yet
            out += event("commits", {"type": "commits", "commits": {"step": 0, "phase": "", "slots": [],
                                                                    "blocks": answer_blocks(self.request)}})
        return out + event("ping", {"type": "ping"})

    def keep_alive(self) -> str:
        return event("ping", {"type": "ping"})  # Anthropic's own, which its clients take anywhere in a stream

    def close_block(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def text(self, text: str) -> str:
        out = ""
        if self.open != "text":
            out = self.close_block()
            self.index, self.open = self.index + 1, "text"
            out += event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": {"type": "text", "text": ""}})
        return out + event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "text_delta", "text": text}})

    def commits(self, text: str, commits: dict) -> str:
        return event("commits", {"type": "commits", "commits": commits}) + (self.text(text) if text else "")

    def tool_call(self, call: ToolCall) -> str:
        out = self.close_block()
        self.index, self.open = self.index + 1, "tool_use"
        out += event("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": tool_use(call, streaming=True)})
        out += event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return out + self.close_block()

    def done(self, outcome: Outcome) -> str:
        delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence}
        return (self.close_block()
                + event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(outcome)})
                + event("message_stop", {"type": "message_stop"}))

    def error(self, refusal: Refusal) -> str:
        return event("error", refusal_error(refusal).anthropic_body(self.request_id))
