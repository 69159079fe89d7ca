"""``python -m benchmarks.soak``: the server under mixed traffic for a while.

N client threads, each looping until the time is up, pick at random (seeded)
among: a streamed chat (its text must equal the answer the same request got
alone before the load: *exact*), a 3-turn conversation re-sent with its
whole history each turn (the first turn exact; later turns should find the
conversation in the prompt cache), a stream dropped mid-way or a request
dropped before its answer (the server should cancel it), a malformed request
(it must get a 4xx), and a long request (a budget of several hundred tokens
that reserves more KV memory, so that under a small ``--max-kv-bytes`` the
others wait; or one past what the budget can ever hold, which must be cut
to it: a 200 with fewer tokens than it asked).

Then it waits for the server to settle, scrapes ``/metrics`` and prints a
table: exact streams, cancellations, 4xx, 5xx, latency percentiles, the
metrics scraped; ``--json`` writes it all. The exit status is 1 when a
response was a 5xx, an answer was not exact, or a request was left active.
Without ``--url`` it serves the model itself (in this process, port 0).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from refusion_mlx.cli import OneLineParser, add_model_args, byte_size, interrupt_once, positive_int, run
from refusion_mlx.errors import RefusionError
from .soak_report import failed, format_report, summarize

PROMPTS = ["Who is Sven?", "Count from 17 to 38.", "Reverse the words: sugar forest orange",
           "Sort these numbers: 67, 4, 77, 15, 70", "Write the multiplication table of 3 up to 5.",
           "Tell me about Zoe."]
TURNS = [["Who is Sven?", "Count from 17 to 38.", "Name three colours."],
         ["Tell me about Zoe.", "Add 2 and 3.", "Reverse the words: sugar forest orange"]]
# one token a step (no slot drafted in parallel): a stream still running after its first chunks
DROP = {"messages": [{"role": "user", "content": "Count from 17 to 38."}], "max_tokens": 256,
        "slot_threshold": 1.0, "token_threshold": 1.0, "stream": True}
MALFORMED = [b"{not json", b"[1, 2]", {}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
             {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
             {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
             {"messages": [{"role": "user", "content": "x"}], "n": 17},
             {"messages": [{"role": "user", "content": "x"}], "block_length": 6}]
ACTIONS = (("stream", 4), ("conversation", 2), ("drop", 2), ("malformed", 2), ("long", 2))
LONG_TOKENS = 400  # with a short prompt: two 256-row KV steps, twice a short request's reservation


@dataclass
class Tally:
    """What the clients saw (one lock for all)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Dict[str, int] = field(default_factory=dict)
    status: Dict[int, int] = field(default_factory=dict)
    latencies: List[float] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def answered(self, status: int, seconds: Optional[float] = None) -> None:
        with self.lock:
            self.status[status] = self.status.get(status, 0) + 1
            if seconds is not None and status == 200:
                self.latencies.append(seconds)

    def problem(self, text: str) -> None:
        with self.lock:
            if len(self.problems) < 20:
                self.problems.append(text)


class Client:
    """HTTP on loopback with the standard library, as the other serving benchmarks."""

    def __init__(self, url: str, timeout: float = 300.0):
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> Tuple[int, str]:
        conn = self.connect()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def post(self, path: str, body) -> Tuple[int, dict, str]:
        """(status, usage or error, text) of a request; streamed when the body asks."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = self.connect()
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200 or not (isinstance(body, dict) and body.get("stream")):
                payload = json.loads(resp.read() or b"{}")
                if resp.status != 200:
                    return resp.status, payload.get("error", {}), ""
                choice = payload["choices"][0]
                return 200, payload["usage"], (choice.get("message") or {}).get("content", choice.get("text", ""))
            text, usage = [], {}
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # an error after the stream began
                    return 500, chunk["error"], "".join(text)
                for choice in chunk.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
                usage = chunk.get("usage") or usage
            return 200, usage, "".join(text)
        finally:
            conn.close()


def chat_body(messages, max_tokens: int, stream: bool) -> dict:
    """Greedy (temperature 0 whatever the server's default), so that an answer can be checked."""
    return {"messages": messages, "max_tokens": max_tokens, "stream": stream, "temperature": 0,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def user(text: str) -> List[dict]:
    return [{"role": "user", "content": text}]


def references(client: Client, max_tokens: int) -> Dict[str, str]:
    """Each prompt's answer alone (no other request running), before the load."""
    out = {}
    for p in PROMPTS + [t[0] for t in TURNS]:
        for n in (max_tokens, LONG_TOKENS):
            status, info, text = client.post("/v1/chat/completions", chat_body(user(p), n, False))
            if status != 200:
                raise RefusionError(f"the reference request for {p!r} got HTTP {status}: {info.get('message')}")
            out[p, n] = text
    return out


def client_loop(client: Client, seed: int, deadline: float, refs: Dict, tally: Tally, max_tokens: int,
                too_long: Optional[int]) -> None:
    rng = random.Random(seed)
    names = [a for a, w in ACTIONS for _ in range(w)]
    while time.monotonic() < deadline:
        action = rng.choice(names)
        t0 = time.perf_counter()
        try:
            if action == "stream":
                p = rng.choice(PROMPTS)
                status, info, text = client.post("/v1/chat/completions", chat_body(user(p), max_tokens, True))
                tally.answered(status, time.perf_counter() - t0)
                check(tally, "stream", status, info, text, refs[p, max_tokens])
            elif action == "conversation":
                converse(client, rng.choice(TURNS), refs, tally, max_tokens)
            elif action == "drop":
                drop(client, rng.random() < 0.5, tally)
            elif action == "malformed":
                body = rng.choice(MALFORMED)
                path = "/v1/completions" if body == {} and rng.random() < 0.5 else "/v1/chat/completions"
                status, info, _ = client.post(path, body)
                tally.answered(status)
                tally.add("malformed")
                if not 400 <= status < 500:
                    tally.problem(f"malformed request {body!r} got HTTP {status}")
            elif too_long is not None and rng.random() < 0.25:  # "long", past what the server can ever hold: cut
                status, info, _ = client.post("/v1/chat/completions", chat_body(user(PROMPTS[0]), too_long, False))
                tally.answered(status, time.perf_counter() - t0)
                tally.add("over_budget_sent")
                if status == 200:
                    tally.add("over_budget_ok")
                if status != 200 or not info.get("completion_tokens", too_long) < too_long:
                    tally.problem(f"a request over --max-kv-bytes got HTTP {status}, not its budget cut: {info}")
            else:  # "long" that fits
                p = rng.choice(PROMPTS)
                status, info, text = client.post("/v1/chat/completions", chat_body(user(p), LONG_TOKENS, False))
                tally.answered(status, time.perf_counter() - t0)
                check(tally, "long", status, info, text, refs[p, LONG_TOKENS])
        except (OSError, http.client.HTTPException, ValueError) as e:
            tally.add("transport_errors")
            tally.problem(f"{action}: {type(e).__name__}: {e}")


def check(tally: Tally, kind: str, status: int, info: dict, text: str, want: str) -> None:
    tally.add(kind)
    if status != 200:
        tally.problem(f"{kind}: HTTP {status}: {info.get('message')}")
        return
    tally.add(kind + "_ok")
    if text == want:
        tally.add(kind + "_exact")
    else:
        tally.problem(f"{kind}: answer differs from the one alone: {text[:60]!r} vs {want[:60]!r}")


def converse(client: Client, turns: List[str], refs: Dict, tally: Tally, max_tokens: int) -> None:
    """Three turns, the whole history re-sent each time (as chat apps do)."""
    messages: List[dict] = []
    for k, question in enumerate(turns):
        messages.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        status, info, text = client.post("/v1/chat/completions", chat_body(list(messages), max_tokens, True))
        tally.answered(status, time.perf_counter() - t0)
        if k == 0:
            check(tally, "conversation_first_turn", status, info, text, refs[question, max_tokens])
        elif status != 200:
            tally.problem(f"conversation turn {k + 1}: HTTP {status}: {info.get('message')}")
        else:
            tally.add("conversation_later_turns")
            cached = (info.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            tally.add("conversation_cache_hits", int(cached > 0))
        if status != 200:
            return
        messages.append({"role": "assistant", "content": text})


def drop(client: Client, early: bool, tally: Tally) -> None:
    """A slow stream left after three chunks, or (``early``) before any answer."""
    conn = client.connect()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(DROP),
                     {"Content-Type": "application/json"})
        if early:
            tally.add("drops_before_answer")
            return
        resp = conn.getresponse()
        if resp.status != 200:
            tally.answered(resp.status)
            tally.problem(f"a stream to drop got HTTP {resp.status}")
            return
        seen = 0
        while seen < 3:
            line = resp.readline()
            if not line:
                break
            seen += line.startswith(b"data:")
        tally.add("drops_mid_stream")
    finally:
        conn.close()  # the client leaves: the server should cancel the request


def settle(client: Client, seconds: float = 60.0) -> dict:
    """/health once nothing is active or queued (or the last one seen)."""
    deadline, state = time.monotonic() + seconds, {}
    while time.monotonic() < deadline:
        _, text = client.get("/health")
        state = json.loads(text)
        if state.get("active") == 0 and state.get("queued") == 0:
            break
        time.sleep(0.1)
    return state


def scrape(client: Client) -> Dict[str, float]:
    from refusion_mlx.serve.core.metrics import parse

    status, text = client.get("/metrics")
    if status != 200:
        raise RefusionError(f"/metrics answered HTTP {status}")
    return parse(text)


def soak(url: str, duration: float, clients: int, max_tokens: int, seed: int) -> dict:
    client = Client(url)
    try:
        _, health = client.get("/health")
    except OSError as e:
        raise RefusionError(f"cannot reach the server at {url}: {e.strerror or e}") from None
    kv = json.loads(health).get("kv") or {}
    per_token, budget = kv.get("bytes_per_token") or 0, kv.get("max_bytes") or 0
    too_long = budget // per_token + 1 if per_token and budget // per_token < 1 << 20 else None
    refs = references(client, max_tokens)
    before = scrape(client)
    tally = Tally()
    deadline = time.monotonic() + duration
    threads = [threading.Thread(target=client_loop, args=(client, seed * 1000 + i, deadline, refs, tally,
                                                          max_tokens, too_long), daemon=True)
               for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    state = settle(client)
    after = scrape(client)
    return summarize(tally, before, after, state, wall, clients)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m benchmarks.soak",
                           description="The server under mixed traffic: streams, re-sent conversations, drops, "
                                       "malformed and long requests; a table of what happened.")
    add_model_args(parser)
    parser.add_argument("--url", help="a running server (http://HOST:PORT); default: serve --model here")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default 60)")
    parser.add_argument("--clients", type=positive_int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--max-tokens", type=positive_int, default=48, help="budget of the chat requests")
    parser.add_argument("--max-batch", type=positive_int, default=8, help="the server's --max-batch (default 8)")
    parser.add_argument("--max-kv-bytes", type=byte_size, default=6 << 20,
                        help="the server's --max-kv-bytes, small so that long requests queue (default 6M: "
                             "six 256-row caches of the demo model; e.g. 2G for an 8B model)")
    parser.add_argument("--seed", type=int, default=0, help="the clients' choices (default 0)")
    parser.add_argument("--json", metavar="OUT", help="also write the report to this JSON file")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 86400:
        parser.error(f"--duration must be within (0, 86400] seconds, got {args.duration}")
    if args.url is not None and not _is_http_url(args.url):
        parser.error(f"--url must be a server's http://HOST:PORT, got {args.url!r}")
    if args.json and not Path(args.json).expanduser().resolve().parent.is_dir():
        parser.error(f"cannot write {args.json}: its folder does not exist")

    def body() -> int:
        server = None
        url = args.url
        if url is None:
            from refusion_mlx.serve.http_server import RefusionServer

            server = RefusionServer(args.model, port=0, dtype=args.dtype, adapter_path=args.adapter_path,
                                    max_batch=args.max_batch, max_kv_bytes=args.max_kv_bytes).start()
            url = server.url[:-3]
        try:
            result = soak(url, args.duration, args.clients, args.max_tokens, args.seed)
        finally:
            if server is not None:
                server.close()
        print(format_report(result))
        if args.json:
            write_json(args.json, result)
        why = failed(result)
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 1
        return 0

    with interrupt_once():  # a second Ctrl-C while the server shuts down ends at once
        return run(body)


def _is_http_url(url: str) -> bool:
    """http://HOST[:PORT] (the client speaks plain HTTP): a scheme, a host and a port that is a number."""
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:  # not a number, or past 65535
        return False
    return parts.scheme == "http" and bool(parts.hostname)


def write_json(path: str, result: dict) -> None:
    target = Path(path).expanduser()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, target)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
