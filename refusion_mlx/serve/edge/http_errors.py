"""Errors at the HTTP edge, in the shape of the route's API: OpenAI's
``{"error": {message, type, param, code}}`` (chat and text completions, the
Responses API, everything else), Anthropic's ``{"type": "error", "error":
{type, message}, "request_id"}`` on ``/v1/messages`` (:func:`anthropic_route`), and on the
routes every API's clients call (``/v1/models``) to a client of Anthropic's
(:func:`client_shape`).

Whatever refused a request -- the body's schema (pydantic), the route, the
request's resolution or the engine (a :class:`~..core.refusal.Refusal`) -- reaches
the client as one :class:`APIError`; :func:`as_api_error` is the one mapping
(a refusal's status comes from its reason: :data:`STATUS`), and
:func:`error_response` writes it in the route's shape.
"""

from __future__ import annotations

import re
from typing import Optional

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..core.apis import error_shape
from ..core.refusal import Refusal
from .request_ids import request_id

# pydantic's names for the members of a union in an error's location (str, literal['a','b'],
# list[...], function-after[...]): not fields, so never part of the parameter's name
UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list|dict|tuple|set)|[a-z-]+\[.*\]")


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None, anthropic_message: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.anthropic_message = anthropic_message  # Anthropic's own words for it, where its clients read them

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self, request_id: str = "") -> dict:
        """Anthropic's error shape: its error type by status (:data:`ANTHROPIC_TYPES`), and the request's id."""
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.anthropic_message or self.message},
                **({"request_id": request_id} if request_id else {})}


# Anthropic's error types by HTTP status (its docs' table; 503 is our "retry later", its overloaded_error).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def anthropic_route(path: str) -> bool:
    """The routes whose errors take Anthropic's shape (:func:`..core.apis.error_shape`): the Messages API's."""
    return error_shape(path) == "anthropic"


# A refusal's HTTP status, by the kind of its reason: the client's to fix, retry later, the server's fault.
STATUS = {"request": 400, "server": 503, "failure": 500}


def refusal_error(refusal: Refusal) -> APIError:
    """A refusal as OpenAI's error: status by its reason, the reason as ``code``
    (and its words in Anthropic's shape: :func:`anthropic_overflow`)."""
    return APIError(STATUS[refusal.reason.kind], refusal.message, refusal.param, refusal.reason.value,
                    anthropic_message=anthropic_overflow(refusal.overflow))


def anthropic_overflow(overflow) -> Optional[str]:
    """A context overflow (a :class:`~refusion_mlx.decode.fit.ContextError`; None: none) in the words of
    Anthropic's API, from which its clients read the sizes: Claude Code compacts the conversation on the
    first (``prompt is too long: N tokens > M maximum``, M the longest prompt that leaves room for an
    answer) and lowers ``max_tokens`` on the second."""
    if overflow is None:
        return None
    prompt, answer, context = overflow.prompt_tokens, overflow.answer, overflow.context
    if overflow.field == "prompt":
        return f"prompt is too long: {prompt} tokens > {context - answer} maximum"
    return (f"input length and `max_tokens` exceed context limit: {prompt} + {answer} > {context}, "
            "decrease input length or `max_tokens` and try again")


def as_api_error(request, exc: Exception) -> APIError:
    """Any error of a request as an APIError: pydantic's first complaint names its field
    (``messages[0].role: ...``); a route that does not exist is 404, a method it does not take 405."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Refusal):
        return refusal_error(exc)
    if isinstance(exc, HTTPException):
        path, method = request.url.path, request.method
        status = exc.status_code
        message = {404: f"no route for {method} {path}", 405: f"{path} does not take {method}"}.get(status)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's parse of the body gave up
            message, code = "the request body is nested too deeply to read as JSON", "invalid_json"
        elif isinstance(exc.__cause__, ValueError):  # Python's limit on an integer's digits (4,300), ...
            message, code = ("the request body holds an integer too long to read (over 4,300 digits)"
                             if "digits" in str(exc.__cause__) else "the request body is not JSON this server reads"
                             ), "invalid_json"
        return APIError(status, message or str(exc.detail), code=code)
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                        code="invalid_json")
    param = ""
    for part in err["loc"][1:] if err["loc"][:1] == ("body",) else err["loc"]:
        if isinstance(part, str) and UNION_MEMBER.fullmatch(part):  # which type of a union it was tried as
            continue
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    kind = err["type"]
    code = {"missing": "missing_required_parameter", "unsupported_parameter": kind}.get(kind) or (
        "invalid_type" if kind.endswith("_type") else "invalid_value")
    message = " ".join(err["msg"].removeprefix("Value error, ").split())
    param = err.get("ctx", {}).get("field") or param  # a field refused before validation
    return APIError(400, f"{param or 'the request body'}: {message}", param or None, code)


def printable(text: str) -> str:
    """``text`` for one log line: control characters (a path's %0a, an escape
    sequence in a header or a field's name the message quotes) escaped, so no
    client writes lines or drives the operator's terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(text))


def client_shape(scope) -> str:
    """The error shape a request's client reads, by its headers: Anthropic's for
    an ``anthropic-version``, or an ``x-api-key`` without ``Authorization`` (its SDK's)."""
    names = {name.lower() for name, _ in scope.get("headers") or ()}
    anthropic = b"anthropic-version" in names or (b"x-api-key" in names and b"authorization" not in names)
    return "anthropic" if anthropic else "openai"


def error_response(error: APIError, scope) -> JSONResponse:
    """The error in the shape of the API whose route the request (its ASGI
    ``scope``) asked for; on a route of every API (``/v1/models``), of its client's."""
    shape = error_shape(scope["path"], client_shape(scope))
    body = error.anthropic_body(request_id(scope)) if shape == "anthropic" else error.body()
    return JSONResponse(body, error.status, headers={"Retry-After": "1"} if error.status == 503 else None)
