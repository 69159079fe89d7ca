"""The web chat page at ``/`` and the stream's commits (``stream_options.include_commits``).

The page is driven in a real headless browser: Debian's ``chromium`` under
Playwright (the ``chromium`` fixture of tests/browser.py: ``.ci/run`` installs
the browser; Playwright's own download is not used). Without a browser that
test is skipped with one line at the end of the run, unless ``CI=true``, where
it fails. One in-process server on the bundled demo model serves every test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from refusion_mlx.decode.params import FIELDS
from refusion_mlx.serve.http_server import RefusionServer

COUNT = "Count from 63 to 83."  # the demo model commits this answer's second slot of 4 after the third and fourth
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server():
    with RefusionServer(None, port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def base(server) -> str:
    return server.url.removesuffix("/v1")


def sse(server, body: dict) -> list:
    """The chunks of a streamed chat completion, as raw JSON."""
    req = urllib.request.Request(base(server) + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        lines = [line.decode().strip() for line in resp]
    assert lines[-2:] == ["data: [DONE]", ""]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, **extra}


def test_default_stream_is_plain_openai(server, client):
    chunks = sse(server, chat(COUNT, stream=True, stream_options={"include_usage": True}))
    assert all("commits" not in c for c in chunks)
    assert set(chunks[1]) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    streamed = list(client.chat.completions.create(model="m", stream=True, **chat(COUNT)))
    assert all(not (c.model_extra or {}) for c in streamed)
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    whole = client.chat.completions.create(model="m", **chat(COUNT)).choices[0].message.content
    assert text == whole and text.startswith("63 64 65")
    with pytest.raises(urllib.error.HTTPError) as err:  # strict, like every field
        sse(server, chat(COUNT, stream=True, stream_options={"include_commits": "yes"}))
    assert err.value.code == 400 and json.load(err.value)["error"]["param"] == "stream_options.include_commits"


def test_commits_cover_the_answer_out_of_order(server, client):
    whole = client.chat.completions.create(model="m", **chat(COUNT))
    chunks = sse(server, chat(COUNT, stream=True, stream_options={"include_commits": True}))
    first = chunks[0]["commits"]
    assert first == {"step": 0, "phase": "", "slots": [], "blocks": [16, 16, 16]}
    steps, pieces, ids = {}, {}, {}
    for c in chunks[1:]:
        if "commits" not in c:
            continue
        commit = c["commits"]
        assert commit["phase"] in ("verify", "infill") and commit["step"] == len({*steps.values()}) + 1
        for slot in commit["slots"]:
            assert len(slot["positions"]) == len(slot["ids"]) == len(slot["pieces"])
            for p, t, piece in zip(slot["positions"], slot["ids"], slot["pieces"]):
                assert p not in steps  # each position is committed once
                steps[p], ids[p], pieces[p] = commit["step"], t, piece
    assert sorted(steps) == list(range(MAX_TOKENS))
    order = [steps[p] for p in range(MAX_TOKENS)]
    assert any(order[i] > order[j] for i in range(len(order)) for j in range(i + 1, len(order))), order
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(pieces[p] for p in range(MAX_TOKENS)) == whole.choices[0].message.content
    # the openai client reads them as an extra field, and the non-stream answer is unchanged
    extra = [c.model_extra["commits"] for c in client.chat.completions.create(
        model="m", stream=True, stream_options={"include_commits": True}, **chat(COUNT)) if c.model_extra]
    assert extra == [c["commits"] for c in chunks if "commits" in c]
    with pytest.raises(openai.BadRequestError) as refused:  # OpenAI's rule: stream_options only with stream
        client.chat.completions.create(model="m", stream_options={"include_commits": True}, **chat(COUNT))
    assert refused.value.body["param"] == "stream_options"
    # a text completion's stream carries them too; EOS is a null piece
    stream = client.completions.create(model="m", prompt="Who is Sven?", max_tokens=64, stream=True,
                                       stream_options={"include_commits": True})
    commits = [c.model_extra["commits"] for c in stream if c.model_extra]
    assert commits[0]["blocks"] == [16, 16, 16, 16]
    flat = [piece for c in commits for slot in c["slots"] for piece in slot["pieces"]]
    assert flat.count(None) <= 1


def test_page_files_and_settings(server):
    with urllib.request.urlopen(base(server) + "/") as resp:
        assert resp.headers["Content-Type"].startswith("text/html")
        scripts = re.findall(r'<script src="([^"]+)"></script>', resp.read().decode())
    assert scripts == ["web/slots.js", "web/settings.js", "web/app.js"]  # app.js last: it starts the page
    for script in scripts:
        with urllib.request.urlopen(base(server) + "/" + script) as resp:
            assert resp.headers["Content-Type"].startswith("text/javascript")
            assert b"innerHTML" not in resp.read()  # model text goes in as text only
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base(server) + "/web/secrets.txt")
    assert err.value.code == 404 and json.load(err.value)["error"]["code"] == "not_found"
    with urllib.request.urlopen(base(server) + "/web/settings.json") as resp:
        settings = json.load(resp)
    names = [f["name"] for f in settings["fields"]]
    assert names == [f.request for f in FIELDS if f.request and f.type in (int, float)]  # not logit_bias
    assert settings["model"] == server.config.model_id
    by_name = {f["name"]: f for f in settings["fields"]}
    assert by_name["slot_threshold"] == {"name": "slot_threshold", "type": "float",
                                         "default": server.config.decoding.slot_threshold,
                                         "help": next(f.help for f in FIELDS if f.name == "slot_threshold"),
                                         "openai": False, "ge": 0, "le": 1}
    assert by_name["max_tokens"]["default"] == server.config.decoding.gen_length


def test_page_chats_in_a_browser(chromium, server, client, tmp_path):
    """Two turns through the page (the first watched live at 300 ms a step), then a refused request."""
    from playwright.sync_api import sync_playwright

    second, tagged = "Who is Sven?", "<b>Who</b> is <i>Zoe</i>?"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 700})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base(server) + "/")
            page.fill("input[name=max_tokens]", str(MAX_TOKENS))
            page.fill("#pace", "300")
            page.fill("#input", COUNT)
            page.evaluate(GRID_AT_STEP_1)
            page.press("#input", "Enter")
            # step 1's frame, taken as the page draws it: a later slot already there, an earlier one still
            # masked (read after a poll instead, a loaded machine's 300 ms could run out in between)
            live = [tuple(c) for c in page.wait_for_function("window.gridAtStep1", polling=25).json_value()]
            target = os.environ.get("REFUSION_WEB_SCREENSHOT")  # docs/images/web-chat.png is taken so
            if target:
                panel, steps = page.locator("#slots").bounding_box(), page.locator("#steps").bounding_box()
                bottom = steps["y"] + steps["height"] + 12
                page.screenshot(path=target.replace(".png", "-live.png"), clip={**panel, "height": bottom - panel["y"]})
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
            first = page.text_content(".msg.assistant .body")
            cells = grid(page)
            page.fill("#pace", "0")
            page.fill("#input", second)
            page.click("#send")
            page.wait_for_selector(".msg.assistant:nth-child(4)[data-finish]", timeout=15000)
            answers = page.eval_on_selector_all(".msg.assistant .body", "els => els.map(e => e.textContent)")
            finishes = page.eval_on_selector_all(".msg.assistant", "els => els.map(e => e.dataset.finish)")
            sven = grid(page)
            meta = page.text_content(".msg.assistant:nth-child(4) .meta")
            page.click(".msg.assistant")  # the first answer's slots again
            again = grid(page)
            shot = tmp_path / "web-chat.png"
            page.screenshot(path=str(shot))
            if target:
                page.screenshot(path=target)
            # a request the server refuses: its one line shown, the text (tags and all) shown as text
            page.fill("input[name=slot_size]", "3")
            page.fill("input[name=block_length]", "16")
            page.fill("#input", tagged)
            page.click("#send")
            page.wait_for_selector(".msg.assistant:nth-child(6)[data-finish]", timeout=15000)
            refused = page.text_content(".msg.assistant:nth-child(6) .meta")
            shown = page.text_content(".msg.user:nth-child(5) .body")
            tags = page.eval_on_selector_all("#messages b, #messages i", "els => els.length")
        finally:
            browser.close()
    assert not errors
    want = client.chat.completions.create(model="m", **chat(COUNT)).choices[0].message.content
    assert first == want and answers[0] == want
    steps = [step for _, step, _ in live]
    assert 1 in steps and None in steps and steps.index(None) < len(steps) - steps[::-1].index(1) - 1, steps
    assert [pos for pos, _, _ in cells] == list(range(MAX_TOKENS))
    steps = [step for _, step, _ in cells]
    assert None not in steps
    assert any(steps[i] > steps[j] for i in range(len(steps)) for j in range(i + 1, len(steps))), steps
    assert "".join(text for _, _, text in cells).replace("\u00a0", " ").replace("␣", " ") == want
    # the second turn: the conversation so far went with it
    history = [{"role": "user", "content": COUNT}, {"role": "assistant", "content": want},
               {"role": "user", "content": second}]
    reply = client.chat.completions.create(model="m", messages=history, max_tokens=MAX_TOKENS)
    assert answers[1] == reply.choices[0].message.content and finishes == ["length", reply.choices[0].finish_reason]
    assert "cached" in meta and "tokens/forward" in meta
    assert sven and all(step is not None for _, step, _ in sven) and sven != cells
    assert again == cells
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert refused == "error: block_length 16 is not a multiple of slot_size 3"
    assert shown == tagged and tags == 0


def test_page_streams_through_each_api(chromium, server, client):
    """The same question through the Responses and the Messages API: the same answer as chat, and
    the slot view filled from each API's own stream (its commits events)."""
    from playwright.sync_api import sync_playwright

    want = client.chat.completions.create(model="m", **chat(COUNT)).choices[0].message.content
    got = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page, errors = chat_page(browser, server)
            for api in ("responses", "messages"):
                page.click("#new-chat")
                page.select_option("#api", api)
                page.fill("#input", COUNT)
                page.press("#input", "Enter")
                page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
                got[api] = (page.text_content(".msg.assistant .body"), grid(page),
                            page.get_attribute(".msg.assistant", "data-finish"))
        finally:
            browser.close()
    assert not errors
    for api, finish in (("responses", "incomplete"), ("messages", "max_tokens")):
        text, cells, finished = got[api]
        assert text == want and finished == finish, api
        assert [pos for pos, _, _ in cells] == list(range(MAX_TOKENS)) and None not in [s for _, s, _ in cells]
        assert "".join(t for _, _, t in cells).replace("\u00a0", " ").replace("␣", " ") == want


def test_page_json_schema_box(chromium, server):
    """A schema in the page's JSON-schema box: the answer (chat, Responses and Messages, which the page
    refused to send as having no structured output) is JSON valid under it; a box that is not JSON is one
    line in the status, and nothing is sent."""
    import jsonschema
    from playwright.sync_api import sync_playwright

    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {
        "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["pet", "age"], "additionalProperties": False}
    answers = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 700})
            page.goto(base(server) + "/")
            page.wait_for_selector("input[name=max_tokens]")
            page.fill("#json-schema", "{not json")
            page.fill("#input", COUNT)
            page.press("#input", "Enter")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('JSON schema')")
            refused = (page.text_content("#status"), page.locator(".msg").count(), page.input_value("#input"))
            page.fill("#json-schema", "null")  # JSON, but no schema: said so, not sent unconstrained
            page.press("#input", "Enter")
            page.wait_for_function("document.getElementById('status').textContent.includes('a schema is an object')")
            page.fill("#json-schema", json.dumps(schema))
            for api in ("chat", "responses", "messages"):
                page.click("#new-chat")
                page.select_option("#api", api)
                page.fill("#input", COUNT)
                page.press("#input", "Enter")
                page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
                answers.append(page.text_content(".msg.assistant .body"))
        finally:
            browser.close()
    assert refused[0].startswith("JSON schema: not valid JSON") and refused[1] == 0
    assert refused[2] == COUNT  # the message typed stays in the box
    for text in answers:
        jsonschema.validate(json.loads(text), schema)


def test_page_stop_new_chat_and_keys(chromium, server):
    """Stop ends a paced replay at once (not when its buffered steps run out); an answer stopped before any
    text leaves the conversation with its question (the Messages API refuses an empty assistant turn);
    Enter that confirms an input method's candidate does not send."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page, errors = chat_page(browser, server)
            page.fill("#pace", "2000")
            page.fill("#input", COUNT)
            page.press("#input", "Enter")
            page.wait_for_function("document.getElementById('slot-caption').textContent.startsWith('step 1 ')",
                                   polling=25)
            t0 = time.monotonic()
            page.click("#stop")
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
            stop = (time.monotonic() - t0, page.get_attribute(".msg.assistant", "data-finish"),
                    page.text_content("#status"))
            kept = page.evaluate("""() => {
                const asked = [{role: "user", content: "q"}];
                keep(asked, "");  // stopped before any text: the question leaves too
                const answered = [{role: "user", content: "q"}];
                keep(answered, "a");
                return [asked.length, answered.length];
            }""")
            page.fill("#pace", "0")
            page.fill("#input", "Who is Sven?")
            page.dispatch_event("#input", "keydown", {"key": "Enter", "isComposing": True, "keyCode": 229})
            composing = page.locator(".msg").count()
        finally:
            browser.close()
    assert not errors
    assert stop[0] < 1.5 and stop[1] == "stopped" and stop[2] == "stopped", stop
    assert kept == [0, 2] and composing == 2  # the IME's Enter sent nothing


def test_page_works_behind_a_path_prefix(chromium, server, client):
    """Behind a reverse proxy that serves the server under ``/refusion/`` (nginx's ``location /refusion/``),
    the page loads its files and settings and streams its answer through the prefix: every path it asks
    for is relative to the page. The proxy here is the browser's own routing; a request outside the prefix
    is answered 404, as the proxy's site would. The proxy passes the server its own address as ``Host``
    (nginx's default), so the server is told the site's origin with ``--allowed-origins``, as the docs say."""
    from playwright.sync_api import sync_playwright

    want = client.chat.completions.create(model="m", **chat(COUNT)).choices[0].message.content
    site, outside = "http://proxy.test", []
    behind = RefusionServer(None, port=0, allowed_origins=(site,)).start()

    def proxy(route):
        url = route.request.url
        if not url.startswith(site + "/refusion/"):
            outside.append(url)
            return route.fulfill(status=404, body="not here")
        route.fulfill(response=route.fetch(url=base(behind) + url[len(site) + len("/refusion"):]))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page, errors = chat_page(browser, behind, url=site + "/refusion/", route=(site + "/**", proxy))
            page.fill("#input", COUNT)
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
            text = page.text_content(".msg.assistant .body")
        finally:
            browser.close()
            behind.close()
    assert not errors and outside == [] and text == want


# The page's fetch of an API, answered in the page: each call takes the next planned stream (its text, and
# whether it ends), the request bodies are kept (``fake.bodies``), and ``fake.push(text)`` / ``fake.end()``
# feed the open one; ``fake.fail()`` breaks it off as a server killed does. Stop errors it as a real fetch's
# body does.
FAKE_FETCH = """plan => {
    const real = window.fetch, fake = window.fake = {bodies: [], plan};
    window.fetch = (path, options = {}) => {
        if (!String(path).startsWith("v1/")) return real(path, options);
        fake.bodies.push(JSON.parse(options.body));
        const [text, ends] = fake.plan.shift();
        const body = new ReadableStream({start(c) {
            fake.push = (t) => c.enqueue(new TextEncoder().encode(t));
            fake.end = () => c.close();
            fake.fail = () => c.error(new TypeError("network error"));
            options.signal.addEventListener("abort", () => c.error(new DOMException("stopped", "AbortError")));
            fake.push(text);
            if (ends) fake.end();
        }});
        return Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}));
    };
}"""


# how many elements the page creates from now on (window.created)
COUNT_ELEMENTS = """() => {
    const create = document.createElement.bind(document);
    window.created = 0;
    document.createElement = (...args) => { window.created++; return create(...args); };
}"""


def chunks_sse(n: int, start: int = 0, blocks: bool = True, finish: str | None = None) -> str:
    """A chat stream's events, one token (``x``) a step at positions ``start`` .. ``start + n - 1``: the
    first (with blocks) announces ``start + n`` positions; with ``finish``, its end (and ``[DONE]``)."""
    def event(content, commits):
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content},
                                                   "finish_reason": None}], "commits": commits}) + "\n\n"
    out = [event("", {"step": 0, "phase": "", "slots": [], "blocks": [16] * ((start + n) // 16)})] if blocks else []
    out += [event("x", {"step": p + 1, "phase": "verify", "slots": [{"positions": [p], "ids": [87], "pieces": ["x"]}]})
            for p in range(start, start + n)]
    if finish:
        out.append("data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                   + "\n\ndata: [DONE]\n\n")
    return "".join(out)


def delta(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + "\n\n"


def test_page_stream_edges(chromium, server):
    """A stream cut before its finish is shown as an error, not an answer, and leaves the conversation
    with its question (it was shown as a finished answer and sent again with the next turn). A message
    is sent as typed, but for blank lines around it (a pasted block lost its first indent). The chat
    follows a streamed answer down only while it is read at its bottom (it jumped there on every read).
    The keyboard: the box keeps it during a stream, Escape stops, Enter on an answer shows its slots."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page, errors = chat_page(browser, server)
            page.evaluate(FAKE_FETCH, [[chunks_sse(20), True], [chunks_sse(16, finish="length"), True],
                                       [delta("a\n" * 60), False], [delta("d"), False]])
            page.fill("#input", "\n    def f():\n        pass\n\n")  # pasted code: its indent is sent
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=5000)
            cut = (page.get_attribute(".msg.assistant", "data-finish"), page.text_content(".msg.assistant .meta"),
                   page.text_content("#status"))
            page.fill("#input", "two")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant:nth-child(4)[data-finish]", timeout=5000)
            finished = (page.get_attribute(".msg.assistant:nth-child(4)", "data-finish"), page.text_content("#status"))
            bodies = page.evaluate("fake.bodies")
            page.fill("#input", "three")
            page.press("#input", "Enter")
            last, scroll = ".msg.assistant:nth-child(6) .body", "document.getElementById('messages').scrollTop"
            page.wait_for_function(f"document.querySelector('{last}').textContent.length == 120 && {scroll} > 0",
                                   timeout=5000)
            page.evaluate(f"{scroll} = 0")  # scrolled up, to read the first turn
            page.evaluate("t => fake.push(t)", delta("b\n" * 20))
            page.wait_for_function(f"document.querySelector('{last}').textContent.includes('b')", timeout=5000)
            scrolled_up = page.evaluate(scroll)
            page.evaluate(f"{scroll} = 1e6")  # back at the bottom: followed again
            page.evaluate("t => fake.push(t)", delta("c\n" * 20))
            page.wait_for_function(f"document.querySelector('{last}').textContent.includes('c')", timeout=5000)
            at_bottom = page.evaluate("(l => l.scrollHeight - l.scrollTop - l.clientHeight)"
                                      "(document.getElementById('messages'))")
            focused = page.evaluate("document.activeElement.id")  # the box keeps the keyboard
            page.keyboard.press("Escape")  # stops
            page.wait_for_selector("#send", timeout=5000)
            escaped = page.get_attribute(".msg.assistant:nth-child(6)", "data-finish")
            page.focus(".msg.assistant")
            page.keyboard.press("Enter")  # the first answer's slots, by keyboard
            shown = page.eval_on_selector(".msg.assistant", "m => m.classList.contains('shown')")
            labels = page.evaluate("""() => [document.getElementById('system').labels[0].textContent,
                document.getElementById('json-schema').labels[0].textContent,
                document.getElementById('status').getAttribute('role')]""")
            page.fill("#input", "four")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant:nth-child(8) .body:text('d')", timeout=5000)
            page.click("#new-chat")  # during the stream: a new, empty chat that is ready
            page.wait_for_selector("#send", timeout=5000)
            renewed = (page.text_content("#status"), page.locator(".msg").count())
        finally:
            browser.close()
    assert not errors
    assert cut == ("error", "error: the connection closed before the answer finished", "error"), cut
    assert finished == ("length", "ready")
    assert bodies[0]["messages"] == [{"role": "user", "content": "    def f():\n        pass"}]
    assert bodies[1]["messages"] == [{"role": "user", "content": "two"}]
    assert scrolled_up == 0 and at_bottom < 2, (scrolled_up, at_bottom)
    assert (focused, escaped, shown) == ("input", "stopped", True)
    assert labels == ["System prompt", "JSON schema", "status"]
    assert renewed == ("ready", 0), renewed  # it said "stopped" (the aborted turn's status)


def test_page_long_answer_stays_responsive(chromium, server):
    """A long answer's burst of events (2,048 one-token steps read at once) is drawn with work that grows
    with its length, not its square, and Stop, clicked while it is being handled, ends it: the page draws
    once a frame, only what changed (it redrew every cell on every commit: seconds of frozen page; a
    rebuild every frame creates 16 elements a token here). The measure is the elements the page creates,
    not wall time, which a loaded machine stretches (a 2-second bound on Stop failed under CI's load)."""
    from playwright.sync_api import sync_playwright

    n, burst = 2048, chunks_sse(2048)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page, errors = chat_page(browser, server)
            page.evaluate(FAKE_FETCH, [[burst, False], [burst, False]])
            page.fill("#input", "Count.")
            page.press("#input", "Enter", timeout=5000)
            page.click("#stop", timeout=5000)
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=10000)
            stop = page.get_attribute(".msg.assistant", "data-finish")
            page.fill("#input", "Count.")
            page.evaluate(COUNT_ELEMENTS)
            page.press("#input", "Enter", timeout=5000)
            page.wait_for_function(f"document.getElementById('slot-caption').textContent.endsWith("
                                   f"'{n} of {n} committed')", timeout=10000, polling=50)
            created = page.evaluate("window.created")
            cells = page.locator("#grid .cell:not(.masked)").count()
            text = page.text_content(".msg.assistant:nth-child(4) .body")
            page.click("#stop", timeout=5000)
            page.wait_for_selector(".msg.assistant:nth-child(4)[data-finish]", timeout=5000)
        finally:
            browser.close()
    assert not errors
    assert stop == "stopped", stop
    assert created < 12 * n and cells == n and text == "x" * n, (created, cells)


def chat_page(browser, server, url=None, route=None):
    """The chat page, loaded (from ``url``: the server's own by default; ``route``: (pattern, handler) the
    browser answers those requests with), its budget set to MAX_TOKENS: (the page, the JS errors it raises)."""
    page = browser.new_page(viewport={"width": 1200, "height": 700})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    if route is not None:
        page.route(*route)
    page.goto(url or base(server) + "/")
    page.wait_for_selector("input[name=max_tokens]")
    page.fill("input[name=max_tokens]", str(MAX_TOKENS))
    return page, errors


CELLS = ("els => els.map(e => [+e.dataset.pos, e.dataset.step ? +e.dataset.step : null, "
         "e.querySelector('.t').textContent])")

# The cells as the caption first says step 1, in ``window.gridAtStep1``: a mutation observer's callback runs
# right after the drawing that set the caption (grid first, then caption), before the page does anything else.
GRID_AT_STEP_1 = """() => {
    const caption = document.getElementById('slot-caption');
    const watch = new MutationObserver(() => {
        if (!caption.textContent.startsWith('step 1 ')) return;
        window.gridAtStep1 = (%s)([...document.querySelectorAll('#grid .cell')]);
        watch.disconnect();
    });
    watch.observe(caption, {childList: true, characterData: true, subtree: true});
}""" % CELLS


def grid(page) -> list:
    """The slot view's cells in page order: (position, step or None, text)."""
    return [tuple(c) for c in page.eval_on_selector_all("#grid .cell", CELLS)]



def test_without_a_browser_the_page_test_says_so_in_one_line_or_fails_under_ci(tmp_path):
    """The README's test command on a machine without chromium: the browser test
    is skipped and the run ends with one line saying how to get it; under CI
    (``CI=true``) the same run fails. Two small pytest runs of the plugin
    (tests/browser.py) with no browser on the PATH."""
    import inspect

    from tests.browser import BROWSERS, NO_BROWSER

    assert "chromium" in inspect.signature(test_page_chats_in_a_browser).parameters
    (tmp_path / "test_page.py").write_text("def test_page(chromium):\n    pass\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not any(os.path.exists(os.path.join(d, b)) for b in BROWSERS))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    runs = {ci: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "-p", "tests.browser", "--rootdir", str(tmp_path), str(tmp_path)],
                                 cwd=root, env={**env, "PATH": path, **({"CI": ci} if ci else {})},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for ci in ("", "true")}
    out = {ci: proc.communicate(timeout=120)[0] for ci, proc in runs.items()}
    assert runs[""].returncode == 0, out[""]
    assert out[""].splitlines().count(NO_BROWSER) == 1 and "1 skipped" in out[""], out[""]
    assert runs["true"].returncode == 1, out["true"]
    assert "no chromium to drive under CI" in out["true"] and "1 failed" in out["true"], out["true"]
    assert NO_BROWSER not in out["true"]
