"""Structured output through the server's three APIs (serve/structured.py), on
the demo model with a chat template that renders tools: chat completions'
``response_format`` (the openai SDK's ``.parse`` too) and forced
``tool_choice``, the Responses API's ``text.format``, the Messages API's
forced ``tool_choice`` -- alone and eight at once; every answer validates.
The demo model knows no JSON: the grammar alone makes these hold.
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

from refusion_mlx.models.loading import DEMO_MODEL, load_tokenizer
from refusion_mlx.serve.http_server import RefusionServer
from refusion_mlx.serve.tool_calls import ToolFormat

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
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
         {"type": "function", "function": {"name": "find", "description": "a person", "parameters": FIND}}]
SCHEMAS = {"add": ADD, "find": FIND}


class Person(BaseModel):
    name: str = Field(pattern="^[A-Z][a-z]{1,7}$")
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "turtle"]


def tool_capable_model(folder):
    """The demo model, with the tests' tool-rendering chat template while its own renders no tools."""
    if ToolFormat.of(load_tokenizer(DEMO_MODEL)) is not None:
        return DEMO_MODEL
    from tests.agent_server import tool_model

    return tool_model(folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RefusionServer(str(tool_capable_model(tmp_path_factory.mktemp("structured") / "m")),
                         model_id="tiny-refusion", port=0).start()
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


def test_strict_tools_under_auto(oai):
    """Strict tools with tool_choice auto: constrained only where the call markers are tokens of their own
    (tests/test_constrained.py); this model spells them as text, so the answer is the unconstrained one."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    answer = ask(oai, "Who is Sven?", tools=strict, max_tokens=24).choices[0].message
    assert answer == ask(oai, "Who is Sven?", tools=TOOLS, max_tokens=24).choices[0].message


def test_responses_text_format(oai):
    r = oai.responses.create(model="tiny-refusion", input="Who is Sven?", max_output_tokens=96,
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PERSON)


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


@pytest.mark.parametrize("fields, param", [
    ({"response_format": json_schema({"type": "string", "pattern": "(?<=a)b"})},
     "response_format.json_schema.schema"),
    ({"response_format": json_schema({"type": "nope"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_a_schema_the_engine_cannot_take_is_one_400(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, **fields)
    err = e.value.body
    assert err["param"] == param and err["message"].startswith(param + ": ") and "\n" not in err["message"]
