"""OpenAI-compatible HTTP server for ReFusion (``python -m refusion_mlx.server``
is its command line).

FastAPI on uvicorn (routes in :mod:`.app`, request models in :mod:`.schemas`,
the schema at ``/docs``) over one engine thread that owns MLX and decodes up
to ``--max-batch`` requests per forward (:mod:`.engine`), continuing
conversations and shared prompts from a prompt cache (:mod:`.prompt_cache`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import Optional, Sequence

import uvicorn

from .engine import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_PROMPT_CACHE_BYTES, DEFAULT_WATCHDOG_SECONDS, Engine
from .text import TextShaper

__all__ = ["DEFAULT_MAX_BODY", "RefusionServer", "TextShaper"]

log = logging.getLogger("refusion_mlx.server")
DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: a long chat history, not an upload


class RefusionServer:
    """An OpenAI-compatible server for one ReFusion model.

    Binds at construction (so a taken port fails before the model loads);
    ``start()`` loads the model and serves on a background thread (tests,
    embedding), ``serve_forever()`` serves on the calling thread (the CLI).
    ``dist``: under ``mlx.launch``, rank 0's group; the other ranks run an
    :class:`Engine` that follows it (``Engine.follow``), without HTTP.
    """

    def __init__(self, model: Optional[str] = None, *, host: str = "127.0.0.1", port: int = 8080,
                 dtype: Optional[str] = None, params=None, default_max_tokens: Optional[int] = None,
                 model_id: Optional[str] = None, max_batch: int = DEFAULT_MAX_BATCH,
                 max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY,
                 allowed_origins: Sequence[str] = (), prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
                 max_active: Optional[int] = None, adapter_path: Optional[str] = None,
                 max_kv_bytes: Optional[int] = None, watchdog_seconds: float = DEFAULT_WATCHDOG_SECONDS,
                 prompt_cache_dir: Optional[str] = None, prompt_cache_dir_bytes: Optional[int] = None,
                 dist=None):
        from ..decode.params import RefusionParams
        from .app import create_app

        self.defaults = params or RefusionParams()
        self.defaults.layout()  # a bad default is a startup error, not a 400 on every request
        self.default_max_tokens = default_max_tokens or self.defaults.gen_length
        self.model_id = model_id or (str(model).rstrip("/") if model else "tiny-refusion")
        self.max_body_bytes = max_body_bytes
        self.allowed_origins = list(allowed_origins)
        self.created = int(time.time())
        self.fingerprint = f"refusion-mlx-{uuid.uuid4().hex[:8]}"
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.host, self.port = self.socket.getsockname()[:2]
        self.engine = Engine(model, dtype=dtype, max_batch=max_active or max_batch, max_queue=max_queue,
                             prompt_cache_bytes=prompt_cache_bytes, adapter_path=adapter_path,
                             max_kv_bytes=max_kv_bytes, watchdog_seconds=watchdog_seconds,
                             prompt_cache_dir=prompt_cache_dir, prompt_cache_dir_bytes=prompt_cache_dir_bytes,
                             dist=dist)
        config = uvicorn.Config(create_app(self), log_config=None, access_log=False, lifespan="off",
                                backlog=2048, timeout_graceful_shutdown=5, timeout_keep_alive=30)
        self.uvicorn = _Uvicorn(config)
        self.uvicorn.engine = self.engine
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def load(self) -> None:
        self.engine.start()

    def start(self) -> "RefusionServer":
        self.load()
        self._thread = threading.Thread(target=self.serve_forever, name="refusion-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        self.uvicorn.run(sockets=[self.socket])

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
    """uvicorn that, on SIGINT/SIGTERM, also ends the engine's requests (open
    streams end with an error event instead of holding the shutdown up)."""

    engine: Engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log.info("shutting down")
        self.engine.stop()
        super().handle_exit(sig, frame)
