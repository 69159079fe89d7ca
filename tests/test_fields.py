"""decode.params.FIELDS is the one table of decoding settings: the CLI flags,
the server's request schema, the prompts file, make_params and the bench's
request bodies all take exactly its names and aliases."""

import argparse
import dataclasses
import json
import typing

import pytest

from refusion_mlx.bench.modes import _request_fields
from refusion_mlx.cli import add_decoding_args
from refusion_mlx.decode.params import ALIASES, FIELDS, PARAM_NAMES, RefusionParams, make_params
from refusion_mlx.decode.prompts_file import parse_prompts
from refusion_mlx.errors import RefusionError
from refusion_mlx.serve.protocols.anthropic_api import MessagesRequest
from refusion_mlx.serve.protocols.responses_api import ResponsesRequest
from refusion_mlx.serve.protocols.bodies import DECODING_FIELDS, foreign_fields
from refusion_mlx.serve.protocols.openai_bodies import ChatCompletionRequest, CompletionRequest

SAMPLE = {int: 8, float: 0.5, dict: {"5": -1.5}}  # a value every field of its type takes
TYPED = {int: "8", float: "0.5", dict: '{"5": -1.5}'}  # ... as a flag gives it
NOT_DECODING = {"model", "stop", "stream", "stream_options", "user"}


def test_the_table_names_every_setting_once():
    assert PARAM_NAMES == tuple(f.name for f in dataclasses.fields(RefusionParams))
    names = [f.name for f in FIELDS] + list(ALIASES)
    assert len(names) == len(set(names))
    assert ALIASES == {"max_tokens": "gen_length", "temp": "temperature"}
    hints = typing.get_type_hints(RefusionParams)
    assert all(hints[f.name] in (f.type, typing.Optional[f.type]) for f in FIELDS if f.type is not dict)
    # an object setting (logit_bias) is given as a mapping and kept as sorted (key, value) pairs
    assert [f.name for f in FIELDS if f.type is dict] == ["logit_bias"]
    assert RefusionParams(logit_bias={"9": 1, 5: -1.5}).logit_bias == ((5, -1.5), (9, 1.0))


def _parser():
    parser = argparse.ArgumentParser()
    add_decoding_args(parser)
    return parser


def test_the_cli_takes_exactly_the_tables_flags():
    parser = _parser()
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "preset")}
    assert set(actions) == {f.name for f in FIELDS if f.flags}
    for f in FIELDS:
        if f.flags:
            assert tuple(actions[f.name].option_strings) == f.flags
            assert actions[f.name].help == f.flag_help()
            for flag in f.flags:
                assert getattr(parser.parse_args([flag, TYPED[f.type]]), f.name) == SAMPLE[f.type]
    assert set(actions) == set(PARAM_NAMES)  # every setting: the sampling filters too, as mlx-lm's flags
    flags = {flag for f in FIELDS for flag in f.flags}
    assert flags == {"--max-tokens", "--gen-length", "--slot-size", "--serial-num-blocks", "--block-length",
                     "--slot-threshold", "--token-threshold", "--temp", "--seed", "--top-p", "--top-k", "--min-p",
                     "--xtc-probability", "--xtc-threshold", "--presence-penalty", "--frequency-penalty",
                     "--logit-bias", "--repetition-penalty"}
    with pytest.raises(SystemExit):  # one layout
        parser.parse_args(["--serial-num-blocks", "2", "--block-length", "8"])
    assert "blocks of 16 tokens" in " ".join(parser.format_help().split())


def test_the_server_schema_takes_exactly_the_tables_request_fields():
    requests = {f.request: f for f in FIELDS if f.request is not None}
    assert set(requests) == set(PARAM_NAMES) - {"gen_length"} | {"max_tokens"}
    tools = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}  # structured output: not FIELDS
    scoring = {"echo", "logprobs", "logprob_estimator", "mc_num", "context_tokens"}  # serve/core/loglikelihood.py
    answers = {"n", "logprobs", "top_logprobs"}  # serve/protocols/openai_choices.py, serve/protocols/openai_logprobs.py
    accepted = {"store", "metadata", "service_tier", "reasoning_effort", "verbosity"}  # typed, changing nothing
    template = {"chat_template_kwargs", "continue_final_message", "add_generation_prompt"}  # how the prompt renders
    for model, extra in ((ChatCompletionRequest, {"messages", "max_completion_tokens"} | answers | tools | accepted
                          | template),
                         (CompletionRequest, {"prompt", "n", "logprobs"} | scoring)):
        assert set(model.model_fields) - NOT_DECODING - extra == set(requests)
        for name, f in requests.items():
            if (model, name) != (CompletionRequest, "max_tokens"):  # its own: 0 is valid with echo
                assert model.model_fields[name].description == f.request_description()
    assert CompletionRequest.model_fields["max_tokens"].description.startswith(
        requests["max_tokens"].request_description())
    # the Responses and Messages APIs take the same decoding fields as extras; their budget is their own
    for model in (ResponsesRequest, MessagesRequest):
        assert set(requests) - {"max_tokens"} <= set(model.model_fields)
        for name, f in requests.items():
            if name != "max_tokens":
                assert model.model_fields[name].description == f.request_description()
    assert "max_tokens" not in ResponsesRequest.model_fields and MessagesRequest.model_fields["max_tokens"].is_required()
    assert set(DECODING_FIELDS) == set(requests) - {"max_tokens"}
    body = {"messages": [{"role": "user", "content": "hi"}]}
    body.update({name: {int: 1, float: 0.5, dict: {"5": -1.5}}[f.type] for name, f in requests.items()})
    request = ChatCompletionRequest.model_validate(body)
    assert all(getattr(request, name) == body[name] for name in requests)


def test_a_settings_other_names_are_refused_where_a_body_does_not_take_them():
    """Every name and alias of the table that is not an API's own name for the setting, and ``preset``, is
    refused by that API (a 400, not a request decoded with the server's defaults); no field an API's
    body reads ever is."""
    names = {name for f in FIELDS for name in (f.name, *f.aliases)} | {"preset"}
    for api, model in (("chat.completions", ChatCompletionRequest), ("completions", CompletionRequest),
                       ("responses", ResponsesRequest), ("messages", MessagesRequest)):
        refused = foreign_fields(api)
        assert not set(refused) & set(model.model_fields), api
        assert names - set(model.model_fields) <= set(refused), api
    assert foreign_fields("responses")["gen_length"].endswith("send max_output_tokens")
    # each API's names for the budget and the stop strings, sent to another (a 200 cut nowhere, stopped nowhere)
    for api, model in (("chat.completions", ChatCompletionRequest), ("completions", CompletionRequest),
                       ("responses", ResponsesRequest), ("messages", MessagesRequest)):
        others = {"max_tokens", "max_completion_tokens", "max_output_tokens", "stop", "stop_sequences",
                  # the schema an answer keeps to, the system prompt, the number of answers, logprobs
                  "response_format", "text", "output_config", "output_format", "system", "instructions", "n",
                  "logprobs", "top_logprobs", "include"}
        if api == "completions":  # its own n and logprobs; response_format: only {"type": "text"} (HARMLESS)
            others -= {"n", "logprobs", "response_format"}
        assert others - set(model.model_fields) <= set(foreign_fields(api)), api
    assert foreign_fields("messages")["temp"].endswith("send temperature")


def test_only_openais_own_fields_are_marked_openai():
    """``openai=True`` is a field OpenAI's API defines (its schema description and the web
    page's label drop "ReFusion"); top_k and min_p are not OpenAI's: its clients send them in
    extra_body, as slot_size, and they are labelled as ReFusion's."""
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase as Chat
    from openai.types.completion_create_params import CompletionCreateParamsBase as Legacy
    requests = {f.request: f for f in FIELDS if f.request is not None}
    for api in (Chat, Legacy):
        assert {name for name, f in requests.items() if f.openai} == set(requests) & set(api.__annotations__)
    for name in ("top_k", "min_p"):
        assert requests[name].request_description().startswith("ReFusion: ")
        assert ChatCompletionRequest.model_fields[name].description.startswith("ReFusion: ")


def test_the_prompts_file_takes_exactly_the_tables_names_and_aliases():
    defaults = RefusionParams()
    for name in list(PARAM_NAMES) + list(ALIASES):
        f = next(f for f in FIELDS if name in (f.name,) + f.aliases)
        value = {"gen_length": 64, "slot_size": 4, "serial_num_blocks": 4, "block_length": 16, "seed": 3,
                 "top_k": 5}.get(f.name, SAMPLE[f.type] if f.type is not int else 1)
        kept = RefusionParams(**{f.name: value}).logit_bias if f.type is dict else value  # as pairs
        [item] = parse_prompts(json.dumps({"prompt": "hi", name: value}), "p.jsonl", defaults)
        assert getattr(item.params, f.name) == kept
        assert getattr(make_params(**{name: value}), f.name) == kept
    with pytest.raises(RefusionError, match="unknown field"):
        parse_prompts(json.dumps({"prompt": "hi", "repetition_context_size": 20}), "p.jsonl", defaults)
    with pytest.raises(TypeError, match="unknown decoding parameter"):
        make_params(repetition_context_size=20)


def test_the_bench_sends_the_tables_request_names():
    fields = _request_fields(make_params(max_tokens=64, block_length=16, seed=3))
    assert fields == {"max_tokens": 64, "slot_size": 4, "block_length": 16, "slot_threshold": 0.6,
                      "token_threshold": 0.3, "temperature": 0.0, "seed": 3, "top_p": 1.0, "top_k": 0,
                      "min_p": 0.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "presence_penalty": 0.0,
                      "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    fields = _request_fields(make_params(max_tokens=64, serial_num_blocks=4))
    assert fields["serial_num_blocks"] == 4 and "block_length" not in fields and "seed" not in fields
    fields = _request_fields(make_params(logit_bias={7: -100}, presence_penalty=0.5))
    assert fields["logit_bias"] == {"7": -100.0} and fields["presence_penalty"] == 0.5  # as a body takes them
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_every_interface_holds_a_setting_to_the_tables_bounds():
    """A value past a setting's upper bound is refused by the flags (the server's --temp 5 started, and requests
    that left temperature out ran at 5, while one sending 5 got a 400), make_params, a prompts file and a
    request alike; its bound itself is taken by all of them."""
    from pydantic import ValidationError

    from refusion_mlx.cli import params_from_args
    from refusion_mlx.errors import DecodeError

    body = {"messages": [{"role": "user", "content": "hi"}]}
    for f in (f for f in FIELDS if f.le is not None):
        for value, taken in ((f.le, True), (f.le + (1 if f.type is int else 0.5), False)):
            value = f.type(value)
            flag = _parser().parse_args([f.flags[0], str(value)])
            made = [lambda: params_from_args(flag), lambda: make_params(**{f.name: value}),
                    lambda: parse_prompts(json.dumps({"prompt": "hi", f.name: value}), "p.jsonl", RefusionParams()),
                    lambda: ChatCompletionRequest.model_validate({**body, f.request: value})]
            for make in made:
                if taken:
                    make()
                else:
                    with pytest.raises((DecodeError, RefusionError, ValidationError)):
                        make()
            if not taken:  # the flag as the user typed it
                with pytest.raises(DecodeError, match=f"^{f.flags[0]} must be"):
                    params_from_args(flag)


def test_the_messages_api_states_its_own_temperature_range():
    """Anthropic's temperature is from 0 to 1: the Messages API's schema (/openapi.json) says so, not the table's
    2, and its validation is the schema's."""
    from pydantic import ValidationError

    from refusion_mlx.serve.protocols.anthropic_api import MAX_TEMPERATURE

    schema = MessagesRequest.model_json_schema()["properties"]["temperature"]
    assert MAX_TEMPERATURE == 1 and {"type": "number", "minimum": 0, "maximum": 1} in schema["anyOf"]
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert MessagesRequest.model_validate({**body, "temperature": 1}).temperature == 1
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        MessagesRequest.model_validate({**body, "temperature": 1.5})
    assert ChatCompletionRequest.model_json_schema()["properties"]["temperature"]["anyOf"][0]["maximum"] == 2


def test_the_most_top_tokens_is_one_bound_on_every_body():
    """top_logprobs (chat, the Responses API) and the legacy completions' logprobs count take up to the same
    MAX_TOP_LOGPROBS (three literals before)."""
    from pydantic import ValidationError

    from refusion_mlx.serve.protocols.bodies import MAX_TOP_LOGPROBS

    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    for model, field, body in ((ChatCompletionRequest, "top_logprobs", chat),
                               (ResponsesRequest, "top_logprobs", {"input": "hi"}),
                               (CompletionRequest, "logprobs", {"prompt": "hi"})):
        assert getattr(model.model_validate({**body, field: MAX_TOP_LOGPROBS}), field) == MAX_TOP_LOGPROBS
        with pytest.raises(ValidationError, match=f"less than or equal to {MAX_TOP_LOGPROBS}"):
            model.model_validate({**body, field: MAX_TOP_LOGPROBS + 1})
