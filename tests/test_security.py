"""Safe to leave running on a laptop (issue 43): no cross-site use, an API
key, a private prompt cache, a body that stalls, a start-up that refuses what
would refuse everything, and an OpenAPI document that says what the server
answers -- checked by a fuzzer driven by that document.

One in-process server (the demo model, two API keys, a 1 s body timeout, a
prompt-cache folder, one allowed origin) serves the HTTP tests.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import signal
import socket
import stat
import threading
import time

import anthropic
import jsonschema
import openai
import pytest

from refusion_mlx.decode.params import make_params
from refusion_mlx.errors import RefusionError
from refusion_mlx.serve.http_server import RefusionServer
from refusion_mlx.serve.edge.security import RequestGuard, SiteGuard, exposure_warning, unpaired_surrogate

KEYS = ("key-one-1234", "key-two-5678")
APP = "http://app.example"
CHAT = "/v1/chat/completions"
QUESTION = "Reverse the words: sugar forest orange"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("security") / "prompt-cache"
    folder.mkdir()
    os.chmod(folder, 0o755)  # as an earlier version left it: made private at start
    return folder


@pytest.fixture(scope="module")
def server(cache_dir):
    with RefusionServer(None, port=0, api_keys=KEYS, body_timeout=1.0, prompt_cache_dir=str(cache_dir),
                        allowed_origins=(APP,), decoding=make_params(max_tokens=16)) as srv:
        yield srv


def call(server, method, path, body=None, headers=None, key=KEYS[0], content_type="application/json"):
    """(status, headers, payload) of one request; ``key`` None sends none."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    sent = {**({"Content-Type": content_type} if content_type and data is not None else {}),
            **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    conn.request(method, path, body=data, headers=sent)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload


def chat(content=QUESTION, **fields):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def openai_error(payload, code=None):
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    assert code is None or err["code"] == code, err
    return err


def completed(server) -> int:
    return json.loads(call(server, "GET", "/health")[2])["completed"]


# --------------------------------------------------------------------------
# Browser-safe: Content-Type, Host, Origin


def test_cross_site_posts_are_refused_before_anything_runs(server):
    before = completed(server)
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        status, _, payload = call(server, "POST", CHAT, chat(), content_type=kind)
        assert status == 415, (kind, payload)
        assert "Content-Type: application/json" in openai_error(payload, "unsupported_media_type")["message"]
    status, _, payload = call(server, "POST", "/v1/messages", chat(), content_type="text/plain")
    assert status == 415 and json.loads(payload)["type"] == "error"  # Anthropic's shape on its route
    # a POST with no body and no Content-Type (POST .../cancel takes none) goes on; a route that needs a body
    # says so (Content-Length: 0 here, then neither it nor a chunked body)
    status, _, payload = call(server, "POST", "/v1/responses/resp_nope/cancel")
    assert status == 404 and openai_error(payload, "not_found")["param"] == "response_id"
    status, _, payload = call(server, "POST", CHAT)
    assert status == 400 and openai_error(payload)["message"].startswith("the request body")
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(f"POST /v1/responses/resp_nope/cancel HTTP/1.1\r\nHost: localhost\r\n"
                  f"Authorization: Bearer {KEYS[0]}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 404 ")
    # a DNS-rebinding page: its own name resolves here, the Host header says so
    status, _, payload = call(server, "POST", CHAT, chat(), headers={"Host": f"evil.example:{server.port}"})
    assert status == 403 and openai_error(payload, "host_not_allowed")
    status, _, payload = call(server, "GET", "/v1/models", headers={"Host": "rebind.attacker.test"})
    assert status == 403
    # a page of another site (its fetch sends its Origin)
    status, _, payload = call(server, "POST", CHAT, chat(), headers={"Origin": "http://evil.example"})
    assert status == 403 and "--allowed-origins http://evil.example" in openai_error(payload)["message"]
    assert completed(server) == before  # none of them ran
    assert call(server, "POST", CHAT, chat(), content_type="application/json; charset=utf-8")[0] == 200
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "localhost"):
        assert call(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    own = f"http://127.0.0.1:{server.port}"  # the server's own page
    assert call(server, "POST", CHAT, chat(), headers={"Origin": own})[0] == 200
    status, headers, _ = call(server, "POST", CHAT, chat(), headers={"Origin": APP})
    assert status == 200 and headers["access-control-allow-origin"] == APP
    # CORS preflight: for the allowed origin (no key needed to ask), not for another
    preflight = {"Origin": APP, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = call(server, "OPTIONS", CHAT, headers=preflight, key=None)
    assert status == 200 and headers["access-control-allow-origin"] == APP
    assert call(server, "OPTIONS", CHAT, headers={**preflight, "Origin": "http://evil.example"}, key=None)[0] == 403


def test_host_and_origin_rules():
    guard = SiteGuard(None, "127.0.0.1")
    assert guard.host_ok("127.0.0.1:8080") and guard.host_ok("localhost:8080") and guard.host_ok("[::1]:8080")
    assert not guard.host_ok("evil.example:8080") and not guard.host_ok("192.168.1.5:8080")
    wide = SiteGuard(None, "0.0.0.0", allowed_hosts=("mymac.local",))
    assert wide.host_ok("192.168.1.5:8080") and wide.host_ok("MyMac.local.:8080") and not wide.host_ok("evil.test")
    assert SiteGuard(None, "127.0.0.1", allowed_hosts=("*",)).host_ok("anything.example")
    assert guard.origin_ok(None, "x") and guard.origin_ok("http://127.0.0.1:8080", "127.0.0.1:8080")
    assert not guard.origin_ok("http://127.0.0.1:9999", "127.0.0.1:8080") and not guard.origin_ok("null", "h")


# --------------------------------------------------------------------------
# The API key


def test_every_route_but_health_the_page_and_hello_needs_the_key(server):
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"),
                         ("GET", "/web/settings.json"), ("GET", "/v1/responses/resp_x"), ("POST", CHAT),
                         ("POST", "/v1/completions"), ("POST", "/v1/responses")):
        status, headers, payload = call(server, method, path, chat() if method == "POST" else None, key=None)
        assert status == 401 and headers["www-authenticate"] == "Bearer", path
        assert "needs an API key" in openai_error(payload, "invalid_api_key")["message"]
    status, _, payload = call(server, "POST", "/v1/messages", chat(), key=None)
    assert status == 401 and json.loads(payload)["error"]["type"] == "authentication_error"
    status, _, payload = call(server, "GET", "/v1/models", key="wrong-key")
    assert status == 401 and "not valid" in openai_error(payload)["message"]
    for path in ("/health", "/", "/web/app.js", "/web/settings.js", "/web/slots.js", "/web/style.css", "/api/hello"):
        assert call(server, "GET", path, key=None)[0] == 200, path
    assert call(server, "HEAD", "/api/hello", key=None)[0] == 200  # Claude Code's connection check, keyless
    status, _, payload = call(server, "GET", "/health", key=None)  # up or not: nothing of the traffic, nor the
    assert json.loads(payload) == {"status": "ok"}  # model's name (by default its folder's path)
    assert {"completed", "prefill_tokens", "prompt_cache"} <= set(json.loads(call(server, "GET", "/health")[2]))
    for path in ("/", "/web/app.js"):  # no other site may frame the page
        headers = call(server, "GET", path, key=None)[1]
        assert headers["x-frame-options"] == "DENY" and headers["content-security-policy"] == "frame-ancestors 'none'"
    assert call(server, "GET", "/v1/models", key=None, headers={"x-api-key": KEYS[1]})[0] == 200
    for headers in ({"x-api-key": "wrong"}, {"x-api-key": "wrong", "anthropic-version": "2023-06-01"}):
        status, answered, payload = call(server, "GET", "/v1/models", key=None, headers=headers)  # an Anthropic
        assert status == 401 and json.loads(payload) == {"type": "error", "error": {  # client's: its own shape
            "type": "authentication_error", "message": "the API key is not valid: send it as Authorization: "
                                                       "Bearer KEY or x-api-key: KEY"},
            "request_id": answered["request-id"]}
    status, _, payload = call(server, "GET", "/v1/models/nope")  # an OpenAI client's: OpenAI's
    assert status == 404 and openai_error(payload, "model_not_found")["param"] == "model"
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=KEYS[1], max_retries=0).models.retrieve(
            "nope")
    assert e.value.body["error"]["type"] == "not_found_error"
    assert call(server, "GET", "/metrics", key=KEYS[1])[0] == 200
    client = openai.OpenAI(base_url=server.url, api_key=KEYS[0], max_retries=0)
    assert client.chat.completions.create(model="m", **chat()).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="nope", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=KEYS[1], max_retries=0)
    assert claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])


def test_metrics_public_and_the_warning_for_an_open_server():
    def scope(path):
        return {"type": "http", "method": "GET", "path": path, "headers": []}

    assert RequestGuard(None, keys=("k",), metrics_public=True).authorized(scope("/metrics"))
    assert not RequestGuard(None, keys=("k",)).authorized(scope("/metrics"))
    line = exposure_warning("0.0.0.0", 8080, ())
    assert line.startswith("WARNING: listening on every address of this machine (port 8080) without an API key")
    assert "--api-key" in line and exposure_warning("0.0.0.0", 8080, ("k",)) is None
    assert exposure_warning("127.0.0.1", 8080, ()) is None and exposure_warning("::1", 8080, ()) is None
    assert exposure_warning("192.168.1.5", 8080, ()).startswith("WARNING: listening on 192.168.1.5")


def test_the_page_asks_for_the_key_once(chromium, server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url.removesuffix("/v1") + "/")
            page.wait_for_selector("#key-dialog[open]")
            asked = page.text_content("#key-message")
            page.fill("#key-input", KEYS[0])
            page.click("#key-ok")
            page.wait_for_selector("input[name=max_tokens]")
            page.fill("#input", "Who is Sven?")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
            answer = page.text_content(".msg.assistant .body")
            stored = page.evaluate("sessionStorage.getItem('refusion-mlx-api-key')")
            page.reload()  # the same tab: not asked again
            page.wait_for_selector("input[name=max_tokens]")
            asked_again = page.eval_on_selector("#key-dialog", "d => d.open")
            page.evaluate("sessionStorage.setItem('refusion-mlx-api-key', 'wrong')")
            page.reload()
            page.wait_for_selector("#key-dialog[open]")
            refused = page.text_content("#key-message")
            # a pasted typographic character: no header can carry it, so the page asks again (fetch threw)
            page.evaluate("sessionStorage.setItem('refusion-mlx-api-key', 's\u00e9cret\u2026')")
            page.reload()
            page.wait_for_selector("#key-dialog[open]")
            printable = page.text_content("#key-message")
            page.fill("#key-input", KEYS[0])
            page.click("#key-ok")
            page.wait_for_selector("input[name=max_tokens]")
        finally:
            browser.close()
    assert not errors and "needs its API key" in asked and stored == KEYS[0] and answer
    assert asked_again is False and "refused that key" in refused and "printable ASCII" in printable


# --------------------------------------------------------------------------
# Requests that stall or lack content; a budget that refuses everything


def test_a_body_that_stalls_after_its_headers_is_a_408(server):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 100\r\n\r\n{\"messages\"")
        head = s.recv(4096).decode()
        waited = time.monotonic() - t0
        while chunk := s.recv(4096):  # the body, then the close
            head += chunk.decode()
    assert head.startswith("HTTP/1.1 408") and "request_timeout" in head and 0.9 < waited < 5, head


def test_no_client_text_reaches_the_log_raw(server, caplog):
    """The path was escaped, but not the messages that quote a client's text: an Origin or Content-Type header
    with escape sequences (before any key is asked for) drove the operator's terminal, and a dict key with a
    newline in a body wrote a forged log line."""
    evil = "\x1b]0;PWNED\x07\x1b[2J\x9b2J"
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        assert call(server, "GET", "/v1/models", key=None, headers={"Origin": "http://x" + evil})[0] == 403
        assert call(server, "POST", CHAT, b"{}", content_type="text/" + evil)[0] == 415
        body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"x\n09:99:99 200 FORGED" + evil: 1}}
        assert call(server, "POST", CHAT, body)[0] == 400
        assert call(server, "GET", "/nope%1b[31mRED")[0] == 404
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 4 and "FORGED" in "".join(lines)
    assert not [m for m in lines if any(not c.isprintable() for c in m)], lines


def test_operators_settings_and_clients_the_docs_promise(server, tmp_path, caplog):
    """A browser SDK's preflight
    (x-stainless-*, Anthropic's direct-browser header) passes for an allowed origin; a request path cannot
    write log lines; --api-key takes commas as the docs say; the port is held from construction; a chunked body
    over the limit is refused at once (not after a 5 s drain)."""
    import argparse

    from refusion_mlx.serve.server_config import add_server_args

    status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", key=None, headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang,"
                                          "anthropic-dangerous-direct-browser-access"})
    assert status == 200 and "x-stainless-lang" in headers["access-control-allow-headers"].lower()
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        call(server, "GET", "/x%0a04:21:59%20serving%20FORGED", key=None)
    forged = [r.getMessage() for r in caplog.records if "FORGED" in r.getMessage()]
    assert forged and all("\n" not in m and m.startswith("401") for m in forged)
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--api-key", "k1,k2", "--api-key", "k3"])
    assert tuple(args.api_keys) == ("k1", "k2", "k3")
    # $REFUSION_MLX_API_KEY as a CI secret that expanded to nothing (or commas): refused, as --api-key '' is,
    # where it served with no key at all; set to keys, they are taken
    from refusion_mlx.server import build_parser
    from refusion_mlx.serve.server_config import ServerConfig

    for value in ("", " ", ",,"):
        os.environ["REFUSION_MLX_API_KEY"] = value
        try:
            with pytest.raises(RefusionError, match="REFUSION_MLX_API_KEY is set but holds no key"):
                ServerConfig.from_args(build_parser().parse_args([]))
        finally:
            del os.environ["REFUSION_MLX_API_KEY"]
    os.environ["REFUSION_MLX_API_KEY"] = "k4, k5"
    try:
        assert ServerConfig.from_args(build_parser().parse_args([])).api_keys == ("k4", "k5")
    finally:
        del os.environ["REFUSION_MLX_API_KEY"]
    held = RefusionServer(None, port=0, max_body_bytes=1000)  # listening before the model loads: no other
    try:  # socket can take the port
        assert held.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        held.start()
        t0 = time.monotonic()
        with socket.create_connection((held.host, held.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + b"%x\r\n" % 4000 + b"x" * 4000 + b"\r\n0\r\n\r\n")
            head = s.recv(4096).decode()
        assert head.startswith("HTTP/1.1 413") and time.monotonic() - t0 < 2.5, head
    finally:
        held.close()


def test_a_shared_folder_is_not_made_private_for_the_prompt_cache(tmp_path):
    """--prompt-cache-dir on a folder others use (/tmp, a team's): refused in one line, its mode left as it was."""
    from refusion_mlx.models.loading import load
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "someone-elses.txt").write_text("x")
    model, _ = load(None)
    with pytest.raises(RefusionError, match="shared .mode 1777. and holds other files"):
        attach(PromptCache(1 << 20), model, str(shared), 1 << 20)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_a_message_without_content_is_a_clear_400(server):
    body = {"messages": [{"role": "user"}], "max_tokens": 8}
    status, _, payload = call(server, "POST", CHAT, body)
    err = openai_error(payload)
    assert status == 400 and err["message"] == ("messages[0].content: a user message needs content (a string or "
                                                "text parts)") and err["param"] == "messages[0].content"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    fine = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "c1", "content": "42"}], "max_tokens": 8}
    assert call(server, "POST", CHAT, fine)[0] == 200  # an assistant's calls need no content


def test_an_unpaired_surrogate_is_a_400_naming_its_field(server):
    """JSON may escape half a UTF-16 pair ("\\ud800"), which is no text: no tokenizer takes it and
    no answer echoing it can be written (a stored response's metadata was a 500). Every route
    refuses it at the edge, in its API's shape, naming the field; a whole pair is one character."""
    lone = '"\\ud800"'
    cases = [(CHAT, '{"messages": [{"role": "user", "content": %s}], "max_tokens": 8}', "messages[0].content"),
             ("/v1/responses", '{"model": "m", "input": "hi", "metadata": {"k": %s}, "max_output_tokens": 8}',
              "metadata.k"),
             ("/v1/completions", '{"prompt": ["hi", %s], "max_tokens": 8}', "prompt[1]"),
             ("/v1/messages", '{"model": "m", "system": %s, "messages": [{"role": "user", "content": "hi"}], '
                              '"max_tokens": 8}', "system")]
    before = completed(server)
    for path, body, param in cases:
        status, _, payload = call(server, "POST", path, (body % lone).encode())
        message = f"{param}: holds an unpaired UTF-16 surrogate (\\ud800), which is not Unicode text"
        if path == "/v1/messages":
            assert status == 400 and json.loads(payload)["error"] == {"type": "invalid_request_error",
                                                                      "message": message}
        else:
            err = openai_error(payload, "invalid_value")
            assert status == 400 and err["message"] == message and err["param"] == param
    assert completed(server) == before  # refused before anything ran
    low = call(server, "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\udc00"}], "max_tokens": 8}')
    assert low[0] == 400 and openai_error(low[2])["param"] == "messages[0].content"
    pair = call(server, "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 8}')
    assert pair[0] == 200  # one character, U+1F600
    assert unpaired_surrogate(b'{"a": "\\\\ud800"}') is None  # an escaped backslash, then the letters "ud800"
    assert unpaired_surrogate(b'{"a": {"\\ud800": 1}}') == ("a", "\\ud800")  # a key: its object is named
    assert unpaired_surrogate(b'"\\udfff"') == ("", "\\udfff") and unpaired_surrogate(b'{"a": "\\ud800') is None
    # the same half pair as raw bytes (CESU-8), or a body in UTF-16: json.loads reads both into a lone
    # surrogate (a 500 in /tokenize, a stored response's metadata); the body is not UTF-8, a 400
    raw = '{"prompt": "\ud800"}'.encode("utf-8", "surrogatepass")
    for body, path in ((raw, "/tokenize"), ('{"model": "m", "input": "hi"}'.encode("utf-16"), "/v1/responses")):
        status, _, payload = call(server, "POST", path, body)
        assert status == 400 and "not UTF-8" in openai_error(payload, "invalid_json")["message"], payload
    assert call(server, "POST", path, '{"model": "m", "input": "hi", "max_output_tokens": 4}'.encode("utf-8-sig"))[0] == 200


def test_a_body_nested_too_deeply_is_one_line(server):
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, payload = call(server, "POST", CHAT, deep)
    err = openai_error(payload, "invalid_json")
    assert status == 400 and err["message"] == "the request body is nested too deeply to read as JSON"
    status, _, payload = call(server, "POST", "/v1/messages", deep)
    assert status == 400 and json.loads(payload)["error"]["message"] == err["message"]
    # an integer past Python's 4,300 digits: it read "There was an error parsing the body"
    long = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}"
    status, _, payload = call(server, "POST", CHAT, long)
    assert status == 400 and "integer too long" in openai_error(payload, "invalid_json")["message"]


def test_max_kv_bytes_below_one_request_is_refused_at_start(capsys):
    with pytest.raises(RefusionError, match=r"--max-kv-bytes 1000 is less than the smallest request reserves "
                                            r"\(256 rows of 4096 bytes = 1048576\)"):
        RefusionServer(None, port=0, max_kv_bytes=1000, dtype="float32").start()  # 4096: float32's bytes
    from refusion_mlx.server import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main(["--port", "0", "--max-kv-bytes", "512K", "--dtype", "float32", "--log-level", "ERROR"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert code == 1 and err.count("error: ") == 1 and "--max-kv-bytes 524288 is less than" in err
    # with --kv-bits the smallest request also holds one slot's rows in float until they are committed
    from refusion_mlx.serve.core.memory import KVCost, check_kv_budget

    with pytest.raises(RefusionError, match=r"\(256 rows of 1152 bytes \+ 4 rows of 4096 bytes a pass holds in "
                                            r"float = 311296\)"):
        check_kv_budget(300_000, KVCost(1152, 4096, 8, 64), make_params(slot_size=4))
    check_kv_budget(311_296, KVCost(1152, 4096, 8, 64), make_params(slot_size=4))


def test_the_open_server_warning_is_said_whatever_the_log_level(capsys):
    from refusion_mlx.server import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # as --log-level ERROR leaves it (pytest's handlers keep basicConfig from it)
    try:  # bound to every address without a key, then stopped by the budget
        code = main(["--host", "0.0.0.0", "--port", "0", "--max-kv-bytes", "1K", "--log-level", "ERROR"])
    finally:
        root.setLevel(level)
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert code == 1 and "WARNING: listening on every address of this machine" in err


# --------------------------------------------------------------------------
# The private prompt cache


def cached(server, key, user=None, content=QUESTION) -> int:
    body = chat(content, **({"user": user} if user else {}))
    status, _, payload = call(server, "POST", CHAT, body, key=key)
    assert status == 200, payload
    return json.loads(payload)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_are_told_only_to_the_owner_of_the_prefix(server, cache_dir):
    secret = "My PIN is 4 7 1 9. Reverse the words: sugar forest orange"
    assert cached(server, KEYS[0], "alice", secret) == 0
    hit = cached(server, KEYS[0], "alice", secret)
    assert hit > 10  # alice continues her own prompt
    assert cached(server, KEYS[0], "bob", secret) == 0  # bob learns nothing of it, and pays the prefill
    assert cached(server, KEYS[1], "alice", secret) == 0  # another key: another partition
    assert cached(server, KEYS[1], "dave", secret) == 0
    assert cached(server, KEYS[0], "alice", secret) == hit
    # Anthropic's metadata.user_id is the same partition as OpenAI's user
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": secret}], "metadata": {"user_id": "carol"}}
    first = json.loads(call(server, "POST", "/v1/messages", body)[2])["usage"]["cache_read_input_tokens"]
    again = json.loads(call(server, "POST", "/v1/messages", body)[2])["usage"]["cache_read_input_tokens"]
    assert first == 0 and again > 10
    # Claude Code's user_id is a JSON object whose session_id is new each run: a new session of the same
    # device continues what the earlier ones prefilled; another device does not
    def claude_code(device, session):
        user = json.dumps({"device_id": device, "account_uuid": "", "session_id": session})
        body["metadata"] = {"user_id": user}
        return json.loads(call(server, "POST", "/v1/messages", body)[2])["usage"]["cache_read_input_tokens"]

    assert claude_code("d1", "s1") == 0 and claude_code("d1", "s2") > 10 and claude_code("d2", "s2") == 0
    # on disk: a private folder of private files, one per owner of the same tokens, named by model and owner
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    files = list(cache_dir.iterdir())
    assert len(files) >= 5 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert len({f.name[:16] for f in files}) == 1 and all(f.name[16] == "-" for f in files)
    assert not any(secret.encode() in f.read_bytes() for f in files)  # tokens, never text or the key
    assert not any(KEYS[0].encode() in f.read_bytes() or b"alice" in f.read_bytes() for f in files)


def test_a_stored_response_belongs_to_its_key(server):
    status, _, payload = call(server, "POST", "/v1/responses", {"input": "Who is Sven?", "max_output_tokens": 8})
    made = json.loads(payload)
    assert status == 200 and made["status"] in ("completed", "incomplete")
    path = f"/v1/responses/{made['id']}"
    status, _, payload = call(server, "GET", path, key=KEYS[1])  # another key: not there for it
    assert status == 404 and openai_error(payload, "not_found")
    follow = {"input": "And Zoe?", "max_output_tokens": 8, "previous_response_id": made["id"]}
    status, _, payload = call(server, "POST", "/v1/responses", follow, key=KEYS[1])
    assert status == 400 and openai_error(payload)["param"] == "previous_response_id"
    assert call(server, "DELETE", path, key=KEYS[1])[0] == 404
    assert json.loads(call(server, "GET", path)[2])["output"] == made["output"]  # its own key: still there
    assert call(server, "POST", "/v1/responses", follow)[0] == 200


def test_cache_owner_by_scope():
    from refusion_mlx.serve.edge.answering import Answering
    from refusion_mlx.serve.edge.security import KEY_SCOPE

    class Request:
        def __init__(self, key=None):
            self.scope = {KEY_SCOPE: key} if key else {}

    def owner(scope, key, user):
        class Server:
            engine = None
            config = type("C", (), {"prompt_cache_scope": scope})()

        return Answering(Server()).cache_owner(Request(key), user)

    assert owner("shared", "k1", "alice") == owner("shared", None, None) == ""
    assert owner("private", "k1", None) is None and owner("private", None, "") is None
    assert owner("private", "k1", "alice") == owner("user", "k1", "alice") != owner("user", "k2", "alice")
    assert owner("user", "k1", None) != owner("user", "k1", "bob") and owner("user", None, None) is not None
    assert owner("user", "k1", "a") == hashlib.sha256(b"k1|a").hexdigest()[:24]


@pytest.fixture(scope="module")
def models():
    """The demo model in float32 and bfloat16, and the golden fixture model: three fingerprints."""
    from tests.helpers import FIXTURE_MODEL
    from refusion_mlx.models.loading import DEMO_MODEL, load

    return [load(DEMO_MODEL, dtype="float32")[0], load(DEMO_MODEL, dtype="bfloat16")[0],
            load(FIXTURE_MODEL, dtype="float32")[0]]


def attached(model, folder, budget=1 << 30, storage=None):
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    cache = PromptCache(1 << 30)
    attach(cache, model, folder, budget, storage=storage)
    return cache


def entry(model, tokens, storage=None):
    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.prefill import prefill

    cache = CommittedCache.for_model(model, storage=storage)
    prefill(model, cache, tokens)
    return cache


def test_models_and_dtypes_sharing_a_folder_keep_to_their_own_files(models, tmp_path):
    tokens = list(range(5, 25))
    caches = [attached(m, tmp_path) for m in models]
    for m, c in zip(models, caches):
        c.insert(entry(m, tokens), "owner-a")
    names = sorted(f.name for f in tmp_path.iterdir())
    assert len(names) == 3 and len({n[:16] for n in names}) == 3  # none overwrote another
    size = max(f.stat().st_size for f in tmp_path.iterdir())
    small = attached(models[0], tmp_path, budget=size + size // 2)  # room for one of its own files
    small.insert(entry(models[0], tokens + [30, 31]), "owner-b")  # its budget trims its own files only
    prefixes = sorted(f.name[:16] for f in tmp_path.iterdir())
    assert len(prefixes) == 3 and len(set(prefixes)) == 3
    for m in models:
        again = attached(m, tmp_path)
        assert len(again) == 1  # each model reads back only its own entry
    # the same weights with an 8-bit KV cache (--kv-bits 8): another stored form, its own files
    from refusion_mlx.decode.kv_store import KVStorage

    eight = KVStorage.of(8, 32, models[0])
    quantized = attached(models[0], tmp_path, storage=eight)
    assert len(quantized) == 0
    quantized.insert(entry(models[0], tokens, eight), "owner-a")
    assert len({f.name[:16] for f in tmp_path.iterdir()}) == 4
    assert len(attached(models[0], tmp_path, storage=eight)) == 1 and len(attached(models[0], tmp_path)) == 1


def test_a_fifo_in_the_folder_is_skipped_without_opening_it(models, tmp_path, caplog):
    from refusion_mlx.decode.kv_store import KVStorage
    from refusion_mlx.serve.caches.cache_files import model_fingerprint

    model = models[0]
    prefix = model_fingerprint(model.model_path, KVStorage().describe(model.cache_spec()))[:16]
    attached(model, tmp_path).insert(entry(model, list(range(5, 25))), "o")
    os.mkfifo(tmp_path / f"{prefix}-{'0' * 32}.safetensors")
    os.mkfifo(tmp_path / "plain.safetensors")
    (tmp_path / f"{prefix}-{'1' * 32}.safetensors").symlink_to("/dev/zero")
    got = []
    with caplog.at_level(logging.WARNING, logger="refusion_mlx.server"):
        thread = threading.Thread(target=lambda: got.append(attached(model, tmp_path)), daemon=True)
        thread.start()
        thread.join(20)
    assert not thread.is_alive(), "start-up hung on a FIFO"
    assert len(got[0]) == 1
    skipped = [r.getMessage() for r in caplog.records if "not a regular file" in r.getMessage()]
    assert len(skipped) == 3, skipped


# --------------------------------------------------------------------------
# The OpenAPI document, and a fuzzer driven by it


@pytest.fixture(scope="module")
def document(server):
    status, _, payload = call(server, "GET", "/openapi.json")
    assert status == 200
    return json.loads(payload)


def test_the_document_says_what_the_server_answers(document):
    assert "422" not in json.dumps(document["paths"]) and "HTTPValidationError" not in json.dumps(document)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert {"200", "400", "401", "403", "408", "411", "413", "415", "500", "503"} <= set(
            document["paths"][path]["post"]["responses"]), path
    assert set(document["paths"]["/health"]["get"]["responses"]) == {"200", "403", "503"}
    assert "404" in document["paths"]["/v1/models/{name}"]["get"]["responses"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
    ref = document["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/AnthropicError"}
    assert set(document["components"]["securitySchemes"]) == {"bearer", "apiKey"}


def resolved(schema, components, depth=0):
    """The schema with its ``$ref``s replaced by what they name."""
    if isinstance(schema, dict):
        if "$ref" in schema and depth < 8:
            return resolved(components[schema["$ref"].rsplit("/", 1)[1]], components, depth + 1)
        return {k: resolved(v, components, depth) for k, v in schema.items()}
    if isinstance(schema, list):
        return [resolved(v, components, depth) for v in schema]
    return schema


# a valid request decodes at most a few slots: the fuzzer checks the contract, not the decoder's speed
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "slot_size": 4, "block_length": 8,
        "serial_num_blocks": 2}


def capped(schema, cap=None):
    if isinstance(schema, dict):
        out = {k: {name: capped(s, CAPS.get(name)) for name, s in v.items()} if k == "properties" else capped(v, cap)
               for k, v in schema.items()}
        if cap is not None and out.get("type") == "integer":
            out["maximum"] = min(out.get("maximum", cap), cap)
        return out
    if isinstance(schema, list):
        return [capped(v, cap) for v in schema]
    return schema


def test_a_fuzzer_driven_by_the_document_gets_only_documented_answers(server, document):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.schema_strategies import JSON, from_schema

    components = document["components"]["schemas"]
    seen = []

    def check(method, path, template, status, payload):
        responses = document["paths"][template][method]["responses"]
        assert str(status) in responses, (method, path, status, payload[:300])
        seen.append(status)
        media = responses[str(status)].get("content", {})
        if status != 200 and "application/json" in media:
            jsonschema.validate(json.loads(payload), resolved(media["application/json"]["schema"], components))

    posts = [(p, capped(resolved(ops["post"]["requestBody"]["content"]["application/json"]["schema"], components)))
             for p, ops in document["paths"].items() if "requestBody" in ops.get("post", {})]  # not .../cancel
    bodies = st.one_of(*[st.tuples(st.just(p), from_schema(s)) for p, s in posts],
                       st.tuples(st.sampled_from([p for p, _ in posts]), JSON))
    fast = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

    @fast
    @given(bodies)
    def post(case):
        path, body = case
        status, _, payload = call(server, "POST", path, body)
        check("post", path, path, status, payload)

    @settings(fast, max_examples=12)
    @given(st.sampled_from(["/v1/models/{name}", "/v1/responses/{response_id}"]),
           st.text("abcdefgh-_.0123456789", min_size=1, max_size=12))
    def get(template, name):
        path = template.split("{")[0] + name
        status, _, payload = call(server, "GET", path)
        check("get", path, template, status, payload)

    post()
    get()
    assert 200 in seen and 400 in seen and not [s for s in seen if s >= 500]
