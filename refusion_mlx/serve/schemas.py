"""The OpenAI request bodies as pydantic models (they make the schema at
``/docs``), and their translation into what the engine runs.

Types are strict (``"12"`` is not a number, ``true`` not an integer) and
ranges are checked here; what needs the tokenizer or the model's context is
checked in :func:`prepare`. Fields that would change an answer's meaning but
cannot be honoured are refused, never ignored; other unknown fields are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..decode.params import FIELDS
from ..errors import RefusionError

MAX_STOP = 16
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _invalid(message: str):
    return PydanticCustomError("invalid_value", message)


# Fields refused unless they hold a value that changes nothing.
HARMLESS = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
            "frequency_penalty": (None, 0), "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""),
            "best_of": (None, 1), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
            "response_format": (None, {"type": "text"})}


def refuse_unsupported(body):
    """Before validation: the first field of HARMLESS holding another value is refused (its name in ctx)."""
    for name, values in HARMLESS.items() if isinstance(body, dict) else ():
        value = body.get(name)
        if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in values):
            why = "not supported by this server"
            if name in ("presence_penalty", "frequency_penalty", "logit_bias"):
                why = "not supported: the planning drafts take temperature, top_p, top_k and min_p only"
            raise PydanticCustomError("unsupported_parameter", why, {"field": name})
    return body


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: Optional[bool] = None
    include_commits: Optional[bool] = Field(
        None, description="ReFusion: each chunk also carries the slots its decoding step committed "
                          "(answer positions, token ids and their text), out of answer order")


class _RequestBase(BaseModel):
    """A request's fields besides the decoding settings (which :func:`_decoding_fields` adds)."""

    model_config = STRICT
    model: Optional[str] = Field(None, description="any name; one model is served")
    stop: Union[str, List[str], None] = Field(None, description=f"up to {MAX_STOP} strings")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None

    _refuse = model_validator(mode="before")(refuse_unsupported)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        items = [value] if isinstance(value, str) else value
        if items is None:
            return None
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise _invalid("must be a string or a list of strings")
        if len(items) > MAX_STOP or not all(items):
            raise _invalid(f"takes 1 to {MAX_STOP} non-empty strings")
        return items


def _decoding_fields() -> Dict[str, Any]:
    """The request's decoding fields, one per setting of ``FIELDS`` with a
    request name: optional (null: the server's default), typed, bounded and
    described as the table says."""
    return {f.request: (Optional[f.type], Field(None, description=f.request_description(), **f.bounds()))
            for f in FIELDS if f.request is not None}


# The fields common to both endpoints: _RequestBase's and the decoding settings.
_Request = create_model("_Request", __base__=_RequestBase, __module__=__name__, **_decoding_fields())


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[TextPart], None] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content):
        """A string, null, or a list of ``{"type": "text", "text": ...}`` parts, joined."""
        if content is None or isinstance(content, str):
            return content or ""
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                              and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise _invalid('must be a string or a list of text parts ({"type": "text", "text": ...})')


class ChatCompletionRequest(_Request):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="as max_tokens (and over it)")


class CompletionRequest(_Request):
    prompt: Union[str, List[int]] = Field(description="a string (used as is) or a list of token ids")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        raise _invalid("must be a non-empty string or list of token ids (one prompt per request)")


# --------------------------------------------------------------------------
# Into the engine's terms


@dataclasses.dataclass
class Request:
    """A validated completion request, ready for the engine."""

    kind: str  # "chat" or "text"
    prompt_ids: List[int]
    params: Any  # RefusionParams
    max_tokens: int
    stop: List[str]
    stream: bool
    include_usage: bool
    include_commits: bool = False  # a stream's chunks carry each step's commits


# The request fields that are RefusionParams' settings under the same name
# (max_tokens, gen_length's request name, is checked against the context in prepare).
DECODING_FIELDS = tuple(f.name for f in FIELDS if f.request == f.name)


def prepare(body: _Request, kind: str, tokenize: Callable[[Any], List[int]], *, defaults,
            default_max_tokens: int, context: int, vocab_size: int) -> Request:
    """Tokenize and check against the model: context, vocabulary, decoding layout."""
    param = "messages" if kind == "chat" else "prompt"
    source = ([{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in body.messages]
              if kind == "chat" else body.prompt)
    outside = [t for t in source if isinstance(t, int) and not 0 <= t < vocab_size]
    if outside:
        raise bad(f"prompt token id {outside[0]} is outside the vocabulary of {vocab_size}", param, "invalid_value")
    try:
        ids = list(tokenize(source))
    except Exception as e:  # a chat template that refuses the conversation
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise bad(f"cannot build the prompt: {detail}", param) from None
    if not ids:
        raise bad("the prompt is empty after tokenization", param, "invalid_value")
    if len(ids) >= context:
        raise bad(f"the prompt is {len(ids)} tokens; the model's context is {context}", param,
                  "context_length_exceeded")
    name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    max_tokens = getattr(body, name)
    if max_tokens is not None and max_tokens > context:
        raise bad(f"{name} must be at most the model's context of {context}, got {max_tokens}", name,
                  "context_length_exceeded")
    slot = body.slot_size or defaults.slot_size
    if max_tokens is None:  # as OpenAI: the default shrinks to what the context leaves
        max_tokens = min(default_max_tokens, ((context - len(ids)) // slot) * slot)
        if max_tokens < 1:
            raise bad(f"the prompt is {len(ids)} tokens; the model's context of {context} leaves no whole "
                      f"slot of {slot} for an answer", param, "context_length_exceeded")
    values = dataclasses.asdict(defaults)
    values["gen_length"] = max_tokens
    given = {f: getattr(body, f) for f in DECODING_FIELDS if getattr(body, f) is not None}
    if "block_length" in given or "serial_num_blocks" in given:  # a request's choice replaces the server's
        values["block_length"] = values["serial_num_blocks"] = None
    values.update(given)
    params = type(defaults)(**values)
    try:
        budget = params.layout().gen_length
    except RefusionError as e:
        raise bad(str(e), None, "invalid_decoding_parameters") from None
    if len(ids) + budget > context:
        raise bad(f"the prompt ({len(ids)} tokens) + {name} ({max_tokens}, {budget} in whole slots) exceeds "
                  f"the model's context of {context}", name, "context_length_exceeded")
    options = body.stream_options
    return Request(kind, ids, params, max_tokens, body.stop or [], bool(body.stream),
                   bool(options and options.include_usage),
                   bool(body.stream and options and options.include_commits))
