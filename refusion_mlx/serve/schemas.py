"""The OpenAI request bodies as pydantic models (they make the schema at
``/docs``), and their adapter into the engine's request
(:func:`openai_request`).

Types are strict (``"12"`` is not a number, ``true`` not an integer) and
ranges are checked here; what needs the tokenizer or the model's context is
checked where the engine's request is made (:mod:`.engine_request`). Fields
that would change an answer's meaning but cannot be honoured are refused,
never ignored; other unknown fields are.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..decode.params import FIELDS, RefusionParams
from .engine_request import EngineRequest, prompt_ids, resolve

MAX_STOP = 16
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _invalid(message: str):
    return PydanticCustomError("invalid_value", message)


# Fields refused unless they hold a value that changes nothing.
HARMLESS = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
            "frequency_penalty": (None, 0), "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""),
            "best_of": (None, 1), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
            "response_format": (None, {"type": "text"})}


# Settings of the server's process, not of a request: refused in a body whatever their value.
PROCESS_SETTINGS = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size"}


def refuse_unsupported(body):
    """Before validation: a field of PROCESS_SETTINGS, or the first field of
    HARMLESS holding another value, is refused (its name in ctx)."""
    for name, flag in PROCESS_SETTINGS.items() if isinstance(body, dict) else ():
        if name in body:
            raise PydanticCustomError("unsupported_parameter", "set for the whole server when it starts ({flag}), "
                                      "not per request", {"field": name, "flag": flag})
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


# The request fields that are RefusionParams' settings under the same name
# (max_tokens, gen_length's request name, is resolve's own argument).
DECODING_FIELDS = tuple(f.name for f in FIELDS if f.request == f.name)


def decoding_fields(body: _Request) -> Dict[str, Any]:
    """The decoding settings a body gives (those not null), by their RefusionParams names."""
    return {f: getattr(body, f) for f in DECODING_FIELDS if getattr(body, f) is not None}


def openai_request(body: _Request, kind: str, tokenize: Callable[[Any], List[int]], *, defaults: RefusionParams,
                   context: int, vocab_size: int) -> EngineRequest:
    """A chat (``kind`` "chat") or text ("text") completion body as the engine's request."""
    param = "messages" if kind == "chat" else "prompt"
    source = ([{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in body.messages]
              if kind == "chat" else body.prompt)
    ids = prompt_ids(source, tokenize, vocab_size, param)
    name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    options = body.stream_options
    return resolve(ids, max_tokens=getattr(body, name), fields=decoding_fields(body), defaults=defaults,
                   context=context, stop=body.stop or (), prompt_param=param, max_tokens_param=name,
                   include_commits=bool(body.stream and options and options.include_commits))
