"""Phase 3's tokenizer for the demo (examples/demo_model/grow_vocab.py's
tool_tokenizer: the demo's, Qwen3's tool tokens and JSON's punctuation added,
examples/demo_model/chat_template.jinja): tools and tool messages render in
Qwen3's format, plain conversations exactly as before. The bundled demo
(phase 3 of examples/demo_model/retrain.py) was trained with it and carries it."""

from __future__ import annotations

import json

import pytest

from refusion_mlx.models.loading import load_tokenizer
from tests.helpers import FIXTURE_MODEL, demo_example_module

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
def folder(tmp_path_factory):
    return demo_example_module("grow_vocab").tool_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"))


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(folder)


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


def test_the_tool_tokens_are_qwen3s(tok, folder):
    """Single tokens after the old vocabulary, not special: decoded answers keep their text.
    Then JSON's punctuation between keys and string values, one token each."""
    ids = [tok.encode(t, add_special_tokens=False)
           for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")]
    assert ids == [[806], [807], [808], [809]]
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert [tok.decode([i]) for i in ids if i >= 806] == [
        "<tool_call>", '{"', '": "', '", "', '": {"', '": "', '"}}', "</tool_call>"]
    facts = tok.encode(FACTS, add_special_tokens=False)
    assert tok.decode(facts) == FACTS and [i for i in facts if i >= 806] == [810] + [811, 812] * 4 + [811, 813]
    # text without them (the shared mix holds none) tokenizes as before
    old = load_tokenizer(FIXTURE_MODEL)
    plain = 'She said "hi", then {x: y} and print(f"{a}")'
    assert tok.encode(plain) == old.encode(plain)
    # mlx-lm reads the template as Qwen3's JSON tool calls (what the server's parser uses)
    assert tok.has_tool_calling and (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (folder / "chat_template.jinja").read_text()
    assert len(tok) == 816


def test_the_bundled_demo_carries_this_tokenizer(folder):
    """retrain.py --install copied phase 3's tokenizer and its vocabulary size into the bundled demo."""
    from refusion_mlx.models.loading import DEMO_MODEL

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "added_tokens.json"):
        assert (DEMO_MODEL / name).read_text() == (folder / name).read_text(), name
    assert json.loads((DEMO_MODEL / "config.json").read_text())["vocab_size"] == 816


# ---------------------------------------------------------------------------
# What the bundled demo learnt: tool_eval.py on held-out checks of tool_data.py --eval (copied from the
# shared mix's: the question about each of its 25 people with a template never trained with tools, and each
# person's facts asked as JSON with a held-out template), and round trips whose result is not a whole person.
# Installed (stage 20): 25 of 25 exact calls (free and constrained), 20 of 25 objects free and 22 under the
# schema, 50 of 50 answers in text after another result; a little room for other backends.

CHECKS = __import__("pathlib").Path(__file__).parent / "fixtures" / "demo_tool_checks"


@pytest.fixture(scope="module")
def demo_scores():
    from refusion_mlx.models.loading import load

    tool_eval = demo_example_module("tool_eval")
    model, tokenizer = load(None, dtype="float32")
    scores = {constrained: tool_eval.evaluate(model, tokenizer, CHECKS, ("tools_alone", "json"), keep=25,
                                              constrained=constrained) for constrained in (False, True)}
    scores[False].update(tool_eval.evaluate(model, tokenizer, CHECKS, ("tool_other",), keep=50))
    return scores


@pytest.mark.parametrize("constrained", [False, True])
def test_the_demo_calls_lookup_person_for_its_people(demo_scores, constrained):
    calls = demo_scores[constrained]["tools_alone"]
    assert calls["known person"]["total"] == 25
    assert calls["known person"]["arguments"] >= 20, calls["failures"]


def test_the_demo_writes_its_peoples_facts_as_json(demo_scores):
    free, constrained = demo_scores[False]["json"], demo_scores[True]["json"]
    assert free["all"]["correct"] >= 15, free["failures"]
    assert constrained["all"]["correct"] >= 19, constrained["failures"]  # (2 of 25 run to the budget in a string)


def test_after_any_result_the_demo_answers_instead_of_calling_again(demo_scores):
    """Held-out round trips whose result is not a whole person (part of one, "not found", the weather, the
    time, a search, an email): the demo answers in text. Before stages 18-19 it called again after half of
    them, and an agent's loop (llm's chain limit, the Agents SDK's max_turns) ran out."""
    other = demo_scores[False]["tool_other"]
    assert other["all"]["total"] == 50
    assert other["all"]["no_call"] >= 48, [f for f in other["failures"] if "<tool_call>" in f["got"]]
