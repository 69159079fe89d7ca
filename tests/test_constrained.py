"""Constrained decoding's guarantee on the demo model (docs/constrained.md).

A property test over generated JSON Schemas and prompts: every schema here
bounds its instances' length (strings by pattern or maxLength, integers by
range, arrays by maxItems, no additional properties), so a budget of that many
bytes' tokens always lets the grammar close: every answer must end with EOS
("stop") and parse and validate -- alone, and in one batch with unconstrained
requests, whose tokens must be exactly those they get alone. The demo model
knows no JSON; the guarantee does not depend on the model.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refusion_mlx as rm
from refusion_mlx.decode.batch import BatchGenerator
from refusion_mlx.decode.grammar import Constraint
from refusion_mlx.decode.params import make_params
from refusion_mlx.errors import DecodeError

PROMPTS = ["Who is Sven?", "Describe Dara as JSON.", "What is 2+2?", "Tell me about Quinn.", "x"]
KEYS = ["name", "age", "city", "pet", "tags", "ok", "id", "note"]
FAST = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def demo():
    return rm.load()


def _integer(pair):
    low, span = pair
    return {"type": "integer", "minimum": low, "maximum": low + span}


LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-60, 60), st.integers(0, 120)).map(_integer),
    st.lists(st.text(alphabet="abc xyz", min_size=1, max_size=5), min_size=1, max_size=4,
             unique=True).map(lambda e: {"enum": e}),
    st.integers(1, 6).map(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(["red", "blue"]).map(lambda c: {"const": c}),
)


def _array(args):
    items, low, extra = args
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + extra}


def _objects(children):
    def make(args):
        props, required = args
        return {"type": "object", "properties": props, "required": [k for k in props if k in required],
                "additionalProperties": False}
    return st.tuples(st.dictionaries(st.sampled_from(KEYS), children, min_size=1, max_size=3),
                     st.sets(st.sampled_from(KEYS))).map(make)


VALUES = st.one_of(LEAVES, st.tuples(LEAVES, st.integers(0, 1), st.integers(0, 2)).map(_array))
SCHEMAS = _objects(st.one_of(VALUES, _objects(LEAVES)))


def most_bytes(schema) -> int:
    """An upper bound on the bytes of any instance as the grammar writes it
    (compact, ", " and ": " separators; a string character at most 6 bytes)."""
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    if "const" in schema:
        return len(json.dumps(schema["const"]).encode())
    kind = schema["type"]
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        n = schema.get("maxLength")
        return 2 + (6 * n if n is not None else int(schema["pattern"].split(",")[1].split("}")[0]))
    if kind == "array":
        return 2 + schema["maxItems"] * (most_bytes(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 2 + most_bytes(v) + 2 for k, v in schema["properties"].items())


def decode_all(model, tokenizer, requests):
    """Run (prompt, constraint, params) requests in one batch; each one's (text, ids, finish)."""
    gen = BatchGenerator(model, tokenizer, max_batch=len(requests))
    uids = [gen.insert(rm.chat_prompt(tokenizer, prompt), params, constraint=c) for prompt, c, params in requests]
    out = {u: ["", [], None] for u in uids}
    while gen.has_work:
        for r in gen.step():
            assert r.error is None, r.error
            out[r.uid][0] += r.text
            out[r.uid][1] += r.tokens
            if r.finish_reason is not None:
                out[r.uid][2] = r.finish_reason
    return [tuple(out[u]) for u in uids]


def check_valid(text, finish, schema):
    assert finish == "stop", (finish, text, schema)
    jsonschema.validate(json.loads(text), schema)


@FAST
@given(schema=SCHEMAS, prompt=st.sampled_from(PROMPTS), temperature=st.sampled_from([0.0, 0.9]))
def test_every_answer_parses_and_validates(demo, schema, prompt, temperature):
    model, tokenizer = demo
    params = make_params(max_tokens=most_bytes(schema), temperature=temperature, seed=7)
    ((text, _, finish),) = decode_all(model, tokenizer, [(prompt, Constraint.json_schema(schema), params)])
    check_valid(text, finish, schema)


@settings(FAST, max_examples=4)
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=3), prompt=st.sampled_from(PROMPTS))
def test_batched_with_unconstrained_requests(demo, schemas, prompt):
    model, tokenizer = demo
    free = ("Who is Sven?", None, make_params(max_tokens=24))
    alone = decode_all(model, tokenizer, [free])[0]
    requests = [free] + [(prompt, Constraint.json_schema(s), make_params(max_tokens=most_bytes(s)))
                         for s in schemas] + [("Tell me about Quinn.", None, make_params(max_tokens=24))]
    results = decode_all(model, tokenizer, requests)
    assert results[0] == alone  # an unconstrained request's tokens do not change in a constrained batch
    for (text, _, finish), s in zip(results[1:-1], schemas):
        check_valid(text, finish, s)


def test_budget_ends_before_the_grammar_closes(demo):
    model, tokenizer = demo
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 40}}, "required": ["a"]}
    ((text, ids, finish),) = decode_all(model, tokenizer, [("Who is Sven?", Constraint.json_schema(schema),
                                                             make_params(max_tokens=8))])
    assert finish == "length" and len(ids) == 8 and tokenizer.eos_token_id not in ids
    assert text.startswith('{"a": "')


def test_the_budget_ends_the_answer_the_same_way_at_every_max_tokens(demo):
    """A grammar that would take more at the budget's end is cut there at every budget: exactly max_tokens
    tokens, no EOS, "length" -- as an unconstrained answer is. The loop once ran to the budget rounded up to
    whole slots (forwards on tokens past the budget), then forced an EOS wherever the grammar accepted, which
    reported free text cut by the budget as finished ("stop")."""
    model, tokenizer = demo
    free = Constraint.lark("start: /[a-zA-Z .,]+/")
    for most in range(3, 10):
        ((text, ids, finish),) = decode_all(model, tokenizer, [("Who is Sven?", free, make_params(max_tokens=most))])
        assert (finish, len(ids)) == ("length", most) and tokenizer.eos_token_id not in ids, (most, text)


def test_a_grammar_that_allows_nothing_more_ends_with_eos_at_the_budget(demo):
    """Where the grammar is complete exactly at the budget's end, its EOS still ends the answer ("stop")."""
    model, tokenizer = demo
    spelled = tokenizer.encode("no. yes.")
    ((text, ids, finish),) = decode_all(model, tokenizer, [
        ("Is Sven a baker?", Constraint.lark('start: "no. yes."'), make_params(max_tokens=len(spelled)))])
    assert (finish, text, ids) == ("stop", "no. yes.", spelled + [tokenizer.eos_token_id])


def test_json_object_and_lark_grammar(demo):
    model, tokenizer = demo
    results = decode_all(model, tokenizer, [
        ("Who is Sven?", Constraint.json_object(), make_params(max_tokens=48)),
        ("Is Sven a baker?", Constraint.lark('start: ("yes" | "no") "." '), make_params(max_tokens=8))])
    (obj, _, finish), (answer, _, finish2) = results
    if finish == "stop":
        assert isinstance(json.loads(obj), dict)
    else:
        assert finish == "length" and obj.startswith("{")
    assert finish2 == "stop" and answer in ("yes.", "no.")


def test_one_host_sync_per_forward(demo, monkeypatch):
    """The masks are made on the host from tokens it holds: no evaluation beyond the step's one."""
    import mlx.core as mx

    model, tokenizer = demo
    real, evals = mx.eval, []
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (evals.append(1), real(*a, **k))[1])
    schema = {"type": "object", "properties": {"pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                        "maxItems": 3}}, "required": ["pets"]}
    _, stats = rm.generate(model, tokenizer, rm.chat_prompt(tokenizer, "Who is Sven?"), max_tokens=48,
                           json_schema=schema, return_stats=True)
    assert stats.masks > 0 and stats.mask_seconds > 0
    assert len(evals) == stats.forwards == stats.host_syncs


def test_a_pass_verifies_at_most_a_window_of_drafts(demo, monkeypatch):
    """While the grammar refused the model's drafts, each pass verified every draft it had buffered and planned
    a window more: a degenerate JSON answer reached 813-row passes (0.4 s a step on the demo model, and every
    request batched with it as slow). A pass now verifies at most ``block_length`` drafts."""
    from refusion_mlx.decode import constrain

    model, tokenizer = demo
    real, sizes = constrain.select, []
    monkeypatch.setattr(constrain, "select", lambda *a, **k: sizes.append(len(real(*a, **k))) or real(*a, **k))
    rm.generate(model, tokenizer, rm.chat_prompt(tokenizer, "Describe Sven as JSON"), max_tokens=400,
                json_object=True, temperature=1.0, seed=1)
    assert sizes and max(sizes) == 16  # the window (block_length), reached and never passed


def test_python_api_keywords(demo):
    model, tokenizer = demo
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for kv_bits in (None, 4):  # a quantized KV cache too
        text = rm.generate(model, tokenizer, rm.chat_prompt(tokenizer, "Who is Sven?"), max_tokens=16,
                           json_schema=schema, kv_bits=kv_bits)
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(DecodeError, match="one of json_schema, grammar"):
        rm.generate(model, tokenizer, "x", json_schema=schema, grammar='start: "a"')


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "(?<=a)b"}, "cannot be compiled: regex parse error"),
    ({"type": 3}, "not a valid JSON Schema"),
    ("{nope", "not valid JSON"),
    ([1], "must be an object"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "cannot be compiled: oneOf is not supported .anyOf is"),
])
def test_a_schema_the_engine_cannot_take_is_one_clear_error(schema, message):
    with pytest.raises(DecodeError, match=message) as e:
        Constraint.json_schema(schema, "response_format")
    assert str(e.value).startswith("response_format: ") and "\n" not in str(e.value)
    assert "coerce_one_of" not in str(e.value)


def test_a_schema_nested_past_the_limits_is_one_clear_error(demo):
    """The Python API gave jsonschema's RecursionError for 200 nested arrays; the CLI and the server refused
    it cleanly: the same DecodeError now, before any library recurses."""
    model, tokenizer = demo
    deep = {"type": "array"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    for schema in (deep, json.dumps(deep)):
        with pytest.raises(DecodeError, match=r"^json_schema: the schema is nested over 32 levels"):
            rm.generate(model, tokenizer, "hi", json_schema=schema, max_tokens=4)
    with pytest.raises(DecodeError, match="nested too deeply to read as JSON"):
        Constraint.json_schema("[" * 100000 + "]" * 100000)
    with pytest.raises(DecodeError, match=r"^tool_choice: the parameters of tool 'f' are nested over 32 levels"):
        Constraint.tool_calls([{"name": "f", "parameters": deep}], "<tool_call>", "</tool_call>")


def test_a_tool_whose_parameters_the_engine_cannot_take_is_named():
    """The calls' grammar embeds every tool's parameters: its error listed that grammar (Lark) in the
    message; the tool at fault is named, with the engine's reason only."""
    ok = {"name": "g", "parameters": {"type": "object"}}
    for parameters, reason in (({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
                               ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf is not supported")):
        with pytest.raises(DecodeError) as e:
            Constraint.tool_calls([ok, {"name": "f", "parameters": parameters}], "<tool_call>", "</tool_call>")
        assert str(e.value).startswith(f"tool_choice: the parameters of tool 'f' cannot be compiled: {reason}")
        assert "start:" not in str(e.value) and "%json" not in str(e.value)


def test_a_grammar_that_admits_no_text_is_refused_before_decoding(demo):
    """A grammar whose every rule recurses without end compiles, but no token may start an answer: one
    error, not an empty answer that finishes "stop"; a grammar of the empty string still answers."""
    model, tokenizer = demo
    with pytest.raises(DecodeError, match=r"^grammar: admits no text"):
        rm.generate(model, tokenizer, "x", grammar='start: x\nx: x "a"', max_tokens=8)
    with pytest.raises(DecodeError, match=r"^grammar: admits no text \(what it forces never ends") as e:
        rm.generate(model, tokenizer, "x", grammar='start: a\na: "(" a ")"', max_tokens=8)  # right recursion
    assert "Too many items" not in str(e.value) and "\n" not in str(e.value)
    assert rm.generate(model, tokenizer, "x", grammar='start: ""', max_tokens=8) == ""
    assert rm.generate(model, tokenizer, "x", grammar='start: "yes" | "no"', max_tokens=8) in ("yes", "no")


def test_a_format_the_engine_does_not_know_only_annotates(demo):
    """pydantic writes formats such as "binary": dropped (JSON Schema formats annotate); known ones kept."""
    model, tokenizer = demo
    schema = {"type": "object", "properties": {"b": {"type": "string", "format": "binary", "maxLength": 3},
                                               "format": {"enum": ["x"]},
                                               "day": {"type": "string", "format": "date"}},
              "required": ["b", "format", "day"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    assert '"binary"' not in c.source and '"date"' in c.source and '"format": {"enum"' in c.source
    ((text, _, finish),) = decode_all(model, tokenizer, [("Who is Sven?", c, make_params(max_tokens=64))])
    check_valid(text, finish, schema)
    assert jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(
        json.loads(text))  # the date is a date


def test_a_lark_json_block_is_decoded_as_json_schema_is(demo):
    """A %json block in a Lark grammar got none of --json-schema's treatment: the demo wrote "{" and then
    whitespace until its budget. Its schema is now decoded as one given alone: compact separators, objects
    closed, integers bounded; %json inside a string, a regex or a comment is left alone."""
    from refusion_mlx.decode.grammar import compile_constraint, json_blocks_for_decoding

    model, tokenizer = demo
    schema = {"type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}},
              "required": ["age", "name"]}
    lark = f'start: "R: " %json {json.dumps(schema)}\n'
    c = compile_constraint(Constraint.lark(lark), tokenizer, model.args.vocab_size, tokenizer.eos_token_id)

    def takes(text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        return c.matcher().valid_prefix(ids) == len(ids)

    assert takes('R: {"age": 7, "name": "Sven"}') and not takes("R: { ") and not takes('R: {"age": 7, "x"')
    assert not takes('R: {"age": ' + "1" * 17)
    ((text, _, finish),) = decode_all(model, tokenizer, [("Who is Sven?", Constraint.lark(lark),
                                                         make_params(max_tokens=64))])
    assert finish == "stop" and text.startswith("R: ")
    jsonschema.validate(json.loads(text[3:]), schema)
    quiet = 'start: "%json {}" x // %json {"a": 1}\nx: /%json {}/'
    assert json_blocks_for_decoding(quiet) == quiet


def test_strict_tools_under_auto_constrain_calls_where_markers_are_tokens(demo):
    """Optional calls (strict tools, or any under the server's default --call-grammar all), tool_choice
    auto: text, then maybe calls whose arguments follow the schema -- where the call markers are tokens of
    their own (Qwen3's, the demo's); a tokenizer that spells them as text (the golden fixture's) gets none."""
    from refusion_mlx.decode.grammar import compile_constraint
    from refusion_mlx.models.loading import load_tokenizer
    from tests.helpers import FIXTURE_MODEL

    model, tokenizer = demo
    add = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"], "additionalProperties": False}}
    c = Constraint.tool_calls([add], "<tool_call>", "</tool_call>", optional=True)
    spelled = load_tokenizer(FIXTURE_MODEL)
    assert compile_constraint(c, spelled, len(spelled.get_vocab()), spelled.eos_token_id) is None
    start, end = tokenizer.convert_tokens_to_ids("<tool_call>"), tokenizer.convert_tokens_to_ids("</tool_call>")
    eos = tokenizer.eos_token_id
    compiled = compile_constraint(c, tokenizer, model.args.vocab_size, eos)

    def allowed(*parts):
        ids = [t for p in parts for t in ([p] if isinstance(p, int) else tokenizer.encode(p, add_special_tokens=False))]
        return compiled.matcher().valid_prefix(ids + [eos]) == len(ids) + 1

    assert allowed("Sven is a baker.") and allowed("")
    assert allowed("Let me add.\n", start, '\n{"name": "add", "arguments": {"a": 2}}\n', end)
    assert not allowed("Let me add.\n", start, '\n{"name": "add", "arguments": {"a": "two"}}\n', end)
    assert not allowed(start, '\n{"name": "sub", "arguments": {"a": 2}}\n', end)


def test_a_format_beside_tools_is_its_json_or_the_calls(demo):
    """A format with tools under auto: the format's JSON or the calls, nothing else (no text, no JSON outside
    the schema, no call outside its tool's parameters) -- with the markers as tokens (the demo's) and spelled
    as text (the golden fixture's: no JSON value starts with "<", so the grammar still holds the answer)."""
    from refusion_mlx.decode.grammar import compile_constraint
    from refusion_mlx.models.loading import load_tokenizer
    from tests.helpers import FIXTURE_MODEL

    model, demo_tokenizer = demo
    add = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"], "additionalProperties": False}}
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    for fmt, schema in ((Constraint.json_schema(city), city), (Constraint.json_object(), {"type": "object"})):
        c = Constraint.tool_calls([add], "<tool_call>", "</tool_call>", optional=True, answer=fmt)
        assert c.whole_answer
        for tokenizer in (demo_tokenizer, load_tokenizer(FIXTURE_MODEL)):
            eos = tokenizer.eos_token_id
            compiled = compile_constraint(c, tokenizer, len(tokenizer.get_vocab()), eos)
            marker = {m: tokenizer.convert_tokens_to_ids(m) if demo_tokenizer is tokenizer else m
                      for m in ("<tool_call>", "</tool_call>")}

            def allowed(*parts):
                ids = [t for p in parts for t in ([p] if isinstance(p, int) else
                                                  tokenizer.encode(p, add_special_tokens=False))]
                return compiled.matcher().valid_prefix(ids + [eos]) == len(ids) + 1

            call = (marker["<tool_call>"], '\n{"name": "add", "arguments": {"a": 2}}\n', marker["</tool_call>"])
            assert allowed('{"city": "Bern"}') and allowed(*call) and allowed(*call, "\n", *call)
            assert not allowed("Sven is a baker.") and not allowed("") and not allowed("Let me add.\n", *call)
            assert not allowed('{"city": "Bern"}', *call)
            assert allowed('{"town": 1}') == (schema != city)
            assert not allowed(marker["<tool_call>"], '\n{"name": "add", "arguments": {"a": "two"}}\n',
                               marker["</tool_call>"])
    with pytest.raises(DecodeError, match="not a JSON Schema but a lark constraint"):
        Constraint.tool_calls([add], "<tool_call>", "</tool_call>", answer=Constraint.lark('start: "x"'))


def test_objects_that_list_their_properties_take_no_other_keys(demo):
    """A schema that lists properties and says nothing of others decodes as if it said
    "additionalProperties": false (vLLM's and xgrammar's default; OpenAI's strict schemas must): a small
    model ran on writing keys nobody asked for until the budget. Allowing others stays possible; data (const,
    enum) is left alone; tool arguments too."""
    from refusion_mlx.decode.grammar import compile_constraint
    from refusion_mlx.decode.json_schema import for_decoding

    model, tokenizer = demo
    inner = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": inner},
                                               "c": {"const": {"properties": {"x": 1}}}},
              "$defs": {"d": {"anyOf": [inner]}}}
    closed = for_decoding(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["items"]["items"]["additionalProperties"] \
        is False and closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["c"] == {"const": {"properties": {"x": 1}}}  # a value, not a schema
    assert "additionalProperties" not in schema and "additionalProperties" not in inner  # the caller's untouched
    assert for_decoding({**inner, "additionalProperties": True})["additionalProperties"] is True

    def takes(constraint, text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = compile_constraint(constraint, tokenizer, model.args.vocab_size, tokenizer.eos_token_id).matcher()
        return matcher.valid_prefix(ids) == len(ids)

    assert takes(Constraint.json_schema(inner), '{"a": 1}')
    assert not takes(Constraint.json_schema(inner), '{"a": 1, "b": 2}')
    assert takes(Constraint.json_schema({**inner, "additionalProperties": True}), '{"a": 1, "b": 2}')
    call = Constraint.tool_calls([{"name": "f", "parameters": inner}], "<tool_call>", "</tool_call>")
    assert takes(call, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert not takes(call, '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_integers_without_bounds_are_held_to_sixteen_digits(demo):
    """An integer with no bound is written in at most 16 digits (llama.cpp's JSON grammars cap them so):
    the demo ran on writing an age's digits until its budget ended. Given bounds are kept."""
    from refusion_mlx.decode.grammar import compile_constraint
    from refusion_mlx.decode.json_schema import for_decoding

    model, tokenizer = demo
    assert for_decoding({"type": "integer"}) == {"type": "integer", "maximum": 10 ** 16 - 1, "minimum": -(10 ** 16 - 1)}
    assert for_decoding({"type": "integer", "minimum": 0}) == {"type": "integer", "minimum": 0,
                                                               "maximum": 10 ** 16 - 1}
    assert for_decoding({"type": "number"}) == {"type": "number"}

    def takes(schema, text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        c = compile_constraint(Constraint.json_schema(schema), tokenizer, model.args.vocab_size, tokenizer.eos_token_id)
        return c.matcher().valid_prefix(ids) == len(ids)

    age = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    assert takes(age, '{"age": ' + "9" * 16 + "}") and takes(age, '{"age": -' + "9" * 16 + "}")
    assert not takes(age, '{"age": ' + "1" * 17)
    # a positive minimum (a negative maximum): the other side is held 16 digits past it, not contradicted
    assert for_decoding({"type": "integer", "minimum": 2 ** 53})["maximum"] == 2 ** 53 + 10 ** 16 - 1
    assert for_decoding({"type": "integer", "exclusiveMaximum": 1 - 2 ** 53})["minimum"] == 2 - 2 ** 53 - 10 ** 16
    assert takes({"type": "integer", "minimum": 2 ** 53}, str(2 ** 53 + 5))



def test_integers_a_const_or_enum_gives_are_not_bounded_and_are_written_exactly(demo):
    """A const or enum gives the values: no 16-digit bound is added (a 20-digit const was "unsatisfiable").
    The engine holds numbers as 64-bit floats (it wrote the const 9999999999999999 as 10000000000000000):
    an integer past 2**53 in a const or enum is one clear error naming the limit."""
    from refusion_mlx.decode.grammar import compile_constraint
    from refusion_mlx.decode.json_schema import for_decoding

    model, tokenizer = demo
    assert for_decoding({"type": "integer", "const": 2 ** 53}) == {"type": "integer", "const": 2 ** 53}
    assert for_decoding({"type": "integer", "enum": [1, 2]}) == {"type": "integer", "enum": [1, 2]}
    for schema in ({"type": "integer", "const": 12345678901234567890}, {"type": "integer", "enum": [1, 2 ** 64]},
                   {"const": 9999999999999999}, {"properties": {"a": {"const": {"b": [-(2 ** 53) - 1]}}}}):
        with pytest.raises(DecodeError, match=r"^s: cannot be compiled: the integer -?\d+ in a const or enum is past "
                                              r"what the grammar engine writes exactly \(integers up to 2\*\*53"):
            Constraint.json_schema(schema, "s")
    for value in (2 ** 53, -(2 ** 53), 10 ** 15 + 1):
        m = compile_constraint(Constraint.json_schema({"type": "integer", "const": value}), tokenizer,
                               model.args.vocab_size, tokenizer.eos_token_id).matcher()
        assert tokenizer.decode(m.forced()) == str(value)


@pytest.mark.parametrize("key, value", [("minimum", 2 ** 53 + 1), ("maximum", -(2 ** 53) - 1), ("minimum", 1e17),
                                        ("exclusiveMinimum", 2 ** 53), ("exclusiveMaximum", -(2 ** 53)),
                                        ("multipleOf", 2 ** 60)])
def test_a_bound_the_engine_would_hold_rounded_is_refused(demo, key, value):
    """A minimum of 2**53 + 1 was held as 2**53, which the answer then was ("stop" with an integer below its
    minimum); an exclusive bound of 2**53 let 2**53 pass. Such a bound is one clear error naming it."""
    from refusion_mlx.decode.grammar import compile_constraint

    model, tokenizer = demo
    with pytest.raises(DecodeError, match=rf"^s: cannot be compiled: the {key} -?[\d.e+]+ is past what the grammar "
                                          r"engine holds exactly \(bounds within 2\*\*53"):
        Constraint.json_schema({"type": "array", "items": {"type": "integer", key: value}}, "s")
    for schema in ({"type": "integer", "minimum": 2 ** 53, "maximum": 2 ** 53},
                   {"type": "integer", "exclusiveMinimum": 2 ** 53 - 3, "exclusiveMaximum": 2 ** 53 - 1}):
        m = compile_constraint(Constraint.json_schema(schema), tokenizer, model.args.vocab_size,
                               tokenizer.eos_token_id).matcher()
        assert tokenizer.decode(m.forced()) == str(schema.get("minimum", 2 ** 53 - 2))


@pytest.mark.parametrize("schema, instance", [
    ({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
      "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"name": {"type": "string", "maxLength": 8}},
      "required": ["name"]}, {"id": 1, "name": "Sven"}),  # inheritance: a base's properties and the schema's own
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},  # b: any value
     {"a": 1, "b": 2}),
])
def test_objects_built_from_several_schemas_are_not_closed_apart(demo, schema, instance):
    """Closing each object schema alone would refuse what they allow together (\"unsatisfiable\"): such a
    schema is decoded as given, and its answers are valid under it."""
    from refusion_mlx.decode.grammar import compile_constraint
    from refusion_mlx.decode.json_schema import for_decoding

    model, tokenizer = demo
    compile_constraint(Constraint.json_schema(schema), tokenizer, model.args.vocab_size, tokenizer.eos_token_id)
    assert "additionalProperties" not in json.dumps(for_decoding(schema))
    ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
    m = compile_constraint(Constraint.json_schema(schema), tokenizer, model.args.vocab_size,
                           tokenizer.eos_token_id).matcher()
    assert m.valid_prefix(ids) == len(ids)  # an instance valid under the schema is taken


@pytest.mark.parametrize("constraint, text", [
    (Constraint.json_schema({"type": "string", "pattern": "^<thin[k]>$"}), '"<think>"'),
    (Constraint.json_schema({"type": "string", "pattern": "^<\\|im_end\\|>$"}), '"<|im_end|>"'),
    (Constraint.json_schema({"const": "x</tool_call>"}), '"x</tool_call>"'),
    (Constraint.lark('start: "<thi" "nk>" "x"'), "<think>x"),
    (Constraint.lark('start: "x</tool_call>"'), "x</tool_call>"),
])
def test_text_that_spells_a_special_token_is_written_as_text(demo, constraint, text):
    """The engine tokenized forced text with the model's tokenizer, which made "<think>" the special token,
    allowed it alone and then refused it (an error mid-answer; a substring check on the schema missed
    "<thin[k]>"): forced text is text now, whatever it spells."""
    model, tokenizer = demo
    ids = [t for r in rm.stream_generate(model, tokenizer, "hi", max_tokens=32, grammar=constraint) for t in r.tokens]
    specials = {t for t in tokenizer.added_tokens_decoder if tokenizer.added_tokens_decoder[t].special}
    body = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
    assert tokenizer.decode(body) == text and not specials & set(body)


def test_a_call_whose_arguments_spell_its_marker_is_taken_and_eos_is_not_text(demo):
    """A call ends at the end marker after its JSON, not one in its strings (serve/core/call_bounds.py), so
    a tool's parameters may spell the calls' markers; a description or title may say anything. A grammar
    that names the EOS token is refused."""
    from refusion_mlx.decode.grammar import compile_constraint

    model, tokenizer = demo
    tool = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"const": "x</tool_call>"}}}}
    Constraint.tool_calls([tool], "<tool_call>", "</tool_call>")
    described = {"type": "object", "description": "</tool_call>", "properties": {"a": {"type": "integer",
                                                                                       "title": "<tool_call>"}}}
    Constraint.tool_calls([{"name": "f", "parameters": described}], "<tool_call>", "</tool_call>")
    with pytest.raises(DecodeError, match="names the end-of-sequence token"):
        compile_constraint(Constraint.lark('start: "a" <|im_end|>'), tokenizer, model.args.vocab_size,
                           tokenizer.eos_token_id)


def test_a_grammar_naming_a_token_that_is_not_text_is_refused(demo):
    """The mask token named in a grammar was committed into the answer and the cache as a decided token;
    padding (<|endoftext|>) likewise. Such a grammar is one clear error, in the Python API and the CLI; tokens
    chat templates write as text (<think>) stay nameable."""
    from refusion_mlx.decode.grammar import compile_constraint

    model, tokenizer = demo
    mask = model.args.mask_token_id
    for source, what in (('start: "x" <|mask|> "y"', "the model's mask token"), (f'start: "x" <[{mask}]>', "the "
                         "model's mask token"), ('start: "x" <|endoftext|>', "a special token, which is not text")):
        with pytest.raises(DecodeError, match=rf"^g: names {what}.*: leave it out of the grammar$"):
            compile_constraint(Constraint.lark(source, "g"), tokenizer, model.args.vocab_size,
                               tokenizer.eos_token_id, mask_id=mask)
        gen = BatchGenerator(model, tokenizer)
        with pytest.raises(DecodeError, match=f"names {what}"):
            gen.insert(rm.chat_prompt(tokenizer, "hi"), make_params(max_tokens=8), constraint=Constraint.lark(source))
    compile_constraint(Constraint.lark('start: "x" <think> "y"'), tokenizer, model.args.vocab_size,
                       tokenizer.eos_token_id, mask_id=mask)


def test_forced_text_is_committed_even_where_several_tokenizations_could_spell_it(demo):
    """llguidance forces a token only where one tokenization is possible; the demo's vocabulary spells a key's
    '": "' as one token or as three, so none is forced there. Matcher.forced gives the whole forced text, in
    the tokenizer's own tokenization (a forward saved at every key), and only what the grammar takes."""
    from refusion_mlx.decode.grammar import compile_constraint

    model, tokenizer = demo
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"]}
    m = compile_constraint(Constraint.json_schema(schema), tokenizer, model.args.vocab_size,
                           tokenizer.eos_token_id).matcher()
    engine_forced = [int(t) for t in m.m.compute_ff_tokens()]
    forced = m.forced()
    assert tokenizer.decode(forced) == '{"name": "' and len(tokenizer.decode(engine_forced)) < len('{"name": "')
    assert forced[:len(engine_forced)] == engine_forced
    assert m.consume(forced) == len(forced)
    value = tokenizer.encode('Sven', add_special_tokens=False)
    assert m.consume(value) == len(value) and m.forced() == []  # inside a string nothing is forced
    close = tokenizer.encode('"', add_special_tokens=False)
    assert m.consume(close) == len(close)
    assert tokenizer.decode(m.forced()) == ', "city": "'


def test_the_tokenizer_lock_is_not_held_while_the_engine_compiles(demo, monkeypatch):
    """The server's lane lock keeps its tokenizer to one thread; a schema that takes the engine seconds to
    compile must not hold it (every other request's templating waited behind it)."""
    import threading

    import llguidance

    from refusion_mlx.decode.grammar import compile_constraint

    model, tokenizer = demo
    constraint = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    lock, held, real = threading.Lock(), [], llguidance.LLMatcher

    class Spy:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        grammar_from_lark = staticmethod(real.grammar_from_lark)

        @staticmethod
        def validate_grammar_with_warnings(*args, **kw):
            held.append(lock.locked())
            return real.validate_grammar_with_warnings(*args, **kw)

        def __new__(cls, *args, **kw):
            held.append(lock.locked())
            return real(*args, **kw)

    monkeypatch.setattr(llguidance, "LLMatcher", Spy)
    compile_constraint(constraint, tokenizer, model.args.vocab_size, tokenizer.eos_token_id, lock=lock)
    assert held and not any(held) and not lock.locked()
