"""Why a request gets no answer, in the server's own terms.

The request's resolution (:mod:`.engine_request`) and the engine refuse or
end a request with a :class:`Refusal`: a :class:`Reason`, a one-line message
and, where one field is to blame, its name. Neither knows HTTP: each API's
edge turns the reason into its status and error shape (OpenAI's in
:mod:`..edge.http_errors`), so a second API maps the same reasons its own way.
"""

from __future__ import annotations

import enum
from typing import Any, Optional


class Reason(enum.Enum):
    """What went wrong; the value is the ``code`` OpenAI's error shape shows."""

    # the request itself: it would never be answered as it is
    INVALID_VALUE = "invalid_value"  # a value the model cannot take (a token id, an empty prompt)
    INVALID_PROMPT = "invalid_prompt"  # the chat template refused the conversation
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_DECODING_PARAMETERS = "invalid_decoding_parameters"  # a bad ReFusion setting or combination
    KV_MEMORY_EXCEEDED = "kv_memory_exceeded"  # could never fit in --max-kv-bytes
    INVALID_REQUEST = "invalid_request"  # the decoder refused it when it started
    UNSUPPORTED = "unsupported_parameter"  # a valid value this server cannot honour (yet)
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"  # not stored here (unknown, deleted or evicted)
    # the server: the same request may be answered later
    SERVER_BUSY = "server_busy"  # --max-queue requests already wait
    SHUTTING_DOWN = "shutting_down"
    ENGINE_DEAD = "engine_dead"  # the engine thread has ended; a restart is needed
    # a failure while answering (a bug, or out of memory)
    ENGINE_FAILED = "engine_failed"
    START_FAILED = "start_failed"
    STEP_FAILED = "step_failed"
    GENERATION_FAILED = "generation_failed"

    @property
    def kind(self) -> str:
        """The reason's kind: "request" (the client's to fix), "server" (retry later) or "failure" (a fault)."""
        if self in _SERVER:
            return "server"
        if self in _FAILURE:
            return "failure"
        return "request"


_SERVER = {Reason.SERVER_BUSY, Reason.SHUTTING_DOWN, Reason.ENGINE_DEAD}
_FAILURE = {Reason.ENGINE_FAILED, Reason.START_FAILED, Reason.STEP_FAILED, Reason.GENERATION_FAILED}


class Refusal(Exception):
    """A request refused, or ended without its answer: ``reason``, a one-line
    ``message``, and ``param``, the request field to blame (None: none);
    ``overflow``: for a prompt the context cannot answer, its sizes (a
    :class:`~refusion_mlx.decode.fit.ContextError`), for an API that words
    them its own way."""

    def __init__(self, reason: Reason, message: str, param: Optional[str] = None, overflow: Any = None):
        super().__init__(message)
        self.reason, self.message, self.param, self.overflow = reason, message, param, overflow


def field_of(message: str, names) -> Optional[str]:
    """The field a "FIELD: ..." message blames, where FIELD is one of ``names`` (None: another message)."""
    head = message.split(":", 1)[0]
    return head if head != message and head in names else None


def invalid(param: str, message: str) -> Refusal:
    """A field's bad value: "PARAM: MESSAGE", blaming PARAM (a 400)."""
    return Refusal(Reason.INVALID_VALUE, f"{param}: {message}", param)


def unsupported(param: str, message: str) -> Refusal:
    """A field this server does not serve: "PARAM: MESSAGE", blaming PARAM (a 400)."""
    return Refusal(Reason.UNSUPPORTED, f"{param}: {message}", param)
