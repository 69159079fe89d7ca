"""The request-body pieces every API shares (pydantic): strict types, the
stop strings' bounds (:func:`check_stops`), ``stream_options``, the server-wide settings, other
servers' sampler fields and other APIs' and servers' fields for what an API
names its own way (:func:`foreign_fields`) that no body may set
(:func:`refuse_unserved`), and
ReFusion's decoding fields, added to any API's body by
:func:`with_decoding` and read back by :func:`decoding_given`.

Each API's own body is its protocol's (OpenAI's completions:
:mod:`.openai_bodies`; :mod:`.responses_api`; :mod:`.anthropic_api`). Types are
strict (``"12"`` is not a number, ``true`` not an integer); unknown fields
are ignored unless a protocol refuses them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from ...decode.params import FIELDS
from ...decode.presets import PRESETS

MAX_STOP = 16  # stop strings a request
MAX_STOP_CHARS = 1000  # characters in one: each step holds back and checks as much of the answer, per stop string
MAX_TOP_LOGPROBS = 20  # most likely tokens shown beside each answer token (top_logprobs, logprobs), as OpenAI's
MAX_USER_CHARS = 256  # the end user's id (user, metadata.user_id: the prompt cache's partition), as OpenAI and
# Anthropic cap it
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

# Settings of the server's process, not of a request: refused in a body whatever their value.
PROCESS_SETTINGS = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size"}

# mlx_lm.server's adapters loaded per request: refused on every API unless it holds a value that changes nothing.
UNSERVED = {"adapters": (None,)}

# The request fields that are RefusionParams' settings under the same name
# (max_tokens, gen_length's request name, is each API's own).
DECODING_FIELDS = tuple(f.name for f in FIELDS if f.request == f.name)


# How each API asks for an answer under a JSON Schema (chat's also serves /v1/completions, which has none).
_SCHEMA = {"chat.completions": 'chat completions\' response_format {"type": "json_schema", "json_schema": '
                               '{"name": ..., "schema": ...}}',
           "responses": 'text.format {"type": "json_schema", "name": ..., "schema": ...}',
           "messages": 'output_config.format {"type": "json_schema", "schema": ...}'}
# Another API's name for what this API names its own way: its field -> this API's.
_NO_STOP = "stop to chat completions, which cuts at stop strings (this API has none)"
_NO_N = "one request per answer (this API has no n; chat completions has)"
_NO_LOGPROBS = "logprobs to chat completions (this API has none)"
_NO_SCHEMA = "response_format to chat completions (this API constrains no answer to a schema)"
_SYSTEM = "a system message in messages"
# OpenAI's and Anthropic's names for the JSON Schema an answer keeps to, its system prompt, its number of
# answers and its logprobs: each accepted only by the API that names it so (a 200 unconstrained, without the
# system prompt, with one answer or no logprobs the client believed it had asked for, otherwise)
_RENAMED = {"responses": {"response_format": "text.format", "output_config": "text.format",
                          "output_format": "text.format", "max_tokens": "max_output_tokens",
                          "max_completion_tokens": "max_output_tokens", "stop": _NO_STOP, "stop_sequences": _NO_STOP,
                          "system": "instructions", "n": _NO_N, "logprobs": "top_logprobs, or include "
                                                                             "message.output_text.logprobs"},
            "messages": {"response_format": "output_config.format", "text": "output_config.format",
                         "stop": "stop_sequences", "max_output_tokens": "max_tokens",
                         "max_completion_tokens": "max_tokens", "instructions": "system", "n": _NO_N,
                         "logprobs": _NO_LOGPROBS, "top_logprobs": _NO_LOGPROBS, "include": _NO_LOGPROBS},
            "chat.completions": {"max_output_tokens": "max_tokens", "stop_sequences": "stop",
                                 "text": "response_format", "output_config": "response_format",
                                 "output_format": "response_format", "system": _SYSTEM, "instructions": _SYSTEM,
                                 "include": "logprobs and top_logprobs"},
            "completions": {"max_output_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
                            "stop_sequences": "stop", "text": _NO_SCHEMA, "output_config": _NO_SCHEMA,
                            "output_format": _NO_SCHEMA, "system": "the system text in prompt (this API has no "
                                                                   "messages; chat completions has)",
                            "instructions": "the instructions in prompt (this API has no messages)",
                            "top_logprobs": "logprobs (an integer here: the top tokens per position)",
                            "include": "logprobs"}}


def _settings_other_names(api: str) -> Dict[str, str]:
    """The names make_params, a prompts file and a bench suite take for a decoding setting that ``api``'s
    body names otherwise (``gen_length``, ``temp``; ``max_tokens`` on the Responses API), each with the
    body's name for it, and ``preset`` with the settings a preset sets."""
    own = {f.request: _RENAMED.get(api, {}).get(f.request, f.request) for f in FIELDS if f.request is not None}
    names = {name: own[f.request] for f in FIELDS if f.request is not None for name in (f.name, *f.aliases)
             if name != own[f.request]}
    preset = ", ".join(own[f.request] for f in FIELDS if any(f.name in p for p in PRESETS.values()))
    return {**names, "preset": f"{preset} (a preset's settings), or start the server with --preset"}


def foreign_fields(api: str) -> Dict[str, str]:
    """The fields that would change ``api``'s answer but that its body does not
    read, each with why it is refused and what to send instead: other servers'
    constraint fields (vLLM's guided_*, llama.cpp's grammar and json_schema)
    on every API, and another API's name for a constraint, a limit or a stop
    string (chat's response_format, max_tokens, stop on the Responses and
    Messages APIs, as OpenAI and Anthropic refuse them; their max_output_tokens
    and stop_sequences on chat and text completions), and a decoding setting's
    other names (:func:`_settings_other_names`: ``gen_length``, ``temp``,
    ``preset``). Ignored, they gave a 200 with an answer the client believed
    constrained, cut, stopped or decoded as asked."""
    schema = _SCHEMA.get(api, _SCHEMA["chat.completions"])
    instead = {
        "guided_json": schema, "json_schema": schema, "structured_outputs": schema,
        "guided_choice": schema + ' with the schema {"enum": [...]} (the answer is then a JSON string)',
        "guided_regex": schema + ' with the schema {"type": "string", "pattern": ...} (a JSON string)',
        "guided_grammar": schema + ", or force a tool call with tool_choice",
        "grammar": schema + ", or force a tool call with tool_choice",
        "guided_decoding_backend": schema + " (this server's engine is llguidance)",
        "guided_whitespace_pattern": schema + " (answers are written as compact as json.dumps writes)"}
    why = {name: f"not supported by this server: send {to}" for name, to in instead.items()}
    title = {"responses": "the Responses API", "messages": "the Messages API", "chat.completions": "chat completions",
             "completions": "text completions"}[api]
    other = {name: f"not a field of {title}; send {to}" for name, to in _settings_other_names(api).items()}
    return {**why, **other,
            **{name: f"not supported by {title}: send {to}" for name, to in _RENAMED.get(api, {}).items()}}


def field_error(message: str, field: Optional[str] = None) -> PydanticCustomError:
    """A body field's bad value, raised in a pydantic validator (the edge words it "FIELD: MESSAGE");
    ``field``: the path it blames inside the validated field (``text.verbosity``), else the field."""
    if field is None:
        return PydanticCustomError("invalid_value", message)
    # the message rides in the context, so a quoted value's "{field}" stays as sent
    return PydanticCustomError("invalid_value", "{why}", {"field": field, "why": message})


def check_stops(items: list) -> Optional[list]:
    """A body's stop strings (``stop``, ``stop_sequences``), refused past
    :data:`MAX_STOP` or :data:`MAX_STOP_CHARS` or empty; None for none (a
    pydantic validator's work: the edge words it "FIELD: MESSAGE")."""
    if len(items) > MAX_STOP or not all(items):
        raise field_error(f"takes up to {MAX_STOP} non-empty strings")
    long = next((i for i, s in enumerate(items) if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise field_error(f"takes strings of at most {MAX_STOP_CHARS} characters (the one at [{long}] has "
                          f"{len(items[long])})")
    return items or None


def refuse_unserved(body, harmless: Dict[str, tuple] = UNSERVED, taken: Sequence[str] = (),
                    foreign: Optional[Dict[str, str]] = None):
    """Before validation, on every API's body: a field of PROCESS_SETTINGS,
    one of ``foreign`` (:func:`foreign_fields`: why it is refused) that is
    set, or the first of ``harmless`` (field: the values that change nothing)
    holding another value, is refused (its name in ctx), but for the fields
    the body ``taken`` itself. The body is returned (a pydantic validator)."""
    for name, flag in PROCESS_SETTINGS.items() if isinstance(body, dict) else ():
        if name in body:
            raise PydanticCustomError("unsupported_parameter", "set for the whole server when it starts ({flag}), "
                                      "not per request", {"field": name, "flag": flag})
    for name, why in (foreign or {}).items() if isinstance(body, dict) else ():
        if body.get(name) is not None:
            raise PydanticCustomError("unsupported_parameter", "{why}", {"field": name, "why": why})
    for name, values in harmless.items() if isinstance(body, dict) else ():
        value = body.get(name)
        if name not in taken and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
                                         for ok in values):
            raise PydanticCustomError("unsupported_parameter", "not supported by this server", {"field": name})
    return body


def refusing(api: str, harmless: Dict[str, tuple] = UNSERVED, *taken: str):
    """:func:`refuse_unserved` as the validator of ``api``'s body (before its fields are read), with the
    fields :func:`foreign_fields` names for it."""
    foreign = foreign_fields(api)
    return model_validator(mode="before")(lambda body: refuse_unserved(body, harmless, taken, foreign))


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: Optional[bool] = None
    include_commits: Optional[bool] = Field(
        None, description="ReFusion: each chunk also carries the slots its decoding step committed "
                          "(answer positions, token ids and their text), out of answer order")


def _decoding_specs(bounds: Dict[str, Dict[str, float]]) -> Dict[str, Any]:
    """The request's decoding fields, one per setting of ``FIELDS`` with a
    request name: optional (null: the server's default), typed, bounded and
    described as the table says (``bounds``: an API's own, over the table's)."""
    return {f.request: (Optional[f.type], Field(None, description=f.request_description(),
                                                **{**f.bounds(), **bounds.get(f.request, {})}))
            for f in FIELDS if f.request is not None}


def with_decoding(name: str, base: type, module: str, without: Sequence[str] = (),
                  bounds: Optional[Dict[str, Dict[str, float]]] = None) -> type:
    """``base``, an API's body, with the decoding fields but those ``without``
    (an API with its own name for the most tokens leaves ``max_tokens`` out);
    ``bounds``: an API's narrower bounds of a field (the Messages API's
    temperature), which its schema then states and its validation applies."""
    return create_model(name, __base__=base, __module__=module,
                        **{k: v for k, v in _decoding_specs(bounds or {}).items() if k not in without})


def decoding_given(body) -> Dict[str, Any]:
    """The decoding settings a body gives (those not null), by their RefusionParams names."""
    return {f: getattr(body, f) for f in DECODING_FIELDS if getattr(body, f) is not None}


def include_commits(body) -> bool:
    """Whether a streamed answer carries each step's commits (``stream_options.include_commits``)."""
    options = body.stream_options
    return bool(body.stream and options and options.include_commits)
