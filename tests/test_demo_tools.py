"""The demo's chat template renders tools and tool messages in Qwen3's format
(plain conversations exactly as before), its tool tokens are Qwen3's, and the
demo model calls tools (examples/demo_model/tool_data.py, retrain.py's phase 3)."""

from __future__ import annotations

import json
import re

import pytest

from refusion_mlx.models.loading import DEMO_MODEL, load_tokenizer
from tests.helpers import FIXTURE_MODEL

LOOKUP = {"type": "function", "function": {
    "name": "lookup_person", "description": "Look up a person's city, job and pet.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
FACTS = '{"name": "Sven", "city": "Hanoi", "job": "baker", "pet": "turtle", "pet_name": "Pepper"}'
INSTRUCTION = ('\n</tools>\nTo call one, write <tool_call>\n{"name": <function-name>, "arguments": '
               '<args-json-object>}\n</tool_call><|im_end|>\n')


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_MODEL)


def render(tok, messages, tools=None, **kwargs):
    kwargs = dict({"add_generation_prompt": True}, **kwargs)
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


def call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_plain_conversations_render_as_before(tok):
    """The template before tools were added is the fixture's (the golden cases'): same text, same ids."""
    old = load_tokenizer(FIXTURE_MODEL)
    turns = [{"role": "user", "content": "Who is Sven?"}, {"role": "assistant", "content": "Sven lives in Hanoi."},
             {"role": "user", "content": "Spell the word cloud."}]
    for messages in (turns[:1], turns, [{"role": "system", "content": "Be brief."}] + turns, turns[:2]):
        for kwargs in ({}, {"add_generation_prompt": False}, {"enable_thinking": False}, {"enable_thinking": True}):
            text = render(tok, messages, **kwargs)
            assert text == render(old, messages, **kwargs)
            assert tok.encode(text) == old.encode(text)


def test_tools_are_listed_in_a_system_block(tok):
    """Each tool as ``name(parameters)``, one a line: the schema as JSON would cost ~170 tokens a tool."""
    text = render(tok, [{"role": "user", "content": "Who is Sven?"}], [LOOKUP, CALCULATOR])
    assert text == ("<|im_start|>system\n# Tools\n<tools>\nlookup_person(name)\ncalculator(expression)"
                    + INSTRUCTION + "<|im_start|>user\nWho is Sven?<|im_end|>\n<|im_start|>assistant\n")
    # parameters in the schema's order; none, or no parameters at all: empty parentheses
    email = {"type": "function", "function": {"name": "send_email", "parameters": {
        "type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}}}}}
    bare = {"type": "function", "function": {"name": "ping"}}
    listed = render(tok, [{"role": "user", "content": "Hi."}], [email, bare])
    assert "<tools>\nsend_email(to, body)\nping()\n</tools>" in listed
    with_system = render(tok, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Who is Sven?"}], [LOOKUP])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n")
    assert with_system.count("<|im_start|>system") == 1 and with_system.count("Be brief.") == 1


def test_calls_and_results_render_as_qwen3s(tok):
    messages = [{"role": "user", "content": "Who is Sven and what is 7 * 6?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [call("lookup_person", {"name": "Sven"}),
                                call("calculator", '{"expression": "7 * 6"}', "call_2")]},
                {"role": "tool", "tool_call_id": "call_1", "content": FACTS},
                {"role": "tool", "tool_call_id": "call_2", "content": "42"},
                {"role": "assistant", "content": "Sven lives in Hanoi. 7 * 6 = 42."}]
    text = render(tok, messages, [LOOKUP, CALCULATOR], add_generation_prompt=False)
    turns = text.split(INSTRUCTION)[1]
    assert turns == (
        "<|im_start|>user\nWho is Sven and what is 7 * 6?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "lookup_person", "arguments": {"name": "Sven"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 6"}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{FACTS}\n</tool_response>\n<tool_response>\n42\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nSven lives in Hanoi. 7 * 6 = 42.<|im_end|>\n")
    # arguments as a JSON string (as OpenAI clients send them back) or an object: the same text
    as_object = [dict(messages[1], tool_calls=[call("calculator", {"expression": "7 * 6"})])]
    as_string = [dict(messages[1], tool_calls=[call("calculator", '{"expression": "7 * 6"}')])]
    assert render(tok, as_object, add_generation_prompt=False) == render(tok, as_string, add_generation_prompt=False)
    # text before the calls stays, a newline apart; a lone tool result is its own user turn
    lead = render(tok, [dict(messages[1], content="Looking.", tool_calls=[call("calculator", {"expression": "1"})]),
                        messages[3]], add_generation_prompt=False)
    assert lead.startswith("<|im_start|>assistant\nLooking.\n<tool_call>\n")
    assert lead.endswith("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n")


def test_the_tool_tokens_are_qwen3s(tok):
    """Single tokens after the old vocabulary, not special: decoded answers keep their text."""
    ids = [tok.encode(t, add_special_tokens=False)
           for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")]
    assert ids == [[806], [807], [808], [809]]
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == text
    # mlx-lm reads the template as Qwen3's JSON tool calls (what the server's parser uses)
    assert tok.has_tool_calling and (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    config = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (DEMO_MODEL / "chat_template.jinja").read_text()
    assert json.loads((DEMO_MODEL / "config.json").read_text())["vocab_size"] == 810


CALL = re.compile(r"^<tool_call>\n(.*)\n</tool_call>$", re.DOTALL)


def test_the_demo_calls_the_right_tool():
    """Held-out questions (tool_data.py never trains them with tools): the demo
    answers with one parseable call of the right tool and arguments; without
    tools it answers directly; given the tool's result, it answers from it."""
    import refusion_mlx as rm
    from refusion_mlx.train.dataset import prompt_ids

    model, tokenizer = rm.load(dtype="float32")
    params = rm.RefusionParams(gen_length=64, block_length=16)
    # held out: "Who is Sven?", 29 * 3, the name Noor
    asks = [("Who is Sven?", [LOOKUP, CALCULATOR], ("lookup_person", {"name": "Sven"})),
            ("What is 29 * 3?", [CALCULATOR], ("calculator", {"expression": "29 * 3"})),
            ("Where does Noor live?", [CALCULATOR, LOOKUP], ("lookup_person", {"name": "Noor"}))]
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}], tools) for q, tools, _ in asks]
    results = rm.batch_generate(model, tokenizer, prompts, params)
    for (question, _, (name, arguments)), result in zip(asks, results):
        match = CALL.match(result.text)
        assert match, (question, result.text)
        assert json.loads(match[1]) == {"name": name, "arguments": arguments}, result.text
    alone = rm.generate(model, tokenizer, rm.chat_prompt(tokenizer, "Describe Sven."), params=params)
    assert alone == "Sven lives in Hanoi. Sven works as a baker. Sven has a turtle named Pepper."
    trip = [{"role": "user", "content": "What is 29 * 3?"},
            {"role": "assistant", "content": None,
             "tool_calls": [call("calculator", {"expression": "29 * 3"})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "87"}]
    answer = rm.generate(model, tokenizer, prompt_ids(tokenizer, trip, [CALCULATOR]), params=params)
    assert answer == "29 * 3 = 87. The answer is 87."
