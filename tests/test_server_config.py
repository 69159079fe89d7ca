"""The server's settings hold to one rule each, whether a flag or ``ServerConfig``'s keyword gives them."""

from __future__ import annotations

import argparse

import pytest

from refusion_mlx.errors import RefusionError
from refusion_mlx.serve.server_config import ServerConfig, add_server_args


def _flag(*argv: str) -> str:
    """The one-line error of the server's flags ``argv`` ("" when they parse)."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    parser = Parser()
    add_server_args(parser)
    try:
        parser.parse_args(list(argv))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("name", ["watchdog_seconds", "body_timeout", "header_timeout"])
def test_a_duration_has_one_bound_as_a_flag_and_a_keyword(name):
    """--watchdog-seconds 2e6 was refused while ServerConfig(watchdog_seconds=2e6) was taken."""
    flag = "--" + name.replace("_", "-")
    for value in (0, -1, 1e6, 2e6):
        assert "positive number of seconds under 1,000,000" in _flag(flag, str(value)), value
        with pytest.raises(RefusionError, match=f"^{name} must be a positive number of seconds under 1,000,000"):
            ServerConfig(**{name: value})
    assert _flag(flag, "999999") == "" and getattr(ServerConfig(**{name: 999999}), name) == 999999


def test_an_api_key_has_one_rule_and_one_message_as_a_flag_and_a_keyword():
    """--api-key and ServerConfig(api_keys=...) said the rule in two messages ("is" and "must be")."""
    from refusion_mlx.serve.server_config import API_KEY_RULE

    for bad in ("k y", "k" * 1025, "clé"):
        assert _flag("--api-key", bad) == f"argument --api-key: {API_KEY_RULE}", bad
        with pytest.raises(RefusionError) as e:
            ServerConfig(api_keys=(bad,))
        assert str(e.value) == API_KEY_RULE, bad
    with pytest.raises(RefusionError, match=API_KEY_RULE):
        ServerConfig(api_keys=("",))
    assert _flag("--api-key", "k" * 1024) == "" and ServerConfig(api_keys="k" * 1024).api_keys == ("k" * 1024,)


def test_the_servers_counts_read_as_every_commands_do():
    """The server's count flags are cli.flags' positive_int and count (it had copies of its own, with other
    messages and a cap of 2**62 that ServerConfig's keywords did not have)."""
    for flag in ("--max-batch", "--decode-concurrency", "--max-active", "--max-queue", "--max-body-bytes",
                 "--max-connections"):
        named = "--max-batch/--decode-concurrency" if flag in ("--max-batch", "--decode-concurrency") else flag
        for text in ("0", "x", "-3"):
            assert _flag(flag, text) == f"argument {named}: expected a positive integer, got {text!r}", flag
        assert _flag(flag, str(1 << 63)) == ""
    for text in ("x", "-1"):
        assert _flag("--max-stored-responses", text) == (
            f"argument --max-stored-responses: expected a whole number (0 or more), got {text!r}")
    assert _flag("--max-stored-responses", "0") == ""
    for text in ("70000", "-1", "x"):
        assert _flag("--port", text) == f"argument --port: port must be within 0..65535, got {text!r}"


def test_only_a_max_tokens_the_operator_gave_caps_the_responses_apis_open_budget():
    """Codex never sends max_output_tokens: OpenAI's Responses API then answers up to the context's end, and so
    does the server, unless its operator gave --max-tokens; chat and text completions keep the default (512)."""
    from refusion_mlx.decode.params import make_params
    from refusion_mlx.serve.core.engine_request import Draft, RequestTerms, finish
    from refusion_mlx.server import build_parser

    assert not ServerConfig.from_args(build_parser().parse_args([])).max_tokens_given
    for argv in (["--max-tokens", "512"], ["--max-tokens", "64"]):
        assert ServerConfig.from_args(build_parser().parse_args(argv)).max_tokens_given, argv
    assert not ServerConfig().max_tokens_given and ServerConfig(decoding=make_params(max_tokens=64)).max_tokens_given
    for given, responses, chat in ((False, 2036, 512), (True, 512, 512)):
        terms = RequestTerms(list, 100, 2048, make_params(), max_tokens_given=given)
        made = {api: finish(Draft([1] * 12, None, {}, api, open_budget=api == "responses"), terms).max_tokens
                for api in ("responses", "chat.completions")}
        assert made == {"responses": responses, "chat.completions": chat}, given
        asked = finish(Draft([1] * 12, 100, {}, "responses", open_budget=True), terms)
        assert asked.max_tokens == 100 and asked.asked_max_tokens is None


def test_an_open_budget_keeps_the_default_block_length_under_a_servers_serial_num_blocks():
    """--serial-num-blocks 4 serves a 512 default as 4 blocks of 128; the Responses API's open budget (the
    context left) would be 4 blocks of ~500 tokens each, every planning pass that wide: it keeps blocks of 16."""
    from refusion_mlx.decode.params import make_params
    from refusion_mlx.serve.core.engine_request import Draft, RequestTerms, finish

    terms = RequestTerms(list, 100, 2048, make_params(serial_num_blocks=4), max_tokens_given=False)
    made = finish(Draft([1] * 12, None, {}, "responses", open_budget=True), terms)
    assert made.max_tokens == 2036 and made.layout.block_lengths == [16] * 127 + [4], made.layout
    chat = finish(Draft([1] * 12, None, {}, "chat.completions"), terms)
    assert chat.layout.block_lengths == [128] * 4, chat.layout
    own = finish(Draft([1] * 12, None, {"serial_num_blocks": 2}, "responses", open_budget=True), terms)
    assert len(own.layout.block_lengths) == 2, own.layout
