"""Connections that hold the server without a request, or without taking its answer, are cut.

uvicorn times out an idle keep-alive connection, but not one that opens and
never finishes its headers; and it takes every connection it can accept, so
a few thousand such sockets use up the process's file descriptors and the
accept error is logged without end. :func:`protocol` makes uvicorn's h11
protocol with these bounds (``ServerConfig``'s, and a constant's):

* ``header_timeout`` -- a connection whose request headers have not all
  arrived this many seconds after it opened (or after the first bytes of
  its next request) is closed; an idle keep-alive connection is uvicorn's
  to time out;
* a request whose headers are over 16 KiB gets 431, however they arrived
  (:class:`BoundedHeaders`; uvicorn answers any request h11 cannot read
  with 400);
* :data:`SEND_TIMEOUT` -- a connection whose answer its client takes none
  of (the transport's buffer stays over its high mark, so uvicorn waits to
  write, and it shrinks by not one byte) for this long is closed, the buffer
  dropped: nginx's ``send_timeout``, time without progress (a slow reader
  that keeps reading is never cut); a stream's request is cancelled then. A stop waits for
  no such client: at the stop (uvicorn's ``shutdown``), or once its buffer
  fills after it, the connection is cut at once;
* ``max_connections`` -- past this many open connections, the oldest one
  still waiting for its headers -- an idle keep-alive connection, between
  two requests, included -- is closed to make room (a new one, when every
  other is being answered); the default leaves room under the process's
  descriptor limit (:func:`default_max_connections`).

:class:`OncePerInterval` keeps a repeated log line (asyncio's accept error)
to one per interval.
"""

from __future__ import annotations

import json
import logging
import resource
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers
MAX_HEADER_BYTES = 16 * 1024  # h11's bound on a request's headers (uvicorn's h11_max_incomplete_event_size)
SEND_TIMEOUT = 60.0  # seconds a client may take none of its answer (nginx's send_timeout), then it is cut
RESERVED_FDS = 128  # descriptors kept free of connections: model files, the prompt cache's, logs


def default_max_connections() -> int:
    """Open connections the server takes: its descriptor limit less :data:`RESERVED_FDS`, at most 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 4096 if soft == resource.RLIM_INFINITY else soft - RESERVED_FDS
    return max(16, min(4096, limit))


class BoundedHeaders(h11.Connection):
    """h11's server side, with the bound on a request's headers (its request line and header fields) kept
    whatever the reads they came in: h11 bounds only a header block still incomplete in its buffer, so
    one that arrives whole in a read passed at any size. ``status``: 431 once a request's headers were
    refused as too large (by h11 or here)."""

    def __init__(self, limit: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=limit)
        self.limit, self.status = limit, None

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.status = e.error_status_hint
            raise
        if isinstance(event, h11.Request):
            size = (len(b"%s %s HTTP/1.1\r\n\r\n" % (event.method, event.target))  # as sent, but for spaces
                    + sum(len(name) + len(value) + 4 for name, value in event.headers))
            if size > self.limit:
                self.status = 431
                raise h11.RemoteProtocolError("request header fields too large", error_status_hint=431)
        return event


def protocol(header_timeout: float, max_connections: int):
    """uvicorn's h11 protocol, bounded: see the module's text."""

    class Bounded(H11Protocol):
        header_timer = send_timer = None
        stopping = False  # the server is stopping: a client that reads nothing is not waited for
        waiting_since = 0.0  # when it began to wait for a request's headers: opened, or its last answer sent

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.conn = BoundedHeaders(self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.waiting_since = self.loop.time()
            if len(self.connections) > max_connections:  # over the cap: the oldest still without headers goes
                # (h11 is IDLE on their side until a request's headers are in, and again once it is answered)
                waiting = [c for c in self.connections if c is not self and c.conn.their_state is h11.IDLE
                           and not c.transport.is_closing()]  # (one closed already is not counted twice)
                oldest = min(waiting, key=lambda c: c.waiting_since, default=self)
                oldest.transport.close()
                if oldest is self:  # every other one is being answered: this one waits for none of them
                    return
            self._time_headers()

        def _time_headers(self) -> None:
            self.header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # its request's headers never all came

        def data_received(self, data: bytes) -> None:
            before = getattr(self, "scope", None)
            super().data_received(data)
            if getattr(self, "scope", None) is not before:  # a request's headers are in
                if self.header_timer is not None:
                    self.header_timer.cancel()
                    self.header_timer = None
            elif self.header_timer is None and self.conn.their_state is h11.IDLE:
                self._time_headers()  # the next request's first bytes, after a keep-alive pause

        def pause_writing(self) -> None:  # the transport's buffer is over its high mark: its client reads nothing
            super().pause_writing()
            if self.send_timer is None:
                self._time_send(0 if self.stopping else SEND_TIMEOUT)

        def _time_send(self, seconds: float) -> None:
            self.send_timer = self.loop.call_later(seconds, self._send_late, self.transport.get_write_buffer_size())

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.send_timer is not None:
                self.send_timer.cancel()
                self.send_timer = None

        def _send_late(self, buffered: int) -> None:
            self.send_timer = None
            if not self.stopping and self.transport.get_write_buffer_size() < buffered:
                self._time_send(SEND_TIMEOUT)  # its client took some: it is slow, not gone
                return
            self.transport.abort()  # not close(): that waits for the buffer to drain, which never comes

        def shutdown(self) -> None:  # the server stops: uvicorn waits for the answers under way, a while
            super().shutdown()
            self.stopping = True
            if self.flow.write_paused:  # its client reads none of it: holding the stop up, then a traceback
                self.transport.abort()

        def on_response_complete(self) -> None:
            self.waiting_since = self.loop.time()  # idle, or the next request's headers are on their way
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers every request h11 refuses with 400; one whose headers are over the bound
            # (16 KiB) gets 431, as RFC 6585 has it, naming the limit
            if self.conn.status != 431:
                return super().send_400_response(msg)
            body = json.dumps({"error": {"message": f"the request's headers are over {self.conn.limit // 1024} KiB",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "request_header_fields_too_large"}}).encode()
            for event in (h11.Response(status_code=431, reason=b"Request Header Fields Too Large",
                                       headers=[(b"content-type", b"application/json"), (b"connection", b"close"),
                                                (b"content-length", b"%d" % len(body))]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            for timer in (self.header_timer, self.send_timer):
                if timer is not None:
                    timer.cancel()
            self.header_timer = self.send_timer = None
            super().connection_lost(exc)

    return Bounded


class OncePerInterval(logging.Filter):
    """Lets a message through once per ``seconds``; its repeats meanwhile are dropped."""

    def __init__(self, seconds: float = 10.0):
        super().__init__()
        self.seconds, self.last = seconds, {}

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, record.msg), time.monotonic()
        if now - self.last.get(key, -self.seconds) < self.seconds:
            return False
        self.last[key] = now
        return True
