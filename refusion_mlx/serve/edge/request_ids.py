"""One id per HTTP request, as OpenAI's and Anthropic's APIs give one, so
that a client's failure can be matched with the server's log.

:class:`RequestIds`, the outermost ASGI layer (outside FastAPI's own error
handling, so a 500 has one too), makes it when the request arrives and sends
it on every response -- answers, streams, errors, pages -- as both
``x-request-id`` (OpenAI's: the openai SDK's ``_request_id``) and
``request-id`` (Anthropic's: the anthropic SDK's ``_request_id`` and
``APIStatusError.request_id``). Anthropic's error bodies carry it as
``request_id`` (:mod:`.http_errors`, the stream's ``error`` event), and the
request's log line ends with it (:func:`tagged`).
"""

from __future__ import annotations

import uuid

REQUEST_ID = "refusion.request_id"  # the ASGI scope's key
HEADERS = (b"x-request-id", b"request-id")


def request_id(scope) -> str:
    """The id of the request whose ASGI ``scope`` this is ("" outside :class:`RequestIds`)."""
    return scope.get(REQUEST_ID, "")


def tagged(line: str, scope) -> str:
    """A log line about the request, its id at the end."""
    rid = request_id(scope)
    return f"{line} [{rid}]" if rid else line


class RequestIds:
    """ASGI middleware: a new ``req_...`` id in the request's scope, and in its response's headers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = scope[REQUEST_ID] = f"req_{uuid.uuid4().hex}"
        value = rid.encode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *((h, value) for h in HEADERS)]}
            await send(message)

        await self.app(scope, receive, with_id)
