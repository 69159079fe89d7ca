"""Anthropic's Messages API: ``POST /v1/messages`` and
``/v1/messages/count_tokens`` -- the body, its adapter into the engine's
request, and the routes. The answer's shape (the message, the stream's
events) is :mod:`.anthropic_events`; errors on these routes take
Anthropic's shape (:func:`..edge.http_errors.anthropic_route`).

``system`` and ``messages`` (text, ``tool_use`` and ``tool_result`` blocks)
become the chat template's messages (:class:`~..core.engine_request.ChatPrompt`):
an assistant's ``tool_use`` blocks its calls, a user's ``tool_result``
blocks tool messages, a ``system`` message inside the conversation a
system message in its place; ``tools`` (``input_schema``) the template's
function tools. ``thinking`` is accepted (:func:`check_thinking`: this model
writes no thinking blocks); ``output_format`` / ``output_config.format``
constrain the answer to a schema. The ``x-api-key``, ``anthropic-version``
and ``anthropic-beta`` headers are accepted and not checked (a local
server). ReFusion's decoding fields are extra body fields, as on chat.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, field_validator

from ..core.engine_request import ChatPrompt, Draft, RequestTerms
from ..core.refusal import Reason, Refusal, invalid, unsupported
from ..core.structured import any_strict, request_constraint, response_format
from ..core.tool_calls import check_results, function_tool, template_tools
from ..edge.answering import Answering
from .anthropic_events import MessagesWriter
from .bodies import (MAX_STOP, MAX_STOP_CHARS, MAX_USER_CHARS, STRICT, StreamOptions, check_stops, decoding_given,
                     field_error, include_commits, refusing, with_decoding)


class _CountBase(BaseModel):
    """What count_tokens reads: the conversation and its tools."""

    model_config = STRICT
    model: Optional[str] = Field(None, description="any name; one model is served")
    messages: List[Dict[str, Any]] = Field(min_length=1)
    system: Union[str, List[Dict[str, Any]], None] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    output_format: Optional[Dict[str, Any]] = Field(
        None, description='{"type": "json_schema", "schema": {...}}: the answer is decoded under the schema '
                          "(constrained, as chat's response_format)")
    output_config: Optional[Dict[str, Any]] = Field(None, description="its format: as output_format")
    mcp_servers: Optional[List[Dict[str, Any]]] = Field(None, description="not supported (Anthropic's MCP "
                                                                          "connector runs their tools)")


class CountTokensRequest(_CountBase):
    pass


class _MessagesBase(_CountBase):
    max_tokens: int = Field(ge=1, description="the answer's most tokens")
    stop_sequences: Optional[List[str]] = Field(None, description=f"up to {MAX_STOP} strings of at most "
                                                f"{MAX_STOP_CHARS} characters")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = Field(None, description="ReFusion: include_commits, as on chat")
    metadata: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None

    # the server's settings (kv_bits), other servers' sampler and constraint fields, as on every API, and
    # OpenAI's response_format and stop (foreign_fields)
    _refuse = refusing("messages")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        user = (value or {}).get("user_id")
        if value is not None and (set(value) - {"user_id"} or not isinstance(user, (str, type(None)))):
            raise field_error('takes user_id alone (a string), as {"user_id": "..."}')
        if user is not None and len(user) > MAX_USER_CHARS:  # the prompt cache's partition, as chat's user
            raise field_error(f"user_id is at most {MAX_USER_CHARS} characters, got {len(user)}")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value):
        return None if value is None else check_stops(value)


def end_user(user_id: Optional[str]) -> Optional[str]:
    """The prompt cache's partition named by ``metadata.user_id``: the string itself, but for Claude Code's
    JSON object of ``device_id``, ``account_uuid`` and ``session_id``, the object less its session: a new
    session of the same user continues the system prompt and tools its earlier sessions prefilled (each
    ``claude`` run has a new session_id, so its first request prefilled them all again)."""
    if not isinstance(user_id, str) or not user_id.startswith("{"):
        return user_id if isinstance(user_id, str) else None
    try:
        fields = json.loads(user_id)
    except ValueError:
        return user_id
    if not isinstance(fields, dict) or "session_id" not in fields:
        return user_id
    fields.pop("session_id")
    return json.dumps(fields, sort_keys=True)


# The decoding fields of chat (temperature, top_p, top_k, slot_size, ...); max_tokens is Anthropic's own, and so
# is its temperature's range, from 0 to 1.
MAX_TEMPERATURE = 1
MessagesRequest = with_decoding("MessagesRequest", _MessagesBase, __name__, without=("max_tokens",),
                                bounds={"temperature": {"le": MAX_TEMPERATURE}})


def _text_blocks(content: Any, param: str) -> str:
    """A string, or a list of text blocks, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{param}[{j}]", 'must be a text block ({"type": "text", "text": ...})')
        texts.append(block["text"])
    return "".join(texts)


def _blocks(message: Dict[str, Any], i: int) -> List[dict]:
    """One message's content as blocks, each checked."""
    content, param = message.get("content"), f"messages[{i}].content"
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(param, "must be a string or a list of content blocks")
    role = message["role"]
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{where}.text", "must be a string")
        elif kind == "tool_use" and role == "assistant":
            if not all(isinstance(block.get(k), str) and block[k] for k in ("id", "name")):
                raise invalid(where, "a tool_use block needs id and name (non-empty strings)")
            if not isinstance(block.get("input"), dict):
                raise invalid(f"{where}.input", "must be an object")
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise invalid(f"{where}.tool_use_id", "must name the tool_use block it answers")
            _text_blocks(block.get("content", ""), f"{where}.content")
            if not isinstance(block.get("is_error", False), bool):
                raise invalid(f"{where}.is_error", "must be a boolean")
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            pass  # an earlier answer's reasoning: not part of the prompt (this model does not think aloud)
        elif kind in ("image", "document", "search_result"):
            raise Refusal(Reason.UNSUPPORTED, f"{where}.type: {kind} blocks are not supported: the model reads "
                                              "text only", f"{where}.type")
        else:
            allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
            message = "an assistant message" if role == "assistant" else f"a {role} message"
            raise invalid(f"{where}.type", f"must be one of {allowed} in {message}, got {kind!r}")
    return content


def _not_empty(content: Any, param: str) -> None:
    """Anthropic's rule: a message has content, and each of its text blocks text."""
    if content == "" or content == []:
        raise invalid(param, "must not be empty (only a final assistant message may be)")
    for j, block in enumerate(content if isinstance(content, list) else ()):
        if isinstance(block, dict) and block.get("type") == "text" and block.get("text") == "":
            raise invalid(f"{param}[{j}].text", "text content blocks must be non-empty")


def _unanswered(waiting: tuple) -> None:
    """Anthropic's rule: an assistant turn's tool_use blocks are answered by tool_result blocks in the next
    turn. ``waiting``: (the assistant message's index, the ids of its calls no result has answered yet)."""
    if waiting and waiting[1]:
        raise invalid(f"messages[{waiting[0]}]", "tool_use ids were found without tool_result blocks immediately "
                                                 f"after: {', '.join(waiting[1])}. Each tool_use block must have a "
                                                 "corresponding tool_result block in the next message")


def _joined(earlier: str, text: str) -> str:
    """The text of two messages of one role in a row, one turn (as Anthropic merges them): a blank line apart."""
    return "\n\n".join(t for t in (earlier, text) if t)


def anthropic_messages(body) -> tuple:
    """The system prompt and messages as the chat template's messages, and each one's field. Consecutive
    user (or assistant) messages are one turn, as Anthropic merges them; a turn's tool_use blocks need their
    tool_result blocks in the next one, and no two tool_use blocks share an id (Anthropic's rules)."""
    out: List[dict] = []
    params: List[str] = []
    if body.system:
        out.append({"role": "system", "content": _text_blocks(body.system, "system")})
        params.append("system")
    made, waiting, previous = set(), (), None  # every call's id; the calls the next turn answers; the last role
    for i, message in enumerate(body.messages):
        role = message.get("role")
        if role == "system":  # a system message inside the conversation (Claude Code's reminders): in its place;
            text = _text_blocks(message.get("content"), f"messages[{i}].content")  # an empty one (Claude Code's
            if text:  # compaction retry sends one) adds nothing: left out, the turns around it as if it were not
                out.append({"role": "system", "content": text})
                params.append(f"messages[{i}]")
                previous = role
            continue
        if not (role == "assistant" and i == len(body.messages) - 1):  # but a final assistant message (a prefill)
            _not_empty(message.get("content"), f"messages[{i}].content")
        if role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role", f"must be user, assistant or system, got {role!r}")
        blocks, param = _blocks(message, i), f"messages[{i}]"
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        same = previous == role and out[-1]["role"] == role  # the same turn as the message before it
        previous = role
        if role == "assistant":
            if not same:
                _unanswered(waiting)
                waiting = (i, ())
            for j, b in enumerate(blocks):
                if b["type"] == "tool_use" and b["id"] in made:
                    raise invalid(f"{param}.content[{j}].id", f"tool_use ids must be unique: {b['id']!r} is used "
                                                              "twice")
                made.update([b["id"]] if b["type"] == "tool_use" else ())
            calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
                     for b in blocks if b["type"] == "tool_use"]
            waiting = (waiting[0], waiting[1] + tuple(c["id"] for c in calls))
            if same:
                out[-1]["content"] = _joined(out[-1]["content"], text)
                if calls:
                    out[-1]["tool_calls"] = out[-1].get("tool_calls", []) + calls
                continue
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            params.append(param)
            continue
        answered = {b["tool_use_id"] for b in blocks if b["type"] == "tool_result"}
        waiting = waiting and (waiting[0], tuple(c for c in waiting[1] if c not in answered))
        for j, b in enumerate(blocks):  # the results first, as the API has them
            if b["type"] == "tool_result":  # a failed tool's result says so (is_error), as the model reads it
                result = _text_blocks(b.get("content", ""), f"{param}.content[{j}].content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {result}" if b.get("is_error") else result})
                params.append(f"{param}.content[{j}]")
        if same and text and out[-1]["role"] == "user":
            out[-1]["content"] = _joined(out[-1]["content"], text)
        elif text or not answered:
            out.append({"role": "user", "content": text})
            params.append(param)
    _unanswered(waiting)
    check_results(out, params)
    return out, params


def anthropic_tools(body, takes_tools: bool) -> tuple:
    """The tools (``input_schema``) in the template's form, checked; (tools, parallel calls allowed)."""
    if body.mcp_servers:  # tools a server of Anthropic's would run, as its server tools (refused below)
        raise Refusal(Reason.UNSUPPORTED, "mcp_servers: not supported: this server runs no MCP connector; give "
                                          "the servers' tools as custom tools", "mcp_servers")
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}]", "must be an object")
        if tool.get("type") not in (None, "custom"):
            raise Refusal(Reason.UNSUPPORTED, f"tools[{i}].type: only custom (client) tools are supported, got "
                                              f"{tool.get('type')!r}", f"tools[{i}].type")
        if not isinstance(tool.get("input_schema"), dict):
            raise invalid(f"tools[{i}].input_schema", "is required (a JSON Schema of an object)")
        if tool["input_schema"].get("type") != "object":  # Anthropic's rule (OpenAI's parameters may leave it out)
            raise invalid(f"tools[{i}].input_schema.type", f'must be "object", got '
                                                           f'{tool["input_schema"].get("type")!r}')
        tools.append(function_tool({"name": tool.get("name"), "description": tool.get("description"),
                                    "parameters": tool["input_schema"]}, f"tools[{i}]", "input_schema"))
    choice = {"type": "auto"} if body.tool_choice is None else body.tool_choice
    kind = choice.get("type")
    if kind not in ("auto", "none", "any", "tool") or (kind == "tool" and not isinstance(choice.get("name"), str)):
        raise invalid("tool_choice", '{"type": "auto"}, {"type": "none"}, {"type": "any"} or '
                                            '{"type": "tool", "name": ...}')
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", f"must be a boolean, got {single!r}")
    picked = {"auto": "auto", "none": "none", "any": "required"}.get(kind, choice.get("name"))
    return template_tools(tools, picked, takes_tools, "tools", "tool_choice", named=kind == "tool"), not single


def chat_prompt_of(body, takes_tools: bool) -> tuple:
    """(the ChatPrompt, whether calls may be parallel). A final assistant
    message of text is a prefill: the answer continues it (and holds only
    what follows it); one that is empty starts the answer as no message would."""
    messages, _ = anthropic_messages(body)
    tools, parallel = anthropic_tools(body, takes_tools)
    last = messages[-1] if messages and body.messages and body.messages[-1].get("role") == "assistant" else None
    prefill = last is not None and "tool_calls" not in last
    if prefill and not last["content"]:
        messages, prefill = messages[:-1], False
    elif prefill and last["content"] != last["content"].rstrip():
        where = f"messages[{len(body.messages) - 1}].content"
        raise invalid(where, "the final assistant content (a prefill the answer continues) cannot end with "
                             "trailing whitespace")
    return ChatPrompt(messages, tools, prefill), parallel


def check_thinking(body) -> None:
    """``thinking``: ``disabled``, ``adaptive`` (the model may choose not to
    think: this one never writes thinking blocks) or ``enabled`` with a
    ``budget_tokens`` of at least 1,024 and under ``max_tokens`` (Anthropic's
    own rule; accepted, and answered without thinking blocks)."""
    thinking = body.thinking or {}
    kind = thinking.get("type")
    if kind not in (None, "disabled", "adaptive", "enabled") or body.thinking is not None and kind is None:
        raise invalid("thinking.type", f"must be disabled, adaptive or enabled, got {kind!r}")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and not (isinstance(budget, int) and not isinstance(budget, bool)
                                  and 1024 <= budget < body.max_tokens):
        raise invalid("thinking.budget_tokens", f"must be an integer of at least 1024 and under max_tokens "
                                                f"({body.max_tokens}), got {budget!r}")


def output_format(body, prefill: bool = False):
    """The answer's format (``output_format``, or ``output_config.format``: a ``json_schema``, Anthropic's
    one type) as a constraint (None: text); refused after a ``prefill``, which a whole JSON document cannot continue (as Anthropic refuses it)."""
    config = body.output_config
    if body.output_format is not None and (config or {}).get("format") is not None:
        raise invalid("output_format", "give output_format or output_config.format, not both (output_format is "
                                       "the older name of output_config.format)")
    if body.output_format is not None:
        field, value = "output_format", body.output_format
    else:
        field, value = "output_config.format", (config or {}).get("format")
    if value is not None and not (isinstance(value, dict) and value.get("type") == "json_schema"):  # not chat's
        raise invalid(field, 'must be {"type": "json_schema", "schema": {...}}, the one format type the Messages '
                             "API takes")
    shape = response_format(value, field, nested=False, named=False)
    if shape is not None and prefill:
        raise unsupported(field, "not supported with a prefill (a final assistant message of text): the answer "
                                 "is a whole JSON document, which cannot continue the prefill")
    return shape


def messages_request(body, terms: RequestTerms) -> Draft:
    """The body in the engine's terms."""
    check_thinking(body)
    prompt, parallel = chat_prompt_of(body, terms.takes_tools)
    ids = terms.prompt_ids(prompt, "messages")
    constraint = request_constraint(prompt.tools, body.tool_choice, parallel, any_strict(body.tools, nested=False),
                                    output_format(body, prompt.prefill))
    return Draft(ids, body.max_tokens, decoding_given(body), "messages", stop=body.stop_sequences or (),
                 include_commits=include_commits(body), prompt_param="messages", tools=prompt.tools,
                 parallel_tool_calls=parallel, constraint=constraint, stop_param="stop_sequences")


def add_routes(app: FastAPI, answering: Answering) -> None:
    """``POST /v1/messages``, ``/v1/messages/count_tokens``, and ``/api/hello``: the connection check
    Claude Code sends (a HEAD, without a key) before its first request."""

    @app.get("/api/hello", include_in_schema=False)
    async def hello():
        return {}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        def make() -> Draft:
            return messages_request(body, answering.terms)

        return await answering.answer(request, make, MessagesWriter(answering.server), bool(body.stream),
                                      end_user((body.metadata or {}).get("user_id")))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request):
        def count() -> int:
            terms = answering.terms
            prompt, _ = chat_prompt_of(body, terms.takes_tools)
            output_format(body, prompt.prefill)  # checked as a request would be (it adds no prompt tokens)
            return len(terms.prompt_ids(prompt, "messages"))

        return {"input_tokens": await answering.off_loop(request, count)}

