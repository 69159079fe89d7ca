"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}`` -- the body, its adapter into the engine's request, and
the routes. The answer's shape (the response object, the typed stream
events) is :mod:`.responses_events`.

``input`` is a string or a list of items -- messages (``input_text`` /
``output_text`` parts), ``function_call`` and ``function_call_output`` --
which become the chat template's messages (:class:`~..core.engine_request.ChatPrompt`);
``instructions`` is the system message. With ``previous_response_id`` the
stored conversation (:mod:`.responses_store`) comes first, so the prompt
continues the earlier one and the prompt cache prefills only what is new.
ReFusion's decoding fields are extra body fields, as on chat.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, Field, field_validator

from ...decode.prompt import template_role
from ..core.engine_request import ChatPrompt, Draft, RequestTerms
from ..core.refusal import Reason, Refusal, invalid, unsupported
from ..core.structured import any_strict, request_constraint, response_format
from ..core.tool_calls import arguments_object, check_results, first_unanswered, function_tool, template_tools
from ..edge.answering import Answering
from ..edge.http_errors import APIError
from ..edge.lanes import weigh
from ..edge.security import KEY_SCOPE
from .bodies import (MAX_TOP_LOGPROBS, MAX_USER_CHARS, STRICT, StreamOptions, decoding_given, field_error,
                     include_commits, refusing, with_decoding)
from .responses_events import ResponsesWriter
from .responses_store import ResponseStore, input_items, item_page

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# tools OpenAI runs itself: a local server cannot, so they are left out of the prompt (a client that sends them
# by default -- Codex's web_search -- still gets answers); a tool_choice that names one is refused
HOSTED = ("web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
          "code_interpreter", "image_generation", "local_shell", "mcp", "tool_search")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")


class _ResponsesBase(BaseModel):
    model_config = STRICT
    model: Optional[str] = Field(None, description="any name; one model is served")
    input: Union[str, List[Dict[str, Any]]] = Field(description="a string, or message, function_call and "
                                                                "function_call_output items")
    instructions: Optional[str] = Field(None, description="the system message (not carried to a follow-up)")
    previous_response_id: Optional[str] = Field(None, description="continue a stored response's conversation")
    tools: Optional[List[Dict[str, Any]]] = Field(None, description='function tools: {"type": "function", "name", '
                                                                    '"description", "parameters"}')
    tool_choice: Union[Literal["none", "auto", "required"], Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = Field(None, description="ReFusion: include_commits, as on chat")
    store: Optional[bool] = Field(None, description="keep the response for previous_response_id (default true)")
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = Field(None, max_length=MAX_USER_CHARS,
                                description="the end user: the prompt cache's partition")
    text: Optional[Dict[str, Any]] = Field(None, description='{"format": {"type": "text"}}, {"format": {"type": '
                                           '"json_object"}} or {"format": {"type": "json_schema", "name", "schema", '
                                           '"strict"}}: the answer is decoded under the schema (constrained)')
    background: Optional[bool] = None
    conversation: Any = Field(None, description="not supported (continue with previous_response_id)")
    prompt: Any = Field(None, description="not supported (stored prompt templates)")
    truncation: Optional[Literal["auto", "disabled"]] = Field(None, description='"auto": the oldest turns of a '
                                                              "conversation too long for the context are left out")
    reasoning: Optional[Dict[str, Any]] = Field(None, description="effort and summary: echoed (this model writes "
                                                                  "no reasoning items)")
    include: Optional[List[str]] = Field(None, description='"message.output_text.logprobs": the answer\'s tokens\' '
                                                           "log-probabilities; other values are accepted and "
                                                           "add nothing")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="the most likely tokens "
                                        "beside each answer token's log-probability (implies them)")

    # the server's settings (kv_bits), other servers' sampler and constraint fields, as on every API, and chat's
    # response_format, max_tokens and stop (foreign_fields)
    _refuse = refusing("responses")

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, value):
        for key, allowed in (("effort", REASONING_EFFORTS), ("summary", REASONING_SUMMARIES)):
            if value is not None and value.get(key) not in (None, *allowed):
                raise field_error(f"{key} must be one of {', '.join(allowed)}, got {value.get(key)!r}")
        return value

    @field_validator("text")
    @classmethod
    def _text(cls, value):
        if value is not None and value.get("verbosity") not in (None, *VERBOSITIES):
            raise field_error(f"must be one of {', '.join(VERBOSITIES)}, got {value.get('verbosity')!r}",
                              "text.verbosity")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value):
        if isinstance(value, str) or isinstance(value, list) and all(isinstance(i, dict) for i in value):
            return value
        raise field_error("must be a string or a list of items (objects)")


# The decoding fields of chat, but max_tokens: the Responses API's is max_output_tokens.
ResponsesRequest = with_decoding("ResponsesRequest", _ResponsesBase, __name__, without=("max_tokens",))


def _text_of(content: Any, param: str) -> str:
    """A message's content: a string or a list of text parts, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_file", "input_audio"):
                raise unsupported(f"{where}.type", f"{kind} parts are not supported: the model reads text only")
            raise invalid(f"{where}.type", f"must be one of {', '.join(TEXT_PARTS[:2])}, got {kind!r}")
        text = part.get("refusal") if part["type"] == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.text", "must be a string")
        texts.append(text)
    return "".join(texts)


def input_messages(items: Union[str, List[Dict[str, Any]]]) -> tuple:
    """The input as the chat template's messages, one an item (a ``function_call``: an assistant message
    making the call, joined to its turn by :func:`one_turn` once checked), and each one's field (for errors)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    messages: List[dict] = []
    params: List[str] = []
    ids: Dict[str, int] = {}  # an item's id -> its index: ids page GET .../input_items, so they differ
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise invalid(f"{param}.id", f"must be a string, got {type(item['id']).__name__}")
        if item.get("id") in ids:
            raise invalid("input", f"duplicate item id {item['id']!r} (input[{ids[item['id']]}] and {param})")
        if item.get("id") is not None:
            ids[item["id"]] = i
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{param}.role", f"must be user, assistant, system or developer, got {role!r}")
            messages.append({"role": template_role(role),
                             "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise invalid(param, "a function_call item needs call_id and name (strings)")
            args = arguments_object(arguments, f"{param}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{param}.call_id", "must name the function_call it answers")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else _text_of(output, f"{param}.output")})
        else:
            raise unsupported(f"{param}.type", f"item type {kind!r} is not supported (message, function_call, "
                                           "function_call_output)")
        params.append(param)
    return messages, params


def one_turn(messages: List[dict]) -> List[dict]:
    """Each call's message joined to the assistant message before it: the calls of one turn, in one message."""
    out: List[dict] = []
    for m in messages:
        if m.get("tool_calls") and out and out[-1]["role"] == "assistant":
            out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), *m["tool_calls"]]}
        else:
            out.append(m)
    return out


def response_tools(body, takes_tools: bool) -> tuple:
    """The function tools in the template's form, checked: (tools, each
    namespaced one's name -> its namespace). A ``namespace`` tool (a named
    group of function tools, as Codex sends its sub-agent tools) gives its
    functions, their calls answered with the namespace (``namespaces``);
    hosted tools the server cannot run (:data:`HOSTED`: web search, file
    search, ...) are left out of the prompt, unless ``tool_choice`` names one."""
    tools, namespaces = [], {}
    for i, tool in enumerate(body.tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            tools.append(function_tool(tool, f"tools[{i}]"))
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise invalid(f"tools[{i}]", "a namespace tool needs name and tools (a list of function tools)")
            for j, fn in enumerate(inner):
                if not isinstance(fn, dict) or fn.get("type", "function") != "function":
                    raise unsupported(f"tools[{i}].tools[{j}].type", "a namespace holds function tools")
                tools.append(function_tool(fn, f"tools[{i}].tools[{j}]"))
                namespaces[fn["name"]] = tool["name"]
        elif kind == "custom":
            continue  # a freeform tool (its input plain text): this model writes JSON calls only; left out
        elif kind not in HOSTED:
            raise unsupported(f"tools[{i}].type", f"only function and namespace tools, and hosted tools left out "
                                                 f"of the prompt ({', '.join(HOSTED)}), are supported; got {kind!r}")
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") in HOSTED:
            raise unsupported("tool_choice", f"names the hosted tool {choice['type']!r}, which this server cannot "
                                             "run")
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice", '"none", "auto", "required" or {"type": "function", "name": ...}')
        choice = choice["name"]
    return template_tools(tools, choice, takes_tools, "tools", "tool_choice",
                          named=isinstance(body.tool_choice, dict)), namespaces


def check_unsupported(body) -> None:
    if body.background:
        raise unsupported("background", "background responses are not supported")
    # what the answer depends on but this server does not keep: left out, the model would answer another prompt
    if body.conversation is not None:
        raise unsupported("conversation", "conversations are not kept here: continue one with "
                                          "previous_response_id, or send it whole as input")
    if body.prompt is not None:
        raise unsupported("prompt", "stored prompt templates are not kept here: send the prompt as input and "
                                    "instructions")
    if body.text is not None and not isinstance(body.text, dict):
        raise invalid("text", 'must be an object such as {"format": {"type": "json_schema", ...}}')


def responses_request(body, store: ResponseStore, terms: RequestTerms, owner: str = "") -> tuple:
    """The body in the engine's terms, the conversation to store with its
    answer, and the namespaces of its namespaced tools (by function name);
    ``owner``: the API key's hash, whose stored responses it may continue."""
    check_unsupported(body)
    history: List[dict] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, owner)
        if previous is None:
            raise Refusal(Reason.PREVIOUS_RESPONSE_NOT_FOUND, f"previous_response_id: no stored response "
                          f"{body.previous_response_id!r} (unknown, deleted or no longer kept)", "previous_response_id")
        history = [dict(m) for m in previous.conversation]
    new, params = input_messages(body.input)
    params = ["previous_response_id"] * len(history) + params
    check_results(history + new, params)
    unanswered = first_unanswered(history + new, right_after=False)  # a call an item: the item named
    if unanswered:  # as OpenAI refuses it
        i, calls = unanswered
        raise invalid(params[i], f"no tool output found for function call {', '.join(calls)} (a "
                                 "function_call_output item with its call_id answers it)")
    conversation = history + one_turn(new)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools, namespaces = response_tools(body, terms.takes_tools)
    if body.truncation == "auto":
        ids = truncated_prompt(system, conversation, tools, terms, body.max_output_tokens)
    else:
        ids = terms.prompt_ids(ChatPrompt(system + conversation, tools), "input")
    parallel = body.parallel_tool_calls is not False
    constraint = request_constraint(tools, body.tool_choice, parallel, any_strict(body.tools, nested=False),
                                    response_format((body.text or {}).get("format"), "text.format", nested=False))
    draft = Draft(ids, body.max_output_tokens, decoding_given(body), "responses", prompt_param="input",
                  max_tokens_param="max_output_tokens", include_commits=include_commits(body), tools=tools,
                  parallel_tool_calls=parallel, constraint=constraint, logprobs=answer_logprobs(body),
                  logprobs_param="include" if body.top_logprobs is None else "top_logprobs", open_budget=True)
    return draft, conversation, namespaces


def truncated_prompt(system: List[dict], conversation: List[dict], tools, terms: RequestTerms,
                     max_output_tokens: Optional[int]) -> List[int]:
    """``truncation: "auto"``: the prompt's ids with the conversation's oldest turns (a user message and
    what answers it; system messages stay) left out, the fewest that leave room for the answer
    (``max_output_tokens``, the server's default, or half the context, whichever is least). The
    stored conversation keeps them all: a follow-up is truncated anew."""
    room = min(max_output_tokens or terms.defaults.gen_length, terms.context // 2)
    starts = [i for i, m in enumerate(conversation) if m["role"] == "user" and i > 0]

    def prompt(dropped: int) -> List[int]:
        start = starts[dropped - 1] if dropped else 0
        kept = [m for m in conversation[:start] if m["role"] == "system"] + conversation[start:]
        return terms.prompt_ids(ChatPrompt(system + kept, tools), "input")

    ids = prompt(0)
    if len(ids) + room <= terms.context or not starts:
        return ids
    low, high = 1, len(starts)  # the fewest turns to drop, found by halving (each try tokenizes the prompt)
    while low < high:
        mid = (low + high) // 2
        if len(prompt(mid)) + room <= terms.context:
            high = mid
        else:
            low = mid + 1
    return prompt(low)


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def answer_logprobs(body) -> Optional[int]:
    """The top tokens per answer token the body asks for (``include`` of
    ``message.output_text.logprobs``, or ``top_logprobs``); None: no logprobs."""
    if body.top_logprobs is not None:
        return body.top_logprobs
    return 0 if LOGPROBS_INCLUDE in (body.include or []) else None


def add_routes(app: FastAPI, answering: Answering) -> None:
    """``POST /v1/responses``, ``POST /v1/responses/input_tokens``, ``GET`` and ``DELETE /v1/responses/{id}``,
    ``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``
    (a 400: no response here runs in the background)."""
    store = ResponseStore(answering.config.max_stored_responses, answering.config.max_stored_response_bytes)

    def weigh_history(body: ResponsesRequest, request: Request) -> None:
        """A follow-up renders its stored conversation too: its lane is picked by both (lanes.weigh)."""
        previous = body.previous_response_id
        entry = store.get(previous, request.scope.get(KEY_SCOPE, "")) if isinstance(previous, str) else None
        weigh(request.scope, entry.nbytes if entry is not None else 0)

    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def create(body: ResponsesRequest, request: Request):
        writer = ResponsesWriter(answering.server, body, store)
        writer.owner = request.scope.get(KEY_SCOPE, "")  # another key's responses are not there for it

        def make() -> Draft:
            draft, writer.conversation, writer.namespaces = responses_request(body, store, answering.terms,
                                                                              writer.owner)
            writer.input_items = input_items(body.input)
            return draft

        weigh_history(body, request)
        return await answering.answer(request, make, writer, bool(body.stream), body.user)

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens", include_in_schema=False)
    async def input_tokens(body: ResponsesRequest, request: Request):
        """The prompt's tokens as ``POST /v1/responses`` would make it (the openai SDK's
        ``responses.input_tokens.count``): its instructions, tools and stored conversation included."""
        owner = request.scope.get(KEY_SCOPE, "")
        weigh_history(body, request)
        draft = await answering.off_loop(request, lambda: responses_request(body, store, answering.terms, owner)[0])
        return {"object": "response.input_tokens", "input_tokens": len(draft.ids)}

    def stored(response_id: str, request: Request):
        """The stored response the request's key may see, or a 404."""
        entry = store.get(response_id, request.scope.get(KEY_SCOPE, ""))
        if entry is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
        return entry

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, request: Request, stream: bool = False):
        entry = stored(response_id, request)
        if stream:  # the SDK would read the JSON as an empty stream, without a word
            raise APIError(400, "stream: a stored response is returned whole here, not streamed again "
                                "(retrieve it without stream)", "stream")
        return entry.response

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        stored(response_id, request)  # OpenAI cancels background responses only, and this server runs none
        raise APIError(400, f"response {response_id!r} is not a background response: only those can be "
                            "cancelled, and this server runs none (background: true is refused)", "response_id")

    @app.get("/v1/responses/{response_id}/input_items")
    async def items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                    order: Literal["asc", "desc"] = "desc", after: Optional[str] = None,
                    before: Optional[str] = None):
        entry = stored(response_id, request)
        page = item_page(entry.input_items, limit, order, after, before)
        if page is None:
            ids = {i["id"] for i in entry.input_items}
            name, cursor = ("after", after) if after is not None and after not in ids else ("before", before)
            raise APIError(400, f"{name}: no input item {cursor!r} in response {response_id!r}", name)
        return page

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        if not store.delete(response_id, request.scope.get(KEY_SCOPE, "")):
            raise APIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}
