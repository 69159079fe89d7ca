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

from tests.helpers import FIXTURE_MODEL
import pytest

from refusion_mlx.serve.http_server import RefusionServer, TextShaper

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
TURNS = ["Who is Sven?", "Count from 17 to 38.", "Reverse the words: sugar forest orange"]
SYSTEM = ("You are a careful assistant for a small bakery in Hanoi. Answer briefly, in plain words, and never "
          "invent prices, opening hours or names that the customer did not give you.")
USERS = ["Who is Sven?", "Count from 17 to 38.", "Sort these numbers: 67, 4, 77, 15, 70", "Tell me about Zoe.",
         "Reverse the words: sugar forest orange", "Write the multiplication table of 3 up to 5.",
         "Name three colours.", "Add 2 and 3."]
LONG = {"prompt": "1 2 3 4 5 6 7 8 9 10", "max_tokens": 1024, "slot_threshold": 1.0,
        "token_threshold": 1.0}  # a raw completion the demo model runs for 20+ seconds


@pytest.fixture(scope="module", autouse=True)
def cli_servers():
    """Three ``python -m refusion_mlx.server`` processes, started first so that their
    startup overlaps the in-process tests; the CLI tests stop them with a signal."""
    procs = {sig: start_cli() for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def expected():
    """Each prompt's answer from the Python API, computed before the server's engine starts
    (so MLX is never used from two threads at once in this process)."""
    from refusion_mlx.decode.params import make_params
    from refusion_mlx.generate import chat_prompt, stream_generate
    from refusion_mlx.models.loading import load
    from refusion_mlx.decode.conversation import ChatSession

    model, tok = load(FIXTURE_MODEL)
    out = {}
    for p in PROMPTS:
        for n in (MAX_TOKENS, SHORT):
            out[p, n] = "".join(r.text for r in stream_generate(model, tok, chat_prompt(tok, p), max_tokens=n))
        out[p] = out[p, MAX_TOKENS]
        out[p, "ids"] = len(chat_prompt(tok, p))
    # a conversation turn by turn, continuing the cache as the terminal chat does
    session = ChatSession(model, tok, make_params(max_tokens=MAX_TOKENS))
    out["turns"] = [session.send(t) for t in TURNS]
    out["turns_prefill"] = [t.prefill_tokens for t in session.turns]
    ids = [chat_prompt(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]) for u in USERS]
    out["system_ids"] = ids
    out["system_answers"] = ["".join(r.text for r in stream_generate(model, tok, i, max_tokens=SHORT)) for i in ids]
    return out


@pytest.fixture(scope="module")
def server(expected):
    srv = RefusionServer(str(FIXTURE_MODEL), model_id="tiny-refusion", port=0).start()
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
        assert r.choices[0].message.refusal is None and r.choices[0].message.annotations == []  # OpenAI's fields
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == expected[p, "ids"]
        assert 0 < r.usage.completion_tokens <= MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        # ReFusion's own usage fields: the default layout (blocks of 16 tokens) and the forwards taken
        usage = r.usage.model_dump()
        assert usage["layout"] == {"block_length": 16, "blocks": 3, "slots_per_block": 4}
        assert usage["forwards"] > 0 and usage["tokens_per_forward"] > 0


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
    assert usage is None  # not asked for (OpenAI's and mlx-lm's rule)


@pytest.mark.parametrize("n", [1, 2])
def test_stream_options_include_usage(client, expected, server, n):
    chunks = list(chat(client, "Who is Sven?", stream=True, stream_options={"include_usage": True}, n=n))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens == expected["Who is Sven?", "ids"]
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count("stop") == n
    assert all(c.usage is None for c in chunks[:-1])
    unasked = list(chat(client, "Who is Sven?", stream=True, stream_options={"include_usage": False}, n=n))
    assert all(c.usage is None and c.choices for c in unasked)
    for path, body in ((CHAT, user(max_tokens=8, n=n)), ("/v1/completions", {"prompt": "1 2 3", "max_tokens": 8,
                                                                              "n": n})):
        raw_chunks = [json.loads(line[6:]) for line in raw(server, "POST", path, {
            **body, "stream": True, "stream_options": {"include_usage": True}})[1].decode().splitlines()
            if line.startswith("data: {")]
        assert all("usage" in c and c["usage"] is None for c in raw_chunks[:-1]), raw_chunks  # as OpenAI sends them
        assert raw_chunks[-1]["usage"]["completion_tokens"] > 0
        unasked = [line for line in raw(server, "POST", path, {**body, "stream": True})[1].decode().splitlines()
                   if line.startswith("data: {")]
        assert unasked and all('"usage"' not in line for line in unasked)


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


def test_an_answer_cut_by_a_stop_string_keeps_refusions_usage(client, server):
    r = chat(client, "Count from 17 to 60.", stop=["21"])  # several steps: cut before the decoder ends
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content.startswith("17 ")
    extra = r.usage.model_extra
    assert extra["layout"]["block_length"] > 0 and extra["forwards"] >= 2 and extra["tokens_per_forward"] > 0
    # completion_tokens: the answer's tokens up to the stop string's end, not the rest of the step decoded
    spelled = json.loads(raw(server, "POST", "/tokenize", {"prompt": r.choices[0].message.content + "21",
                                                          "add_special_tokens": False})[1])["count"]
    assert r.usage.completion_tokens == spelled


def test_refusion_extra_fields(client):
    r = chat(client, "Count from 17 to 38.", extra_body={"slot_size": 8, "block_length": 32,
                                                          "slot_threshold": 0.5, "token_threshold": 0.2})
    assert r.choices[0].message.content.startswith("17 18 19")
    hot = chat(client, "Who is Sven?", temperature=0.8, seed=3, top_p=0.9)
    again = chat(client, "Who is Sven?", temperature=0.8, seed=3, top_p=0.9)
    assert hot.choices[0].message.content == again.choices[0].message.content  # seeded


def test_twenty_concurrent_streams(client, expected, server):
    """20 streaming clients at once: every stream completes with the right text."""
    # one SDK client for the 20 streams, each its own connection of the client's pool (an SDK client takes
    # 50 ms of CPU to make, its SSL context: a second of the test's own)
    def run(i):
        p = PROMPTS[i % len(PROMPTS)]
        t0 = time.perf_counter()
        text, finish, first = "", None, None
        for chunk in chat(client, p, stream=True, max_tokens=SHORT):
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
# FastAPI: the schema, sampling fields, validation errors


def test_docs_and_openapi(server):
    status, page = raw(server, "GET", "/docs")
    assert status == 200 and b"swagger" in page.lower()
    status, schema = raw(server, "GET", "/openapi.json")
    schema = json.loads(schema)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])
    fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "top_p", "top_k", "min_p", "slot_size", "block_length"} <= set(fields)
    assert raw(server, "GET", "/v1/models/tiny-refusion")[0] == 200


@pytest.mark.parametrize("fields,param", [
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_p": 0}, "top_p"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": "low"}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": [17]}, "logit_bias"),
    ({"logit_bias": {"seventeen": 5}}, "logit_bias"), ({"logit_bias": {"17": 101}}, "logit_bias"),
    ({"logit_bias": {"17": "up"}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"stop": ["a"] * 17}, "stop"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"repetition_penalty": -1}, "repetition_penalty"), ({"xtc_probability": 1.5}, "xtc_probability"),
    ({"xtc_threshold": 0.6}, "xtc_threshold"),
    ({"adapters": "my-adapters"}, "adapters"),  # mlx_lm.server's: refused, never silently ignored
    ({"tool_choice": 5}, "tool_choice"), ({"stop": 5}, "stop"),  # a union's member is not named in the field
    ({"store": "yes"}, "store"), ({"metadata": "x"}, "metadata"), ({"service_tier": "gold"}, "service_tier"),
    ({"reasoning_effort": "ultra"}, "reasoning_effort"), ({"verbosity": 3}, "verbosity"),  # OpenAI's 400s
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs"),
])
def test_pydantic_errors_are_400_in_the_openai_envelope(server, fields, param):
    err = check_error(*raw(server, "POST", CHAT, user(**fields)), 400, param)
    assert err["message"].startswith(param + ": ") and "\n" not in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [
    ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["yes", "no"]),
    ("guided_grammar", 'root ::= "a"'), ("guided_decoding_backend", "xgrammar"), ("guided_whitespace_pattern", ""),
    ("structured_outputs", {"choice": ["a"]}), ("grammar", 'root ::= "a"'), ("json_schema", {"type": "object"}),
])
def test_other_servers_constraint_fields_are_refused_not_ignored(server, field, value):
    """vLLM's guided_* and llama.cpp's grammar / json_schema were ignored: a 200 whose answer the client took for
    constrained. A 400 naming the field and what to send instead; null still changes nothing."""
    for path, body in ((CHAT, user(**{field: value})), ("/v1/completions", {"prompt": "x", field: value})):
        err = check_error(*raw(server, "POST", path, body), 400, field)
        assert err["message"].startswith(f"{field}: not supported by this server: send chat completions' "
                                         'response_format {"type": "json_schema"') and "\n" not in err["message"]
    assert raw(server, "POST", CHAT, user(max_tokens=2, **{field: None}))[0] == 200


def test_openai_fields_that_change_nothing_are_taken(client, expected):
    p = "Who is Sven?"
    r = chat(client, p, store=False, metadata={"app": "x"}, service_tier="auto", reasoning_effort="low",
             extra_body={"verbosity": "low"})
    assert r.choices[0].message.content == expected[p]


def test_chat_template_kwargs_reach_the_template_over_the_servers_own(client, server):
    """mlx_lm.server's and vLLM's ``chat_template_kwargs`` (a Qwen3 client's ``enable_thinking: false``)
    were ignored: the prompt was the thinking one. They reach the template, over --chat-template-config."""
    def prompt_tokens(**kw):
        return chat(client, "Who is Sven?", max_tokens=2, **kw).usage.prompt_tokens

    from refusion_mlx.generate import chat_prompt

    thinking = prompt_tokens()
    quiet = len(chat_prompt(server.engine.tokenizer, "Who is Sven?", template_kwargs={"enable_thinking": False}))
    assert quiet > thinking
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == quiet
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == thinking
    config = server.engine.config  # the server's own, under a request's
    object.__setattr__(config, "chat_template_config", {"enable_thinking": False})
    try:
        assert prompt_tokens() == quiet
        assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == thinking
    finally:
        object.__setattr__(config, "chat_template_config", None)


def test_a_replayed_refusal_is_the_assistants_text(client, server):
    """A conversation replayed from OpenAI holds refusals: ``content: null`` with ``refusal``, or a refusal
    part. Each is the assistant's text, as its same words as content would be (both were 400s)."""
    def answer(assistant):
        messages = [{"role": "user", "content": "Who is Sven?"}, {"role": "assistant", **assistant},
                    {"role": "user", "content": "Who is Zoe?"}]
        return client.chat.completions.create(model="m", messages=messages, max_tokens=16).choices[0].message.content

    plain = answer({"content": "I cannot say."})
    assert answer({"content": None, "refusal": "I cannot say."}) == plain
    assert answer({"content": [{"type": "refusal", "refusal": "I cannot say."}]}) == plain
    err = check_error(*raw(server, "POST", CHAT, {"messages": [{"role": "user", "content": "hi",
                                                                "refusal": "no"}]}), 400, "messages[0].refusal")
    assert err["message"] == "messages[0].refusal: only an assistant message refuses"
    err = check_error(*raw(server, "POST", CHAT, {"messages": [{"role": "assistant", "content": None}]}), 400,
                      "messages[0].content")
    assert err["message"].startswith("messages[0].content: an assistant message needs content")


def test_continue_final_message_continues_the_assistants_message(client, server):
    """vLLM's continue_final_message: the answer continues a final assistant message (the prompt leaves its
    turn open, as completing the rendered text); without it the message is a closed turn, as OpenAI reads it.
    add_generation_prompt false alone ends the prompt with the last message closed (vLLM's reading); with
    continue_final_message it must be false."""
    turns = [{"role": "user", "content": "Who is Sven?"}, {"role": "assistant", "content": "Sven lives"}]
    rendered = "<|im_start|>user\nWho is Sven?<|im_end|>\n<|im_start|>assistant\nSven lives"  # the demo's template
    go_on = client.chat.completions.create(model="m", messages=turns, max_tokens=16,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = client.completions.create(model="m", prompt=rendered, max_tokens=16)
    assert go_on.choices[0].message.content == text.choices[0].text
    assert go_on.usage.prompt_tokens == text.usage.prompt_tokens
    closed = client.chat.completions.create(model="m", messages=turns, max_tokens=16,
                                            extra_body={"add_generation_prompt": True})
    assert closed.usage.prompt_tokens > go_on.usage.prompt_tokens  # the turn closed, the answer's opened
    shut = client.chat.completions.create(model="m", messages=turns, max_tokens=16,
                                          extra_body={"add_generation_prompt": False})  # closed, none opened
    shut_text = client.completions.create(model="m", prompt=rendered + "<|im_end|>\n", max_tokens=16)
    assert shut.usage.prompt_tokens == shut_text.usage.prompt_tokens == closed.usage.prompt_tokens - 3
    assert shut.choices[0].message.content == shut_text.choices[0].text
    err = check_error(*raw(server, "POST", CHAT, user(continue_final_message=True)), 400, "continue_final_message")
    assert err["message"].startswith("continue_final_message: "), err
    for fields, param in (({"add_generation_prompt": True}, "add_generation_prompt"),
                          ({"response_format": {"type": "json_object"}}, "response_format")):
        body = {"messages": turns, "continue_final_message": True, **fields}
        err = check_error(*raw(server, "POST", CHAT, body), 400, param)
        assert err["message"].startswith(f"{param}: "), err


def test_logit_bias_and_penalties_reach_the_decoder(client, expected):
    """OpenAI's logit_bias (token ids as strings), presence_penalty and frequency_penalty, as the openai client
    sends them, and mlx-lm's and vLLM's repetition_penalty; the decoder's part is tests/test_penalties.py."""
    p = "Who is Sven?"
    forced = chat(client, p, max_tokens=8, logit_bias={"5": 100})  # token 5 is "&" in this byte-level vocabulary
    assert forced.choices[0].message.content == "&" * 8
    banned = chat(client, p, logit_bias={"5": -100, "50": -100}, presence_penalty=0, frequency_penalty=0)
    assert banned.choices[0].message.content == expected[p]  # tokens the answer has not: the same answer
    count = "Count from 1 to 20."
    penalised = [chat(client, count, presence_penalty=2, frequency_penalty=2).choices[0].message.content
                 for _ in (0, 1)]
    assert penalised[0] == penalised[1] != chat(client, count).choices[0].message.content
    repeated = chat(client, count, extra_body={"repetition_penalty": 1.8}).choices[0].message.content
    assert repeated not in penalised and repeated != chat(client, count).choices[0].message.content
    assert chat(client, count, extra_body={"repetition_penalty": 1}).choices[0].message.content == \
        chat(client, count).choices[0].message.content


def test_sampling_fields_apply_to_the_planning_drafts(client, expected):
    p = "Who is Sven?"
    greedy = chat(client, p, top_p=0.5, extra_body={"top_k": 3, "min_p": 0.2})  # temperature 0: the argmax
    assert greedy.choices[0].message.content == expected[p]
    kw = dict(temperature=1.5, seed=7, top_p=0.9, presence_penalty=0, frequency_penalty=0.0,
              extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0})  # top_k, min_p: not in the openai client's signature
    a, b = chat(client, p, **kw), chat(client, p, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded
    narrow = [chat(client, p, temperature=1.5, seed=s, extra_body={"top_k": 1}).choices[0].message.content
              for s in (1, 2)]
    assert narrow == [expected[p]] * 2  # top_k=1 leaves only the argmax to sample
    count, xtc = "Count from 1 to 20.", {"xtc_probability": 1, "xtc_threshold": 0.05}  # mlx-lm's XTC
    dropped = [chat(client, count, temperature=1, seed=3, extra_body=xtc).choices[0].message.content for _ in (0, 1)]
    assert dropped[0] == dropped[1] != chat(client, count, temperature=1, seed=3).choices[0].message.content
    assert chat(client, p, extra_body=xtc).choices[0].message.content == expected[p]  # greedy: the argmax


def test_a_signed_64_bit_seed_is_taken_on_every_api(server):
    """OpenAI's seed is a signed 64-bit integer (clients send -1): taken as its 64 bits (-1 is 2**64 - 1), and
    answer k's seed + k wraps past 2**64 - 1; the other APIs and the scoring estimator take the same range."""
    def answer(path, body):
        status, payload = raw(server, "POST", path, body)
        assert status == 200, payload
        return json.loads(payload)

    sampled = user("Count from 17 to 38.", max_tokens=12, temperature=1.5)
    texts = [[c["message"]["content"] for c in answer(CHAT, {**sampled, **fields})["choices"]]
             for fields in ({"seed": -1}, {"seed": 2 ** 64 - 1, "n": 2}, {"seed": 0}, {"seed": -2 ** 63})]
    assert texts[0] == texts[1][:1] and texts[1][1:] == texts[2] and texts[3]
    answer("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "temperature": 1.0, "seed": -1})
    answer("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "seed": -2 ** 63})
    answer("/v1/completions", {"prompt": "1 2 3 4", "echo": True, "logprobs": 0, "max_tokens": 0,
                               "logprob_estimator": "mc", "mc_num": 2, "context_tokens": 2, "seed": -1})
    for path, body in ((CHAT, sampled), ("/v1/responses", {"input": "Hi"}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})):
        status, payload = raw(server, "POST", path, {**body, "seed": -2 ** 63 - 1})
        assert status == 400 and json.loads(payload)["error"]["message"].startswith("seed: "), payload


# --------------------------------------------------------------------------
# Batching and the prompt cache


def test_conversation_turn_by_turn_reuses_the_cache(client, expected):
    """Each turn continues the previous turn's cache (prompt + answer): cached_tokens grows,
    and the answers are the terminal chat's (ChatSession), which reuses the same way."""
    messages, cached, prompts = [], [], []
    for turn, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS)
        answer = r.choices[0].message.content
        assert answer == expected["turns"][turn]
        messages.append({"role": "assistant", "content": answer})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompts.append(r.usage.prompt_tokens)
        if turn:
            assert prompts[-1] - cached[-1] == expected["turns_prefill"][turn]
            assert cached[-1] > prompts[-2]  # the previous prompt and (part of) its answer
    assert cached == sorted(cached) and cached[-1] > cached[0]
    again = client.chat.completions.create(model="m", messages=messages[:1], max_tokens=MAX_TOKENS)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == expected["turns"][0]  # exact reuse: the same answer


def test_shared_system_prompt_is_prefilled_once(server, expected):
    ids = expected["system_ids"]
    shared = min(next(i for i, (a, b) in enumerate(zip(x, y)) if a != b) for x in ids for y in ids if x is not y)
    assert shared > 30
    before = health(server)

    def run(u):
        c = openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=60)
        return c.chat.completions.create(model="m", max_tokens=SHORT, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": u}])

    with ThreadPoolExecutor(len(USERS)) as pool:
        results = list(pool.map(run, USERS))
    after = health(server)
    assert [r.usage.prompt_tokens for r in results] == [len(i) for i in ids]
    assert [r.choices[0].message.content for r in results] == expected["system_answers"]  # as without the cache
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled <= shared + sum(len(i) - shared for i in ids)  # the system prompt once, each question once
    assert sum(r.usage.prompt_tokens_details.cached_tokens >= shared for r in results) >= len(USERS) - 1


def test_eight_streams_share_forwards(server):
    """8 concurrent streams decode in one batch, each as it would alone; throughput against one stream."""
    client = openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=60)  # a connection a stream
    clients = [client] * 8

    def run(c):
        out = c.completions.create(model="m", prompt=LONG["prompt"], max_tokens=32, stream=True, extra_body={
            k: LONG[k] for k in ("slot_threshold", "token_threshold")})  # one slot a step: 8+ steps each
        return "".join(ch.choices[0].text for ch in out if ch.choices)

    t0 = time.perf_counter()
    alone = run(clients[0])
    one = time.perf_counter() - t0
    before = health(server)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(run, clients))
    eight = time.perf_counter() - t0
    after = health(server)
    assert texts == [alone] * 8 and alone
    rows = (after["step_rows"] - before["step_rows"]) / max(1, after["steps"] - before["steps"])
    print(f"\n1 stream {one:.2f}s; 8 streams {eight:.2f}s: {8 * one / eight:.1f}x the throughput, "
          f"{rows:.1f} requests per forward")
    assert rows > 4 and after["active"] == 0


def test_lru_eviction_under_a_tiny_budget():
    from refusion_mlx.serve.caches.prompt_cache import PromptCache
    from tests.helpers import StandInCache as Fake

    cache = PromptCache(max_bytes=1000)
    cache.insert(Fake([1, 2, 3, 4]))
    cache.insert(Fake([1, 2, 3, 4, 5, 6]))  # extends the first: it replaces it
    assert len(cache) == 1 and cache.nbytes == 600
    cache.insert(Fake([1, 2, 3]))  # the entry holds its rows already: nothing is added
    assert list(cache.entries) == [("", (1, 2, 3, 4, 5, 6))] and cache.nbytes == 600
    assert cache.lookup([1, 2, 3, 9])[0] == 3 and cache.lookup([1, 2])[0] == 1  # one token left to prefill
    cache.insert(Fake([7, 8, 9]))  # 900 bytes: both fit
    assert len(cache) == 2
    cache.lookup([1, 2, 3])  # the older entry is used: the newer one is now least recently used
    cache.insert(Fake([5, 5]))
    assert cache.nbytes <= 1000 and cache.lookup([7, 8, 9, 1])[0] == 0 and cache.lookup([1, 2, 3, 4])[0] == 3
    assert PromptCache(max_bytes=0).lookup([1, 2]) == (0, None)
    kept = list(cache.entries)
    cache.insert(Fake(list(range(100, 111))))  # 1100 bytes, over the whole budget: not kept, nothing evicted
    assert list(cache.entries) == kept
    running = [("", Fake([1, 2, 3]))]  # a request still decoding: its rows count, but not in a cache that is off
    assert cache.lookup([1, 2, 3, 4], running=running)[0] == 3
    assert PromptCache(max_bytes=0).lookup([1, 2, 3, 4], running=running) == (0, None)


def test_a_prompt_cache_lookup_reads_the_prompt_not_every_entry():
    """A lookup compared the prompt with every entry of its owner, and an insert checked every entry, on
    the engine thread: 36 ms an admission with 256 two-thousand-token conversations of one system
    prompt. The entries are indexed by their tokens: the tokens a lookup or an insert compares do not
    grow with the entries kept."""
    import random

    from refusion_mlx.serve.caches.prompt_cache import PromptCache
    from tests.helpers import StandInCache

    compared = [0]

    class Token(int):  # an id that counts its comparisons
        __hash__ = int.__hash__

        def __eq__(self, other):
            compared[0] += 1
            return int(self) == int(other)

        def __ne__(self, other):
            return not self == other

    def costs(entries: int) -> tuple:
        cache, rng, system = PromptCache(1 << 40), random.Random(0), list(range(100, 300))
        for _ in range(entries):  # conversations after one system prompt
            cache.insert(StandInCache(Token(t) for t in system + [rng.randrange(400, 800) for _ in range(20)]))
        compared[0] = 0
        n, _ = cache.lookup([Token(t) for t in system + [1, 2, 3]])
        looked, compared[0] = compared[0], 0
        cache.insert(StandInCache(Token(t) for t in system + [3, 2, 1]))
        assert len(cache) == entries + 1
        return n, looked, compared[0]

    few, many = costs(8), costs(512)
    assert few[0] == many[0] == 200  # the system prompt is found
    assert many == few, (few, many)  # as many tokens compared with 512 entries as with 8


def test_tiny_prompt_cache_budget_evicts(expected):
    """--prompt-cache-bytes bounds the cache: with room for one conversation, another evicts it."""
    row = 4 * 2 * 2 * 64 * 4  # a row's bytes: 4 layers, keys and values, 2 heads of 64, float32
    room = (expected[PROMPTS[0], "ids"] + SHORT + 2) * row * 3 // 2  # an entry holds its rows alone
    with RefusionServer(str(FIXTURE_MODEL), model_id="tiny-refusion", port=0, prompt_cache_bytes=room,
                        dtype="float32") as srv:  # room for one conversation at float32's bytes per token
        c = openai.OpenAI(base_url=srv.url, api_key="local", max_retries=0, timeout=60)
        first = [chat(c, p, max_tokens=SHORT).usage.prompt_tokens_details.cached_tokens
                 for p in (PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0])]
        state = health(srv)["prompt_cache"]
    assert first[1] == expected[PROMPTS[0], "ids"] - 1  # a hit
    assert first[3] < first[1]  # evicted by the other conversation
    assert state["entries"] == 1 and state["bytes"] <= state["max_bytes"]


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
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "picture"}]}]}, 400, "messages[0].content"),
    (CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    (CHAT, user(max_tokens=-1), 400, "max_tokens"),
    (CHAT, user(max_tokens=0), 400, "max_tokens"),
    (CHAT, user(max_tokens="12"), 400, "max_tokens"),
    (CHAT, user(max_tokens=True), 400, "max_tokens"),
    (CHAT, user(max_tokens=2.5), 400, "max_tokens"),
    (CHAT, user(temperature="hot"), 400, "temperature"),
    (CHAT, user(temperature=-1), 400, "temperature"),
    (CHAT, user(top_p=1.5), 400, "top_p"),
    (CHAT, user(stream="yes"), 400, "stream"),
    (CHAT, user(stop=5), 400, "stop"),
    (CHAT, user(stop=[""]), 400, "stop"),
    (CHAT, user(seed=-2 ** 63 - 1), 400, "seed"),  # OpenAI's seed is a signed 64-bit integer, an MLX key unsigned
    (CHAT, user(seed=2 ** 64), 400, "seed"),
    (CHAT, user(n=17), 400, "n"),
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
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 5}, 400, "echo"),
    (CHAT, user(stream_options={"include_usage": True}), 400, "stream_options"),  # as OpenAI: only with stream
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
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


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_media_parts_are_refused_at_their_own_path(server, kind):
    """As the Responses and Messages APIs say it: the part's type, and that the model reads text only."""
    content = [{"type": "text", "text": "What is this?"}, {"type": kind, kind: {"url": "https://x/y.png"}}]
    err = check_error(*raw(server, "POST", CHAT, user(content)), 400, "messages[0].content[1].type")
    assert err["message"] == (f"messages[0].content[1].type: {kind} parts are not supported: the model reads text "
                              "only") and err["code"] == "unsupported_parameter", err


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
    check_error(*raw(server, "POST", CHAT + "/", {}), 404)  # not a bodiless redirect
    check_error(*raw(server, "GET", "/v1/models/other-model"), 404)
    check_error(*raw(server, "BREW", CHAT), 405)
    big = json.dumps(user("x" * (2 << 20))).encode()
    check_error(*raw(server, "POST", CHAT, big), 413)
    # a malformed header never reaches the app: uvicorn answers a plain 400 and closes (sent in one
    # piece: a body arriving after the close would reset the connection before the client reads the 400)
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n{}")
        assert s.recv(4096).startswith(b"HTTP/1.1 400 ")


def test_missing_content_length_and_garbage(server):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\r\n")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 411")
    for body in (b"{}", b"2\r\n{}\r\n0\r\n\r\n"):  # Content-Length and Transfer-Encoding both: 400 at once
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
            start, head = time.monotonic(), b""
            while chunk := s.recv(4096):  # the answer closes the connection (its body was not read)
                head += chunk
        assert head.startswith(b"HTTP/1.1 400") and b"Transfer-Encoding with a Content-Length" in head
        assert time.monotonic() - start < 5  # not the body timeout's 408
    ask = json.dumps(user("Who is Sven?", max_tokens=8)).encode()
    for pieces, status in (([ask[:10], ask[10:]], b"200"), ([b"x" * (1 << 19)] * 3, b"413")):
        with socket.create_connection((server.host, server.port), timeout=30) as s:  # chunked: taken, within
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                      b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")  # --max-body-bytes
            try:
                for piece in pieces:
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                s.sendall(b"0\r\n\r\n")
            except OSError:  # refused before it was all sent (413): the connection is closed
                pass
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
        assert (b'"choices"' if status == b"200" else b"request_too_large") in answer
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
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
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
    batch = srv.config.max_batch
    for _ in range(batch + 2):  # a batch runs, 2 wait
        s = socket.create_connection((srv.host, srv.port), timeout=30)
        body = json.dumps({**LONG, "stream": False}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(s)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = health(srv)
        if now["active"] == batch and now["queued"] == 2:
            break
        time.sleep(0.05)
    assert now["active"] == batch and now["queued"] == 2
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = health(srv)
        if now["active"] == 0 and now["queued"] == 0:
            break
        time.sleep(0.05)
    assert now["active"] == 0 and now["queued"] == 0
    assert now["cancelled"] == before["cancelled"] + batch + 2 and now["completed"] == before["completed"]


def test_openai_client_example(server, capsys, monkeypatch):
    """The example run as its own ``__main__`` in this process (a process of its own spent 1.5 s of CPU
    importing the openai client this process has)."""
    import runpy

    script = ROOT / "examples" / "openai_client.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--base-url", server.url])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capsys.readouterr()
    assert ended.value.code == 0, err
    assert "stream> 17 18 19" in out and "finish_reason=" in out and "usage:" in out
    assert "chat> Sven lives in Hanoi." in out and "bad request> 400" in out


# --------------------------------------------------------------------------
# Unit: in-order text shaping


def test_text_shaper_holds_back_partial_stop():
    shaper = TextShaper(stop=["END"], eos_id=0)
    assert shaper.feed("abc E", [1, 2], False) == ("abc ", None)
    assert shaper.feed("N", [3], False) == ("", None)
    assert shaper.feed("Dx", [4], False) == ("", "stop")
    assert shaper.completion_tokens == 4
    shaper = TextShaper(stop=["END"], eos_id=0)
    assert shaper.feed("abc EN", [1, 2], False) == ("abc ", None)
    assert shaper.feed("O", [5, 0], True) == ("ENO", None)
    assert shaper.completion_tokens == 3  # EOS is not a completion token


# --------------------------------------------------------------------------
# The CLI: python -m refusion_mlx.server


def default_signals() -> None:
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start_cli(*args):
    """Start the server CLI on a free port; its stderr lines go to a queue. Its signals are as a terminal
    gives them, whatever this run was started under (nohup ignores SIGHUP, a shell's ``&`` SIGINT)."""
    proc = subprocess.Popen([sys.executable, "-m", "refusion_mlx.server", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=default_signals)
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_cli_serves_and_shuts_down_cleanly(cli_servers, sig):
    """SIGTERM, Ctrl-C, and SIGHUP (its terminal closed) mid-answer: the stream ends, exit status 0."""
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
    (["--max-tokens", "0"], "--max-tokens must be a positive integer"),
    (["--slot-size", "4", "--block-length", "6"], "not a multiple"),
    (["--host", "203.0.113.77"], "cannot listen on"),
    (["--max-active", "0"], "--max-active: expected a positive integer"),
    (["--max-kv-bytes", "0"], "must be more than 0 bytes"),
    (["--watchdog-seconds", "soon"], "must be a positive number of seconds"),
    (["--header-timeout", "-1"], "--header-timeout: must be a positive number of seconds"),
    (["--max-connections", "0"], "--max-connections: expected a positive integer"),
    (["--max-stored-response-bytes", "lots"], "invalid size"),
    (["--chat-template-config", "{enable_thinking: false}"], "--chat-template-config"),
])
def test_cli_bad_flags_one_line(flags, needle):
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.server", *flags], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
