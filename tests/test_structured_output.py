"""Structured output through the server's three APIs (serve/core/structured.py), on
the demo model: chat completions' ``response_format`` (the openai SDK's
``.parse`` too) and forced ``tool_choice``, the Responses API's
``text.format``, the Messages API's forced ``tool_choice`` -- alone and eight
at once; every answer validates. These schemas are not the demo's JSON
family: the grammar alone makes them hold.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from refusion_mlx.serve.http_server import RefusionServer
from tests.agent_server import TOOLS as DEMO_TOOLS  # the demo's own two tools: it calls them

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "turtle"]}, "maxItems": 2},
    "city": {"type": "string", "maxLength": 6}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
FIND = {"type": "object", "properties": {"name": {"enum": ["Sven", "Dara", "Quinn"]}}, "required": ["name"],
        "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
         {"type": "function", "function": {"name": "find", "description": "a person", "parameters": FIND}}]
SCHEMAS = {"add": ADD, "find": FIND}


class Person(BaseModel):
    name: str = Field(pattern="^[A-Z][a-z]{1,7}$")
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "turtle"]


@pytest.fixture(scope="module")
def server():
    srv = RefusionServer(None, model_id="tiny-refusion", port=0).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=120)


def ask(oai, prompt="Who is Sven?", **kw):
    return oai.chat.completions.create(model="tiny-refusion", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=kw.pop("max_tokens", 96), **kw)


def json_schema(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_response_format_json_schema_eight_at_once(oai):
    prompts = ["Who is Sven?", "Describe Dara.", "Quinn?", "x", "Who is Zoe?", "Tell me a story.", "2+2?", "Hi"]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: ask(oai, p, response_format=json_schema(PERSON)), prompts))
    for a in answers:
        assert a.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(a.choices[0].message.content), PERSON)


def test_openai_sdk_parse_and_json_object(oai):
    parsed = oai.chat.completions.parse(model="tiny-refusion", messages=[{"role": "user", "content": "Who is Sven?"}],
                                        response_format=Person, max_tokens=64)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    obj = ask(oai, response_format={"type": "json_object"}, max_tokens=32).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    text = ask(oai, response_format={"type": "text"}, max_tokens=24).choices[0].message.content
    assert text == ask(oai, max_tokens=24).choices[0].message.content  # "text" constrains nothing


def test_a_budget_too_small_finishes_length(oai):
    choice = ask(oai, response_format=json_schema(PERSON), max_tokens=6).choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"name":')


def test_forced_tool_calls(oai):
    for choice, names in (("required", {"add", "find"}), ({"type": "function", "function": {"name": "find"}},
                                                          {"find"})):
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: ask(oai, p, tools=TOOLS, tool_choice=choice),
                                    ["What is 2+3?", "Who is Sven?"]))
        for a in answers:
            c = a.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                assert call.function.name in names
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tools_whose_schemas_refer_to_their_own_definitions(oai):
    """A tool's ``$ref``s (pydantic's ``$defs`` for a nested model, ``#`` for itself) point into its own
    parameters, wherever the calls' grammar places them: forced and strict calls decode under them."""
    import openai as sdk

    class Name(BaseModel):
        name: Literal["Sven", "Dara", "Quinn"]

    class Lookup(BaseModel):
        person: Name

    tool = sdk.pydantic_function_tool(Lookup, name="lookup")
    params = tool["function"]["parameters"]
    assert "$defs" in params and '"$ref": "#/$defs/Name"' in json.dumps(params)
    for kw in ({"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "lookup"}}}):
        message = ask(oai, "Who is Sven?", tools=[tool, TOOLS[0]], max_tokens=96, **kw).choices[0].message
        assert message.tool_calls
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), params if call.function.name == "lookup"
                                else ADD)
    from refusion_mlx.decode.grammar import relocated

    itself = {"type": "object", "properties": {"next": {"$ref": "#"}, "n": {"$ref": "#/$defs/N"},
                                               "tag": {"const": {"$ref": "#"}}, "default": {"$ref": "#/$defs/N"}},
              "$defs": {"N": {"type": "integer"}}}
    moved = relocated(itself, "/anyOf/1/properties/arguments")
    assert moved["properties"]["next"] == {"$ref": "#/anyOf/1/properties/arguments"}
    assert moved["properties"]["n"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/N"}
    assert moved["properties"]["tag"] == {"const": {"$ref": "#"}} and moved["$defs"] == itself["$defs"]
    assert moved["properties"]["default"] == moved["properties"]["n"]  # a property's name, not the keyword


def test_a_forced_call_cut_by_max_tokens_shows_no_markup(server, oai):
    """A call max_tokens cut short is left out, on every API, streamed or not: the answer is what came
    before it (nothing, when the call is forced), finishing "length" (Anthropic: "max_tokens")."""
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120)
    msgs = [{"role": "user", "content": "What is 29 * 3?"}]
    chat = ask(oai, "What is 29 * 3?", tools=TOOLS, tool_choice="required", max_tokens=5).choices[0]
    assert chat.finish_reason == "length" and not chat.message.content and not chat.message.tool_calls
    streamed = [c.choices[0] for c in oai.chat.completions.create(
        model="m", messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=5, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in streamed) == "" and streamed[-1].finish_reason == "length"
    r = oai.responses.create(model="m", input="What is 29 * 3?", max_output_tokens=5, tool_choice="required",
                             tools=[{"type": "function", **t["function"]} for t in TOOLS])
    assert r.status == "incomplete" and r.output_text == "" and not r.output
    m = claude.messages.create(model="m", max_tokens=5, messages=msgs, tool_choice={"type": "any"},
                               tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                      for t in TOOLS])
    assert m.stop_reason == "max_tokens" and not any("<tool_call>" in getattr(b, "text", "") for b in m.content)


def test_strict_tools_under_auto(oai):
    """Strict tools with tool_choice auto, and any tools under the default ``--call-grammar all``: text,
    then maybe calls under their schemas (the demo's call markers are tokens of its own, so the grammar
    sees every call it opens): the same answer either way, and each call it makes validates."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    def said(answer):  # the text and the calls (their ids are new each time)
        return answer.content, [(c.function.name, c.function.arguments) for c in answer.tool_calls or ()]

    calls = 0
    for prompt in ("Who is Sven?", "Find Dara.", "Add 4 and 5.", "What is 4 + 5?"):
        answer = ask(oai, prompt, tools=strict, max_tokens=48).choices[0].message
        assert said(answer) == said(ask(oai, prompt, tools=TOOLS, max_tokens=48).choices[0].message)
        for call in answer.tool_calls or ():
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            calls += 1
    assert calls  # the demo calls tools (its own two, examples/demo_model/tool_data.py): these too


CALLED, PLAIN = "Where does Sven live?", "Give Alice's facts as JSON."  # the demo calls lookup_person, or not


def test_tools_and_a_format_under_auto_answer_with_calls_or_the_json(oai):
    """Tools (tool_choice auto) beside a format (``response_format``, ``text.format``, ``output_format``):
    the answer is the calls or the format's JSON, as OpenAI's (the Agents SDK's ``output_type`` with tools).
    The format's grammar alone made the call the demo opens text inside the JSON ('{"city": "searckup_pki"}').
    tool_choice "none": the JSON; "required": the call. Chat completions here, streamed too."""
    for fmt in (json_schema(CITY, "answer"), {"type": "json_object"}):
        call = ask(oai, CALLED, tools=DEMO_TOOLS, response_format=fmt, max_tokens=48).choices[0]
        assert call.finish_reason == "tool_calls" and not call.message.content, call
        assert [(c.function.name, json.loads(c.function.arguments)) for c in call.message.tool_calls] == [
            ("lookup_person", {"name": "Sven"})]
        text = ask(oai, PLAIN, tools=DEMO_TOOLS, response_format=fmt, max_tokens=48).choices[0]
        assert not text.message.tool_calls and text.message.content.startswith("{")
        if fmt["type"] == "json_schema" or text.finish_reason == "stop":  # any object: the demo may run on (GPU paths)
            assert text.finish_reason == "stop"
            jsonschema.validate(json.loads(text.message.content), fmt.get("json_schema", {}).get("schema", {}))
    streamed = [c.choices[0] for c in oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": CALLED}], tools=DEMO_TOOLS, stream=True, max_tokens=48,
        response_format=json_schema(CITY, "answer")) if c.choices]
    assert [t.function.name for c in streamed for t in c.delta.tool_calls or ()] == ["lookup_person"]
    assert streamed[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in streamed)
    none = ask(oai, CALLED, tools=DEMO_TOOLS, tool_choice="none", response_format=json_schema(CITY, "answer"),
               max_tokens=48).choices[0]
    assert none.finish_reason == "stop" and not none.message.tool_calls
    jsonschema.validate(json.loads(none.message.content), CITY)
    forced = ask(oai, PLAIN, tools=DEMO_TOOLS, tool_choice="required", response_format=json_schema(CITY, "answer"),
                 max_tokens=48).choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.tool_calls


def test_tools_and_text_format_on_the_responses_api_answer_with_calls_or_the_json(oai):
    """The Responses API's ``text.format`` beside tools under auto: a function_call item, or the JSON."""
    functions = [{"type": "function", **t["function"]} for t in DEMO_TOOLS]
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": CITY}}
    r = oai.responses.create(model="m", input=CALLED, max_output_tokens=48, tools=functions, text=fmt)
    assert r.status == "completed" and r.output_text == ""
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", "lookup_person", {"name": "Sven"})]
    r = oai.responses.create(model="m", input=PLAIN, max_output_tokens=48, tools=functions, text=fmt)
    assert r.status == "completed" and [o.type for o in r.output] == ["message"]
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_tools_and_output_format_on_the_messages_api_answer_with_calls_or_the_json(server):
    """The Messages API's ``output_format`` beside tools under auto: a tool_use block, or the JSON."""
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in DEMO_TOOLS]
    for prompt, stop in ((CALLED, "tool_use"), (PLAIN, "end_turn")):
        m = claude.messages.create(model="m", max_tokens=48, tools=tools, messages=[{"role": "user", "content": prompt}],
                                   extra_body={"output_format": {"type": "json_schema", "schema": CITY}})
        assert m.stop_reason == stop, m.content
        if stop == "tool_use":
            assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "lookup_person", {"name": "Sven"})]
        else:
            jsonschema.validate(json.loads(m.content[0].text), CITY)


def test_text_that_spells_a_special_token_is_answered_as_text(oai):
    """A pattern spelling "<think>" got past the check for special tokens and failed mid-answer (a 400 after
    the work; under tool_choice auto a non-strict tool's pattern failed the whole request): it is text now."""
    tag = {"type": "string", "pattern": "^<thin[k]>$"}
    r = ask(oai, response_format=json_schema(tag, "tag"), max_tokens=16).choices[0]
    assert r.message.content == '"<think>"' and r.finish_reason == "stop"
    tools = [{"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"t": tag}, "required": ["t"]}}}]
    for choice in ("auto", "required"):
        r = ask(oai, "Tag it.", tools=tools, tool_choice=choice, max_tokens=32).choices[0]
        for call in r.message.tool_calls or ():
            assert json.loads(call.function.arguments) == {"t": "<think>"}
    assert r.finish_reason == "tool_calls"


def test_responses_text_format(oai):
    r = oai.responses.create(model="tiny-refusion", input="Who is Sven?", max_output_tokens=96,
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with pytest.raises(openai.BadRequestError) as e:  # chat completions' nesting: the schema would go unread
        oai.responses.create(model="tiny-refusion", input="Who is Sven?", max_output_tokens=8, text={
            "format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert e.value.body["param"] == "text.format.json_schema"


def test_anthropic_forced_tool_choice(server):
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120)
    tools = [{"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    for choice, names in (({"type": "any"}, {"add", "find"}), ({"type": "tool", "name": "add"}, {"add"})):
        m = claude.messages.create(model="tiny-refusion", max_tokens=96, tools=tools, tool_choice=choice,
                                   messages=[{"role": "user", "content": "Who is Sven?"}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses
        for b in uses:
            assert b.name in names
            jsonschema.validate(b.input, SCHEMAS[b.name])


def test_a_call_whose_argument_holds_the_end_marker_is_a_call(server, oai):
    """An argument may hold the call format's end marker (an agent writing a file about tool calls): the call
    ends at the marker after its JSON, so it comes back a call with its argument whole, on both APIs (a schema
    that spells the markers is taken: it was refused while such a call ended there)."""
    write = {"type": "object", "properties": {"content": {"type": "string", "pattern": "^see <[/]tool_call> here$"},
                                              "tag": {"enum": ["<tool_call></tool_call>"]}},
             "required": ["content", "tag"]}
    want = {"content": "see </tool_call> here", "tag": "<tool_call></tool_call>"}
    c = ask(oai, "write it", max_tokens=96, tools=[{"type": "function", "function": {"name": "Write",
                                                                                     "parameters": write}}],
            tool_choice={"type": "function", "function": {"name": "Write"}}).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content, c
    assert json.loads(c.message.tool_calls[0].function.arguments) == want
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120)
    m = claude.messages.create(model="tiny-refusion", max_tokens=96, messages=[{"role": "user", "content": "write it"}],
                               tools=[{"name": "Write", "input_schema": write}], tool_choice={"type": "tool",
                                                                                              "name": "Write"})
    assert m.stop_reason == "tool_use" and [(b.type, b.input) for b in m.content] == [
        ("tool_use", want)]


def test_a_schema_without_type_object_is_an_object_or_a_400(server, oai):
    """OpenAI's ``parameters`` without ``type`` are an object's (OpenAI takes them): a forced call's
    arguments are decoded as one, never null, and the call never comes back as markup text. Anthropic
    refuses an ``input_schema`` whose type is not "object", as its API does."""
    untyped = ({"properties": {}}, {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                              {"type": "null"}]})
    for params in untyped:
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            c = ask(oai, "Who is Sven?", tools=[tool], tool_choice=choice, max_tokens=64).choices[0]
            assert c.finish_reason == "tool_calls" and not c.message.content, c
            assert isinstance(json.loads(c.message.tool_calls[0].function.arguments), dict)
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120)
    for params in untyped:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="m", max_tokens=32, tool_choice={"type": "any"},
                                   tools=[{"name": "f", "input_schema": params}],
                                   messages=[{"role": "user", "content": "Who is Sven?"}])
        assert e.value.body["error"]["message"].startswith("tools[0].input_schema.type: ")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": json_schema({"type": "string", "pattern": "(?<=a)b"})},
     "response_format.json_schema.schema"),
    ({"response_format": json_schema({"type": "nope"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema('{"type": "object"}')}, "response_format.json_schema.schema"),  # text
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # as OpenAI: a schema's name is required (the Responses API's rule too), strict is a boolean
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": CITY}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {  # beside a format too
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}], "response_format": json_schema(CITY)},
     "tools"),
])
def test_a_schema_the_engine_cannot_take_is_one_400(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, **fields)
    err = e.value.body
    assert err["param"] == param and err["message"].startswith(param + ": ") and "\n" not in err["message"]


def test_stop_strings_are_refused_where_a_grammar_holds_the_whole_answer(server, oai):
    """A stop string would cut a constrained answer short (and it would still say "stop"): one 400 naming the
    API's own field, for a format and a forced call; strict tools under auto (text, then maybe calls) keep them."""
    for fields, by in (({"response_format": json_schema(PERSON)}, "response_format"),
                       ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(oai, stop=['"a'], **fields)
        assert e.value.body["param"] == "stop" and e.value.body["message"].startswith(
            f"stop: not supported with an answer constrained by {by}")
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    answer = ask(oai, stop=["Sven"], tools=strict, max_tokens=24)
    finish, calls = answer.choices[0].finish_reason, answer.choices[0].message.tool_calls or []
    for call in calls:  # what the grammar held is whole, whatever ended the answer
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # "length" exactly when the budget ended it (where the grammar would still take more: another call)
    assert (finish == "length") == (answer.usage.completion_tokens >= 24), (finish, answer.usage)
    assert finish in ("length", "tool_calls" if calls else "stop"), (finish, calls)
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-refusion", max_tokens=32, stop_sequences=["{"], tool_choice={"type": "any"},
                               tools=[{"name": "add", "description": "x", "input_schema": ADD}],
                               messages=[{"role": "user", "content": "What is 2+3?"}])
    assert e.value.body["error"]["message"].startswith("stop_sequences: not supported")


def test_call_grammar_constrains_auto_calls_in_one_place():
    """``--call-grammar all`` (the default): a request with tools and no constraint of its own is decoded as
    text, then maybe calls under their tools' schemas; "strict", a format, a forced call, logprobs: as asked."""
    import dataclasses

    from refusion_mlx.decode.grammar import Constraint
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.errors import RefusionError
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.server_config import ServerConfig
    from refusion_mlx.serve.core.structured import with_call_grammar

    plain = EngineRequest([1, 2], RefusionParams(), tools=tuple(TOOLS), parallel_tool_calls=False)
    made = with_call_grammar(plain, "all")
    spec = json.loads(made.constraint.source)
    assert made.constraint.kind == "tool_calls" and spec["optional"] and not spec["parallel"]
    assert [t["name"] for t in spec["tools"]] == ["add", "find"] and spec["tools"][0]["parameters"] == ADD
    assert with_call_grammar(plain, "strict") is plain
    assert with_call_grammar(dataclasses.replace(plain, tools=()), "all").constraint is None
    assert with_call_grammar(dataclasses.replace(plain, logprobs=2), "all").constraint is None
    shaped = dataclasses.replace(plain, constraint=made.constraint)
    assert with_call_grammar(shaped, "all") is shaped
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^(?=a)a+$"}}}}}  # a look-around: the engine cannot compile it
    assert with_call_grammar(dataclasses.replace(plain, tools=(odd,)), "all").constraint is None
    fmt = Constraint.json_schema(CITY, "response_format")  # a format: its JSON or the calls, under either setting
    for setting in ("all", "strict"):
        spec = json.loads(with_call_grammar(dataclasses.replace(plain, constraint=fmt), setting).constraint.source)
        assert spec["answer"] == CITY and not spec["optional"] and [t["name"] for t in spec["tools"]] == ["add", "find"]
    formatted = dataclasses.replace(plain, constraint=fmt, tools=(odd,))  # tools it cannot take: the format alone
    assert with_call_grammar(formatted, "all") is formatted
    assert ServerConfig().call_grammar == "all"
    with pytest.raises(RefusionError, match="call_grammar must be one of all, strict"):
        ServerConfig(call_grammar="always")


def test_call_grammar_strict_decodes_other_tools_calls_freely(server, oai):
    """The demo left free (``--call-grammar strict``, its tools not strict) breaks some calls it opens: they
    stay text and are counted unparsed; under the default every call it opens parses and validates."""
    import urllib.request

    from refusion_mlx.serve.core.metrics import parse

    def unparsed(srv):
        with urllib.request.urlopen(srv.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
            return parse(r.read().decode()).get('refusion_tool_calls_total{result="unparsed"}', 0)

    prompts = ["What is 45 - 18?", "Please add 6 and 78.", "What is 6 times 7?", "Who is Sven?"]
    free = RefusionServer(None, model_id="tiny-refusion", port=0, call_grammar="strict").start()
    try:
        client = openai.OpenAI(base_url=free.url, api_key="local", max_retries=0, timeout=120)
        answers = [ask(client, p, tools=DEMO_TOOLS, max_tokens=64).choices[0].message for p in prompts]
        assert unparsed(free) >= 1 and any("<tool_call>" in (a.content or "") for a in answers)
        before = unparsed(free)  # tools marked strict are constrained there on every API, the Messages API too
        claude = anthropic.Anthropic(base_url=free.url.removesuffix("/v1"), api_key="local", max_retries=0)
        strict = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"], "strict": True} for t in DEMO_TOOLS]
        for p in prompts:
            m = claude.messages.create(model="m", max_tokens=64, tools=strict,
                                       messages=[{"role": "user", "content": p}])
            assert not any("<tool_call>" in getattr(b, "text", "") for b in m.content), m.content
        assert unparsed(free) == before
        formatted = ask(client, "Who is Sven?", tools=DEMO_TOOLS, response_format=json_schema(CITY, "answer"),
                        max_tokens=48).choices[0]  # with a format the call is in its grammar, whatever the setting
        assert [c.function.name for c in formatted.message.tool_calls or ()] == ["lookup_person"]
    finally:
        free.close()
    before = unparsed(server)
    for p in prompts:
        answer = ask(oai, p, tools=DEMO_TOOLS, max_tokens=64).choices[0].message
        assert "<tool_call>" not in (answer.content or "")
        for call in answer.tool_calls or ():
            key = {"lookup_person": "name", "calculator": "expression"}[call.function.name]
            assert list(json.loads(call.function.arguments)) == [key]
    assert unparsed(server) == before


def test_constraints_compile_once_on_the_requests_thread(server, oai, monkeypatch):
    """A request's constraint (its format, or the call grammar of its tools) is compiled on the request's
    thread, once for every request that repeats it; the engine's thread, which every running request
    waits on, never compiles one."""
    import threading
    import uuid

    import refusion_mlx.decode.batch as batch
    import refusion_mlx.decode.grammar as grammar

    compiled, engine = [], []
    real = grammar.compile_constraint

    def on_request_thread(constraint, *args, **kw):
        compiled.append((constraint.kind, threading.current_thread().name))
        lock = kw["lock"]  # the lane's tokenizer lock: held while the tokenizer is read, not during the compile
        assert not lock.locked()
        return real(constraint, *args, **kw)

    def on_engine_thread(constraint, *args):
        engine.append(constraint.kind)
        return real(constraint, *args)

    monkeypatch.setattr(grammar, "compile_constraint", on_request_thread)
    monkeypatch.setattr(batch, "compile_constraint", on_engine_thread)
    tag = uuid.uuid4().hex  # a schema and tools no other test sent: not compiled yet
    schema = {**PERSON, "description": tag}
    tools = [{"type": "function", "function": {**t["function"], "parameters": {**t["function"]["parameters"],
                                                                             "description": tag}}} for t in TOOLS]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    for _ in range(3):
        jsonschema.validate(json.loads(ask(oai, response_format=fmt).choices[0].message.content), PERSON)
        for call in ask(oai, "Add 4 and 5.", tools=tools, max_tokens=48).choices[0].message.tool_calls or ():
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert sorted(kind for kind, _ in compiled) == ["json_schema", "tool_calls"]
    assert all(name != "refusion-engine" for _, name in compiled)
    assert engine == []


def test_the_grammar_engine_view_of_the_tokenizer_is_built_at_start(server):
    """llguidance's view of the tokenizer (seconds at 151k tokens, in a lane's lock) is made while the server
    starts, once, and shared by both lanes: the first request with tools does not build it."""
    from refusion_mlx.decode.ll_tokenizer import _TOKENIZERS, hf_tokenizer

    engine = server.engine
    views = [_TOKENIZERS.get(hf_tokenizer(t), {}) for t in (engine.tokenizer, *engine.http_tokenizers)]
    key = (engine.args.vocab_size, engine.eos_id)
    assert all(key in v for v in views)
    assert len({id(v[key]) for v in views}) == 1
