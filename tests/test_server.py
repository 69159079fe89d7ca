"""The OpenAI-compatible server, driven on loopback by the official ``openai`` client.

One in-process server (port 0: a free port) serves most tests; the CLI tests
start ``python -m refusion_mlx.server`` as a subprocess to check startup,
bad flags and shutdown on SIGINT/SIGTERM.
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from refusion_mlx.serve.server import RefusionServer, TextShaper

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Who is Sven?",
    "Count from 17 to 38.",
    "Write the multiplication table of 3 up to 5.",
    "Reverse the words: sugar forest orange",
    "Sort these numbers: 67, 4, 77, 15, 70",
    "Write a Python function g that multiplies x by 4.",
]
MAX_TOKENS = 48
SHORT = 16  # the concurrency test's budget: 20 answers must stay cheap on a slow BLAS
LONG = {"prompt": "1 2 3 4 5 6 7 8 9 10", "max_tokens": 1024, "slot_threshold": 1.0,
        "token_threshold": 1.0}  # a raw completion the demo model runs for 20+ seconds


@pytest.fixture(scope="module", autouse=True)
def cli_servers():
    """Two ``python -m refusion_mlx.server`` processes, started first so that their
    startup overlaps the in-process tests; the CLI tests stop them with a signal."""
    procs = {sig: start_cli() for sig in (signal.SIGTERM, signal.SIGINT)}
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def expected():
    """Each prompt's answer from the Python API, computed before the server's engine starts
    (so MLX is never used from two threads at once in this process)."""
    from refusion_mlx.generate import chat_prompt, stream_generate
    from refusion_mlx.models.loading import load

    model, tok = load()
    out = {}
    for p in PROMPTS:
        for n in (MAX_TOKENS, SHORT):
            out[p, n] = "".join(r.text for r in stream_generate(model, tok, chat_prompt(tok, p), max_tokens=n))
        out[p] = out[p, MAX_TOKENS]
        out[p, "ids"] = len(chat_prompt(tok, p))
    return out


@pytest.fixture(scope="module")
def server(expected):
    srv = RefusionServer(port=0).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=60)


def chat(client, prompt, **kw):
    return client.chat.completions.create(model="tiny-refusion", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def health(server) -> dict:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.request("GET", "/health")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


# --------------------------------------------------------------------------
# The openai client, streaming and not


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny-refusion"]


def test_chat_matches_python_api(client, expected):
    for p in PROMPTS[:3]:
        r = chat(client, p)
        assert r.choices[0].message.content == expected[p]
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == expected[p, "ids"]
        assert 0 < r.usage.completion_tokens <= MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_in_order(client, expected):
    p = "Count from 17 to 38."
    stream = chat(client, p, stream=True)
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            finishes.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == expected[p]
    assert len(pieces) > 3  # released as it became final, not in one piece at the end
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert usage.prompt_tokens == expected[p, "ids"] and usage.completion_tokens > 0


def test_stream_options_include_usage(client):
    chunks = list(chat(client, "Who is Sven?", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].usage is None


def test_completions(client):
    r = client.completions.create(model="tiny-refusion", prompt="1 2 3 4 5", max_tokens=10)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert r.choices[0].text.strip()
    streamed = client.completions.create(model="tiny-refusion", prompt="1 2 3 4 5", max_tokens=10, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = client.completions.create(model="tiny-refusion", prompt=[16, 17], max_tokens=4)
    assert ids.usage.prompt_tokens == 2


def test_max_tokens_cut_inside_a_slot(client, expected):
    """max_tokens=5 with slots of 4: the decoder's budget is 8, the answer 5 tokens."""
    p = "Count from 17 to 38."
    r = chat(client, p, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert expected[p].startswith(r.choices[0].message.content) and r.choices[0].message.content


def test_stop_strings(client, expected):
    p = "Who is Sven?"
    r = chat(client, p, stop=["baker", "never there"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected[p][: expected[p].index("baker")]
    s = chat(client, p, stop="baker", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content


def test_refusion_extra_fields(client):
    r = chat(client, "Count from 17 to 38.", extra_body={"slot_size": 8, "block_length": 32,
                                                          "slot_threshold": 0.5, "token_threshold": 0.2})
    assert r.choices[0].message.content.startswith("17 18 19")
    hot = chat(client, "Who is Sven?", temperature=0.8, seed=3, top_p=0.9)
    again = chat(client, "Who is Sven?", temperature=0.8, seed=3, top_p=0.9)
    assert hot.choices[0].message.content == again.choices[0].message.content  # seeded


def test_twenty_concurrent_streams(client, expected, server):
    """20 streaming clients at once: every stream completes with the right text."""
    def run(i):
        p = PROMPTS[i % len(PROMPTS)]
        c = openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=60)
        t0 = time.perf_counter()
        text, finish, first = "", None, None
        for chunk in chat(c, p, stream=True, max_tokens=SHORT):
            if chunk.choices:
                if chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter() - t0
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return p, text, finish, first, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(run, range(20)))
    wall = time.perf_counter() - t0
    for p, text, finish, _, _ in results:
        assert text == expected[p, SHORT] and finish in ("stop", "length")
    firsts = sorted(r[3] for r in results)
    print(f"\n20 concurrent streams: wall {wall:.2f}s, first text median {firsts[10]:.2f}s, "
          f"max {firsts[-1]:.2f}s, total max {max(r[4] for r in results):.2f}s")
    assert health(server)["active"] == 0


# --------------------------------------------------------------------------
# Malformed requests: 4xx with an OpenAI error object, and the server stays up


def raw(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, payload


def user(content="Who is Sven?", **fields):
    return {"model": "tiny-refusion", "messages": [{"role": "user", "content": content}], **fields}


CHAT = "/v1/chat/completions"
BAD = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
    (CHAT, b"\xff\xfe{}", 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "Who is Sven?"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    (CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    (CHAT, user(max_tokens=-1), 400, "max_tokens"),
    (CHAT, user(max_tokens=0), 400, "max_tokens"),
    (CHAT, user(max_tokens=10 ** 12), 400, "max_tokens"),
    (CHAT, user(max_tokens=2040), 400, "max_tokens"),  # fits alone, not after the prompt
    (CHAT, user(max_tokens="12"), 400, "max_tokens"),
    (CHAT, user(max_tokens=True), 400, "max_tokens"),
    (CHAT, user(max_tokens=2.5), 400, "max_tokens"),
    (CHAT, user(temperature="hot"), 400, "temperature"),
    (CHAT, user(temperature=-1), 400, "temperature"),
    (CHAT, user(top_p=1.5), 400, "top_p"),
    (CHAT, user(stream="yes"), 400, "stream"),
    (CHAT, user(stop=5), 400, "stop"),
    (CHAT, user(stop=[""]), 400, "stop"),
    (CHAT, user(seed=-1), 400, "seed"),
    (CHAT, user(n=2), 400, "n"),
    (CHAT, user(model=7), 400, "model"),
    (CHAT, user(slot_size=0), 400, "slot_size"),
    (CHAT, user(slot_size=True), 400, "slot_size"),
    (CHAT, user(block_length=6), 400, None),  # not a multiple of the slot size
    (CHAT, user(block_length=8, serial_num_blocks=2), 400, None),
    (CHAT, user(slot_threshold=2), 400, "slot_threshold"),
    (CHAT, user(token_threshold="high"), 400, "token_threshold"),
    (CHAT, user(stream_options=3), 400, "stream_options"),
    (CHAT, user("1 " * 3000), 400, "messages"),  # the prompt alone is over the context
    ("/v1/completions", {"model": "m"}, 400, "prompt"),
    ("/v1/completions", {"prompt": 123}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
]


def check_error(status, payload, want_status, want_param=None):
    assert status == want_status, payload
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if want_param is not None:
        assert err["param"] == want_param, err
    return err


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_malformed_request_is_4xx(server, path, body, status, param):
    check_error(*raw(server, "POST", path, body), status, param)


def test_invalid_combination_reports_the_decoder_message(server):
    err = check_error(*raw(server, "POST", CHAT, user(block_length=6)), 400)
    assert "not a multiple of slot_size" in err["message"]
    err = check_error(*raw(server, "POST", CHAT, user("1 " * 3000)), 400)
    assert err["code"] == "context_length_exceeded"


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Who is Sven?", max_tokens=-3)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "robot", "content": "hi"}])


def test_http_level_errors(server):
    check_error(*raw(server, "GET", CHAT), 405)
    check_error(*raw(server, "POST", "/v1/models", {}), 405)
    check_error(*raw(server, "DELETE", "/v1/models"), 405)
    check_error(*raw(server, "GET", "/v1/nothing"), 404)
    check_error(*raw(server, "GET", "/v1/models/other-model"), 404)
    check_error(*raw(server, "BREW", CHAT), 405)
    big = json.dumps(user("x" * (2 << 20))).encode()
    check_error(*raw(server, "POST", CHAT, big), 413)
    check_error(*raw(server, "POST", CHAT, b"{}", {"Content-Length": "abc"}), 400)


def test_missing_content_length_and_garbage(server):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 411")
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"\x00\x01 garbage\r\n\r\n")
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.") and " 400 " in head.splitlines()[0]


def test_server_healthy_after_abuse(client, server, expected):
    assert health(server)["status"] == "ok"
    assert chat(client, "Who is Sven?").choices[0].message.content == expected["Who is Sven?"]


# --------------------------------------------------------------------------
# A client that disconnects mid-stream frees its generation


def test_disconnect_mid_stream_frees_generation(server, client):
    before = health(server)
    s = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({**LONG, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    deadline = time.monotonic() + 30
    while got.count(b"data:") < 3 and time.monotonic() < deadline:  # a few chunks arrived
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"data:") >= 3
    assert health(server)["active"] == 1
    s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = health(server)
        if now["active"] == 0:
            break
        time.sleep(0.05)
    assert now["active"] == 0
    assert now["cancelled"] == before["cancelled"] + 1
    assert now["completed"] == before["completed"]  # it was stopped, not run to the end
    assert chat(client, "Who is Sven?").choices[0].finish_reason == "stop"


def test_clients_that_leave_while_queued_are_cancelled(server):
    """A request whose client leaves before it starts never runs."""
    srv = server
    before = health(srv)
    socks = []
    for _ in range(6):  # 4 run (max_active), 2 wait
        s = socket.create_connection((srv.host, srv.port), timeout=30)
        body = json.dumps({**LONG, "stream": False}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(s)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = health(srv)
        if now["active"] == 4 and now["queued"] == 2:
            break
        time.sleep(0.05)
    assert now["active"] == 4 and now["queued"] == 2
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = health(srv)
        if now["active"] == 0 and now["queued"] == 0:
            break
        time.sleep(0.05)
    assert now["active"] == 0 and now["queued"] == 0
    assert now["cancelled"] == before["cancelled"] + 6 and now["completed"] == before["completed"]


def test_openai_client_example(server):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"), "--base-url", server.url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "stream> 17 18 19" in r.stdout and "finish_reason=" in r.stdout and "usage:" in r.stdout
    assert "chat> Sven lives in Hanoi." in r.stdout and "bad request> 400" in r.stdout


# --------------------------------------------------------------------------
# Unit: in-order text shaping


def test_text_shaper_holds_back_partial_stop():
    shaper = TextShaper(lambda ids: "", max_tokens=100, stop=["END"], eos_id=0)
    assert shaper.feed("abc E", [1, 2], False) == ("abc ", None)
    assert shaper.feed("N", [3], False) == ("", None)
    assert shaper.feed("Dx", [4], False) == ("", "stop")
    shaper = TextShaper(lambda ids: "", max_tokens=100, stop=["END"], eos_id=0)
    assert shaper.feed("abc EN", [1, 2], False) == ("abc ", None)
    assert shaper.feed("O", [5, 0], True) == ("ENO", None)


def test_text_shaper_cuts_at_max_tokens():
    pieces = {1: "a", 2: "b", 3: "c"}
    shaper = TextShaper(lambda ids: "".join(pieces[i] for i in ids), max_tokens=2, stop=[], eos_id=0)
    assert shaper.feed("abc", [1, 2, 3], False) == ("ab", "length")
    assert shaper.tokens == [1, 2]


# --------------------------------------------------------------------------
# The CLI: python -m refusion_mlx.server


def start_cli(*args):
    """Start the server CLI on a free port; its stderr lines go to a queue."""
    proc = subprocess.Popen([sys.executable, "-m", "refusion_mlx.server", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    return proc, lines


def wait_ready(proc, lines) -> int:
    """The port from the server's 'serving ... at http://127.0.0.1:PORT/v1' line."""
    deadline = time.monotonic() + 90
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        m = re.search(r"serving \S+ at http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"server did not start: {seen}")


def drain(lines) -> str:
    out = []
    while True:
        try:
            out.append(lines.get(timeout=0.5))
        except queue.Empty:
            return "".join(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_serves_and_shuts_down_cleanly(cli_servers, sig):
    proc, lines = cli_servers[sig]
    port = wait_ready(proc, lines)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
    assert c.models.list().data[0].id == "tiny-refusion"
    stream = c.completions.create(model="tiny-refusion", stream=True, prompt=LONG["prompt"], max_tokens=1024,
                                  extra_body={k: LONG[k] for k in ("slot_threshold", "token_threshold")})
    next(iter(stream))  # a generation in flight when the signal comes
    proc.send_signal(sig)
    assert proc.wait(timeout=20) == 0
    with pytest.raises(Exception):
        for _ in stream:  # the stream ends (error event or closed connection), it does not hang
            pass
        raise RuntimeError("stream ended")
    log = drain(lines)
    assert "shutting down" in log and "stopped" in log and "Traceback" not in log


@pytest.mark.parametrize("flags,needle", [
    (["--port", "70000"], "port must be within"),
    (["--max-tokens", "0"], "gen_length must be a positive integer"),
    (["--slot-size", "4", "--block-length", "6"], "not a multiple"),
    (["--host", "203.0.113.77"], "cannot listen on"),
    (["--max-active", "0"], "must be >= 1"),
])
def test_cli_bad_flags_one_line(flags, needle):
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.server", *flags], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
