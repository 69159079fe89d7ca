"""Agents and apps: tool calls on chat completions, the Responses API and
Anthropic's Messages API, driven by their real clients (the ``openai`` SDK,
the ``anthropic`` SDK, the OpenAI Agents SDK, LangChain) and raw HTTP.

One server for the module (tests/agent_server.py): the demo model, whose
chat template renders tools and which calls them. Its answers, calls
included, are its own (``CALC`` is held out of its tool training), except
three that THE TEST DOUBLE ``ScriptedCalls`` writes at the decoding boundary
(the real decoding runs; the text is replaced), because the demo never
writes them: text followed by two calls at once (``BOTH``), a call that
does not parse (``BROKEN``), and text after a call (``AFTER``).
"""

from __future__ import annotations

import http.client
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from refusion_mlx.decode.params import make_params
from refusion_mlx.serve.core.metrics import parse
from tests.agent_server import TOOLS, scripted_server

MAX_TOKENS = 64  # a call is 45-52 tokens
SVEN = "Who is Sven?"
CALC = "What is 29 * 3?"  # the demo calls the calculator (a question held out of its training)
CALL_ARGS = {"expression": "29 * 3"}
RESULT = "87"  # the calculator's result; the demo's answer from it is text (its digits not always right: the
# demo answers 4-6 of 100 held-out tool results exactly, examples/demo_model/README.md), the same on every API
BOTH = "Who are Sven and Zoe?"  # scripted: text, then two lookup_person calls
BROKEN = "Break the call."  # scripted: a call that does not parse
AFTER = "Call, then say."  # scripted: a calculator call, then text
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server():
    with scripted_server(decoding=make_params(max_tokens=MAX_TOKENS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                               timeout=60)


def user(text):
    return [{"role": "user", "content": text}]


def raw(server, method, path, body=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request(method, path, body=body if body is None or isinstance(body, bytes) else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, kind, payload = resp.status, resp.getheader("content-type"), resp.read()
    conn.close()
    return status, kind, payload


def events(server, path, body):
    """A stream's server-sent events as (event name or None, data)."""
    req = urllib.request.Request(server.url.removesuffix("/v1") + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out, name = [], None
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in (raw_line.decode().rstrip("\n") for raw_line in resp):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, line[6:] if line == "data: [DONE]" else json.loads(line[6:])))
                name = None
    return out


def follow_up(oai) -> str:
    """The demo's answer, on chat completions, to CALC after its calculator call and RESULT: each API's
    round trip renders the same conversation, so each must answer exactly this."""
    messages = user(CALC) + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps(CALL_ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": RESULT}]
    out = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
    assert out.finish_reason == "stop" and out.message.content and out.message.tool_calls is None
    return out.message.content


def metrics(server) -> dict:
    return parse(raw(server, "GET", "/metrics")[2].decode())


# --------------------------------------------------------------------------
# Chat completions with tools (the openai SDK)


def test_tools_enter_the_prompt_through_the_chat_template(server, oai):
    """The prompt with tools is the template's rendering of them (its token count), and tool_choice none
    renders none; the demo's answer to a question that needs no tool is the one it gives without tools."""
    from refusion_mlx.decode.stream import chat_prompt

    tokenizer = server.engine.http_tokenizers[0]
    plain = oai.chat.completions.create(model="m", messages=user(SVEN))
    with_tools = oai.chat.completions.create(model="m", messages=user(SVEN), tools=TOOLS)
    none = oai.chat.completions.create(model="m", messages=user(SVEN), tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens == len(chat_prompt(tokenizer, user(SVEN), tools=TOOLS))
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens == len(chat_prompt(tokenizer, user(SVEN)))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert plain.choices[0].message.content.startswith("Sven") and plain.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_openai_tool_round_trip(server, oai):
    messages = user(CALC)
    first = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == CALL_ARGS
    for stop in (["\n"], ["29"], ["calc"]):  # a stop string cuts the text, never a call's markup or arguments
        cut = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, stop=stop).choices[0]
        assert cut.finish_reason == "tool_calls" and cut.message.content is None, stop
        assert json.loads(cut.message.tool_calls[0].function.arguments) == CALL_ARGS
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == follow_up(oai)
    # the conversation continues from the prompt cache: the first turn is not prefilled again
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_openai_streamed_tool_calls(oai):
    chunks = list(oai.chat.completions.create(model="m", messages=user(BOTH), tools=TOOLS, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert content == "I will look both up."  # no markup, nor the newline before the call
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "lookup_person", {"name": "Sven"}), (1, "lookup_person", {"name": "Zoe"})]
    assert len({tc.id for tc in calls}) == 2 and chunks[-1].choices[0].finish_reason == "tool_calls"
    # the demo's own call, decoded over several steps, streamed
    chunks = list(oai.chat.completions.create(model="m", messages=user(CALC), tools=TOOLS, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("calculator", CALL_ARGS)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_ends_after_the_first_call(oai):  # scripted: the demo makes one call
    out = oai.chat.completions.create(model="m", messages=user(BOTH), tools=TOOLS, parallel_tool_calls=False)
    msg = out.choices[0].message
    assert [c.function.arguments for c in msg.tool_calls] == ['{"name": "Sven"}']
    assert out.choices[0].finish_reason == "tool_calls" and msg.content == "I will look both up."


def test_a_call_that_does_not_parse_stays_text_and_is_counted(server, oai):
    before = metrics(server)['refusion_tool_calls_total{result="unparsed"}']
    out = oai.chat.completions.create(model="m", messages=user(BROKEN), tools=TOOLS)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.startswith('<tool_call>\n{"name": "calculator"')
    assert metrics(server)['refusion_tool_calls_total{result="unparsed"}'] == before + 1


# --------------------------------------------------------------------------
# The Responses API (the openai SDK)


def test_responses_text_is_the_chat_answer(server, oai):
    chat = oai.chat.completions.create(model="m", messages=user(SVEN)).choices[0].message.content
    resp = oai.responses.create(model="m", input=SVEN)
    assert resp.status == "completed" and resp.output_text == chat and resp.output[0].type == "message"
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.usage.input_tokens_details.cached_tokens == resp.usage.input_tokens - 1  # the same prompt
    from openai.types.responses import Response

    whole = json.loads(raw(server, "POST", "/v1/responses", {"input": SVEN, "max_output_tokens": 4})[2])
    assert Response.model_validate(whole).usage.input_tokens_details.cache_write_tokens == 0  # the SDK's types hold
    short = oai.responses.create(model="m", input=SVEN, max_output_tokens=4, instructions="Be brief.",
                                 text={"format": {"type": "text"}, "verbosity": "low"})
    assert short.text.verbosity == "low"  # echoed, as OpenAI does (it was dropped)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.instructions == "Be brief." and short.usage.output_tokens == 4
    assert [(o.type, o.status) for o in short.output] == [("message", "incomplete")] and short.output_text
    evs = events(server, "/v1/responses", {"input": SVEN, "max_output_tokens": 4, "stream": True})
    done = [d["item"] for e, d in evs if e == "response.output_item.done"]
    assert evs[-1][0] == "response.incomplete" and [i["status"] for i in done] == ["incomplete"]
    assert evs[-1][1]["response"]["output"] == done and done[0]["content"][0]["text"] == short.output_text


def test_responses_stream_events(server):  # scripted: text and two calls
    evs = events(server, "/v1/responses", {"input": BOTH, "tools": RESPONSES_TOOLS, "stream": True})
    kinds = [e for e, _ in evs]
    assert all(d["type"] == e for e, d in evs) and [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and kinds.count("response.function_call_arguments.done") == 2
    text = "".join(d["delta"] for e, d in evs if e == "response.output_text.delta")
    args = [d["delta"] for e, d in evs if e == "response.function_call_arguments.delta"]
    assert text == "I will look both up." and args == ['{"name": "Sven"}', '{"name": "Zoe"}']
    final = evs[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == text


def test_a_failed_response_keeps_its_text_and_openais_error_codes(server, monkeypatch):  # scripted: BOTH
    """A step that fails mid-stream: ``response.failed`` with a code of OpenAI's list (the server's own in the
    message), its output the message written so far (incomplete); every event valid under the SDK's types."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    gen, real, said = server.engine.gen, server.engine.gen.step, []

    def failing():  # once the script's first piece went out
        if said:
            raise RuntimeError("a step failed")
        out = real()
        said.extend(r for r in out if r.text == "I will look both up.\n")
        return out

    monkeypatch.setattr(gen, "step", failing)
    evs = events(server, "/v1/responses", {"input": BOTH, "tools": RESPONSES_TOOLS, "stream": True})
    monkeypatch.setattr(gen, "step", real)
    assert [e for e, _ in evs][-4:] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.failed"]
    failed = evs[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "a step failed" in failed["error"]["message"] and "(step_failed)" in failed["error"]["message"]
    assert [(o["type"], o["status"], o["content"][0]["text"]) for o in failed["output"]] == [
        ("message", "incomplete", "I will look both up.")]
    for _, e in evs:
        pydantic.TypeAdapter(ResponseStreamEvent).validate_python(e, strict=True)


def test_items_keep_the_order_written_whole_or_streamed(server):  # scripted: text after a call
    """Text after a call comes after it, whole or streamed, on the Responses and Messages APIs; the message
    that max_output_tokens cut is incomplete either way (the stored response is the streamed one)."""
    body = {"input": AFTER, "tools": RESPONSES_TOOLS, "max_output_tokens": 8}
    whole = json.loads(raw(server, "POST", "/v1/responses", body)[2])
    final = events(server, "/v1/responses", {**body, "stream": True})[-1][1]["response"]
    for response in (whole, final):
        assert response["status"] == "incomplete"
        assert [(o["type"], o["status"]) for o in response["output"]] == [("function_call", "completed"),
                                                                          ("message", "incomplete")]
        assert response["output"][1]["content"][0]["text"] == "The answer follows."
    message = {"max_tokens": 64, "messages": user(AFTER), "tools": ANTHROPIC_TOOLS}
    whole = json.loads(raw(server, "POST", "/v1/messages", message)[2])
    streamed = events(server, "/v1/messages", {**message, "stream": True})
    assert [b["type"] for b in whole["content"]] == ["tool_use", "text"] == [
        d["content_block"]["type"] for e, d in streamed if e == "content_block_start"]


def test_responses_function_call_round_trip_continues_from_the_cache(oai):
    answer = follow_up(oai)
    first = oai.responses.create(model="m", input=CALC, tools=RESPONSES_TOOLS)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calculator" and json.loads(call.arguments) == CALL_ARGS
    second = oai.responses.create(model="m", previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert second.status == "completed" and second.output_text == answer and second.previous_response_id == first.id
    # only what is new is prefilled: the whole first turn comes from the prompt cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens - second.usage.input_tokens_details.cached_tokens < 30
    # the same conversation sent whole, without previous_response_id, is the same prompt
    whole = oai.responses.create(model="m", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": CALC},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert whole.usage.input_tokens == second.usage.input_tokens
    # a call with no function_call_output is refused, as OpenAI refuses it ("No tool output found ...")
    made = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    also, ask = {**made, "call_id": "call_also"}, {"role": "user", "content": CALC}
    said, answered = ({"role": "assistant", "content": "Computing."},
                      {"type": "function_call_output", "call_id": "call_also", "output": RESULT})
    for fields, param in (({"input": [ask, made]}, "input[1]"),
                          ({"input": "Thanks.", "previous_response_id": first.id}, "previous_response_id"),
                          ({"input": [ask, also, made, answered]}, "input[2]"),  # the call's own item, not its turn's
                          ({"input": [ask, said, made]}, "input[2]")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="m", tools=RESPONSES_TOOLS, **fields)
        assert e.value.body["param"] == param and e.value.body["message"] == (
            f"{param}: no tool output found for function call {call.call_id} (a function_call_output item with its "
            "call_id answers it)"), e.value.body
    # consecutive calls are still one assistant turn, after the message before them: the prompt chat makes of it
    both = [ask, said, also, made, answered, {**answered, "call_id": call.call_id}]
    turn = {**said, "tool_calls": [{"id": c["call_id"], "type": "function", "function": {
        "name": c["name"], "arguments": c["arguments"]}} for c in (also, made)]}
    results = [{"role": "tool", "tool_call_id": i, "content": RESULT} for i in ("call_also", call.call_id)]
    chat = oai.chat.completions.create(model="m", messages=[ask, turn] + results, max_tokens=1)
    assert oai.responses.input_tokens.count(model="m", input=both).input_tokens == chat.usage.prompt_tokens


def test_fields_an_sdk_sends_are_honoured_not_dropped(server, oai, claude):
    """Anthropic's is_error reaches the model (a failed tool reads as failed); the Responses API echoes its
    reasoning settings and, with truncation "auto", leaves out a conversation's oldest turns to fit."""
    call = [{"role": "user", "content": CALC},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                               "input": {"expression": "29 * 3"}}]}]
    counts = [claude.messages.count_tokens(model="m", tools=ANTHROPIC_TOOLS, messages=call + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ZeroDivision",
                                      "is_error": failed}]}]).input_tokens for failed in (False, True)]
    assert counts[1] > counts[0]  # "Error: ZeroDivision"
    r = oai.responses.create(model="m", input=SVEN, max_output_tokens=4, reasoning={"effort": "high"})
    counted = oai.responses.input_tokens.count(model="m", input=SVEN, instructions="Be brief.")
    asked = oai.responses.create(model="m", input=SVEN, instructions="Be brief.", max_output_tokens=4)
    assert counted.object == "response.input_tokens" and counted.input_tokens == asked.usage.input_tokens
    assert r.reasoning.effort == "high" and r.reasoning.summary is None
    long = [{"role": "user", "content": "Tell me about Sven. " * 120}, {"role": "assistant", "content": "Sven."}] * 3
    body = {"input": long + [{"role": "user", "content": SVEN}], "max_output_tokens": 16}
    status, _, payload = raw(server, "POST", "/v1/responses", body)
    assert status == 400 and json.loads(payload)["error"]["code"] == "context_length_exceeded"
    status, _, payload = raw(server, "POST", "/v1/responses", {**body, "truncation": "auto"})
    answer = json.loads(payload)
    assert status == 200 and answer["truncation"] == "auto" and answer["output"][0]["content"][0]["text"]
    assert 1000 < answer["usage"]["input_tokens"] < 2048 - 16  # the oldest turn left out (of ~700 tokens), no more


def test_a_tool_named_like_a_tool_choice_mode_can_be_forced(server):
    """A tool may be named "none" (or "auto", "required"): naming it in tool_choice forces a call to it on
    every API, not tool_choice "none" (which left every tool out and refused the request)."""
    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    chat = [{"type": "function", "function": {"name": n, "parameters": params}} for n in ("none", "calculator")]
    flat = [{"type": "function", "name": n, "parameters": params} for n in ("none", "calculator")]
    anthropic = [{"name": n, "input_schema": params} for n in ("none", "calculator")]
    for path, body, named in (
            ("/v1/chat/completions", {"messages": user(CALC), "tools": chat,
                                      "tool_choice": {"type": "function", "function": {"name": "none"}}},
             lambda a: a["choices"][0]["message"]["tool_calls"][0]["function"]["name"]),
            ("/v1/responses", {"input": CALC, "tools": flat, "tool_choice": {"type": "function", "name": "none"}},
             lambda a: a["output"][0]["name"]),
            ("/v1/messages", {"max_tokens": 64, "messages": user(CALC), "tools": anthropic,
                              "tool_choice": {"type": "tool", "name": "none"}},
             lambda a: a["content"][-1]["name"])):
        status, _, payload = raw(server, "POST", path, body)
        assert status == 200, payload
        assert named(json.loads(payload)) == "none", path


def test_stored_responses_get_and_delete(server, oai):
    resp = oai.responses.create(model="m", input=SVEN)
    assert oai.responses.retrieve(resp.id).output_text == resp.output_text
    with pytest.raises(openai.BadRequestError) as e:  # not an empty stream without a word
        list(oai.responses.retrieve(resp.id, stream=True))
    assert e.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as e:  # only a background response is cancelled; none runs here
        oai.responses.cancel(resp.id)
    assert "not a background response" in e.value.body["message"] and e.value.body["param"] == "response_id"
    oai.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.cancel(resp.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(resp.id)
    unstored = oai.responses.create(model="m", input=SVEN, store=False)
    assert raw(server, "GET", f"/v1/responses/{unstored.id}")[0] == 404
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input="Next.", previous_response_id=resp.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


def test_stored_response_lists_its_input_items(server, oai):
    """GET /v1/responses/{id}/input_items (the openai SDK's input_items.list):
    the request's own input, newest first by default, with ids, paged."""
    resp = oai.responses.create(model="m", max_output_tokens=8, input=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": SVEN}])
    items = oai.responses.input_items.list(resp.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", SVEN), ("system", "Answer briefly.")]
    assert all(i.type == "message" and i.id.startswith("msg_") for i in items.data)
    first = oai.responses.input_items.list(resp.id, order="asc", limit=1)
    assert [i.role for i in first.data] == ["system"] and first.has_more
    rest = oai.responses.input_items.list(resp.id, order="asc", after=first.data[0].id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    calls = oai.responses.create(model="m", max_output_tokens=8, input=[
        {"role": "user", "content": CALC},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": RESULT}], tools=RESPONSES_TOOLS)
    listed = json.loads(raw(server, "GET", f"/v1/responses/{calls.id}/input_items?order=asc")[2])["data"]
    assert [(i["type"], i["status"]) for i in listed] == [("message", "completed"), ("function_call", "completed"),
                                                          ("function_call_output", "completed")]  # the SDK's types
    import pydantic
    from openai.types.responses import ResponseItem

    said = oai.responses.create(model="m", max_output_tokens=4, input=[
        {"role": "user", "content": SVEN}, {"role": "assistant", "content": "Sven."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "More."}]},
        {"role": "user", "content": "Go on."}])
    listed = json.loads(raw(server, "GET", f"/v1/responses/{said.id}/input_items?order=asc")[2])["data"]
    assert [p["annotations"] for i in listed[1:3] for p in i["content"]] == [[], []]  # the SDK's types, strictly
    assert all(pydantic.TypeAdapter(ResponseItem).validate_python(i, strict=True) for i in listed)
    one = oai.responses.create(model="m", max_output_tokens=8, input=SVEN)  # a string is one user message
    assert [i.content[0].type for i in oai.responses.input_items.list(one.id).data] == ["input_text"]
    assert raw(server, "GET", f"/v1/responses/{resp.id}/input_items?after=msg_nope")[0] == 400
    assert raw(server, "GET", f"/v1/responses/{resp.id}/input_items?limit=0")[0] == 400
    assert raw(server, "GET", "/v1/responses/resp_nope/input_items")[0] == 404
    for bad in ({"x": 1}, ["l"], 5):  # an item's id is a string (it pages the list), or absent / null: a new one
        status, _, payload = raw(server, "POST", "/v1/responses", {"max_output_tokens": 4, "input": [
            {"id": bad, "role": "user", "content": SVEN}]})
        error = json.loads(payload)["error"]
        assert status == 400 and error["param"] == "input[0].id" and "must be a string" in error["message"]
    null = oai.responses.create(model="m", max_output_tokens=4, input=[{"id": None, "role": "user", "content": SVEN}])
    assert oai.responses.input_items.list(null.id).data[0].id.startswith("msg_")
    # ids page the list, so they differ (OpenAI's 400 too); a page after an id moves on, whatever the items
    twice = [{"id": "msg_dup", "role": "user", "content": SVEN}, {"id": "msg_dup", "role": "user", "content": "Hi."}]
    status, _, payload = raw(server, "POST", "/v1/responses", {"max_output_tokens": 4, "input": twice})
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "input" and "duplicate item id 'msg_dup'" in error["message"]
    from refusion_mlx.serve.protocols.responses_store import item_page

    items = [{"id": i} for i in ("a", "dup", "b", "dup", "c")]
    assert [i["id"] for i in item_page(items, 2, "asc", after="dup")["data"]] == ["c"]
    assert [i["id"] for i in item_page(items, 9, "desc", before="dup")["data"]] == ["c"]


# --------------------------------------------------------------------------
# Anthropic's Messages API (the anthropic SDK)


def test_anthropic_final_assistant_message_is_a_prefill(server, oai, claude):
    """A final assistant message starts the answer (Anthropic's prefill): the
    prompt leaves that turn open, the answer holds only what follows (the
    same as completing the rendered text), and its count says so; an empty one
    is no message; one ending in whitespace is Anthropic's 400."""
    prefill = user(SVEN) + [{"role": "assistant", "content": "Sven lives"}]
    rendered = "<|im_start|>user\nWho is Sven?<|im_end|>\n<|im_start|>assistant\nSven lives"  # the demo's template
    plain = claude.messages.count_tokens(model="m", messages=user(SVEN)).input_tokens
    count = claude.messages.count_tokens(model="m", messages=prefill).input_tokens
    assert count == json.loads(raw(server, "POST", "/tokenize", {"prompt": rendered})[2])["count"] > plain
    msg = claude.messages.create(model="m", max_tokens=16, messages=prefill)
    assert msg.content[0].text == oai.completions.create(model="m", prompt=rendered, max_tokens=16).choices[0].text
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count
    empty = claude.messages.create(model="m", max_tokens=16, messages=user(SVEN) + [
        {"role": "assistant", "content": ""}])
    assert empty.content[0].text == claude.messages.create(model="m", max_tokens=16,
                                                           messages=user(SVEN)).content[0].text
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=16, messages=user(SVEN) + [
            {"role": "assistant", "content": "Sven lives "}])
    assert "trailing whitespace" in e.value.body["error"]["message"]


def test_anthropic_create_stream_and_count_tokens(oai, claude):
    chat = oai.chat.completions.create(model="m", messages=user(SVEN)).choices[0].message.content
    msg = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=user(SVEN))
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat
    u = msg.usage
    assert u.cache_read_input_tokens > 0 and u.input_tokens + u.cache_read_input_tokens == claude.messages.count_tokens(
        model="m", messages=user(SVEN)).input_tokens
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=user(SVEN)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == chat and final.stop_reason == "end_turn" and final.usage.output_tokens == u.output_tokens
    cut = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=user(SVEN), stop_sequences=["baker"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "baker"
    assert cut.content[0].text == chat[:chat.index("baker")]
    assert claude.messages.create(model="m", max_tokens=3, messages=user(SVEN)).stop_reason == "max_tokens"
    page = claude.models.list()  # Anthropic's model objects, from the same route as OpenAI's
    (card,) = page.data
    assert (card.type, card.display_name, page.has_more, page.first_id) == ("model", card.id, False, card.id)
    assert card.created_at.year >= 2025 and oai.models.list().data[0].id == card.id


def test_anthropic_stream_events(server):
    evs = events(server, "/v1/messages", {"max_tokens": MAX_TOKENS, "messages": user(BOTH), "stream": True,
                                          "tools": ANTHROPIC_TOOLS})  # scripted: text and two calls
    kinds = [e for e, _ in evs]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for e, d in evs if e == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use", "tool_use"]
    assert kinds.count("content_block_stop") == 3 and evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    deltas = [d["delta"] for e, d in evs if e == "content_block_delta"]
    assert [json.loads(d["partial_json"]) for d in deltas if d["type"] == "input_json_delta"] == [
        {"name": "Sven"}, {"name": "Zoe"}]
    again = events(server, "/v1/messages", {"max_tokens": MAX_TOKENS, "messages": user(BOTH), "stream": True,
                                            "tools": ANTHROPIC_TOOLS})  # its prompt cached now
    first, last = again[0][1]["message"]["usage"], again[-2][1]["usage"]
    assert first["cache_read_input_tokens"] > 0 and first["output_tokens"] == 0
    assert (first["input_tokens"], first["cache_read_input_tokens"]) == (last["input_tokens"],
                                                                         last["cache_read_input_tokens"])


def test_anthropic_tool_use_round_trip(oai, claude):
    messages = user(CALC)
    first = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=messages, tools=ANTHROPIC_TOOLS)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "calculator" and use.input == CALL_ARGS
    assert use.id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    second = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=messages, tools=ANTHROPIC_TOOLS)
    assert second.stop_reason == "end_turn" and [(b.type, b.text) for b in second.content] == [("text", follow_up(oai))]
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=user(CALC), tools=ANTHROPIC_TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == CALL_ARGS


# --------------------------------------------------------------------------
# Bad input: one clear 4xx in the API's own error shape, streamed or not


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
BAD = [
    ("/v1/chat/completions", {"messages": user(SVEN), "tools": [BAD_TOOL]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": user(SVEN), "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/chat/completions", {"messages": user(SVEN), "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": user(SVEN), "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": user(SVEN) + [{"role": "tool", "tool_call_id": "call_9", "content": "42"}]},
     "messages[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "calculator", "arguments": "not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    # arguments nested past the parser (a string's nesting is not the body's): json.loads' RecursionError, a 500
    ("/v1/chat/completions", {"messages": user(SVEN) + [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "calculator", "arguments": "[" * 100000 + "]" * 100000}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}, "messages[1].tool_calls[0].function.arguments"),
    ("/v1/responses", {"input": [{"role": "user", "content": CALC}, {"type": "function_call", "call_id": "c1",
                                                                      "name": "calculator",
                                                                      "arguments": '{"a":' + "[" * 100000 + "]" * 100000 + "}"},
                                 {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, "input[1].arguments"),
    ("/v1/responses", {"input": SVEN, "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools[0].parameters"),
    ("/v1/responses", {"input": SVEN, "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "x"}},
     "tool_choice"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "42"}]}, "input[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ("/v1/responses", {"input": [{"type": "reasoning"}]}, "input[0].type"),
    ("/v1/responses", {"input": SVEN, "previous_response_id": "resp_nope"}, "previous_response_id"),
    # what the answer would depend on but is not kept here: refused, not answered without it
    ("/v1/responses", {"input": SVEN, "conversation": "conv_1"}, "conversation"),
    ("/v1/responses", {"input": SVEN, "prompt": {"id": "pmpt_1"}}, "prompt"),
    ("/v1/responses", {"input": SVEN, "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, "text.format.schema"),
    ("/v1/responses", {"input": 5}, "input"),
    # as strict as OpenAI's and Anthropic's own: none of these is read as a default
    ("/v1/responses", {"input": SVEN, "reasoning": {"effort": "extreme"}}, "reasoning"),
    ("/v1/responses", {"input": SVEN, "reasoning": "high"}, "reasoning"),
    ("/v1/responses", {"input": SVEN, "text": {"verbosity": "loud"}}, "text.verbosity"),  # it was echoed
    ("/v1/responses", {"input": SVEN, "text": {"verbosity": ["low"]}}, "text.verbosity"),
    ("/v1/responses", {"input": SVEN, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ("/v1/responses", {"input": SVEN, "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format.name"),
    ("/v1/responses", {"input": SVEN, "text": {"format": {"type": "json_schema", "name": "x", "strict": "yes",
                                                          "schema": {"type": "object"}}}}, "text.format.strict"),
    ("/v1/responses", {"input": [{"role": "user", "content": CALC}, {"type": "function_call", "call_id": "c1",
                                                                      "name": "calculator"}]}, "input[1].arguments"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "tools": ANTHROPIC_TOOLS, "tool_choice": {}},
     "tool_choice"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "thinking": {}}, "thinking.type"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "tools": [{"name": "f", "input_schema": None}]},
     "tools[0].input_schema"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "", "input": {}}]}]}, "messages[0].content[0]"),
    ("/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42",
                                      "is_error": "yes"}]}]}, "messages[1].content[0].is_error"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "tools": [{"name": "f", "input_schema": {
        "type": "object", "required": 3}}]}, "tools[0].input_schema"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "tools": ANTHROPIC_TOOLS,
                      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "mcp_servers": [
        {"type": "url", "url": "https://mcp.example/sse", "name": "x"}]}, "mcp_servers"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "42"}]}]}, "messages[0].content[0]"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages[0].content[0].type"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": "6*7"}]}]},
     "messages[0].content[0].input"),
    ("/v1/messages", {"messages": user(SVEN)}, "max_tokens"),  # required
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content[0].type"),
    # Anthropic's own limits: content and text blocks non-empty (but a final assistant prefill), temperature
    # from 0 to 1, metadata user_id alone
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN) + [{"role": "assistant", "content": [
        {"type": "text", "text": ""}]}, {"role": "user", "content": "Go on."}]}, "messages[1].content[0].text"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "temperature": 1.5}, "temperature"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "metadata": {"user_id": "u", "foo": "x"}},
     "metadata"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "metadata": {"user_id": 5}}, "metadata"),
    # the prompt cache's partition: at most 256 characters, as chat's and the Responses API's user (unbounded here)
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "metadata": {"user_id": "u" * 257}}, "metadata"),
    ("/v1/chat/completions", {"max_tokens": 8, "messages": user(SVEN), "user": "u" * 257}, "user"),
    ("/v1/responses", {"input": SVEN, "user": "u" * 257}, "user"),
    ("/v1/messages", {"max_tokens": 8, "messages": user(SVEN), "tool_choice": {"type": "any"}}, "tool_choice"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_input_is_one_4xx_in_the_api_shape(server, path, body, param):
    for stream in (False, True):  # nothing half-streamed: a stream is refused before it starts
        status, kind, payload = raw(server, "POST", path, {**body, **({"stream": True} if stream else {})})
        assert status == 400 and kind == "application/json", payload
        err = json.loads(payload)
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
            assert err["error"]["type"] == "invalid_request_error" and "\n" not in err["error"]["message"]
            assert err["error"]["message"].startswith(param + ": "), err  # Anthropic's shape has no param
        else:
            assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
            assert err["error"]["message"].startswith(param + ": ") and "\n" not in err["error"]["message"]


def test_anthropic_shape_for_every_error_on_its_routes(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=8, messages=user(SVEN), tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "no tool named" in e.value.message
    status, _, payload = raw(server, "GET", "/v1/messages")
    assert status == 405 and json.loads(payload)["type"] == "error"
    status, _, payload = raw(server, "POST", "/v1/messages", b"{oops")
    assert status == 400 and json.loads(payload)["error"]["type"] == "invalid_request_error"


# --------------------------------------------------------------------------
# One engine for all three: batching, metrics by API, the slots in every stream


def test_the_three_apis_batch_together_with_their_answers_alone(server, oai, claude):
    def ask(api):
        if api == "chat":
            return oai.chat.completions.create(model="m", messages=user(SVEN)).choices[0].message.content
        if api == "responses":
            return oai.responses.create(model="m", input=SVEN).output_text
        return claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=user(SVEN)).content[0].text

    alone = ask("chat")
    steps = metrics(server)["refusion_steps_total"]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, ["chat", "responses", "messages"] * 2))
    assert answers == [alone] * 6
    assert metrics(server)["refusion_steps_total"] - steps < 6 * 4  # shared forwards (each alone takes 4 steps)


def test_metrics_by_api(server, oai):
    m = metrics(server)
    for api in ("chat.completions", "responses", "messages"):
        assert m[f'refusion_api_requests_total{{api="{api}",outcome="completed"}}'] >= 3, api
    assert m['refusion_tool_calls_total{result="parsed"}'] >= 6
    completions = m.get('refusion_api_requests_total{api="completions",outcome="completed"}', 0)
    oai.completions.create(model="m", prompt="1 2 3", max_tokens=4)
    assert metrics(server)['refusion_api_requests_total{api="completions",outcome="completed"}'] == completions + 1


@pytest.mark.parametrize("path,body,name", [
    ("/v1/responses", {"input": SVEN}, "response.commits"),
    ("/v1/messages", {"messages": user(SVEN), "max_tokens": MAX_TOKENS}, "commits"),
])
def test_every_stream_carries_the_slots_when_asked(server, path, body, name):
    """The web page's slot view: stream_options.include_commits on the Responses and Messages APIs too."""
    evs = events(server, path, {**body, "stream": True, "stream_options": {"include_commits": True}})
    commits = [d["commits"] for e, d in evs if e == name]
    assert commits[0]["step"] == 0 and sum(commits[0]["blocks"]) == MAX_TOKENS
    positions = sorted(p for c in commits[1:] for s in c["slots"] for p in s["positions"])
    assert positions and positions == list(range(len(positions)))
    assert not [e for e, _ in events(server, path, {**body, "stream": True}) if e == name]


# --------------------------------------------------------------------------
# Agent frameworks: the OpenAI Agents SDK and LangChain


@pytest.fixture(scope="module")
def agents_sdk(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI otherwise
    client = openai.AsyncOpenAI(base_url=server.url, api_key="local", max_retries=0)
    return agents, {"chat": agents.OpenAIChatCompletionsModel(model="tiny-refusion", openai_client=client),
                    "responses": agents.OpenAIResponsesModel(model="tiny-refusion", openai_client=client)}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_runner_with_a_function_tool(agents_sdk, api):
    agents, models = agents_sdk
    seen = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """The value of an arithmetic expression."""
        seen.append(expression)
        return RESULT

    agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculator], model=models[api])
    result = agents.Runner.run_sync(agent, CALC, max_turns=3)
    # its instructions are a system message: another conversation than follow_up's, answered in text
    assert seen == [CALL_ARGS["expression"]] and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_runner_answers(agents_sdk, oai, api):
    agents, models = agents_sdk
    agent = agents.Agent(name="plain", model=models[api])
    chat = oai.chat.completions.create(model="m", messages=user(SVEN)).choices[0].message.content
    assert agents.Runner.run_sync(agent, SVEN).final_output == chat


def test_langchain(server):
    langchain = pytest.importorskip("langchain_openai")
    llm = langchain.ChatOpenAI(model="tiny-refusion", base_url=server.url, api_key="local", max_retries=0,
                               max_tokens=MAX_TOKENS)
    text = llm.invoke(SVEN).content
    assert text.startswith("Sven")
    calls = llm.bind_tools(TOOLS).invoke(CALC).tool_calls
    assert [(c["name"], c["args"]) for c in calls] == [("calculator", CALL_ARGS)]
    chunks = list(llm.bind_tools(TOOLS).stream(BOTH))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [c["args"] for c in merged.tool_calls] == [{"name": "Sven"}, {"name": "Zoe"}]
    responses = langchain.ChatOpenAI(model="tiny-refusion", base_url=server.url, api_key="local", max_retries=0,
                                     use_responses_api=True)
    assert responses.invoke(SVEN).text == text


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agent_loop_example(server, oai, api, monkeypatch, capsys):
    """examples/agent_loop.py, run as its command line would (in this process: no second interpreter)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("agent_loop_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr("sys.argv", ["agent_loop.py", CALC, "--base-url", server.url, "--api", api])
    assert example.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f'  calculator({json.dumps(CALL_ARGS)}) -> {RESULT}', f"tiny-refusion> {follow_up(oai)}"]
    assert example.calculate("(2 + 3) * 4 / 8") == "2.5" and example.calculate("__import__('os')").startswith(
        "error")
