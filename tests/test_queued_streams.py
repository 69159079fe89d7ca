"""A stream that waits in a busy server's queue starts before its admission (serve/edge/answering.py
``QUEUED_START``): its headers, its API's first events and keep-alives go out while it waits, so a queue
longer than a client's idle timer (Codex and Claude Code: 300 s) does not end it; it got nothing, not even
its headers, until a batch row was free. Once admitted it answers as it would have alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from refusion_mlx.serve.edge import answering
from refusion_mlx.serve.http_server import RefusionServer

ASK = [{"role": "user", "content": "Who is Sven?"}]
# each API's stream: (path, body, what its first events say, its keep-alive)
STREAMS = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": ASK, "max_tokens": 16},
             '"role": "assistant"', ": keep-alive\n\n"),
    "messages": ("/v1/messages", {"model": "m", "messages": ASK, "max_tokens": 16},
                 "event: message_start\n", "event: ping\n"),
    "responses": ("/v1/responses", {"model": "m", "input": ASK, "max_output_tokens": 16},
                  "event: response.created\n", "event: response.in_progress\n"),
    "chat-n2": ("/v1/chat/completions", {"model": "m", "messages": ASK, "max_tokens": 16, "n": 2},
                '"role": "assistant"', ": keep-alive\n\n"),
}


@pytest.fixture(scope="module")
def server():
    patch = pytest.MonkeyPatch()
    patch.setattr(answering, "QUEUED_START", 0.2)
    patch.setattr(answering, "KEEP_ALIVE", 0.1)
    srv = RefusionServer(None, model_id="m", port=0, max_batch=1).start()
    yield srv
    srv.close()
    patch.undo()


def stream(server, name, started=None, release=None) -> dict:
    """The stream's status, what came before ``release`` was set (``started`` is set once that is in), and
    its whole text."""
    path, body, _, _ = STREAMS[name]
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    early = ""
    with httpx.stream("POST", server.url.removesuffix("/v1") + path, json={"stream": True, **body},
                      headers=headers, timeout=60) as r:
        chunks = r.iter_text()
        if started is not None:
            while "keep-alive" not in early and "ping" not in early and early.count("in_progress") < 2:
                early += next(chunks)
            started.set()
            release.wait(30)
        rest = "".join(chunks)
    return {"status": r.status_code, "early": early, "text": early + rest}


def answer_text(name: str, text: str) -> list:
    """The pieces of text the stream carries (sorted: two choices' chunks interleave as they come), without
    the ids and times that differ between runs."""
    keys = ('"content": "', '"text": "', '"delta": "')
    out = []
    for line in text.splitlines():
        for key in keys:
            at = line.find(key)
            while at >= 0:
                end = line.index('"', at + len(key))
                out.append(line[at + len(key):end])
                at = line.find(key, end)
    return sorted(out)


@pytest.mark.parametrize("name", list(STREAMS))
def test_a_queued_stream_starts_before_its_admission_and_answers_as_alone(server, name):
    alone = stream(server, name)
    gate, entered = threading.Event(), threading.Event()
    gen = server.engine.gen
    real = gen.step

    def held():  # the one batch row stays taken until the queued stream has started
        entered.set()
        gate.wait(30)
        return real()

    gen.step = held
    started, release = threading.Event(), threading.Event()
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(stream, server, "chat")
            assert entered.wait(30)
            queued = pool.submit(stream, server, name, started, release)
            assert started.wait(10), "the queued stream sent nothing while it waited"
            waiting = server.engine.snapshot()["queued"]
            gen.step = real
            gate.set()
            release.set()
            results = first.result(60), queued.result(60)
    finally:
        gen.step = real
        gate.set()
        release.set()
    _, _, opening, keep_alive = STREAMS[name]
    assert waiting >= 1 and results[0]["status"] == results[1]["status"] == alone["status"] == 200, waiting
    assert opening in results[1]["early"] and keep_alive in results[1]["early"], results[1]["early"]
    assert answer_text(name, results[1]["text"]) == answer_text(name, alone["text"]) != [], results[1]["text"]
