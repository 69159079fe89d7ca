"""The server measured from the client's seat, on loopback.

* ``http_levels``: N concurrent streaming clients through
  ``/v1/chat/completions``, the same workload at every N (the suite's
  prompts, ``rounds`` times over): aggregate tokens/s and latency per request.
* ``conversation``: a multi-turn chat sent the way chat apps send it -- the
  whole history on every turn -- and what the server prefilled each turn
  (``usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens``),
  with and without its prompt cache; the server without it is sent the
  history of the one with it (its answers), so both see the same prompts.

The client is the standard library's ``http.client`` (no extra dependency),
reading the SSE stream as a chat app does.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence
from urllib.parse import urlsplit

import numpy as np

from ..serve.edge.answering import CUT_HEADER
from .suite import BenchError


@dataclass
class Reply:
    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    first_text_seconds: float
    finish_reason: Optional[str] = None
    max_tokens_cut: Optional[str] = None  # the server's X-Max-Tokens-Cut, "ASKED -> GIVEN": cut to fit the context

    @property
    def tokens_with_eos(self) -> int:
        """The answer's tokens as the in-process measurements count them: the
        server's usage leaves out the EOS that ended an answer ("stop"; bench
        sends no stop strings)."""
        return self.completion_tokens + (self.finish_reason == "stop")


def chat(url: str, messages: List[Dict[str, str]], timeout: float = 600.0, **fields) -> Reply:
    """One streamed chat completion; the text and the final usage."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}, **fields}
    t0 = time.perf_counter()
    first = None
    text, usage, finish, cut = [], {}, None, None
    try:
        key = os.environ.get("REFUSION_MLX_API_KEY", "").split(",")[0].strip()  # a server with --api-key
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"the server answered HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        cut = resp.getheader(CUT_HEADER)
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    finally:
        conn.close()
    seconds = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return Reply("".join(text), int(usage.get("completion_tokens", 0)), int(usage.get("prompt_tokens", 0)),
                 int(details.get("cached_tokens", 0) or 0), seconds, first if first is not None else seconds, finish,
                 cut)


@dataclass
class HttpLevel:
    clients: int
    requests: int
    tokens: int
    wall_seconds: float
    latencies: List[float] = field(default_factory=list)
    first_text: List[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        lat, ttft = np.array(self.latencies or [0.0]), np.array(self.first_text or [0.0])
        return {"clients": self.clients, "requests": self.requests, "tokens": self.tokens,
                "wall_seconds": round(self.wall_seconds, 4),
                "tokens_per_second": round(self.tokens / self.wall_seconds, 2) if self.wall_seconds else 0.0,
                "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
                "latency_p90_s": round(float(np.percentile(lat, 90)), 4),
                "first_text_p50_s": round(float(np.percentile(ttft, 50)), 4)}


def http_level(url: str, requests: Sequence[dict], clients: int) -> HttpLevel:
    """``requests`` (chat completion bodies) through ``clients`` concurrent streams."""
    queue = list(enumerate(requests))
    lock = threading.Lock()
    out = HttpLevel(clients, len(requests), 0, 0.0)
    errors: List[str] = []

    def client() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                _, body = queue.pop(0)
            try:
                r = chat(url, **body)
            except Exception as e:  # reported after the run
                with lock:
                    errors.append(str(e))
                return
            with lock:
                out.tokens += r.tokens_with_eos  # as the in-process levels count
                out.latencies.append(r.seconds)
                out.first_text.append(r.first_text_seconds)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.wall_seconds = time.perf_counter() - t0
    if errors:
        raise BenchError(f"a benchmark request failed: {errors[0]}")
    return out


def conversation(url: str, questions: Sequence[str], answers: Optional[Sequence[str]] = None,
                 **fields) -> List[dict]:
    """Send a conversation turn by turn, the whole history each time (as chat
    apps do); per turn: prompt tokens, cached tokens, prefilled tokens, the
    answer and ``max_tokens_cut`` (the server's ``X-Max-Tokens-Cut``: the
    turn's budget was cut to fit the context, else None). ``answers``: the
    assistant's turns of the history, in place of this server's own (another
    run's, so that both are sent the same prompts)."""
    messages: List[Dict[str, str]] = []
    rows = []
    for k, q in enumerate(questions, 1):
        messages.append({"role": "user", "content": q})
        r = chat(url, list(messages), **fields)
        messages.append({"role": "assistant", "content": r.text if answers is None else answers[k - 1]})
        rows.append({"turn": k, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                     "prefilled_tokens": r.prompt_tokens - r.cached_tokens,
                     "answer_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
                     "max_tokens_cut": r.max_tokens_cut, "seconds": round(r.seconds, 4), "answer": r.text})
    return rows


def new_since_previous_turn(rows: Sequence[dict]) -> List[Optional[int]]:
    """Prompt tokens that are new at each turn: this turn's prompt minus the
    previous turn's prompt and answer, the EOS that ended it included (what a
    perfect cache would prefill: the decode that wrote the answer also wrote
    its EOS, which the chat template closes the turn with; the server's usage
    leaves it out of ``answer_tokens``)."""
    out: List[Optional[int]] = [None]
    for prev, row in zip(rows, rows[1:]):
        answered = prev["answer_tokens"] + (prev.get("finish_reason") == "stop")
        out.append(row["prompt_tokens"] - prev["prompt_tokens"] - answered)
    return out
