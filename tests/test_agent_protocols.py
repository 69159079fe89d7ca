"""What the stock coding agents send, answered as the APIs define it (issue
51), on the demo model: the Responses API's ``namespace`` and hosted tools
(Codex), the Messages API's ``thinking``, system messages inside the
conversation and structured output (Claude Code, the ``anthropic`` SDK's
``messages.parse``), a ``max_tokens`` past the context cut to fit on all
three APIs, ``HEAD`` wherever ``GET`` is, every 4xx in the server's log, and
no transformers warning on stderr."""

from __future__ import annotations

import http.client
import json
import logging
from typing import Literal

import anthropic
import pytest
from pydantic import BaseModel

from refusion_mlx.models.loading import DEMO_MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    from refusion_mlx.serve.http_server import RefusionServer

    srv = RefusionServer(str(DEMO_MODEL), model_id="demo", port=0).start()
    yield srv
    srv.close()


def call(srv, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(payload) if payload else None


def test_a_tool_calls_logprobs_cover_the_content_alone(server):
    """An answer that is a call has no content, so no content logprobs (they were the call's markup:
    <tool_call>, {", name ...), whole and streamed; OpenAI's logprobs cover the content alone."""
    from tests.agent_server import TOOLS

    ask = {"messages": [{"role": "user", "content": "Where does Sven live?"}], "tools": TOOLS,
           "logprobs": True, "top_logprobs": 1, "max_tokens": 48}
    status, _, payload = call(server, "POST", "/v1/chat/completions", ask)
    choice = payload["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["logprobs"] == {"content": []}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**ask, "stream": True}),
                 {"Content-Type": "application/json"})
    chunks = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    conn.close()
    assert [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]] == []
    assert any(ch["delta"].get("tool_calls") for c in chunks for ch in c["choices"])


def test_responses_tools_as_codex_sends_them(server):
    namespace = {"type": "namespace", "name": "weather_v1", "description": "Weather tools.", "tools": [WEATHER]}
    body = {"input": "Weather in Bern?", "max_output_tokens": 32, "tools": [namespace, {"type": "web_search"}],
            "tool_choice": "required", "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "store": False, "prompt_cache_key": "k", "client_metadata": {"thread_id": "t"}}
    status, _, answer = call(server, "POST", "/v1/responses", body, {"x-codex-beta-features": "x"})
    assert status == 200, answer
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert calls and all(c["name"] == "get_weather" and c["namespace"] == "weather_v1" for c in calls)
    status, _, err = call(server, "POST", "/v1/responses", {**body, "tool_choice": {"type": "web_search"}})
    assert status == 400 and err["error"]["param"] == "tool_choice" and "web_search" in err["error"]["message"]
    status, _, err = call(server, "POST", "/v1/responses", {**body, "tools": [{"type": "spreadsheet"}]})
    assert status == 400 and err["error"]["param"] == "tools[0].type"


def test_messages_as_claude_code_sends_them(server):
    user = [{"role": "user", "content": "Who is Sven?"}]
    status, headers, answer = call(server, "POST", "/v1/messages", {
        "messages": user + [{"role": "assistant", "content": "Sven?"},
                            {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Yes."}],
        "max_tokens": 32000, "thinking": {"type": "adaptive"}, "stream": False},
        {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    assert status == 200 and answer["stop_reason"] in ("end_turn", "max_tokens"), answer
    assert headers["x-max-tokens-cut"].startswith("32000 -> ")
    assert all(block["type"] != "thinking" for block in answer["content"])
    with_system = call(server, "POST", "/v1/messages/count_tokens", {
        "messages": user + [{"role": "system", "content": "Answer briefly."}]})[2]["input_tokens"]
    assert with_system > call(server, "POST", "/v1/messages/count_tokens", {"messages": user})[2]["input_tokens"]
    status, _, err = call(server, "POST", "/v1/messages", {"messages": user, "max_tokens": 64,
                                                           "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert status == 400 and "thinking.budget_tokens" in err["error"]["message"]
    status, _, _ = call(server, "POST", "/v1/messages", {"messages": user, "max_tokens": 2048,
                                                         "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert status == 200


def test_an_empty_system_message_adds_nothing(server):
    """Claude Code's compaction retry sends {"role": "system", "content": []} inside the conversation: it is
    left out (the prompt as without it), not refused; a user or assistant message still may not be empty."""
    said = [{"role": "user", "content": "[earlier conversation truncated]"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}, {"role": "user", "content": "go on"}]
    for empty in ([], "", [{"type": "text", "text": ""}]):
        messages = said[:1] + [{"role": "system", "content": empty}] + said[1:] + [
            {"role": "system", "content": "Today's date is 2026-12-06."}]
        status, _, answer = call(server, "POST", "/v1/messages", {"messages": messages, "max_tokens": 8})
        assert status == 200, (empty, answer)
        counted = call(server, "POST", "/v1/messages/count_tokens", {"messages": messages})[2]["input_tokens"]
        assert counted == call(server, "POST", "/v1/messages/count_tokens", {
            "messages": said + messages[-1:]})[2]["input_tokens"], empty
    status, _, err = call(server, "POST", "/v1/messages", {"messages": [said[0], {"role": "user", "content": []}],
                                                           "max_tokens": 8})
    assert status == 400 and err["error"]["message"].startswith("messages[1].content: must not be empty"), err


def test_messages_are_checked_and_merged_as_anthropic_does(server):
    """Anthropic's rules: each tool_use is answered by a tool_result in the next turn (a final one is not),
    tool_use ids differ, disable_parallel_tool_use is a boolean; consecutive messages of a role are one turn."""
    def use(*ids):
        return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "lookup_person",
                                                  "input": {"name": "Sven"}} for i in ids]}

    def result(*ids):
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "Hanoi"} for i in ids]}

    ask, said = {"role": "user", "content": "Where does Sven live?"}, {"role": "user", "content": "Thanks."}
    for messages, param in (([ask, use("a")], "messages[1]"), ([ask, use("a", "b"), result("a")], "messages[1]"),
                            ([ask, use("a"), said, {"role": "assistant", "content": "Hanoi."}, said], "messages[1]"),
                            ([ask, use("a"), result("a"), use("b")], "messages[3]")):
        status, _, err = call(server, "POST", "/v1/messages", {"messages": messages, "max_tokens": 8})
        assert status == 400 and err["error"]["message"].startswith(
            f"{param}: tool_use ids were found without tool_result blocks immediately after: "), (messages, err)
    status, _, err = call(server, "POST", "/v1/messages", {"messages": [ask, use("a", "a"), result("a")],
                                                           "max_tokens": 8})
    assert status == 400 and err["error"]["message"].startswith("messages[1].content[1].id: tool_use ids must be "
                                                                "unique"), err
    status, _, err = call(server, "POST", "/v1/messages", {
        "messages": [ask], "max_tokens": 8, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "no"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert status == 400 and err["error"]["message"].startswith("tool_choice.disable_parallel_tool_use: "), err
    status, _, answer = call(server, "POST", "/v1/messages", {"messages": [ask, use("a"), said, result("a")],
                                                              "max_tokens": 8})  # the next turn, merged
    assert status == 200, answer

    def count(messages):
        return call(server, "POST", "/v1/messages/count_tokens", {"messages": messages})[2]["input_tokens"]

    said_twice = {"role": "user", "content": "Where does Sven live?\n\nThanks."}
    assert count([ask, said]) == count([said_twice]) < count([ask, {"role": "assistant", "content": "Hm."}, said])
    reply = [{"role": "assistant", "content": "Sven"}, {"role": "assistant", "content": [{"type": "text",
                                                                                         "text": "lives"}]}]
    assert count([ask] + reply + [said]) == count([ask, {"role": "assistant", "content": "Sven\n\nlives"}, said])
    assert count([ask] + reply) == count([ask, {"role": "assistant", "content": "Sven\n\nlives"}])  # one prefill


def test_chat_calls_are_each_answered_by_the_tool_messages_right_after(server):
    """OpenAI's rule: an assistant message's tool_calls are each answered by the tool messages that follow it
    (a final one too), else a 400 naming the assistant message and the unanswered ids."""
    def made(*ids):
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "lookup_person", "arguments": "{}"}} for i in ids]}

    def result(i):
        return {"role": "tool", "tool_call_id": i, "content": "Hanoi"}

    ask, said = {"role": "user", "content": "Where does Sven live?"}, {"role": "user", "content": "Thanks."}
    for messages, param, missing in (([ask, made("a")], "messages[1]", "a"),
                                     ([ask, made("a", "b"), result("a"), said], "messages[1]", "b"),
                                     ([ask, made("a", "b"), said, result("a"), result("b")], "messages[1]", "a, b"),
                                     ([ask, made("a"), result("a"), made("b", "c")], "messages[3]", "b, c")):
        status, _, err = call(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
        assert status == 400 and err["error"]["param"] == param, (messages, err)
        assert err["error"]["message"] == (
            f"{param}: an assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'; the following tool_call_ids did not have response messages: {missing}"), err
    answered = [ask, made("a", "b"), result("b"), result("a"), said]
    status, _, answer = call(server, "POST", "/v1/chat/completions", {"messages": answered, "max_tokens": 4})
    assert status == 200, answer


def test_chat_calls_each_in_its_own_message_are_answered_by_the_results_after_them(server):
    """Codex's chat client writes each of a turn's parallel calls as its own assistant message, then the
    results: the call-only messages are one group, answered by the tool messages right after it (any order);
    a group left partly unanswered is still refused, naming the message of the first unanswered call."""
    from refusion_mlx.models.loading import load_tokenizer
    from refusion_mlx.serve.protocols.openai_bodies import ChatCompletionRequest, openai_messages

    def made(i, content=None):
        return {"role": "assistant", "content": content, "tool_calls": [{"id": i, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": i})}}]}

    def result(i):
        return {"role": "tool", "tool_call_id": i, "content": f"sunny in {i}"}

    system, ask, said = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hanoi, Oslo?"},
                         {"role": "user", "content": "Thanks."})
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    for messages in ([system, ask, made("call_a"), made("call_b"), result("call_a"), result("call_b")],
                     [ask, made("call_a"), made("call_b"), result("call_b"), result("call_a"), said],
                     [ask, made("call_a", "Checking."), made("call_b", ""), result("call_a"), result("call_b")]):
        status, _, answer = call(server, "POST", "/v1/chat/completions",
                                 {"messages": messages, "tools": tools, "max_tokens": 4})
        assert status == 200, (messages, answer)
    for messages, param, missing in (([ask, made("a"), made("b"), result("b"), said], "messages[1]", "a"),
                                     ([ask, made("a"), made("b"), result("a")], "messages[2]", "b"),
                                     ([ask, made("a"), made("b", "Hm."), result("a"), result("b")], "messages[1]",
                                      "a"),
                                     ([ask, made("a"), result("a"), made("b"), made("c"), result("c")],
                                      "messages[3]", "b"),
                                     ([ask, made("a"), said, made("b"), result("a"), result("b")], "messages[1]",
                                      "a")):
        status, _, err = call(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
        assert status == 400 and err["error"]["param"] == param, (messages, err)
        assert err["error"]["message"].endswith(f"did not have response messages: {missing}"), err
    # rendered as the template writes it: each call its own assistant turn, the results one user turn after them
    grouped = openai_messages(ChatCompletionRequest.model_validate({"messages": [
        ask, made("call_a"), made("call_b"), result("call_a"), result("call_b")]}).messages)
    text = load_tokenizer(DEMO_MODEL).apply_chat_template(grouped, tools=tools, tokenize=False)
    turn = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n'
            '</tool_call><|im_end|>\n')
    assert text.endswith(turn % "call_a" + turn % "call_b" + "<|im_start|>user\n<tool_response>\nsunny in call_a\n"
                         "</tool_response>\n<tool_response>\nsunny in call_b\n</tool_response><|im_end|>\n"), text


def test_max_tokens_past_the_context_is_cut_on_every_api(server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 100000}),
                       ("/v1/responses", {"input": "Hi", "max_output_tokens": 100000}),
                       ("/v1/completions", {"prompt": "1 2 3", "max_tokens": 5000, "stream": True})):
        status, headers, _ = call(server, "POST", path, body) if not body.get("stream") else _streamed(server, path,
                                                                                                      body)
        asked = body.get("max_tokens") or body.get("max_output_tokens")
        given = int(headers["x-max-tokens-cut"].split(" -> ")[1])
        assert status == 200 and headers["x-max-tokens-cut"].startswith(f"{asked} -> ") and given <= 2048, path
    long = "1 2 3 " * 330  # ~2k tokens: its max_tokens is cut; the short prompt's is not
    for prompts in (["1 2 3", long], [long, "1 2 3"]):  # the header says the cut whichever prompt it hit
        status, headers, _ = call(server, "POST", "/v1/completions", {"prompt": prompts, "max_tokens": 100})
        assert status == 200 and headers["x-max-tokens-cut"].startswith("100 -> "), prompts
        assert int(headers["x-max-tokens-cut"].split(" -> ")[1]) < 100


def test_a_prompt_past_the_context_is_worded_as_each_apis_clients_read_it(server):
    """Anthropic's sentence on the Messages API (Claude Code compacts on "prompt is too long" and reads both
    sizes from it), OpenAI's code context_length_exceeded on the others (Codex's cue): the same sizes."""
    long = [{"role": "user", "content": "Tell me about Sven. " * 500}]
    tokens = call(server, "POST", "/v1/messages/count_tokens", {"messages": long})[2]["input_tokens"]
    assert tokens > 2048
    for stream in (False, True):
        status, _, err = call(server, "POST", "/v1/messages", {"messages": long, "max_tokens": 64, "stream": stream})
        assert status == 400 and err["type"] == "error", err
        assert err["error"] == {"type": "invalid_request_error",  # the demo's 2048 less one slot of 4
                                "message": f"prompt is too long: {tokens} tokens > 2044 maximum"}, err
    status, _, err = call(server, "POST", "/v1/chat/completions", {"messages": long, "max_tokens": 64})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert err["error"]["message"] == f"the prompt is {tokens} tokens; the model's context is 2048", err
    from refusion_mlx.decode.fit import ContextError  # the budget's overflow (a cut budget rarely meets it)
    from refusion_mlx.serve.edge.http_errors import anthropic_overflow

    budget = ContextError("the prompt (2000 tokens) + max_tokens ...", "max_tokens", 2000, 64, 2048)
    assert anthropic_overflow(budget) == ("input length and `max_tokens` exceed context limit: 2000 + 64 > 2048, "
                                          "decrease input length or `max_tokens` and try again")


def test_a_responses_request_without_max_output_tokens_gets_the_context_left(server):
    """As OpenAI's: an omitted max_output_tokens is no limit below the context (Codex sends none, and failed
    every turn the server's 512 cut), not cut with X-Max-Tokens-Cut; chat keeps the server's default."""
    status, headers, answer = call(server, "POST", "/v1/responses", {"input": "Who is Sven?"})
    assert status == 200 and "x-max-tokens-cut" not in headers, answer
    left = (2048 - answer["usage"]["input_tokens"]) // 4 * 4  # whole slots of 4, in blocks of 16
    assert answer["usage"]["layout"]["blocks"] == -(-left // 16) and answer["max_output_tokens"] is None, answer
    status, _, answer = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user",
                                                                                    "content": "Who is Sven?"}]})
    assert status == 200 and answer["usage"]["layout"]["blocks"] == 512 // 16, answer


def test_every_api_refuses_the_fields_chat_refuses(server):
    """The server's own settings, per-request adapters and settings out of bounds are refused alike on the
    three APIs (each in its own error shape), never ignored; values that change nothing pass, and mlx-lm's XTC."""
    bases = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
             ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
             ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
    for path, body in bases:
        for field, value in (("kv_bits", 4), ("kv_group_size", 32), ("xtc_threshold", 0.6), ("adapters", "a"),
                             ("repetition_penalty", 10.5), ("xtc_probability", 1.5)):
            status, _, err = call(server, "POST", path, {**body, field: value})
            message = err["error"]["message"]
            assert status == 400 and message.startswith(f"{field}: "), (path, field, err)
            assert ("--kv-bits" in message) == (field == "kv_bits"), message
            assert (err.get("type") == "error") == (path == "/v1/messages"), err
        status, _, answer = call(server, "POST", path, {**body, "xtc_probability": 0.5, "logit_bias": {},
                                                        "repetition_penalty": 1.3})  # (mlx-lm's, HF's, vLLM's)
        assert status == 200, (path, answer)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}


@pytest.mark.parametrize("path, field, value, instead", [
    ("/v1/responses", "response_format", {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
     "send text.format"),
    ("/v1/responses", "response_format", {"type": "text"}, "send text.format"),
    ("/v1/responses", "max_tokens", 5, "send max_output_tokens"),
    ("/v1/responses", "max_completion_tokens", 5, "send max_output_tokens"),
    ("/v1/responses", "stop", ["20"], "send stop to chat completions"),
    ("/v1/responses", "guided_json", SCHEMA, 'send text.format {"type": "json_schema"'),
    ("/v1/responses", "grammar", 'root ::= "yes"', 'send text.format {"type": "json_schema"'),
    ("/v1/messages", "response_format", {"type": "json_object"}, "send output_config.format"),
    ("/v1/messages", "stop", ["20"], "send stop_sequences"),
    ("/v1/messages", "grammar", 'root ::= "yes"', 'send output_config.format {"type": "json_schema"'),
    ("/v1/messages", "guided_choice", ["yes", "no"], 'send output_config.format {"type": "json_schema"'),
    ("/v1/chat/completions", "max_output_tokens", 5, "send max_tokens"),
    ("/v1/chat/completions", "stop_sequences", ["20"], "send stop"),
    ("/v1/completions", "stop_sequences", ["20"], "send stop"),
    ("/v1/chat/completions", "gen_length", 8, "not a field of chat completions; send max_tokens"),
    ("/v1/chat/completions", "temp", 1.5, "send temperature"),
    ("/v1/chat/completions", "preset", "gsm8k", "send slot_size, serial_num_blocks"),
    ("/v1/completions", "gen_length", 8, "send max_tokens"),
    ("/v1/completions", "temp", 1.5, "send temperature"),
    ("/v1/responses", "gen_length", 8, "send max_output_tokens"),
    ("/v1/responses", "temp", 1.5, "send temperature"),
    ("/v1/responses", "preset", "gsm8k", "or start the server with --preset"),
    ("/v1/messages", "gen_length", 8, "send max_tokens"),
    ("/v1/messages", "temp", 1.5, "send temperature"),
    ("/v1/messages", "preset", "gsm8k", "send slot_size, serial_num_blocks"),
])
def test_other_apis_fields_that_would_change_the_answer_are_refused(server, path, field, value, instead):
    """Chat's response_format, max_tokens and stop, and other servers' constraint fields, were ignored on the
    Responses and Messages APIs: a 200 whose answer the client believed constrained, cut or stopped; so were
    the names make_params, a prompts file and a bench suite take for a setting (gen_length 8 decoded 87
    tokens, temp 1.5 greedily). A 400 in the API's own shape naming the field and what that API takes
    instead (as OpenAI and Anthropic refuse them)."""
    body = ({"input": "Count from 17 to 38.", "max_output_tokens": 40} if path == "/v1/responses" else
            {"prompt": "Count from 17 to 38.", "max_tokens": 40} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "Count from 17 to 38."}], "max_tokens": 40})
    status, _, err = call(server, "POST", path, {**body, field: value})
    assert status == 400, (field, err)
    message = err["error"]["message"]
    assert message.startswith((f"{field}: not supported by ", f"{field}: not a field of ")), err
    assert instead in message and "\n" not in message, err
    assert (err.get("type") == "error") == (path == "/v1/messages"), err
    if path != "/v1/messages":
        assert err["error"]["param"] == field and err["error"]["code"] == "unsupported_parameter", err
    status, _, answer = call(server, "POST", path, {**body, "max_output_tokens": 4, field: None} if
                             path == "/v1/responses" else {**body, "max_tokens": 4, field: None})
    assert status == 200, answer  # null changes nothing


def test_what_the_sdks_send_by_default_is_not_refused(server):
    """The fields the anthropic SDK and Claude Code, and the openai SDK and Codex, send pass."""
    status, _, answer = call(server, "POST", "/v1/messages", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": False, "temperature": 1,
        "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"},
        "service_tier": "auto", "context_management": {"edits": []}, "stop_sequences": ["\n\nHuman:"],
        "output_config": {"effort": "low"}})
    assert status == 200, answer
    status, _, answer = call(server, "POST", "/v1/responses", {
        "input": "Hi", "max_output_tokens": 4, "reasoning": {"effort": "low", "summary": "auto"}, "store": False,
        "include": [], "prompt_cache_key": "k", "parallel_tool_calls": True, "tool_choice": "auto",
        "text": {"verbosity": "low"}, "service_tier": "auto", "temperature": 1, "top_p": 1, "truncation": "auto"})
    assert status == 200, answer


def _streamed(srv, path, body):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), None


class Person(BaseModel):
    name: Literal["Sven", "Zoe", "Max"]  # the demo model's words run on inside a free string
    age: int


def test_anthropic_structured_output_is_decoded_under_the_schema(server):
    client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0)
    parsed = client.messages.parse(model="demo", max_tokens=64, output_format=Person,
                                   messages=[{"role": "user", "content": "Tell me about Zoe."}])
    assert isinstance(parsed.parsed_output, Person), parsed.content
    schema = {"type": "object", "properties": {"city": {"enum": ["Hanoi", "Bern", "Perth"]}}, "required": ["city"],
              "additionalProperties": False}
    status, _, answer = call(server, "POST", "/v1/messages", {
        "messages": [{"role": "user", "content": "Where does Sven live?"}], "max_tokens": 48,
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert status == 200 and set(json.loads(answer["content"][0]["text"])) == {"city"}, answer
    status, _, counted = call(server, "POST", "/v1/messages/count_tokens", {
        "messages": [{"role": "user", "content": "Hi"}], "output_format": {"type": "json_schema", "schema": schema}})
    assert status == 200 and counted["input_tokens"] > 0
    prefilled = [{"role": "user", "content": "Where does Sven live?"}, {"role": "assistant", "content": '{"city":'}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # a whole JSON document cannot continue a prefill
        for fields, field in (({"output_format": {"type": "json_schema", "schema": schema}}, "output_format"),
                              ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                               "output_config.format")):
            status, _, err = call(server, "POST", path, {"messages": prefilled, "max_tokens": 48, **fields})
            assert status == 400 and err["error"]["message"].startswith(f"{field}: not supported with a prefill"), err


def test_output_format_and_output_config_format_together_are_refused(server):
    """Both given: output_config.format was ignored (an array's schema decoded as the object's). Anthropic's
    invalid_request_error names the conflict, on count_tokens too."""
    obj = {"type": "json_schema", "schema": {"type": "object"}}
    arr = {"type": "json_schema", "schema": {"type": "array", "items": {"type": "integer"}}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _, err = call(server, "POST", path, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                     "output_format": obj, "output_config": {"format": arr}})
        assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"].startswith("output_format: give output_format or output_config.format, "
                                                  "not both"), err


@pytest.mark.parametrize("fmt", [{"type": "json_object"}, {"type": "text"}, "json", {"schema": {}}])
def test_a_format_type_anthropic_lacks_is_refused(server, fmt):
    """Chat's json_object was taken as output_config.format (Anthropic has json_schema alone): a 400 in
    Anthropic's shape naming the type it takes, for either field."""
    for field, fields in (("output_config.format", {"output_config": {"format": fmt}}),
                          ("output_format", {"output_format": fmt})):
        if not isinstance(fmt, dict) and field == "output_format":
            continue  # not an object: the body's own check refuses it
        status, _, err = call(server, "POST", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 8, **fields})
        assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"] == f'{field}: must be {{"type": "json_schema", "schema": {{...}}}}, the one ' \
                                          "format type the Messages API takes", err


def test_head_is_answered_wherever_get_is_and_every_4xx_is_logged(server, caplog):
    for path in ("/", "/v1/models", "/health"):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("HEAD", path)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"", path
        conn.close()
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        status, _, _ = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                     "temperature": -1})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("400 POST /v1/chat/completions")]
    assert status == 400 and len(lines) == 1 and "temperature" in lines[0], caplog.text


def _ids(headers) -> str:
    """The response's request id: the same in OpenAI's x-request-id and Anthropic's request-id."""
    lower = {k.lower(): v for k, v in headers.items()}
    assert lower["x-request-id"] == lower["request-id"] and lower["request-id"].startswith("req_"), headers
    return lower["request-id"]


def test_every_response_has_a_request_id_the_log_line_names(server, caplog, monkeypatch):
    """No response carried a request id: a client (the SDKs' ``_request_id``) could not match a failure with
    the server's log. Every response -- answers, streams, errors, in each API's shape -- has one, its own; an
    Anthropic error body has it as request_id; the request's log line ends with it."""
    import openai

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    messages = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        seen = []
        for path, body in (("/v1/chat/completions", chat), ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
                           ("/v1/messages", messages)):
            status, headers, _ = call(server, "POST", path, body)
            streamed_status, streamed, _ = _streamed(server, path, {**body, "stream": True})
            assert status == streamed_status == 200, path
            seen += [_ids(headers), _ids(streamed)]
        status, headers, err = call(server, "POST", "/v1/messages", {**messages, "temperature": -1})
        assert status == 400 and err["request_id"] == _ids(headers), err
        status, headers, err = call(server, "POST", "/v1/chat/completions", {**chat, "temperature": -1})
        assert status == 400 and "request_id" not in err and "request_id" not in err["error"], err  # OpenAI's shape
        refused = _ids(headers)
        status, headers, _ = call(server, "GET", "/v1/nope")
        assert status == 404 and _ids(headers) not in seen
        status, headers, _ = call(server, "POST", "/v1/chat/completions", {}, {"Content-Type": "text/plain"})
        assert status == 415 and _ids(headers) not in seen
        monkeypatch.setattr(server.engine, "health", lambda: 1 / 0)  # a bug: answered by FastAPI's last handler
        status, headers, err = call(server, "GET", "/health", headers={"anthropic-version": "2023-06-01"})
        assert status == 500 and err["request_id"] == _ids(headers) not in seen, err
        monkeypatch.undo()
    assert len(set(seen)) == len(seen)  # one per request
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if line.startswith("400 POST /v1/chat/completions") and
            line.endswith(f"[{refused}]")], lines
    assert [line for line in lines if line.startswith("stream ") and line.endswith(f"[{seen[1]}]")], lines
    assert [line for line in lines if line.startswith("/v1/responses ") and line.endswith(f"[{seen[2]}]")], lines
    oai = openai.OpenAI(base_url=server.url, api_key="local", max_retries=0)
    raw = oai.chat.completions.with_raw_response.create(model="demo", max_tokens=4, messages=chat["messages"])
    assert raw.parse()._request_id == _ids(dict(raw.headers))
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0)
    assert claude.messages.create(model="demo", **messages)._request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as refusal:
        claude.messages.create(model="demo", extra_body={"temperature": 2}, **messages)
    assert refusal.value.request_id == refusal.value.body["request_id"]


def test_a_prompt_over_the_tokenizers_length_warns_nothing(capfd, caplog):
    from refusion_mlx.models.loading import load_tokenizer

    tokenizer = load_tokenizer(DEMO_MODEL)
    assert len(tokenizer.encode("Sven lives in Hanoi. " * 3000)) > 10000
    assert "Token indices" not in capfd.readouterr().err + caplog.text
