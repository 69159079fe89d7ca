"""The Responses API's answer: the response object and its typed stream
events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta`` /
``.done``, ``response.completed``, ...), each with its ``sequence_number``.

The answer's text is a ``message`` output item (one per run of text between
calls), its calls one ``function_call`` item each, in the order the model
wrote them, the same whole or streamed. A finished
response is stored (unless ``store`` is false) with its conversation, for
``previous_response_id``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Dict, List, Optional

from ..core.outcome import Outcome
from ..core.refusal import Reason, Refusal
from ..core.slots import answer_blocks
from ..core.tool_calls import ToolCall
from ..edge.answering import Answer, Writer, event
from .openai_logprobs import chat_logprobs
from .responses_store import ResponseStore

log = logging.getLogger("refusion_mlx.server")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(done: Outcome) -> dict:
    """The Responses API's usage, with ReFusion's figures (layout, forwards, tokens_per_forward) after it
    (``cache_write_tokens`` 0: every prompt is cached when it finishes, at no extra cost)."""
    u = done.usage
    return {"input_tokens": u.prompt, "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": 0},
            "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total, **u.refusion()}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: Optional[list] = None) -> dict:
    """An assistant ``message`` item (``status``: "in_progress" while it is
    written, "incomplete" when max_output_tokens cut it); ``logprobs``: its
    tokens' entries (``openai_logprobs``), when asked."""
    content = [output_text(text, logprobs)] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text(text: str, logprobs: Optional[list] = None) -> dict:
    """An ``output_text`` part: its ``logprobs`` those of chat completions' ``content`` (empty unless asked)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": shaped(logprobs)}


def shaped(entries: Optional[list]) -> list:
    """Token entries as the Responses API shows them: ``{token, logprob, bytes, top_logprobs}``, as chat does."""
    return chat_logprobs(entries)["content"] if entries else []


def call_item(item_id: str, call: ToolCall, status: str = "completed", namespace: Optional[str] = None) -> dict:
    """A call as a ``function_call`` item; a namespaced tool's carries its ``namespace``."""
    item = {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}
    return {**item, "namespace": namespace} if namespace else item


class ResponsesWriter(Writer):
    """A response, whole or as typed events; stored when it finishes."""

    def __init__(self, server, body, store: ResponseStore):
        self.body, self.store = body, store
        self.conversation: List[dict] = []  # set by the adapter: the messages, without instructions
        self.owner = ""  # set by the adapter: the hash of the API key the request presented
        self.input_items: List[dict] = []  # set by the adapter: the input as items, for GET .../input_items
        self.namespaces: Dict[str, str] = {}  # set by the adapter: a namespaced function's namespace
        self.id, self.created = _id("resp"), int(time.time())
        self.model = server.config.model_id
        self.seq = 0
        self.output: List[dict] = []
        self.open: Optional[dict] = None  # the message item being streamed
        self.open_text: List[str] = []  # its text so far
        self.calls: List[ToolCall] = []
        self.text_parts: List[str] = []
        self.open_logprobs: List[dict] = []  # the open message's token entries, when asked

    # -- the response object --------------------------------------------------

    def response(self, status: str, done: Optional[Outcome] = None, error: Optional[dict] = None) -> dict:
        body, params = self.body, self.request.params if self.request is not None else None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        reasoning = body.reasoning or {}  # echoed: this model writes no reasoning items
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": self.model, "output": list(self.output),
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": reasoning.get("effort"),
                                                                         "summary": reasoning.get("summary")},
                "store": body.store is not False, "temperature": params.temperature if params else body.temperature,
                "text": {"format": (body.text or {}).get("format") or {"type": "text"},
                         **({"verbosity": body.text["verbosity"]} if "verbosity" in (body.text or {}) else {})},
                "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "top_logprobs": body.top_logprobs,
                "top_p": params.top_p if params else body.top_p,
                "truncation": body.truncation or "disabled", "usage": usage(done) if done else None,
                "user": body.user, "metadata": body.metadata or {}}

    def finish(self, done: Outcome) -> dict:
        """The finished response (completed, or incomplete at max_output_tokens), stored."""
        status = "incomplete" if done.finish_reason == "length" else "completed"
        response = self.response(status, done)
        if self.body.store is not False:
            text = "".join(self.text_parts)
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}
                     for c in self.calls]
            answer = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            if not self.store.put(response, self.conversation + [answer], self.owner, self.input_items):
                log.warning("response %s not stored: over --max-stored-response-bytes (%d)", self.id,
                            self.store.max_bytes)
        return response

    def answer(self, answer: Answer) -> dict:
        for i, part in enumerate(answer.parts):  # in the order written, as the stream's items
            if isinstance(part, ToolCall):
                self.output.append(call_item(_id("fc"), part, namespace=self.namespaces.get(part.name)))
                continue
            cut = answer.done.finish_reason == "length" and i == len(answer.parts) - 1  # last: cut short
            self.output.append(message_item(_id("msg"), part.text, "incomplete" if cut else "completed",
                                            part.logprobs))
        self.text_parts, self.calls = [answer.text], list(answer.calls)
        return self.finish(answer.done)

    # -- the stream -----------------------------------------------------------

    def emit(self, kind: str, **fields) -> str:
        self.seq += 1
        return event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def keep_alive(self) -> str:
        """``response.in_progress`` again, with the snapshot: Codex's idle timer counts events, not SSE
        comments; a lifecycle event is valid anywhere in the stream and the SDKs take it as a snapshot."""
        return self.emit("response.in_progress", response=self.response("in_progress"))

    def start(self) -> str:
        out = self.emit("response.created", response=self.response("in_progress"))
        out += self.emit("response.in_progress", response=self.response("in_progress"))
        if self.request.include_commits:  # the answer's blocks, nothing committed yet
            out += self.emit("response.commits", commits={"step": 0, "phase": "", "slots": [],
                                                           "blocks": answer_blocks(self.request)})
        return out

    def text(self, text: str, entries: Optional[list] = None) -> str:
        out = ""
        if self.open is None:
            self.open = message_item(_id("msg"), "", "in_progress")
            out += self.emit("response.output_item.added", output_index=len(self.output), item=self.open)
            out += self.emit("response.content_part.added", item_id=self.open["id"], output_index=len(self.output),
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        self.text_parts.append(text)
        self.open_text.append(text)
        self.open_logprobs += entries or []
        return out + self.emit("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                               content_index=0, delta=text, logprobs=shaped(entries))

    def logprobs(self, text: str, entries: list) -> str:
        return self.text(text, entries) if text or entries else ""

    def commits(self, text: str, commits: dict) -> str:
        return self.emit("response.commits", commits=commits) + (self.text(text) if text else "")

    def close_message(self, status: str = "completed") -> str:
        if self.open is None:
            return ""
        text, index, item_id = "".join(self.open_text), len(self.output), self.open["id"]
        entries, self.open_logprobs = self.open_logprobs, []
        part = output_text(text, entries)
        item = message_item(item_id, text, status, entries)
        self.output.append(item)
        self.open, self.open_text = None, []
        return (self.emit("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                          text=text, logprobs=part["logprobs"])
                + self.emit("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part=part)
                + self.emit("response.output_item.done", output_index=index, item=item))

    def tool_call(self, call: ToolCall) -> str:
        out = self.close_message()
        self.calls.append(call)
        index, item_id = len(self.output), _id("fc")
        namespace = self.namespaces.get(call.name)
        out += self.emit("response.output_item.added", output_index=index,
                         item=call_item(item_id, call, "in_progress", namespace))
        out += self.emit("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                         delta=call.arguments)
        out += self.emit("response.function_call_arguments.done", item_id=item_id, output_index=index,
                         name=call.name, arguments=call.arguments)
        item = call_item(item_id, call, namespace=namespace)
        self.output.append(item)
        return out + self.emit("response.output_item.done", output_index=index, item=item)

    def done(self, outcome: Outcome) -> str:
        out = self.close_message("incomplete" if outcome.finish_reason == "length" else "completed")
        response = self.finish(outcome)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self.emit(kind, response=response)

    def error(self, refusal: Refusal) -> str:
        """``response.failed``, the text written so far its message item (incomplete)."""
        out = self.close_message("incomplete")
        return out + self.emit("response.failed", response=self.response("failed", error=response_error(refusal)))


# OpenAI's ResponseError.code is one of a fixed list: a reason maps onto it, and its own code is in the message
ERROR_CODES = {Reason.SERVER_BUSY: "rate_limit_exceeded", Reason.INVALID_PROMPT: "invalid_prompt"}


def response_error(refusal: Refusal) -> dict:
    """A failed response's ``error``: ``server_error`` but where OpenAI's list has the reason's code."""
    return {"code": ERROR_CODES.get(refusal.reason, "server_error"),
            "message": f"{refusal.message} ({refusal.reason.value})"}

