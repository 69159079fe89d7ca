"""The HTTP layer: FastAPI routes over the engine.

Handlers run on uvicorn's event loop: pydantic validates the body, a worker
thread makes the engine's request of it (the API's adapter makes a draft --
:mod:`.protocols.openai_bodies`, :mod:`.protocols.responses_api`,
:mod:`.protocols.anthropic_api` -- and ``core.engine_request.finish`` the
request), the engine queues it as a Job and the handler awaits its events
(:mod:`.edge.answering`, the same for every API). Each API's routes are
added from its line of :data:`.core.apis.PROTOCOLS`. Every error -- a refusal of the request's resolution or of
the engine included -- is answered in the shape of the route's API
(:mod:`.edge.http_errors`: OpenAI's envelope ``{"error": {message, type, param,
code}}``, Anthropic's on ``/v1/messages``); a stream carries only final
text, in answer order, as server-sent events. Before any route:
:mod:`.edge.security`'s Host and Origin checks, the API key, and the body's
type, size and arrival (415, 411, 413, 408); around everything, the request's id
(:mod:`.edge.request_ids`), in its response's headers and its log line.
"""

from __future__ import annotations

import datetime
import importlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .._version import __version__
from .core.apis import ROUTE_MODULES
from .core.metrics import exposition, gauges
from .core.refusal import Refusal
from .edge.answering import Answering, ClientGone
from .edge.api_schema import schema_maker
from .edge.http_errors import APIError, as_api_error, error_response, printable
from .edge.page import add_page
from .edge.request_ids import HEADERS, RequestIds, tagged
from .edge.security import KEY_SCOPE, HeadAsGet, RequestGuard, SiteGuard
from .protocols import tokenizer_api

log = logging.getLogger("refusion_mlx.server")


def create_app(server) -> FastAPI:
    """The FastAPI app of a RefusionServer (its engine and its ServerConfig: model id, defaults, limits)."""
    engine, config = server.engine, server.config
    app = FastAPI(title="refusion-mlx", version=__version__, redirect_slashes=False,  # a 404 in the API's shape,
                  # not a bodiless 307 an SDK does not follow
                  description="OpenAI-compatible server for a ReFusion model (batched, with a prompt cache).")
    # outermost last: the Host and Origin checks, CORS (with --allowed-origins), then the key and the body
    def refused(error: APIError, scope) -> None:  # every error answered: counted, and logged in one line
        engine.metrics.http_error(error.status)
        named = error.param and not error.message.startswith(error.param)
        log.info("%s", tagged(f"{error.status} {printable(scope['method'])} {printable(scope['path'])}: "
                              + printable((f"{error.param}: " if named else "") + error.message), scope))

    app.add_middleware(HeadAsGet)  # innermost: the guards see the HEAD, the routes a GET
    app.add_middleware(RequestGuard, keys=config.api_keys, max_bytes=config.max_body_bytes,
                       body_timeout=config.body_timeout, metrics_public=config.metrics_public, on_error=refused,
                       stopping=lambda: engine.stopping_since is not None)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["*"],  # the SDKs' own too (x-stainless-*, anthropic-dangerous-...)
                           expose_headers=[h.decode() for h in HEADERS])  # the request id, to a page's SDK
    app.add_middleware(SiteGuard, bound=server.host, allowed_hosts=config.allowed_hosts + (config.host,),  # --host NAME
                       allowed_origins=config.allowed_origins, on_error=refused)

    async def on_error(request: Request, exc: Exception):
        error = as_api_error(request, exc)
        refused(error, request.scope)
        return error_response(error, request.scope)

    for exc in (APIError, Refusal, HTTPException, RequestValidationError):
        app.add_exception_handler(exc, on_error)

    async def client_gone(request: Request, exc: Exception):  # nobody reads the answer: nothing to log
        return Response(status_code=499)

    async def bug(request: Request, exc: Exception):  # a bug: logged by the server, answered in the API's shape
        refused(APIError(500, "internal error"), request.scope)
        return error_response(APIError(500, "the server failed on this request (see its log)",
                                       code="internal_error"), request.scope)

    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, bug)

    def card() -> dict:  # OpenAI's model object and Anthropic's in one (each SDK reads its own fields)
        created = datetime.datetime.fromtimestamp(server.created, datetime.timezone.utc)
        return {"id": config.model_id, "object": "model", "created": server.created, "owned_by": "refusion-mlx",
                "type": "model", "display_name": config.model_id, "created_at": created.isoformat()}

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models():
        return {"object": "list", "data": [card()], "has_more": False, "first_id": config.model_id,
                "last_id": config.model_id}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != config.model_id:
            raise APIError(404, f"model {name!r} is not served here (this server serves {config.model_id!r})",
                           "model", "model_not_found")
        return card()

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health(request: Request):
        """Whether the server is up: 503 when the engine is stopping, dead, or stuck in a step past the
        watchdog. With --api-key, only to a request with a key (or with --metrics-public) also the
        queue, batch, counters, KV reservations and the prompt cache's size, as /metrics guards them."""
        ok, status = engine.health()
        shown = not config.api_keys or config.metrics_public or KEY_SCOPE in request.scope
        return JSONResponse({"status": status, **({"model": config.model_id, **engine.snapshot()} if shown else {})},
                            200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        """Prometheus' text format, or OpenMetrics when the scraper's Accept asks for it (names prefixed
        ``refusion_``)."""
        body, kind = exposition(engine.metrics, gauges(engine.snapshot(), engine.health()[0]),
                                request.headers.get("accept"))
        return Response(body, media_type=kind)

    answering = Answering(server)
    for module in ROUTE_MODULES:  # each API's routes (protocols.PROTOCOLS)
        importlib.import_module(f"{__package__}.{module}").add_routes(app, answering)
    tokenizer_api.add_routes(app, answering)  # /tokenize, /detokenize, /tokenizer_info (evaluation tools)

    add_page(app, server)  # the web chat at /
    app.openapi = schema_maker(app, config)  # the document as the server answers: its errors, not FastAPI's 422
    stack = app.build_middleware_stack  # the request id outermost, around FastAPI's own error handling (a 500)
    app.build_middleware_stack = lambda: RequestIds(stack())
    return app
