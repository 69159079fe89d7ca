"""The OpenAPI document (``/openapi.json``, ``/docs``) as the server answers.

FastAPI describes the request bodies and a 422 it never sends: a refused
body is a 400 in the server's own error shape (:mod:`.http_errors`). This
module rewrites each operation's responses to what it can answer: 400 and
the refusals of :mod:`.security` (401 with ``--api-key``, 403, and a POST's
408, 411, 413, 415), 404 where the path names something, 500 and 503 where
a request is generated, ``/health``'s 503, and ``/metrics`` as Prometheus
text; each error in OpenAI's envelope, or Anthropic's on ``/v1/messages``.
With ``--api-key`` the key's two headers are the operations' security.
``tests/test_security.py`` fuzzes the server from this document.
"""

from __future__ import annotations

from typing import Callable

from ..core.apis import GENERATING
from ..core.metrics import CONTENT_TYPE
from .http_errors import anthropic_route
from .security import PUBLIC

NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": NULLABLE_STRING,
                       "code": NULLABLE_STRING}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error", "request_id"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}, "request_id": {"type": "string"}}},
}
WHY = {
    400: "invalid request: not JSON, a wrong type or value, a prompt over the context (one line naming the field)",
    401: "no API key, or a wrong one (the server was started with --api-key)",
    403: "the Host header does not name this server, or the request comes from another site's page",
    404: "nothing of that name here",
    408: "the body did not arrive within --body-timeout of its headers",
    411: "no Content-Length",
    413: "the body is over --max-body-bytes",
    415: "the body is not sent as Content-Type: application/json",
    500: "the generation failed",
    503: "the queue is full, or the server is stopping or its engine has stopped: retry later",
}


def _error(status: int, path: str) -> dict:
    name = "AnthropicError" if anthropic_route(path) else "Error"
    return {"description": WHY[status],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def statuses(path: str, method: str, keys: bool, metrics_public: bool) -> list:
    """The error statuses an operation can answer."""
    out = [403]
    if keys and path not in PUBLIC and not (metrics_public and path == "/metrics"):
        out.append(401)
    if method == "post":
        out += [400, 408, 411, 413, 415]
    if "{" in path:
        out += [400, 404]
    if method == "post" and path in GENERATING:
        out += [500, 503]
    return sorted(set(out))


def schema_maker(app, config) -> Callable[[], dict]:
    """``app.openapi``: FastAPI's document, its responses made the server's (made once)."""
    made = {}
    default = app.openapi

    def openapi() -> dict:
        if made:
            return made
        doc = default()
        components = doc.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas.update(SCHEMAS)
        keys = bool(config.api_keys)
        if keys:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                             "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        for path, operations in doc["paths"].items():
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                codes = statuses(path, method, keys, config.metrics_public)
                responses.update({str(s): _error(s, path) for s in codes})
                if 401 in codes:
                    op["security"] = [{"bearer": []}, {"apiKey": []}]
                if path == "/health":
                    responses["503"] = {"description": "the engine is stopping, dead or stuck (the same body, "
                                                       "its status says which)",
                                        "content": {"application/json": {"schema": {"type": "object"}}}}
                if path == "/metrics":
                    responses["200"] = {"description": "Prometheus' text format",
                                        "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}
        made.update(doc)
        return made

    return openapi
