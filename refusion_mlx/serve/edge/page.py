"""The web chat page at ``/``: plain files of ``web/`` (no build step, nothing
fetched from elsewhere) and the settings it offers, read from the decoding
table (``decode/params.py`` FIELDS) and the server's decoding defaults
(``ServerConfig.decoding``)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from ...decode.params import FIELDS
from .http_errors import APIError

# no other site may frame the page (clickjacking): the old header and CSP's, for every browser
NO_FRAMES = {"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}


def page_files() -> dict:
    """The page's files by name, read once."""
    folder = resources.files(__package__) / "web"
    return {f.name: f.read_bytes() for f in folder.iterdir()
            if f.is_file() and any(f.name.endswith(ext) for ext in MEDIA_TYPES)}


def page_settings(server) -> dict:
    """What the page's settings panel offers: each request field of the decoding
    table that is a number (``logit_bias``, an object, is for the API) with its
    type, bounds, meaning and the server's default."""
    fields = []
    for f in FIELDS:
        if f.request is None or f.type not in (int, float):
            continue
        default = getattr(server.config.decoding, f.name)  # gen_length: max_tokens' default
        fields.append({"name": f.request, "type": f.type.__name__, "default": default, "help": f.help,
                       "openai": f.openai, **f.bounds()})
    return {"model": server.config.model_id, "fields": fields}


def add_page(app: FastAPI, server) -> None:
    files = page_files()

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(files["index.html"], headers={"Cache-Control": "no-cache", **NO_FRAMES})

    @app.get("/web/settings.json", include_in_schema=False)
    async def settings():
        return page_settings(server)

    @app.get("/web/{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in files:
            raise APIError(404, f"no file {name!r} in the web page", code="not_found")
        kind = next(t for ext, t in MEDIA_TYPES.items() if name.endswith(ext))
        return Response(files[name], media_type=kind, headers={"Cache-Control": "no-cache", **NO_FRAMES})
