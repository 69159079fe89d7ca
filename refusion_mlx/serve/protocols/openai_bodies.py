"""OpenAI's chat and text completion bodies as pydantic models (they make
the schema at ``/docs``; ``ChatCompletionRequest`` and ``CompletionRequest``
as OpenAI names them, on the shared ``_Body``), and their adapter into the
engine's terms (:func:`openai_request` makes a
:class:`~..core.engine_request.Draft`).

The pieces every API's body shares are :mod:`.bodies`'. Ranges are checked
here; what needs the tokenizer or the model's context is checked where the
engine's request is made (:mod:`..core.engine_request`). Fields that would change
an answer's meaning but cannot be honoured are refused, never ignored;
other unknown fields are.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ...decode.params import FIELDS
from ...decode.prompt import CHAT_ROLES, template_role
from ...decode.stream import template_options
from ...errors import DecodeError
from .bodies import (MAX_STOP, MAX_STOP_CHARS, MAX_TOP_LOGPROBS, MAX_USER_CHARS, STRICT, UNSERVED, StreamOptions,
                     check_stops, decoding_given, field_error, include_commits, refusing, with_decoding)
from ..core.engine_request import ChatPrompt, Draft, RequestTerms
from ..core.refusal import Reason, Refusal
from ..core.structured import any_strict, request_constraint, response_format
from ..core.tool_calls import arguments_object, check_results, first_unanswered, function_tool, template_tools
from .openai_echo import context_tokens, scoring_of

# OpenAI's fields refused unless they hold a value that changes nothing (with those every API refuses).
HARMLESS = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
            "suffix": (None, ""), "best_of": (None, 1), "functions": (None, []),
            "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
            "modalities": (None, ["text"]), "audio": (None,),
            "web_search_options": (None,),  # spoken answers; a hosted search this server cannot run
            **UNSERVED}

MAX_N = 16  # samples per prompt (n)
MEDIA_PARTS = ("image_url", "input_audio", "file")  # chat's content parts a text-only model cannot read


class _BodyBase(BaseModel):
    """A request body's fields besides the decoding settings (which :func:`.bodies.with_decoding` adds)."""

    model_config = STRICT
    model: Optional[str] = Field(None, description="any name; one model is served")
    stop: Union[str, List[str], None] = Field(None, description=f"up to {MAX_STOP} strings of at most "
                                              f"{MAX_STOP_CHARS} characters")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, max_length=MAX_USER_CHARS, description="the end user: the prompt cache's "
                                "partition (a request continues only the cached prompts of its own user and API key)")

    _refuse = refusing("chat.completions", HARMLESS)

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_value", "only allowed when stream is true",
                                      {"field": "stream_options"})
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        items = [value] if isinstance(value, str) else value
        if items is None:
            return None
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise field_error("must be a string or a list of strings")
        return check_stops(items)


# The body fields common to both endpoints: _BodyBase's and the decoding settings.
_Body = with_decoding("_Body", _BodyBase, __name__)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as JSON text (an object)")


class ToolCallIn(BaseModel):
    """A call an earlier assistant message made."""

    model_config = STRICT
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = STRICT
    role: Literal[CHAT_ROLES]
    content: Union[str, List[TextPart], None] = None
    tool_calls: Optional[List[ToolCallIn]] = Field(None, description="assistant: the calls it made")
    tool_call_id: Optional[str] = Field(None, description="tool: the call this message answers")
    refusal: Optional[str] = Field(None, description="assistant: a refusal it gave (read as its text)")

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content):
        """A string, null, or a list of ``{"type": "text", "text": ...}`` parts (an assistant's
        ``{"type": "refusal", "refusal": ...}`` too, as OpenAI replays them), joined."""
        if content is None or isinstance(content, str):
            return content  # null or absent: only an assistant's message with calls may have none
        kinds = {"text": "text", "refusal": "refusal"}
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") in kinds and isinstance(p.get(kinds[p["type"]]), str)
                for p in content):
            return "".join(p[kinds[p["type"]]] for p in content)
        raise field_error('must be a string or a list of text parts ({"type": "text", "text": ...})')


class ChatCompletionRequest(_Body):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="as max_tokens (and over it)")
    tools: Optional[List[Dict[str, Any]]] = Field(None, description='function tools: {"type": "function", '
                                                  '"function": {"name", "description", "parameters"}}')
    tool_choice: Union[Literal["none", "auto", "required"], Dict[str, Any], None] = Field(
        None, description='"auto" (the default with tools), "none", "required" or {"type": "function", "function": '
                          '{"name": ...}}: a forced call is decoded under its tools\' parameters schemas')
    parallel_tool_calls: Optional[bool] = Field(None, description="false: the answer ends after its first call")
    n: Optional[int] = Field(None, ge=1, le=MAX_N, description="independent answers, decoded together "
                             "(with a seed, answer k uses seed + k)")
    logprobs: Optional[bool] = Field(None, description="each answer token's log-probability: the probability "
                                     "the decoder accepted it under (docs/serving.md)")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: the most "
                                        "likely tokens of the row that scored each token")
    response_format: Optional[Dict[str, Any]] = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}: the answer is decoded under the schema (constrained)')
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        None, description='the chat template\'s own variables, over the server\'s --chat-template-config '
                          '(mlx_lm.server\'s and vLLM\'s field): {"enable_thinking": false}')
    continue_final_message: Optional[bool] = Field(
        None, description="vLLM's field: the answer continues the final message, an assistant's (a prefill), "
                          "instead of a new turn after it")
    add_generation_prompt: Optional[bool] = Field(
        None, description="vLLM's field: true (the default) opens the answer's turn; false only with "
                          "continue_final_message")

    # OpenAI's fields that change nothing here, typed as OpenAI types them (a bad value is its 400)
    store: Optional[bool] = Field(None, description="accepted: chat completions are not stored")
    metadata: Optional[Dict[str, str]] = Field(None, description="accepted, not stored")
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = Field(
        None, description="accepted: this model does not reason before answering")
    verbosity: Optional[Literal["low", "medium", "high"]] = None

    @field_validator("messages", mode="before")
    @classmethod
    def _media(cls, messages):
        """An image, audio or file part is refused at its own path (before a message's content is read)."""
        for i, m in enumerate(messages if isinstance(messages, list) else ()):
            content = m.get("content") if isinstance(m, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in MEDIA_PARTS:
                    raise PydanticCustomError("unsupported_parameter", "{kind} parts are not supported: the model "
                                              "reads text only", {"field": f"messages[{i}].content[{j}].type",
                                                                  "kind": kind})
        return messages

    @model_validator(mode="after")
    def _opening(self):
        """vLLM's pair: an answer opens a turn (add_generation_prompt) or continues the final assistant message."""
        if self.continue_final_message and self.add_generation_prompt:
            raise PydanticCustomError("invalid_value", "must be false with continue_final_message true: the answer "
                                      "continues the final message instead of opening a turn",
                                      {"field": "add_generation_prompt"})
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise PydanticCustomError("invalid_value", "the final message must be an assistant's, which the answer "
                                      "continues (messages[{last}] is a {role} message)",
                                      {"field": "continue_final_message", "last": len(self.messages) - 1,
                                       "role": self.messages[-1].role})
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        try:
            return None if value is None else template_options(value, "chat_template_kwargs")
        except DecodeError as e:
            raise field_error(str(e).removeprefix("chat_template_kwargs: ")) from None

    _refuse = refusing("chat.completions", HARMLESS, "n", "logprobs", "top_logprobs", "response_format")


def refuse_tools(body):
    """Before validation: a text completion takes no tools."""
    for name in ("tools", "tool_choice") if isinstance(body, dict) else ():
        if body.get(name) not in (None, [], "none", "auto"):
            raise PydanticCustomError("unsupported_parameter", "not supported by /v1/completions (a chat "
                                      "completion takes tools)", {"field": name})
    return body


MAX_PROMPTS = 128  # prompts (times n) in one text completion request


class CompletionRequest(_Body):
    prompt: List[Union[str, List[int]]] = Field(description="a string (used as is), a list of token ids, or a "
                                                f"list of up to {MAX_PROMPTS} of those (one choice each)")
    max_tokens: Optional[int] = Field(None, ge=0, description=next(
        f.request_description() for f in FIELDS if f.request == "max_tokens") + "; 0 only with echo")
    n: Optional[int] = Field(None, ge=1, le=MAX_N, description="independent answers per prompt, decoded "
                             "together (with a seed, answer k uses seed + k)")
    echo: Optional[bool] = Field(None, description="the prompt back before the answer; with max_tokens 0 or 1 "
                                 "and logprobs, each prompt token's log-probability (scoring, docs/serving.md)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="the answer tokens' "
                                    "log-probabilities and this many most likely tokens per token; with echo: the "
                                    "prompt's")
    logprob_estimator: Optional[Literal["ar", "mc"]] = Field(
        None, description='with echo: "ar" (default) the prompt read autoregressively, one forward; "mc" the '
                          "authors' masked-diffusion Monte Carlo estimator of the tokens after context_tokens")
    mc_num: Optional[int] = Field(None, ge=1, le=1024, description='samples of the "mc" estimator (128)')
    context_tokens: Union[int, List[int], None] = Field(
        None, description='"mc": the prompt\'s first tokens that are context (one per prompt, or one for all)')

    _no_tools = model_validator(mode="before")(refuse_tools)
    _refuse = refusing("completions", HARMLESS, "n", "logprobs", "echo")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt):
        one = (isinstance(prompt, str) and prompt) or (
            isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt))
        prompts = [prompt] if one else prompt
        if isinstance(prompts, list) and 0 < len(prompts) <= MAX_PROMPTS and all(
                (isinstance(p, str) and p) or (isinstance(p, list) and p and all(type(t) is int for t in p))
                for p in prompts):
            return prompts
        raise field_error("must be a non-empty string or list of token ids, or a list of 1 to "
                       f"{MAX_PROMPTS} of those")


# --------------------------------------------------------------------------
# Into the engine's terms


def openai_messages(messages: List[Message]) -> List[dict]:
    """The messages in the chat template's form: developer as system, text
    parts joined, a call's arguments as an object; tool results answer calls made."""
    out = []
    for i, m in enumerate(messages):
        if m.refusal is not None and m.role != "assistant":
            raise Refusal(Reason.INVALID_VALUE, f"messages[{i}].refusal: only an assistant message refuses",
                          f"messages[{i}].refusal")
        content = m.content if m.content is not None else m.refusal
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise Refusal(Reason.INVALID_VALUE, f"messages[{i}].content: {'an' if m.role == 'assistant' else 'a'} "
                                                f"{m.role} message needs content (a string or text parts)",
                          f"messages[{i}].content")
        message = {"role": template_role(m.role), "content": content or ""}
        if m.tool_calls:
            if m.role != "assistant":
                raise Refusal(Reason.INVALID_VALUE, f"messages[{i}].tool_calls: only an assistant message makes "
                                                    "calls", f"messages[{i}].tool_calls")
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if not m.tool_call_id:
                raise Refusal(Reason.INVALID_VALUE, f"messages[{i}].tool_call_id: a tool message names the call "
                                                    "it answers", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    check_results(out, [f"messages[{i}]" for i in range(len(out))])
    unanswered = first_unanswered(out, right_after=True)
    if unanswered:  # OpenAI's rule, in its words
        i, ids = unanswered
        raise Refusal(Reason.INVALID_VALUE, f"messages[{i}]: an assistant message with 'tool_calls' must be followed "
                                            "by tool messages responding to each 'tool_call_id'; the following "
                                            f"tool_call_ids did not have response messages: {', '.join(ids)}",
                      f"messages[{i}]")
    return out


def _arguments(text: str, i: int, j: int) -> dict:
    return arguments_object(text or "{}", f"messages[{i}].tool_calls[{j}].function.arguments")


def chat_tools(body: ChatCompletionRequest, takes_tools: bool) -> tuple:
    """The request's function tools in the template's form, checked (none with tool_choice "none")."""
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            raise Refusal(Reason.UNSUPPORTED, f"tools[{i}].type: only function tools are supported, got "
                                              f"{tool.get('type')!r}", f"tools[{i}].type")
        tools.append(function_tool(tool.get("function"), f"tools[{i}].function"))
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise Refusal(Reason.INVALID_VALUE, 'tool_choice: "none", "auto", "required" or {"type": "function", '
                                                '"function": {"name": ...}}', "tool_choice")
        choice = name
    return template_tools(tools, choice, takes_tools, "tools", "tool_choice",
                          named=isinstance(body.tool_choice, dict))


def openai_request(body: _Body, kind: str, terms: RequestTerms, index: int = 0) -> Draft:
    """A chat (``kind`` "chat") or text ("text") completion body as the
    engine's draft request; ``index``: which of a text completion's prompts."""
    param = "messages" if kind == "chat" else "prompt"
    tools = chat_tools(body, terms.takes_tools) if kind == "chat" else ()
    prefill = bool(getattr(body, "continue_final_message", False))
    source = (ChatPrompt(openai_messages(body.messages), tools, prefill, body.chat_template_kwargs,
                         opened=body.add_generation_prompt is not False) if kind == "chat" else body.prompt[index])
    ids = terms.prompt_ids(source, param)
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    shape = response_format(body.response_format, "response_format") if kind == "chat" else None
    if shape is not None and prefill:
        raise Refusal(Reason.UNSUPPORTED, "response_format: not supported with continue_final_message: the answer "
                      "is a whole JSON document, which cannot continue the final message", "response_format")
    constraint = request_constraint(tools, body.tool_choice, parallel, any_strict(body.tools),
                                    shape) if kind == "chat" else None
    name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    scoring = scoring_of(body, ids, context_tokens(body, index), index) if kind == "text" else None
    return Draft(ids, getattr(body, name), decoding_given(body), "chat.completions" if kind == "chat" else
                 "completions", stop=body.stop or (), include_commits=include_commits(body), prompt_param=param,
                 max_tokens_param=name, tools=tools, parallel_tool_calls=parallel, constraint=constraint,
                 logprobs=None if scoring is not None else answer_logprobs(body, kind), scoring=scoring)


def answer_logprobs(body, kind: str):
    """The top tokens per answer token a body asks for (None: no logprobs)."""
    if kind == "text":
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise Refusal(Reason.INVALID_VALUE, "top_logprobs: needs logprobs true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None
