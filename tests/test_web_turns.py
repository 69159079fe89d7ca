"""The web chat page's turns at their edges, in headless Chromium (tests/browser.py's ``chromium``, as in
tests/test_web.py, whose helpers these tests share): where the chat is scrolled when an answer ends, fails or
is stopped; what the keyboard does during an answer; what a failed turn leaves to retry; the settings kept.
Most turns are answered in the page (tests/test_web.py's ``FAKE_FETCH``), so each stream's timing is the
test's; one in-process server on the bundled demo model serves the page and the real answers.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import openai
import pytest

from refusion_mlx.serve.http_server import RefusionServer
from tests.test_web import COUNT, FAKE_FETCH, MAX_TOKENS, chat_page, delta

# the chat's last message: how far its end lies below what the chat shows (0 or less: in view)
BELOW = """() => { const list = document.getElementById('messages');
    return list.lastElementChild.getBoundingClientRect().bottom - list.getBoundingClientRect().bottom; }"""
SCROLL = "document.getElementById('messages').scrollTop"


@pytest.fixture(scope="module")
def server():
    with RefusionServer(None, port=0) as s:
        yield s


def finish_sse(finish: str = "length", tokens: int = 40) -> str:
    """A chat stream's end: the finish, the usage chunk (the answer's line of statistics), ``[DONE]``."""
    chunks = [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
              {"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 9, "tokens_per_forward": 1.0,
                                        "prompt_tokens_details": {"cached_tokens": 0}}}]
    return "".join("data: " + json.dumps(c) + "\n\n" for c in chunks) + "data: [DONE]\n\n"


@contextmanager
def chat_in_browser(chromium, server):
    """The chat page (tests/test_web.py's ``chat_page``) in a headless browser of its own, with no storage kept
    from another test; it raised no JavaScript error by the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page, errors = chat_page(browser, server)
            yield page
        finally:
            browser.close()
    assert not errors


def streamed(page, n: int, text: str) -> None:
    """Waits until the ``n``-th message (an answer) shows ``text`` and the chat followed it down."""
    page.wait_for_function(f"document.querySelector('.msg:nth-child({n}) .body').textContent === {json.dumps(text)}"
                           f" && {SCROLL} > 0", timeout=5000)


def test_the_end_of_each_answer_stays_in_view(chromium, server):
    """The line under an answer (its statistics, its error, "stopped") comes into view with it while the chat is
    read at its bottom: the statistics were drawn before the text's last frame, which then measured the chat as
    scrolled up and stayed; an error or a stop never scrolled. A reader scrolled up is left where they are."""
    text = "a\n" * 39 + "a"  # no line of its own for the cursor, which leaves with the stream
    with chat_in_browser(chromium, server) as page:
        page.evaluate(FAKE_FETCH, [[delta(text), False]] * 4)
        below = []
        for n, end in ((2, finish_sse()), (4, 'data: {"error": {"message": "the model failed"}}\n\n'),
                       (6, None), (8, finish_sse())):
            page.fill("#input", f"turn {n // 2}")
            page.press("#input", "Enter")
            streamed(page, n, text)
            if n == 8:
                page.evaluate(f"{SCROLL} = 0")  # scrolled up, to read an earlier turn
            if end is None:
                page.keyboard.press("Escape")
            else:
                page.evaluate("t => { fake.push(t); fake.end(); }", end)
            page.wait_for_selector(f".msg.assistant:nth-child({n})[data-finish]", timeout=5000)
            below.append((page.text_content(f".msg:nth-child({n}) .meta"), page.evaluate(BELOW)))
        scrolled_up = page.evaluate(SCROLL)
    metas = [meta.split(" · ")[-1] for meta, _ in below]
    assert metas == ["finish: length", "error: the model failed", "stopped", "finish: length"], below
    assert all(px <= 0 for _, px in below[:3]), below
    assert scrolled_up == 0 and below[3][1] > 0, below


def test_enter_during_an_answer_sends_nothing_and_stops_nothing(chromium, server):
    """A second Enter (a double tap, a key's auto-repeat) while an answer is pending leaves it alone: the keyboard
    went to Stop, where Enter clicked it and the question was dropped. The box stays open: the next question is
    typed during the answer and sent by Enter once it has ended."""
    with chat_in_browser(chromium, server) as page:
        page.evaluate(FAKE_FETCH, [["", False], ["", False]])
        page.fill("#input", "one")
        page.press("#input", "Enter")
        page.keyboard.press("Enter")  # at once: nothing is on screen yet
        page.evaluate("t => fake.push(t)", delta("a"))
        page.wait_for_function("document.querySelector('.msg.assistant .body').textContent === 'a'",
                               timeout=5000)
        page.keyboard.type("two")
        page.keyboard.down("Enter")  # held: the key repeats
        page.keyboard.down("Enter")
        page.keyboard.up("Enter")
        during = (page.locator(".msg").count(), page.input_value("#input"), page.evaluate("fake.bodies.length"),
                  page.evaluate("document.activeElement.id"))
        page.evaluate("t => { fake.push(t); fake.end(); }", finish_sse(tokens=1))
        page.wait_for_selector(".msg.assistant[data-finish]", timeout=5000)
        first = page.get_attribute(".msg.assistant", "data-finish")
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg:nth-child(4)", timeout=5000)
        sent = page.evaluate("fake.bodies[1].messages")
    assert during == (2, "two", 1, "input"), during
    assert first == "length"
    assert sent == [{"role": "user", "content": "one"}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "two"}]


def test_the_keyboard_stays_where_the_user_is_when_an_answer_ends(chromium, server):
    """Typing in another box (the system prompt, a setting) while an answer streams goes on there when it ends:
    the page put the keyboard back in the message box after every answer (the text typed was split across two
    boxes; a phone's keyboard popped up). It moves only from Stop, which hides, to the box."""
    with chat_in_browser(chromium, server) as page:
        page.evaluate(FAKE_FETCH, [[delta("a"), False], [delta("b"), False]])
        page.fill("#input", "one")
        page.press("#input", "Enter")
        page.click("#system")
        page.keyboard.type("Be ")
        page.evaluate("t => { fake.push(t); fake.end(); }", finish_sse(tokens=1))
        page.wait_for_selector(".msg.assistant[data-finish]", timeout=5000)
        page.keyboard.type("brief.")
        typed = (page.input_value("#system"), page.input_value("#input"))
        page.fill("#input", "two")
        page.press("#input", "Enter")
        page.click("#stop")
        page.wait_for_selector(".msg.assistant:nth-child(4)[data-finish]", timeout=5000)
        after_stop = page.evaluate("document.activeElement.id")
    assert typed == ("Be brief.", ""), typed
    assert after_stop == "input"


def test_a_failed_question_goes_back_to_the_box(chromium, server):
    """A refused or failed turn can be sent again: its question, which leaves the conversation, is marked so on
    screen and put back in the message box (unless the next one is being typed there), where Enter sends it
    once (the box was emptied, so "retry later" meant typing it again). A stopped turn's box stays empty."""
    question = "Who is Sven?"
    with chat_in_browser(chromium, server) as page:
        sent = []
        page.on("request", lambda r: sent.append(json.loads(r.post_data)) if "/v1/" in r.url else None)
        page.fill("input[name=slot_size]", "3")  # refused: block_length 16 is not a multiple of it
        page.fill("input[name=block_length]", "16")
        page.fill("#input", question)
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
        refused = (page.text_content(".msg.assistant .meta"), page.input_value("#input"),
                   page.eval_on_selector(".msg.user", "m => [m.className, m.querySelector('.meta').textContent]"))
        page.fill("input[name=slot_size]", "")
        page.fill("input[name=block_length]", "")
        page.press("#input", "Enter")  # the retry
        page.wait_for_selector(".msg.assistant:nth-child(4)[data-finish]", timeout=15000)
        retried = (page.get_attribute(".msg.assistant:nth-child(4)", "data-finish"),
                   page.get_attribute(".msg.user:nth-child(3)", "class"))
        page.evaluate(FAKE_FETCH, [[delta("a"), False], [delta("b"), False]])
        page.fill("#input", "fails")
        page.press("#input", "Enter")
        page.keyboard.type("next")  # typed during the answer: it stays
        page.evaluate("t => { fake.push(t); fake.end(); }", 'data: {"error": {"message": "the model failed"}}\n\n')
        page.wait_for_selector(".msg.assistant:nth-child(6)[data-finish]", timeout=5000)
        kept = page.input_value("#input")
        page.fill("#input", "stopped")
        page.press("#input", "Enter")
        page.keyboard.press("Escape")
        page.wait_for_selector(".msg.assistant:nth-child(8)[data-finish]", timeout=5000)
        stopped = page.input_value("#input")
    assert refused == ("error: block_length 16 is not a multiple of slot_size 3", question,
                       ["msg user left-out", "left out of the conversation"]), refused
    assert [body["messages"] for body in sent] == [[{"role": "user", "content": question}]] * 2
    assert retried[0] in ("stop", "length") and retried[1] == "msg user", retried
    assert kept == "next" and stopped == ""


def test_a_stream_broken_off_says_so(chromium, server):
    """A server killed during an answer breaks the stream off (the body's read fails): the page says what
    docs/serving.md says, "the connection closed before the answer finished", not the browser's "network error"."""
    with chat_in_browser(chromium, server) as page:
        page.evaluate(FAKE_FETCH, [[delta("a"), False]])
        page.fill("#input", "one")
        page.press("#input", "Enter")
        page.wait_for_function("document.querySelector('.msg.assistant .body').textContent === 'a'",
                               timeout=5000)
        page.evaluate("fake.fail()")
        page.wait_for_selector(".msg.assistant[data-finish]", timeout=5000)
        cut = (page.text_content(".msg.assistant .meta"), page.text_content("#status"))
    assert cut == ("error: the connection closed before the answer finished", "error"), cut


def test_a_64_bit_seed_is_sent_as_typed(chromium, server):
    """A seed past a double's exact integers goes to the server as typed: 9007199254740993 went as ...992, and
    2**64 - 1 (the bound /web/settings.json gives) as 2**64, which the server refused. The answer is the API's
    for that seed; past the bound, the server's one line."""
    top = 2**64 - 1
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    want = client.chat.completions.create(model="m", messages=[{"role": "user", "content": COUNT}], seed=top,
                                          temperature=1.5, max_tokens=MAX_TOKENS).choices[0].message.content
    seeds = [top, 2**53 + 1, -(2**63), top + 1]
    with chat_in_browser(chromium, server) as page:
        sent = []
        page.on("request", lambda r: sent.append(r.post_data) if "/v1/" in r.url else None)
        page.fill("input[name=temperature]", "1.5")
        turns = []
        for seed in seeds:
            page.click("#new-chat")
            page.fill("input[name=seed]", str(seed))
            page.fill("#input", COUNT)
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.assistant[data-finish]", timeout=15000)
            turns.append((page.text_content(".msg.assistant .body"), page.text_content(".msg.assistant .meta")))
    assert [json.loads(body)["seed"] for body in sent] == seeds
    assert turns[0][0] == want and "finish: length" in turns[0][1], turns[0]
    assert all("error" not in meta for _, meta in turns[:3]), turns
    assert turns[3][1] == "error: seed: Input should be less than or equal to 18446744073709551615", turns[3]


@pytest.mark.parametrize("stored", ["null", "{bad", "[1]", '{"max_tokens": {"a": 1}, "seed": "7"}'])
def test_unreadable_stored_settings_are_passed_over(chromium, server, stored):
    """Settings in local storage the page cannot read (``null``, not JSON, a hand's edit) leave the server's
    defaults and the page ready, and the next edit is kept: the page said "cannot read the settings: Cannot read
    properties of null" and never saved an edit again. What can be read is used."""
    with chat_in_browser(chromium, server) as page:
        page.evaluate("s => localStorage.setItem('refusion-mlx-settings', s)", stored)
        page.reload()
        page.wait_for_selector("input[name=max_tokens]")
        page.wait_for_function("document.getElementById('status').textContent !== 'loading…'")
        loaded = (page.text_content("#status"), page.input_value("input[name=max_tokens]"),
                  page.input_value("input[name=seed]"))
        page.fill("input[name=max_tokens]", "20")
        kept = page.evaluate("JSON.parse(localStorage.getItem('refusion-mlx-settings'))")
    assert loaded == ("ready", "", "7" if "seed" in stored else ""), loaded
    assert kept["max_tokens"] == "20", kept


def test_every_setting_is_kept_and_reset(chromium, server):
    """The system prompt, the JSON schema, the endpoint and ms per step are kept across a reload, as the decoding
    fields are (a reload lost them), and Reset clears them all, as its title says (it left them in place)."""
    panel = {"#system": "Be brief.", "#json-schema": '{"type": "object"}', "#pace": "300",
             "input[name=max_tokens]": "20"}
    read = "sel => document.querySelector(sel).value"
    with chat_in_browser(chromium, server) as page:
        for selector, value in panel.items():
            page.fill(selector, value)
        page.select_option("#api", "responses")
        page.reload()
        page.wait_for_selector("input[name=max_tokens]")
        kept = {selector: page.evaluate(read, selector) for selector in [*panel, "#api"]}
        page.click("#reset")
        reset = {selector: page.evaluate(read, selector) for selector in [*panel, "#api"]}
        page.reload()
        page.wait_for_selector("input[name=max_tokens]")
        reloaded = {selector: page.evaluate(read, selector) for selector in [*panel, "#api"]}
    assert kept == {**panel, "#api": "responses"}, kept
    defaults = {"#system": "", "#json-schema": "", "#pace": "0", "input[name=max_tokens]": "", "#api": "chat"}
    assert reset == reloaded == defaults, (reset, reloaded)
