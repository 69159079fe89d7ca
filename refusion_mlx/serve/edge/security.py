"""What keeps the server to its user, at the HTTP edge: two ASGI middlewares
around the app (``app.create_app`` puts them in place).

:class:`SiteGuard` (outermost): the ``Host`` header must name the server --
one of the addresses it is bound to, ``localhost``, or a name of
``--allowed-hosts`` -- or it is a 403 (a DNS-rebinding page, whose own name
resolves to this machine, cannot read answers); a browser's request from a
page of another origin (its ``Origin`` header) is a 403 unless
``--allowed-origins`` names that origin. CORS (off unless
``--allowed-origins``) sits inside it.

:class:`RequestGuard`: with ``--api-key`` every route but ``/health`` and the
web page's own static files needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY`` (401; ``/metrics`` too, unless ``--metrics-public``); a
POST with a body needs a JSON ``Content-Type`` (415: a cross-site form or
``text/plain`` POST, which a browser sends without asking, never runs; one
with no body and no ``Content-Type`` goes on, and a route that needs a body
answers its 400), a
``Content-Length`` or a chunked body, not both (411, 400), within
``--max-body-bytes`` (413), its whole
body within ``--body-timeout`` seconds of its headers (408; 503 when the
server stops while it is still coming), and no string
in it with an unpaired UTF-16 surrogate (400, naming the field); the body
is then handed to the app as read.

Every refusal is one line in the route's API error shape
(:func:`.http_errors.error_response`). The key a request presented is left
in its scope (:data:`KEY_SCOPE`: a hash, never the key) for the prompt
cache's partitions.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import re
import time
from typing import Callable, Iterable, Optional, Tuple

from ..core.refusal import Reason, Refusal
from .http_errors import APIError, error_response, refusal_error
from .lanes import BODY_BYTES

KEY_SCOPE = "refusion.key"  # the scope entry holding the hash of the API key a request presented
WILDCARDS = ("0.0.0.0", "::", "")
# what a browser may load without the key: the page itself, which asks for the key
PUBLIC_PAGE = ("/", "/web/app.js", "/web/settings.js", "/web/slots.js", "/web/style.css")
PUBLIC = ("/health", "/v1/health", "/api/hello")  # /api/hello: a client's connection check, no key
STOP_CHECK = 0.25  # seconds between two looks at whether the server is stopping, while a body arrives


def key_id(key: str) -> str:
    """What stands for an API key in the prompt cache's partitions and files: a short hash."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def exposure_warning(host: str, port: int, keys: Iterable[str]) -> Optional[str]:
    """The warning for a server other machines can reach without a key (None: loopback, or a key is set)."""
    if is_loopback(host) or any(keys):
        return None
    where = "every address of this machine" if host in WILDCARDS else host
    return (f"WARNING: listening on {where} (port {port}) without an API key: anyone who can reach this "
            "machine can run the model and read its answers. Set --api-key or REFUSION_MLX_API_KEY, "
            "or bind to 127.0.0.1")


def _header(scope, name: bytes) -> Optional[str]:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def _hostname(value: str) -> str:
    """The name or address of a Host header or an origin's authority, without the port."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class SiteGuard:
    """ASGI middleware: the Host a request names and the Origin of the page that
    sent it (a browser's) must be the server's own, or allowed; else 403."""

    def __init__(self, app, bound: str, allowed_hosts: Tuple[str, ...] = (),
                 allowed_origins: Tuple[str, ...] = (), on_error: Optional[Callable[[APIError, dict], None]] = None):
        self.app, self.on_error = app, on_error
        self.any_host = "*" in allowed_hosts
        self.wildcard = bound in WILDCARDS
        self.hosts = {"localhost", _hostname(bound)} | {_hostname(h) for h in allowed_hosts}
        self.origins = set(allowed_origins)

    def host_ok(self, host: Optional[str]) -> bool:
        if host is None or self.any_host:
            return True  # HTTP/1.0 without a Host: no browser sends that
        name = _hostname(host).rstrip(".")
        if name in self.hosts:
            return True
        try:  # an address is no rebinding: a page can only name an address it was served from
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        return self.wildcard or address.is_loopback

    def origin_ok(self, origin: Optional[str], host: Optional[str]) -> bool:
        if origin is None or "*" in self.origins or origin in self.origins:
            return True
        authority = origin.split("://", 1)[-1]
        return host is not None and authority.lower() == host.strip().lower()  # the server's own page

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host, origin = _header(scope, b"host"), _header(scope, b"origin")
        if not self.host_ok(host):
            error = APIError(403, f"the Host header {host!r} does not name this server; start it with "
                                  f"--allowed-hosts {_hostname(host or '')} to accept that name",
                             code="host_not_allowed", type="permission_error")
        elif not self.origin_ok(origin, host):
            error = APIError(403, f"requests from pages of {origin} are refused; start the server with "
                                  f"--allowed-origins {origin} to allow that origin",
                             code="origin_not_allowed", type="permission_error")
        else:
            return await self.app(scope, receive, send)
        if self.on_error is not None:
            self.on_error(error, scope)
        await error_response(error, scope)(scope, receive, send)


# JSON escapes of a UTF-16 surrogate that is not half of a pair: "\ud800" alone
# (a pair, "\ud83d\ude00", is one character and passes). A high half not
# followed by a low one; a low half not preceded by a high one. Each pattern
# starts with its literal "\u", which the regex engine searches for fast:
# a 1 MB body takes under 1 ms, 9 ms when it is all emoji pairs (2-core CPU).
_LONE_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")
_LONE_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(body: bytes) -> bool:
    """Whether ``body`` is UTF-8 (strictly: no surrogate's bytes). JSON text
    on the wire is UTF-8 (RFC 8259); Python's json.loads also reads UTF-16
    and UTF-32, and the bytes of a lone surrogate, into strings no tokenizer
    or answer can carry (500s further in)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def unpaired_surrogate(body: bytes) -> Optional[Tuple[str, str]]:
    """Where a JSON ``body`` holds a string with an unpaired UTF-16 surrogate
    (``"\\ud800"``), which is no Unicode text: no tokenizer takes it, and
    no answer echoing it can be written as UTF-8. The field's path
    (``messages[0].content``; ``""`` for the body itself) and the surrogate,
    first in the body's order; None when there is none, or when the body is
    not JSON (the route says so)."""
    if not (_LONE_HIGH.search(body) or _LONE_LOW.search(body)):  # the common case: no parse
        return None
    try:
        todo = [("", json.loads(body))]
    except (ValueError, RecursionError):
        return None
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                return path, f"\\u{ord(found.group()):04x}"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                found = _SURROGATE.search(key)
                if found:  # the path would hold it too: the object's own path is named
                    return path, f"\\u{ord(found.group()):04x}"
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
    return None


def _json_type(value: Optional[str]) -> bool:
    media = (value or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class RequestGuard:
    """ASGI middleware: the API key (401), then a POST's Content-Type (415; none for no body),
    Content-Length (411, 413), a body that arrives in time (408) and holds
    text only (400: :func:`unpaired_surrogate`). ``stopping()``: whether the
    server is stopping, when a body still to come is waited for no longer (503)."""

    def __init__(self, app, keys: Tuple[str, ...] = (), max_bytes: int = 1 << 20, body_timeout: float = 30.0,
                 metrics_public: bool = False, on_error: Optional[Callable[[APIError, dict], None]] = None,
                 stopping: Callable[[], bool] = lambda: False):
        self.app, self.max_bytes, self.body_timeout, self.on_error = app, max_bytes, body_timeout, on_error
        self.stopping = stopping
        self.keys = tuple(k.encode() for k in keys)
        self.public = PUBLIC + (("/metrics",) if metrics_public else ())

    def presented(self, scope) -> Optional[bytes]:
        auth = _header(scope, b"authorization")
        if auth is not None and auth[:7].lower() == "bearer ":
            return auth[7:].strip().encode("latin-1")
        key = _header(scope, b"x-api-key")
        return key.strip().encode("latin-1") if key is not None else None

    def authorized(self, scope) -> bool:
        """Whether the request may pass, its key's hash left in its scope (on a
        public route too: ``/health`` shows its counts only to a key)."""
        path = scope["path"]
        if not self.keys:
            return True
        given = self.presented(scope)
        match = [k for k in self.keys if given is not None and hmac.compare_digest(given, k)]
        if match:
            scope[KEY_SCOPE] = key_id(match[0].decode())
        if path in self.public or (scope["method"] in ("GET", "HEAD") and path in PUBLIC_PAGE):
            return True
        if scope["method"] == "OPTIONS":
            return True  # a CORS preflight carries no credentials; the request after it does
        return bool(match)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.authorized(scope):
            how = "Authorization: Bearer KEY or x-api-key: KEY"
            given = self.presented(scope) is not None
            error = APIError(401, ("the API key is not valid" if given else "this server needs an API key")
                             + f": send it as {how}", code="invalid_api_key")
            return await self.refuse(error, scope, receive, send, {"WWW-Authenticate": "Bearer"})
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")  # a number: h11 refuses others
        chunked = _header(scope, b"transfer-encoding") is not None  # h11 takes chunked alone
        kind = _header(scope, b"content-type")
        if kind is None and not chunked and length in (None, "0"):  # no body at all (POST .../cancel)
            scope[BODY_BYTES] = 0
            return await self.app(scope, _replay(b"", receive), send)
        if not _json_type(kind):
            error = APIError(415, "the request body must be JSON, sent with Content-Type: application/json "
                                  f"(got {_header(scope, b'content-type') or 'none'})",
                             code="unsupported_media_type")
        elif chunked and length is not None:  # both: a smuggling risk
            error = APIError(400, "Transfer-Encoding with a Content-Length is not accepted: send one of them")
        elif not chunked and length is None:
            error = APIError(411, "a Content-Length header (or a chunked body) is required", code="length_required")
        elif length is not None and int(length) > self.max_bytes:
            await self.drain(receive, int(length))  # read it, or the client sees a reset, not the 413
            error = APIError(413, f"the request body is {int(length)} bytes; the limit is {self.max_bytes}",
                             code="request_too_large")
        else:
            body, more = await self.read(receive)
            if body is None:  # the client left
                return
            if body is False and self.stopping():
                error = refusal_error(Refusal(Reason.SHUTTING_DOWN, "the server is shutting down"))
            elif body is False:
                error = APIError(408, f"the request body did not arrive within {self.body_timeout:g} s of its "
                                      "headers", code="request_timeout")
            elif len(body) > self.max_bytes:  # chunked: known only as it comes
                if more:  # read the rest, or the client sees a reset, not the 413
                    await self.drain(receive, 64 << 20)
                error = APIError(413, f"the request body is over the limit of {self.max_bytes} bytes",
                                 code="request_too_large")
            elif not _utf8(body):  # a surrogate's bytes (CESU-8), a UTF-16 body: json.loads would take them
                error = APIError(400, "the request body is not UTF-8 text (JSON is sent as UTF-8)",
                                 code="invalid_json")
            else:
                where = unpaired_surrogate(body)
                if where is None:
                    scope[BODY_BYTES] = len(body)  # which tokenizing lane it takes (lanes.py)
                    return await self.app(scope, _replay(body, receive), send)
                error = APIError(400, f"{where[0] or 'the request body'}: holds an unpaired UTF-16 surrogate "
                                      f"({where[1]}), which is not Unicode text", where[0] or None, "invalid_value")
        await self.refuse(error, scope, receive, send)

    async def refuse(self, error: APIError, scope, receive, send, headers=None):
        if self.on_error is not None:
            self.on_error(error, scope)
        response = error_response(error, scope)
        response.headers.update(headers or {})
        if error.status in (408, 503) or _header(scope, b"transfer-encoding") is not None:  # a body left unread
            response.headers["Connection"] = "close"
        await response(scope, receive, send)

    async def next_message(self, receive, deadline: float):
        """The client's next message; None when none comes by ``deadline`` (monotonic) or the server stops."""
        while True:
            try:
                return await asyncio.wait_for(receive(), max(0.0, min(deadline - time.monotonic(), STOP_CHECK)))
            except asyncio.TimeoutError:
                if self.stopping() or time.monotonic() >= deadline:
                    return None

    async def read(self, receive):
        """(the body, whether more of it is still to come): bytes (once over the limit, what came so far),
        None when the client leaves, False when it stalls past the timeout or the server stops meanwhile."""
        parts, size, deadline = [], 0, time.monotonic() + self.body_timeout
        while True:
            message = await self.next_message(receive, deadline)
            if message is None:
                return False, False
            if message["type"] == "http.disconnect":
                return None, False
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if not message.get("more_body") or size > self.max_bytes:
                return b"".join(parts), bool(message.get("more_body"))

    async def drain(self, receive, length: int) -> None:
        left, deadline = min(length, 64 << 20), time.monotonic() + 5
        while left > 0 and time.monotonic() < deadline:
            message = await self.next_message(receive, deadline)
            if message is None:
                return
            left = left - len(message.get("body", b"")) if message.get("more_body") else 0


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body already read, then waits on the client (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class HeadAsGet:
    """ASGI middleware: ``HEAD`` answered wherever ``GET`` is -- the route runs as
    a GET, its headers go out, its body does not (clients probe with HEAD)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)

