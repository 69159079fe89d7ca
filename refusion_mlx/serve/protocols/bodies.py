"""The request-body pieces every API shares (pydantic): strict types, the
stop strings' bound, ``stream_options``, the server-wide settings and other
servers' sampler fields no body may set (:func:`refuse_unserved`), and
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

MAX_STOP = 16
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

# Settings of the server's process, not of a request: refused in a body whatever their value.
PROCESS_SETTINGS = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size"}

# Other servers' sampler settings the planning drafts cannot take (OpenAI's penalties, mlx_lm.server's own),
# and adapters loaded per request: refused on every API unless they hold a value that changes nothing.
SAMPLER_ONLY = "not supported: the planning drafts take temperature, top_p, top_k and min_p only"
UNSERVED = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
            "repetition_penalty": (None, 0, 1), "xtc_probability": (None, 0), "adapters": (None,)}

# The request fields that are RefusionParams' settings under the same name
# (max_tokens, gen_length's request name, is each API's own).
DECODING_FIELDS = tuple(f.name for f in FIELDS if f.request == f.name)


def field_error(message: str) -> PydanticCustomError:
    """A body field's bad value, raised in a pydantic validator (the edge words it "FIELD: MESSAGE")."""
    return PydanticCustomError("invalid_value", message)


def refuse_unserved(body, harmless: Dict[str, tuple] = UNSERVED, taken: Sequence[str] = (),
                    foreign: Optional[Dict[str, str]] = None):
    """Before validation, on every API's body: a field of PROCESS_SETTINGS,
    one of ``foreign`` (another server's field: what to send instead) that is
    set, or the first of ``harmless`` (field: the values that change nothing)
    holding another value, is refused (its name in ctx), but for the fields
    the body ``taken`` itself. The body is returned (a pydantic validator)."""
    for name, flag in PROCESS_SETTINGS.items() if isinstance(body, dict) else ():
        if name in body:
            raise PydanticCustomError("unsupported_parameter", "set for the whole server when it starts ({flag}), "
                                      "not per request", {"field": name, "flag": flag})
    for name, instead in (foreign or {}).items() if isinstance(body, dict) else ():
        if body.get(name) is not None:
            raise PydanticCustomError("unsupported_parameter", "not supported by this server: send {instead}",
                                      {"field": name, "instead": instead})
    for name, values in harmless.items() if isinstance(body, dict) else ():
        value = body.get(name)
        if name not in taken and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
                                         for ok in values):
            why = SAMPLER_ONLY if name in UNSERVED and name != "adapters" else "not supported by this server"
            raise PydanticCustomError("unsupported_parameter", why, {"field": name})
    return body


def refusing(harmless: Dict[str, tuple] = UNSERVED, *taken: str, foreign: Optional[Dict[str, str]] = None):
    """:func:`refuse_unserved` as a body's validator (before its fields are read)."""
    return model_validator(mode="before")(lambda body: refuse_unserved(body, harmless, taken, foreign))


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: Optional[bool] = None
    include_commits: Optional[bool] = Field(
        None, description="ReFusion: each chunk also carries the slots its decoding step committed "
                          "(answer positions, token ids and their text), out of answer order")


def _decoding_specs() -> Dict[str, Any]:
    """The request's decoding fields, one per setting of ``FIELDS`` with a
    request name: optional (null: the server's default), typed, bounded and
    described as the table says."""
    return {f.request: (Optional[f.type], Field(None, description=f.request_description(), **f.bounds()))
            for f in FIELDS if f.request is not None}


def with_decoding(name: str, base: type, module: str, without: Sequence[str] = ()) -> type:
    """``base``, an API's body, with the decoding fields but those ``without``
    (an API with its own name for the most tokens leaves ``max_tokens`` out)."""
    return create_model(name, __base__=base, __module__=module,
                        **{k: v for k, v in _decoding_specs().items() if k not in without})


def decoding_given(body) -> Dict[str, Any]:
    """The decoding settings a body gives (those not null), by their RefusionParams names."""
    return {f: getattr(body, f) for f in DECODING_FIELDS if getattr(body, f) is not None}


def include_commits(body) -> bool:
    """Whether a streamed answer carries each step's commits (``stream_options.include_commits``)."""
    options = body.stream_options
    return bool(body.stream and options and options.include_commits)
