"""A whole answer's JSON body, encoded off the event loop and in pieces."""

from __future__ import annotations

import json
from typing import Callable, Optional

from fastapi.responses import Response

_CHOICES = "\0choices\0"


def _compact(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def json_bytes(body: dict) -> bytes:
    """A whole answer as JSONResponse writes it, its ``choices`` encoded one at a time: the C encoder
    holds the GIL for a call, so one call over 100 MB (echo scoring, many prompts with logprobs) would
    stop every other thread, the event loop too."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        return _compact(body)
    shell = _compact({**body, "choices": _CHOICES})
    at = shell.index(_compact(_CHOICES))
    return b"".join([shell[:at], b"[", b",".join(_compact(c) for c in choices), b"]",
                     shell[at + len(_compact(_CHOICES)):]])


async def json_answer(build: Callable[[], dict], headers: Optional[dict] = None) -> Response:
    """A whole answer: built and encoded on a worker thread, so a large one never holds the event loop
    (``/health`` went unanswered for 48 s while a 134 MB answer was encoded there). Not a tokenizer
    lane: an answer already made goes out during a shutdown, and no request's tokenizing waits on it."""
    from starlette.concurrency import run_in_threadpool

    content = await run_in_threadpool(lambda: json_bytes(build()))
    return Response(content, media_type="application/json", headers=headers)
