"""The server's folders keep their roles: the core and the caches know no API
and no HTTP, the edge knows no protocol, and each API is its own files plus
one line of ``core.apis.PROTOCOLS``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "refusion_mlx" / "serve"
# folder -> what its modules may not import (serve's folders by name, and outside packages)
FORBIDDEN = {
    "core": {"edge", "protocols", "app", "http_server", "fastapi", "starlette", "pydantic", "uvicorn"},
    "caches": {"edge", "protocols", "app", "http_server", "core", "fastapi", "starlette", "pydantic"},
    "edge": {"protocols", "app", "http_server"},
    "protocols": {"app", "http_server"},
}


def imported(path: Path) -> set:
    """What a module imports: the serve folder or top module each import names, and outside top packages."""
    names = set()
    package = path.relative_to(SERVE.parent.parent).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1]) + (node.module or "").split(".")
                full = [p for p in base if p]
                if not node.module:
                    full = [full + [a.name] for a in node.names][0]
            else:
                full = (node.module or "").split(".")
            if full[:2] == ["refusion_mlx", "serve"] and len(full) > 2:
                names.add(full[2])
            elif full[0] != "refusion_mlx":
                names.add(full[0])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
    return names


def test_each_folder_imports_only_what_lies_below_it():
    broken = []
    for folder, forbidden in FORBIDDEN.items():
        for path in sorted((SERVE / folder).glob("*.py")):
            wrong = imported(path) & forbidden
            if wrong:
                broken.append(f"{path.relative_to(SERVE)}: {sorted(wrong)}")
    assert not broken, broken


def test_every_api_is_one_line_of_the_list():
    from refusion_mlx.serve.core import apis
    from refusion_mlx.serve.core.metrics import ServerMetrics, families

    assert len(set(apis.APIS)) == len(apis.PROTOCOLS)
    for protocol in apis.PROTOCOLS:
        module = importlib.import_module(f"refusion_mlx.serve.{protocol.routes}")
        assert callable(module.add_routes), protocol.routes
        assert protocol.errors in ("openai", "anthropic")
    assert apis.error_shape("/v1/messages/count_tokens") == "anthropic"
    assert apis.error_shape("/v1/chat/completions") == apis.error_shape("/health") == "openai"
    assert apis.error_shape("/v1/models", "anthropic") == "anthropic"  # every API's route: its client's shape
    assert apis.error_shape("/v1/responses", "anthropic") == "openai"
    labels = {m.labels["api"] for f in families(ServerMetrics(), {}) if f.name == "refusion_api_requests"
              for m in f.samples}
    assert labels == set(apis.APIS)  # /metrics labels every API of the list, and no other


def test_the_openapi_document_marks_every_generating_route():
    from refusion_mlx.serve.core.apis import GENERATING
    from refusion_mlx.serve.edge.api_schema import statuses

    for path in GENERATING:
        assert {500, 503} <= set(statuses(path, "post", keys=False, metrics_public=False)), path
    assert 500 not in statuses("/tokenize", "post", keys=False, metrics_public=False)
