"""mlx_lm.server's flags: ``--chat-template`` (a template in place of the model's, on generate and chat too),
``--decode-concurrency`` (``--max-batch``), and those with no like here refused in one line that says why, as
mlx_lm.convert's, mlx_lm.lora's and mlx_lm.fuse's are."""

from __future__ import annotations

import json
import urllib.request

import pytest

from refusion_mlx import chat, server
from refusion_mlx.cli.mlx_lm_flags import SERVER_UNSUPPORTED
from refusion_mlx.errors import LoadError
from refusion_mlx.generate import chat_prompt, main
from refusion_mlx.models.loading import load
from refusion_mlx.models.template_steps import MAX_TEMPLATE_CHARS
from refusion_mlx.serve.server_config import ServerConfig

from tests.helpers import FIXTURE_MODEL

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


def test_the_server_takes_mlx_lm_servers_names():
    args = server.build_parser().parse_args(["--decode-concurrency", "3", "--chat-template", TEMPLATE,
                                             "--chat-template-args", '{"enable_thinking": false}'])
    config = ServerConfig.from_args(args)
    assert config.max_batch == 3 and config.chat_template == TEMPLATE
    assert config.chat_template_config == {"enable_thinking": False}
    assert ServerConfig.from_args(server.build_parser().parse_args([])).chat_template is None


@pytest.mark.parametrize("flags", sorted(SERVER_UNSUPPORTED))
def test_the_servers_flags_with_no_like_say_why_in_one_line(capsys, flags):
    argv = [flags[0]] + (["4"] if SERVER_UNSUPPORTED[flags] else [])
    with pytest.raises(SystemExit) as exit_info:
        server.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and f"error: {flags[0]}: " in err, err
    assert "not supported" in err and "_" not in err.split(": ", 2)[2].replace("refusion_mlx", ""), err


@pytest.mark.parametrize("command, argv, says", [
    ("convert", ["--hf-path", "x", "--dequantize"], "again without --quantize for float weights"),
    ("convert", ["--hf-path", "x", "-d"], "again without --quantize"),
    ("convert", ["--hf-path", "x", "--upload-repo", "me/model"], "hf upload REPO FOLDER"),
    ("convert", ["--hf-path", "x", "--trust-remote-code"], "no checkpoint's own code is run"),
    ("train", ["--report-to", "wandb"], "reporting to wandb or swanlab is not supported here"),
    ("train", ["--project-name", "p"], "reporting is not supported here"),
    ("train", ["--clear-cache-threshold", "1G"], "clearing MLX's cache while training is not supported"),
    ("train", ["--trust-remote-code"], "a ReFusion model needs no code of its own"),
    ("fuse", ["--export-gguf"], "no GGUF runtime runs ReFusion's slot decoder"),
    ("fuse", ["--gguf-path", "m.gguf"], "no GGUF runtime"),
    ("fuse", ["--upload-repo", "me/model"], "hf upload REPO FOLDER")])
def test_mlx_lms_other_commands_flags_with_no_like_say_why(capsys, command, argv, says):
    import importlib

    module = importlib.import_module({"convert": "refusion_mlx.convert.__main__",
                                      "train": "refusion_mlx.train.__main__", "fuse": "refusion_mlx.fuse"}[command])
    with pytest.raises(SystemExit) as exit_info:
        module.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    flag = next(a for a in argv if a.startswith("-") and a != "--hf-path")
    assert exit_info.value.code == 2 and err.count("\n") == 1 and f"error: {flag}: " in err and says in err, err


def test_generate_decodes_under_the_template_given(capsys):
    code = main(["--model", str(FIXTURE_MODEL), "--prompt", "Who is Sven?", "--max-tokens", "8", "--json",
                 "--chat-template", TEMPLATE, "--system", "Be brief."])
    out = capsys.readouterr().out
    assert code == 0, out
    _, tokenizer = load(FIXTURE_MODEL)
    assert tokenizer.decode(json.loads(out)["prompt_ids"]) == "[system] Be brief.\n[user] Who is Sven?\n>"


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}", "fails on a one-message chat: Unexpected end of template"),
    ("{{ raise_exception('no tools here') }}", "fails on a one-message chat: no tools here"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran past"),
    (" ", "the chat template given is empty"),
    ("x" * (MAX_TEMPLATE_CHARS + 1), f"is {MAX_TEMPLATE_CHARS + 1:,} characters long")])
def test_a_template_that_cannot_serve_is_refused_as_the_model_loads(template, says):
    with pytest.raises(LoadError, match=says):
        load(FIXTURE_MODEL, chat_template=template)


def test_the_commands_say_a_bad_template_in_one_line(capsys, monkeypatch):
    for command, prompt in ((main, ["--prompt", "Hi"]), (chat.main, [])):  # before chat reads a line
        assert command(["--model", str(FIXTURE_MODEL), *prompt, "--chat-template", "{{ x"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: the chat template given fails on a one-message chat: ") and \
            err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt", "Hi", "--no-chat-template", "--chat-template", TEMPLATE])
    assert exit_info.value.code == 2 and "--chat-template needs the chat template" in capsys.readouterr().err


def test_the_server_renders_every_chat_with_the_template_given():
    from refusion_mlx.server import RefusionServer

    _, tokenizer = load(FIXTURE_MODEL, chat_template=TEMPLATE)
    expected = len(chat_prompt(tokenizer, "Who is Sven?"))
    with RefusionServer(str(FIXTURE_MODEL), port=0, chat_template=TEMPLATE) as srv:
        with urllib.request.urlopen(srv.url.removesuffix("/v1") + "/tokenizer_info") as resp:
            assert json.load(resp)["chat_template"] == TEMPLATE
        body = {"messages": [{"role": "user", "content": "Who is Sven?"}], "max_tokens": 4}
        request = urllib.request.Request(srv.url + "/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as resp:
            assert json.load(resp)["usage"]["prompt_tokens"] == expected
    assert expected != len(chat_prompt(load(FIXTURE_MODEL)[1], "Who is Sven?"))
