"""The APIs the server speaks: one line each.

A :class:`Protocol` names what the rest of the server reads of an API: its
name (``EngineRequest.api``, ``/metrics``' label), the routes that generate
(the OpenAPI document's 500 and 503), the prefixes whose errors take its
shape (other routes answer in the shape of the client that asks), and the module whose ``add_routes`` adds its routes (its adapter and
its writer live beside it). A new API is its own files and one line of
:data:`PROTOCOLS`; ``app``, ``metrics``, ``api_schema`` and ``http_errors``
read this list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Protocol:
    api: str
    paths: Tuple[str, ...]  # the routes that generate an answer
    errors: str = "openai"  # the shape of its routes' errors: "openai" or "anthropic"
    routes: str = ""  # the module (under refusion_mlx.serve) whose add_routes(app, answering) adds them
    prefixes: Tuple[str, ...] = ()  # paths whose errors take its shape (its paths, and aliases of them)


PROTOCOLS: Tuple[Protocol, ...] = (
    Protocol("chat.completions", ("/v1/chat/completions",), routes="protocols.openai_api"),
    Protocol("completions", ("/v1/completions",), routes="protocols.openai_api"),
    Protocol("responses", ("/v1/responses",), routes="protocols.responses_api"),
    Protocol("messages", ("/v1/messages",), "anthropic", "protocols.anthropic_api", prefixes=("/v1/messages", "/messages")),
)
APIS = tuple(p.api for p in PROTOCOLS)
GENERATING = tuple(path for p in PROTOCOLS for path in p.paths)
ROUTE_MODULES = tuple(dict.fromkeys(p.routes for p in PROTOCOLS))


def error_shape(path: str, client: str = "openai") -> str:
    """The error shape of the route at ``path``: its protocol's, else the
    ``client``'s (a route every API's clients call, as ``/v1/models``: the
    shape of the API whose client asked, OpenAI's unless told)."""
    for p in PROTOCOLS:
        if path.startswith(p.prefixes or p.paths):
            return p.errors
    return client
