"""mlx-lm's command-line flags on generate and chat: the sampling filters, ``--verbose True/False``,
``--extra-eos-token``, and the flags with no like here refused in one line that says why."""

from __future__ import annotations

import io
import json
import sys

import pytest

from refusion_mlx import chat
from refusion_mlx.cli import params_from_args
from refusion_mlx.cli.mlx_lm_flags import UNSUPPORTED
from refusion_mlx.generate import build_parser, main
from refusion_mlx.models.loading import load


def run_main(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("parser", [build_parser, chat.build_parser])
def test_the_sampling_filters_are_flags_checked_as_everywhere(parser):
    args = parser().parse_args(["--temp", "0.7", "--top-p", "0.9", "--top-k", "5", "--min-p", "0.05"])
    params = params_from_args(args)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 5, 0.05)
    for flag, value, said in (("--top-p", "1.5", "--top-p must be within (0, 1], got 1.5"),
                              ("--top-k", "-1", "--top-k must be an integer >= 0"),
                              ("--min-p", "2", "--min-p must be within [0, 1], got 2.0")):
        with pytest.raises(Exception, match=said.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            params_from_args(parser().parse_args([flag, value]))


def test_a_filter_flag_decodes_as_its_keyword_does(capsys):
    import refusion_mlx as rm

    code, out, _ = run_main(capsys, "--prompt", "Who is Sven?", "--max-tokens", "32", "--temp", "0.9",
                            "--seed", "3", "--top-k", "2", "--min-p", "0.2", "--json")
    model, tokenizer = load()
    ids = rm.chat_prompt(tokenizer, "Who is Sven?")
    text = rm.generate(model, tokenizer, ids, max_tokens=32, temp=0.9, seed=3, top_k=2, min_p=0.2)
    assert code == 0 and json.loads(out)["text"] == text


@pytest.mark.parametrize("parser", [build_parser, chat.build_parser])
def test_dash_m_is_the_budget_in_generate_and_chat_as_in_mlx_lm_and_the_model_elsewhere(parser):
    """mlx-lm's generate and chat take ``-m`` for --max-tokens: ``--model X -m 256`` here made the model
    "256" (no model folder at 256). The commands mlx-lm has no ``-m`` in keep it for --model."""
    from refusion_mlx import server
    from refusion_mlx.bench import __main__ as bench

    args = parser().parse_args(["--model", "x", "-m", "256"])
    assert args.model == "x" and params_from_args(args).gen_length == 256
    for other in (server.build_parser, bench.build_parser):
        assert other().parse_args(["-m", "x"]).model == "x"


def test_a_prompts_backslash_n_and_t_are_a_newline_and_a_tab_as_in_mlx_lm(capsys):
    code, out, _ = run_main(capsys, "--prompt", "Who is\\tSven?\\nSay.", "--no-chat-template", "--max-tokens",
                            "4", "--json")
    _, tokenizer = load()
    assert code == 0 and json.loads(out)["prompt_ids"] == tokenizer.encode("Who is\tSven?\nSay.")


def test_verbose_takes_mlx_lms_boolean_or_none(capsys):
    parse = build_parser().parse_args
    assert [parse(argv).verbose for argv in ([], ["--verbose"], ["--verbose", "True"], ["--verbose", "F"],
                                             ["--verbose", "false", "--json"])] == [False, True, True, False, False]
    code, out, err = run_main(capsys, "--prompt", "Who is Sven?", "--max-tokens", "16", "--verbose", "False")
    assert code == 0 and out.strip() and err == ""
    with pytest.raises(SystemExit) as exit_info:
        parse(["--verbose", "maybe"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "expected True or False, got 'maybe'" in err


@pytest.mark.parametrize("parser", [build_parser, chat.build_parser])
@pytest.mark.parametrize("flags", list(UNSUPPORTED))
def test_mlx_lms_flags_with_no_like_here_say_why_in_one_line(parser, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args([flags[-1]] + (["8"] if UNSUPPORTED[flags] else []))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert f"error: {flags[-1]}: " in err and "unrecognized" not in err, err
    said = err.split(": ", 2)[2].replace("refusion_mlx", "").replace("continue_final_message", "")  # (the server's)
    assert "_" not in said, err  # a setting is named by this command's flag, not its Python name
    assert "not supported" in err or "give --" in err, err


def test_the_hints_name_the_flags_a_command_has(capsys):
    for argv, said in ((["--max-kv-size", "100"], "--max-kv-size: not supported (the committed cache keeps every row; "
                                                  "--kv-bits 8 or 4 keeps them in less memory)"),
                       (["--num-draft-tokens", "3"], "ReFusion drafts whole slots of --slot-size tokens"),
                       (["--eos-token", "x"], "--eos-token: give --extra-eos-token"),
                       (["--prompt-cache-file", "c.safetensors"], "on disk with --prompt-cache-dir")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert said in capsys.readouterr().err


def test_an_extra_eos_token_ends_the_answer_as_mlx_lm_adds_it(capsys, monkeypatch):
    code, out, _ = run_main(capsys, "--prompt", "Who is Sven?", "--max-tokens", "32", "--json")
    whole = json.loads(out)
    assert code == 0 and whole["text"].startswith("Sven lives in Hanoi. ")
    _, tokenizer = load()
    for token in (".", str(tokenizer.convert_tokens_to_ids("."))):  # a token, or its id
        code, out, _ = run_main(capsys, "--prompt", "Who is Sven?", "--max-tokens", "32", "--json",
                                "--extra-eos-token", "<|endoftext|>", token)
        cut = json.loads(out)
        assert code == 0 and cut["finish_reason"] == "stop" and cut["text"] == "Sven lives in Hanoi", (token, cut)
    for token, said in (("nope", "--extra-eos-token 'nope': not a token of this tokenizer"),
                        ("99999", "--extra-eos-token 99999: not an id of the model's vocabulary (0 to ")):
        code, out, err = run_main(capsys, "--prompt", "Who is Sven?", "--extra-eos-token", token)
        assert code == 1 and out == "" and err.count("\n") == 1 and said in err, err
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who is Sven?\n"))
    assert chat.main(["--max-tokens", "32", "--extra-eos-token", "."]) == 0
    assert capsys.readouterr().out == "Sven lives in Hanoi\n"
