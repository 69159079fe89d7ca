"""Every API's answers, byte for byte but for the last digits of their
logprobs, against a recording.

A fixed set of requests -- chat and text completions (whole, streamed, with
tools, logprobs, several choices, a schema, scoring), the Responses API
(with a stored follow-up), the Messages API, tokenization and refusals in
each API's error shape -- is sent to one server on the bundled demo model (whose template takes tools); the
answers, with what changes from run to run (ids, times, the fingerprint)
replaced by placeholders, must equal ``fixtures/api_answers.json``: one
recording per device path (``REFUSION_MLX_PATHS``; the GPU paths decode in
bfloat16, the CPU paths in float32, so their answers differ). The
recording was made before the server's layout changed (issue 52); a change
that alters any answer shows here as the first request whose bytes differ.
Three answers were refusals until issue 51 made them answers: a
``max_tokens`` past the context (cut to fit), a hosted tool (left out of
the prompt) and a system message inside the Messages API's conversation.
The CPU paths' two Monte Carlo scoring answers were recorded again when the
estimator came to feed the context once (its numbers moved by at most 6e-6).
The two answers of several choices gained ReFusion's ``layout`` and
``tokens_per_forward`` in their usage, as one answer's usage has them.
A chat answer's message gained OpenAI's ``refusal: null`` and ``annotations: []``,
and a stream with ``include_usage`` its ``"usage": null`` on every chunk before
the usage chunk (added to both recordings, nothing else changed).
The three answers with legacy ``top_logprobs`` (text logprobs, the two AR
scorings) gained the token itself where it was not among the top ones, as
OpenAI's legacy logprobs have it (``logprobs`` 0: only it, where echo had null).
The Messages API's refusal gained Anthropic's ``request_id`` (both recordings).
The Responses answer sent without ``max_output_tokens`` (the hosted tool's) lays out the
context the prompt leaves, 128 blocks where the server's default 512 tokens were 32, as
OpenAI's omitted budget is no limit (both recordings; nothing else changed).
Decimal numbers compare to 1e-4 (:func:`same_answer`): on an Intel Xeon
MKL's float32 matmuls round the recording's logprobs (made on an AMD EPYC)
differently in their sixth digit, with every token the same.

``python -m tests.test_api_answers`` writes the recording of the paths it runs on anew.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest

from refusion_mlx.models.loading import DEMO_MODEL

RECORDING = Path(__file__).parent / "fixtures" / "api_answers.json"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "Who is Sven?"}]
# (name, method, path, body or None); a body's "$resp" is the previous Responses answer's id
REQUESTS = [
    ("chat", "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 16}),
    ("chat stream", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat commits", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 8, "stream": True, "stream_options": {"include_commits": True}}),
    ("chat logprobs", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}),
    ("chat logprobs stream", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 8, "logprobs": True, "top_logprobs": 1, "stream": True}),
    ("chat n", "POST", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 8, "n": 2, "temperature": 0.7, "seed": 3}),
    ("chat stop", "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 16, "stop": ["is"]}),
    ("chat forced call", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Weather in Bern?"}], "tools": [WEATHER], "max_tokens": 32,
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("chat forced call stream", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Weather in Bern?"}], "tools": [WEATHER], "max_tokens": 32,
      "tool_choice": "required", "stream": True}),
    ("chat schema", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Tell me about Zoe."}], "max_tokens": 32,
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}}),
    ("text", "POST", "/v1/completions", {"prompt": "1 2 3 4", "max_tokens": 8}),
    ("text ids stream", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}),
    ("text prompts", "POST", "/v1/completions", {"prompt": ["1 2 3", "a b c"], "max_tokens": 8}),
    ("text prompts stream", "POST", "/v1/completions",
     {"prompt": ["1 2 3", "a b c"], "max_tokens": 8, "stream": True}),
    ("text logprobs", "POST", "/v1/completions", {"prompt": "1 2 3 4", "max_tokens": 8, "logprobs": 2}),
    ("score ar", "POST", "/v1/completions", {"prompt": "1 2 3 4 5", "max_tokens": 1, "echo": True, "logprobs": 1}),
    ("score ar prompts", "POST", "/v1/completions",
     {"prompt": ["1 2 3", "x y"], "max_tokens": 0, "echo": True, "logprobs": 0}),
    ("score mc", "POST", "/v1/completions",
     {"prompt": "1 2 3 4 5 6", "max_tokens": 0, "echo": True, "logprobs": 1, "logprob_estimator": "mc",
      "mc_num": 4, "context_tokens": 3}),
    ("score mc stream", "POST", "/v1/completions",
     {"prompt": "1 2 3 4 5 6", "max_tokens": 1, "echo": True, "logprobs": 1, "logprob_estimator": "mc",
      "mc_num": 2, "context_tokens": 2, "stream": True}),
    ("responses", "POST", "/v1/responses", {"input": "Who is Sven?", "max_output_tokens": 16}),
    ("responses follow-up", "POST", "/v1/responses",
     {"input": "And Zoe?", "previous_response_id": "$resp", "max_output_tokens": 8}),
    ("responses get", "GET", "/v1/responses/$resp", None),
    ("responses items", "GET", "/v1/responses/$resp/input_items", None),
    ("responses stream", "POST", "/v1/responses",
     {"input": "Who is Sven?", "max_output_tokens": 8, "stream": True, "store": False}),
    ("responses call stream", "POST", "/v1/responses",
     {"input": "Weather in Bern?", "max_output_tokens": 32, "stream": True, "tool_choice": "required",
      "tools": [{"type": "function", **WEATHER["function"]}]}),
    ("responses schema", "POST", "/v1/responses",
     {"input": "Tell me about Zoe.", "max_output_tokens": 32,
      "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}}}),
    ("messages", "POST", "/v1/messages", {"messages": USER, "max_tokens": 16}),
    ("messages stream", "POST", "/v1/messages", {"messages": USER, "max_tokens": 16, "stream": True,
                                                 "system": "Be brief."}),
    ("messages call", "POST", "/v1/messages",
     {"messages": [{"role": "user", "content": "Weather in Bern?"}], "max_tokens": 32,
      "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
      "tool_choice": {"type": "any"}}),
    ("messages call stream", "POST", "/v1/messages",
     {"messages": [{"role": "user", "content": "Weather in Bern?"}], "max_tokens": 32, "stream": True,
      "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
      "tool_choice": {"type": "tool", "name": "get_weather"}}),
    ("messages stop", "POST", "/v1/messages", {"messages": USER, "max_tokens": 16, "stop_sequences": ["is"]}),
    ("count tokens", "POST", "/v1/messages/count_tokens", {"messages": USER}),
    ("tokenize", "POST", "/tokenize", {"prompt": "Who is Sven?"}),
    ("models", "GET", "/v1/models", None),
    ("bad chat", "POST", "/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ("max_tokens past the context, cut", "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 100000}),
    ("hosted tool, left out", "POST", "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}),
    ("bad messages", "POST", "/v1/messages", {"messages": USER}),
    ("system message in messages", "POST", "/v1/messages",
     {"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}),
    ("bad kv bits", "POST", "/v1/completions", {"prompt": "1", "kv_bits": 4}),
    ("bad route", "GET", "/v1/nothing", None),
]
VARYING = [
    (re.compile(r'"(created|created_at)": ?\d+'), r'"\1": 0'),
    (re.compile(r'"created_at": ?"[0-9T:+-]+"'), r'"created_at": "DATE"'),
    (re.compile(r"(chatcmpl|cmpl|msg|resp|fc|call|toolu|req)[-_][0-9a-f]{12,}"), r"\1-ID"),
    (re.compile(r"refusion-mlx-[0-9a-f]{8}"), "refusion-mlx-FP"),
]


def normal(text: str) -> str:
    for pattern, repl in VARYING:
        text = pattern.sub(repl, text)
    return text


def record(base_url: str) -> list:
    """Each request's (name, status, answer text with the varying parts replaced)."""
    out, previous = [], ""
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for name, method, path, body in REQUESTS:
            text = json.dumps(body).replace("$resp", previous) if body is not None else None
            r = http.request(method, path.replace("$resp", previous), content=text,
                             headers={"Content-Type": "application/json"} if text is not None else {})
            if name == "responses":
                previous = r.json()["id"]
            out.append([name, r.status_code, normal(r.text)])
    return out


@pytest.fixture(scope="module")
def answers():
    from refusion_mlx.serve.http_server import RefusionServer

    server = RefusionServer(str(DEMO_MODEL), model_id="tiny-refusion", port=0).start()
    try:
        yield record(server.url.removesuffix("/v1"))
    finally:
        server.close()


FLOAT = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def same_answer(got: str, want: str) -> bool:
    """The same text, every decimal number in it (logprobs) equal to 1e-4: the
    BLAS may round a float32 sum differently on another CPU (MKL takes its
    kernels by the instruction set), and nothing else may differ."""
    if FLOAT.split(got) != FLOAT.split(want):
        return False
    a, b = FLOAT.findall(got), FLOAT.findall(want)
    return len(a) == len(b) and all(abs(float(x) - float(y)) <= 1e-4 * max(1.0, abs(float(y))) for x, y in zip(a, b))


def test_every_answer_is_the_recorded_one(answers):
    from refusion_mlx.models import backend

    recorded = json.loads(RECORDING.read_text())[backend.paths()]
    assert [a[0] for a in answers] == [r[0] for r in recorded]
    for got, want in zip(answers, recorded):
        assert got[:2] == want[:2] and same_answer(got[2], want[2]), f"{got[0]}: the answer differs from the recording"
    assert same_answer('{"logprob": -6.869966506958008}', '{"logprob": -6.869961738586426}')
    assert not same_answer('{"logprob": -6.8699}', '{"logprob": -6.9699}')
    assert not same_answer('{"token": "Sven", "logprob": -6.8}', '{"token": "Zoe", "logprob": -6.8}')


def test_the_recording_covers_every_api_and_refusal():
    recorded = json.loads(RECORDING.read_text())["cpu"]
    statuses = {name: status for name, status, _ in recorded}
    assert statuses["bad chat"] == statuses["bad messages"] == statuses["bad kv bits"] == 400
    assert statuses["bad route"] == 404
    assert all(status == 200 for name, status in statuses.items() if not name.startswith("bad"))
    tool_calls = [text for name, _, text in recorded if "call" in name]
    assert all("get_weather" in text for text in tool_calls)


if __name__ == "__main__":  # the recording, made anew
    from refusion_mlx.serve.http_server import RefusionServer

    from refusion_mlx.models import backend

    srv = RefusionServer(str(DEMO_MODEL), model_id="tiny-refusion", port=0).start()
    try:
        recording = json.loads(RECORDING.read_text()) if RECORDING.exists() else {}
        recording[backend.paths()] = record(srv.url.removesuffix("/v1"))
        RECORDING.write_text(json.dumps(recording, indent=1) + "\n")
    finally:
        srv.close()
    print(f"wrote {RECORDING}", file=sys.stderr)
