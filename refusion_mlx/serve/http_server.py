"""The HTTP server for ReFusion (``python -m refusion_mlx.server`` is its
command line): OpenAI's chat and text completions and Responses API,
Anthropic's Messages API, tool calls on all three.

FastAPI on uvicorn (routes in :mod:`.app` and each API's module, request models in :mod:`.protocols.openai_bodies`,
the schema at ``/docs``) over one engine thread that owns MLX and decodes up
to ``--max-batch`` requests per forward (:mod:`.core.engine`), continuing
conversations and shared prompts from a prompt cache (:mod:`.caches.prompt_cache`).
One :class:`ServerConfig` (:mod:`.server_config`), made once, holds every
setting; the server, its app and its engine read it.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import uuid
from typing import Optional

import uvicorn

from .core.engine import Engine
from .core.text import TextShaper
from .edge.connections import OncePerInterval, default_max_connections, protocol
from .edge.security import exposure_warning
from .server_config import ServerConfig
from ..distributed import watchdog
from ..errors import RefusionError

__all__ = ["RefusionServer", "ServerConfig", "TextShaper"]

log = logging.getLogger("refusion_mlx.server")
BACKLOG = 2048  # connections the kernel queues before the server accepts them (during the model's load too)


class RefusionServer:
    """An OpenAI- and Anthropic-compatible server for one ReFusion model.

    ``config``: its :class:`ServerConfig`; or, without one, ``model`` and the
    config's fields as keywords (``RefusionServer(model, port=0,
    max_batch=4)``). Binds at construction (so a taken port fails before the
    model loads); ``start()`` loads the model and serves on a background
    thread (tests, embedding), ``serve_forever()`` serves on the calling
    thread (the CLI). ``dist``: under ``mlx.launch``, rank 0's group; the
    other ranks run an :class:`Engine` that follows it (``Engine.follow``),
    without HTTP.
    """

    def __init__(self, model: Optional[str] = None, *, config: Optional[ServerConfig] = None, dist=None,
                 **settings):
        from .edge.answering import GRACEFUL_SHUTDOWN
        from .app import create_app

        if config is None:
            config = ServerConfig(model=model, **settings)
        elif model is not None or settings:
            raise TypeError("give a ServerConfig, or the model and its fields as keywords, not both")
        self.config = config
        self.created = int(time.time())
        self.fingerprint = f"refusion-mlx-{uuid.uuid4().hex[:8]}"
        host = config.host
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, config.port))
            # listening now holds the port while the model loads (a bound socket that does not listen is
            # one another SO_REUSEADDR socket may bind too); a client's connection waits in the backlog
            self.socket.listen(BACKLOG)
        except OSError:
            self.socket.close()
            raise
        self.host, self.port = self.socket.getsockname()[:2]
        warning = exposure_warning(host, self.port, config.api_keys)
        if warning:  # other machines can reach it, and nothing asks them for a key: said whatever --log-level
            log.warning("%s", warning) if log.isEnabledFor(logging.WARNING) else print(warning, file=sys.stderr)
        self.engine = Engine(config, dist=dist)
        bounded = protocol(config.header_timeout, config.max_connections or default_max_connections())
        uvicorn_config = uvicorn.Config(create_app(self), log_config=None, access_log=False, lifespan="off",
                                        backlog=BACKLOG, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
                                        timeout_keep_alive=30, http=bounded)
        _quiet_repeats()
        self.uvicorn = _Uvicorn(uvicorn_config)
        self.uvicorn.engine = self.engine
        self._thread: Optional[threading.Thread] = None
        self._served = threading.Event()  # uvicorn is not running (set: not started yet, or done)
        self._served.set()
        if dist is not None:  # a rank that ends on a lost peer answers its open requests first
            watchdog.before_exit(self._last_words)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def load(self) -> None:
        self.engine.start()

    def start(self) -> "RefusionServer":
        """Load and serve on a background thread. On any failure (Ctrl-C included) the server is closed,
        its engine thread ended, before the error goes on: ``with server:`` does not call ``close`` then."""
        try:
            self.load()
            self._thread = threading.Thread(target=self.serve_forever, name="refusion-http", daemon=True)
            self._thread.start()
            while not self.uvicorn.started and self._thread.is_alive():
                time.sleep(0.01)
            if not self.uvicorn.started:
                raise RefusionError(f"the HTTP server on port {self.port} stopped before it served (see the log)")
        except BaseException:
            self.close()
            raise
        return self

    def serve_forever(self) -> None:
        self._served.clear()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._served.set()

    def _last_words(self) -> None:
        """This rank is ending (a rank died, a collective timed out: ``watchdog.end``): every open request
        gets its "shutting down" answer -- from the engine, else from the HTTP side itself (``STOP_WAIT``) --
        and uvicorn's graceful shutdown delivers them before the process exits."""
        self.engine.stop()
        self.uvicorn.should_exit = True
        self._served.wait()

    def close(self) -> None:
        """End open requests (503), stop serving, stop the engine thread."""
        self.engine.stop()
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.engine.stop(timeout=10)
        self.socket.close()

    def __enter__(self) -> "RefusionServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn that, on SIGINT/SIGTERM (and SIGHUP, raised as SIGTERM by the CLI), also ends the engine's
    requests (open streams end with an error event instead of holding the shutdown up)."""

    engine: Engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log.info("shutting down")
        self.engine.stop()
        super().handle_exit(sig, frame)


_QUIETED = OncePerInterval(10.0)


def _quiet_repeats() -> None:
    """asyncio's accept error (out of descriptors) and uvicorn's protocol warnings: once per 10 s each."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if _QUIETED not in logger.filters:
            logger.addFilter(_QUIETED)

