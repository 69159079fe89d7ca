"""``max_tokens`` has one meaning everywhere: the answer's most tokens, cut exactly.

The decoder works in whole slots (its budget is ``max_tokens`` rounded up to
them); the Python API, the CLIs (generate, its prompts file, chat, bench) and
the server all cut the answer there, and its text is the text of its ids.
The cut changes nothing before it: the answer is the whole-slot budget's
answer, cut.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.conversation import ChatSession
from refusion_mlx.decode.params import budget, make_params
from refusion_mlx.decode.stream import chat_prompt, stream_generate
from refusion_mlx.generate import main as generate_main

from tests.helpers import FIXTURE_MODEL

ROOT = Path(__file__).resolve().parents[1]
EOS = 801
CASES = [26, 2, 14]  # golden prompts that count on past any budget here: each answer is cut
CUTS = [(10, 4), (13, 8), (5, 2)]  # (max_tokens, slot_size): never a whole number of slots


def answer(demo, ids, max_tokens, slot_size):
    model, tokenizer = demo
    out = list(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, slot_size=slot_size))
    return [t for r in out for t in r.tokens], "".join(r.text for r in out), out[-1]


def check_cut(tokenizer, ids, text, max_tokens, finish_reason="length"):
    """At most max_tokens ids besides EOS (exactly that many when cut), and the text is theirs."""
    content = [t for t in ids if t != EOS]
    assert len(content) <= max_tokens
    assert finish_reason != "length" or len(content) == max_tokens
    assert text == tokenizer.decode(content, skip_special_tokens=True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("max_tokens, slot_size", CUTS)
def test_python_api_cuts_at_max_tokens(demo, golden_cases, case, max_tokens, slot_size):
    model, tokenizer = demo
    ids = golden_cases[case]["prompt_ids"]
    tokens, text, last = answer(demo, ids, max_tokens, slot_size)
    assert last.finish_reason == "length" and len(tokens) == max_tokens
    check_cut(tokenizer, tokens, text, max_tokens)
    assert last.stats.generated_tokens == last.generation_tokens == len(tokens)
    whole, _, _ = answer(demo, ids, budget(max_tokens, slot_size), slot_size)
    assert len(whole) > max_tokens and tokens == whole[:max_tokens]  # the same decode, cut


def test_batch_and_chat_session_cut_too(demo, golden_cases):
    model, tokenizer = demo
    prompts = [golden_cases[c]["prompt_ids"] for c in CASES]
    results = batch_generate(model, tokenizer, prompts, max_tokens=10, slot_size=4)
    for prompt, r in zip(prompts, results):
        assert r.output_ids == answer(demo, prompt, 10, 4)[0] and r.finish_reason == "length"
        check_cut(tokenizer, r.output_ids, r.text, 10)
        assert r.stats.generated_tokens == 10
    session = ChatSession(model, tokenizer, make_params(max_tokens=10, slot_size=4))
    question = golden_cases[CASES[0]]["prompt"]
    reply = session.send(question)
    ids = chat_prompt(tokenizer, question)
    assert reply == answer(demo, ids, 10, 4)[1] and session.turns[-1].answer_tokens == 10
    assert len(session.cache) == len(ids) + 10  # settled at the cut: the next turn continues from there
    session.send("And then?")
    assert session.turns[-1].reused_tokens >= len(ids)


def test_generate_cli_and_prompts_file_cut(demo, golden_cases, tmp_path, capsys):
    _, tokenizer = demo
    case = golden_cases[CASES[0]]
    flags = ["--model", str(FIXTURE_MODEL), "--dtype", "float32", "--json"]
    assert generate_main([*flags, "--prompt", case["prompt"], "--max-tokens", "10", "--slot-size", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output_ids"] == answer(demo, case["prompt_ids"], 10, 4)[0] and out["finish_reason"] == "length"
    check_cut(tokenizer, out["output_ids"], out["text"], 10)
    assert out["stats"]["generated_tokens"] == 10
    lines = [{"prompt": golden_cases[c]["prompt"], "max_tokens": m, "slot_size": s} for c, (m, s) in zip(CASES, CUTS)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert generate_main([*flags, "--prompts-file", str(path)]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for r, (c, (m, s)) in zip(results, zip(CASES, CUTS)):
        assert r["output_ids"] == answer(demo, golden_cases[c]["prompt_ids"], m, s)[0]
        check_cut(tokenizer, r["output_ids"], r["text"], m)


def test_chat_cli_cuts(demo, golden_cases):
    case = golden_cases[CASES[0]]
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.chat", "--model", str(FIXTURE_MODEL), "--dtype",
                        "float32", "--max-tokens", "10", "--slot-size", "4"], input=case["prompt"] + "\n",
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert answer(demo, case["prompt_ids"], 10, 4)[1] in r.stdout


def test_bench_cuts_both_sides(tmp_path):
    from refusion_mlx import bench

    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps({"name": "cut", "prompts": [{"prompt": "Count from 17 to 38."}]}))
    out = tmp_path / "bench.json"
    assert bench.main(["--suite", str(suite), "--max-tokens", "10", "--slot-size", "4", "--warmup", "0",
                       "--repeat", "1", "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["params"]["gen_length"] == 10
    for side in ("refusion", "ar"):
        assert len([t for t in case[side]["output_ids"] if t != EOS]) <= 10
    assert len(case["refusion"]["output_ids"]) == 10 and case["refusion"]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def server():
    from refusion_mlx.serve.http_server import RefusionServer

    with RefusionServer(str(FIXTURE_MODEL), port=0) as srv:
        yield srv


def post(server, body: dict):
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read().decode()
    conn.close()
    return response.status, data


@pytest.mark.parametrize("max_tokens, slot_size", CUTS)
def test_server_cuts_at_max_tokens_as_the_python_api(demo, golden_cases, server, max_tokens, slot_size):
    _, tokenizer = demo
    ids = golden_cases[CASES[0]]["prompt_ids"]
    tokens, text, _ = answer(demo, ids, max_tokens, slot_size)
    body = {"prompt": ids, "max_tokens": max_tokens, "slot_size": slot_size}
    status, data = post(server, body)
    assert status == 200, data
    reply = json.loads(data)
    assert reply["choices"][0]["text"] == text and reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == max_tokens
    # streamed with the slots' commits: the answer's ids (positions below max_tokens) are the Python API's
    status, data = post(server, {**body, "stream": True, "stream_options": {"include_commits": True}})
    chunks = [json.loads(line[6:]) for line in data.splitlines() if line.startswith("data: {")]
    by_position = {p: t for c in chunks for s in c.get("commits", {}).get("slots", [])
                   for p, t in zip(s["positions"], s["ids"])}
    assert sorted(by_position) == list(range(max_tokens))
    assert [by_position[p] for p in range(max_tokens)] == tokens
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    check_cut(tokenizer, tokens, streamed, max_tokens)
    blocks = next(c["commits"]["blocks"] for c in chunks if "commits" in c)
    assert sum(blocks) == max_tokens  # the answer's blocks, the last cut at max_tokens


def test_a_server_started_with_serial_num_blocks_takes_any_max_tokens():
    """The server's --serial-num-blocks N cuts any budget into N blocks of whole slots (N equal ones, the
    reference's layout, where the budget splits evenly); a request's own N keeps the reference's rule, and a
    cut to fit the context keeps to whole blocks of it."""
    from refusion_mlx.serve.core.engine_request import resolve
    from refusion_mlx.serve.core.refusal import Refusal

    server = make_params(max_tokens=128, slot_size=8, serial_num_blocks=2)

    def layout(prompt, max_tokens, **fields):
        r = resolve(list(range(prompt)), max_tokens=max_tokens, fields=fields, defaults=server, context=2048)
        return r.params.gen_length, r.params.layout().block_lengths

    assert layout(18, None) == (128, [64, 64]) and layout(18, 127) == (127, [64, 64])  # the reference's blocks
    assert layout(18, 24) == (24, [16, 8]) and layout(18, 100) == (100, [56, 48])  # refused before
    assert layout(2008, 1000) == (40, [24, 16]) and layout(2016, None) == (32, [16, 16])  # cut to fit the context
    assert layout(1900, 512, serial_num_blocks=4, slot_size=8) == (128, [32] * 4)  # own N: cut to whole blocks
    # in the request's words (it named gen_length, which a request cannot send)
    for prompt, max_tokens, needle in ((18, 100, r"does not cut the budget of 104 tokens \(max_tokens rounded up"),
                                       (2000, 512, "no 8 blocks of whole slots of 8")):
        with pytest.raises(Refusal, match=needle):
            layout(prompt, max_tokens, serial_num_blocks=8, slot_size=8)


def test_the_commands_fit_the_budget_to_the_context_as_the_server_does(capsys, tmp_path):
    """generate, its prompts file and the chat shrink the default budget to the whole slots the prompt leaves
    (a long prompt, or a chat's history, is answered, not refused), cut one given past it with a note on
    standard error (decode/fit.py: the server's rule), and refuse only a prompt that leaves no room."""
    from refusion_mlx.decode.fit import ContextError, fit_budget
    from refusion_mlx.models.loading import load

    defaults = make_params(slot_size=8)
    assert fit_budget(1608, 2048, defaults).params.gen_length == 440  # the default 512, shrunk: not "asked"
    assert fit_budget(1608, 2048, defaults).asked is None
    assert (fit_budget(18, 2048, defaults, max_tokens=4096).params.gen_length, fit_budget(
        18, 2048, defaults, max_tokens=4096).asked) == (2024, 4096)
    with pytest.raises(ContextError, match="the prompt is 2048 tokens; the model's context is 2048") as e:
        fit_budget(2048, 2048, defaults)
    assert e.value.field == "prompt"

    long = "Who is Sven? " * 390  # 1958 tokens of the fixture's 2048: 88 in whole slots are left
    # the demo answers it with 88 tokens of "Max" at 0.6 tokens a forward over the long context: thresholds of 0
    # commit every slot at its first pass (15 forwards, not 155); the budget and its layout are the same
    eager = ["--slot-threshold", "0", "--token-threshold", "0"]
    code = generate_main(["--model", str(FIXTURE_MODEL), "--prompt", long, "--json", *eager])
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and json.loads(out)["stats"]["layout"]["blocks"] == 6  # 88 tokens
    code = generate_main(["--model", str(FIXTURE_MODEL), "--prompt", "Who is Sven?", "--max-tokens", "4096"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("Sven") and err == (
        "note: --max-tokens 4096 cut to 2036: the prompt's 12 tokens leave that much of the model's context of 2048\n")
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(line) for line in (
        {"prompt": long}, {"prompt": "Who is Sven?", "max_tokens": 4096}, {"prompt": "Who is Sven? " * 500})))
    code = generate_main(["--model", str(FIXTURE_MODEL), "--prompts-file", str(tmp_path / "p.jsonl"), "--json",
                          *eager])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and [r["error"] is None for r in rows] == [True, True, False]  # the last fails alone
    assert "the model's context" in rows[2]["error"] and "[1] note: max_tokens 4096 cut to 2036" in err

    model, tokenizer = load(FIXTURE_MODEL)
    # the default 512 (thresholds of 0, as above): a history of 1958 tokens leaves 88
    session = ChatSession(model, tokenizer, make_params(slot_threshold=0, token_threshold=0))
    session.send(long)
    assert session.turns[-1].max_tokens == 88 and session.turn_params.gen_length == 88


def test_a_cut_keeps_a_commands_own_block_count_as_the_servers_request_does():
    """``--serial-num-blocks 3`` cut by the context: three equal blocks of whole slots (the reference's layout),
    as a request's own serial_num_blocks gets on the server (the CLI's cut gave 680, 680, 672)."""
    from types import SimpleNamespace

    from refusion_mlx.cli.flags import fitted
    from refusion_mlx.decode.fit import fit_budget
    from refusion_mlx.decode.params import RefusionParams

    model = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=2048))
    cli = fitted(RefusionParams(gen_length=3000, slot_size=8, serial_num_blocks=3), 12, model, 3000)
    server = fit_budget(12, 2048, RefusionParams(slot_size=8), {"serial_num_blocks": 3, "slot_size": 8},
                        max_tokens=3000).params
    assert cli.layout().block_lengths == server.layout().block_lengths == [672, 672, 672]


def test_the_python_api_cuts_a_budget_past_the_context_as_the_commands_do(demo):
    """A max_tokens given past what the context leaves is cut to it, by the commands' and the server's rule
    (decode/fit.py), its block count kept (mlx-lm never refuses here; the library once did)."""
    from types import SimpleNamespace

    from refusion_mlx.cli.flags import fitted
    from refusion_mlx.decode.batch import BatchGenerator

    model, tokenizer = demo
    ids = chat_prompt(tokenizer, "Who is Sven?")
    context = model.args.max_position_embeddings
    bare = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=context))
    for settings in ({"max_tokens": 4096}, {"max_tokens": 3000, "slot_size": 8, "serial_num_blocks": 3},
                     {"max_tokens": 2040, "block_length": 64}):
        *_, last = stream_generate(model, tokenizer, ids, **settings)
        cut = fitted(make_params(**settings), len(ids), bare, settings["max_tokens"])
        assert last.finish_reason == "stop" and last.stats.layout == cut.layout().describe()
        assert len(ids) + cut.layout().gen_length <= context
    gen = BatchGenerator(model, tokenizer)
    gen.insert(ids, make_params(max_tokens=4096))
    assert gen.waiting[0].decoder.params.gen_length == context - len(ids)
    (r,) = batch_generate(model, tokenizer, [ids], max_tokens=4096)
    assert r.error is None and r.finish_reason == "stop"


def test_a_preset_at_another_budget_has_one_layout_on_every_interface(capsys, tmp_path):
    """A preset keeps its block length at another budget (decode/presets.py) through generate, a prompts file's
    line and a server started with it (the server and the prompts file spread its 4 blocks over 100 tokens:
    4 blocks of 32, one slot each, where generate gave 1 block of 128)."""
    from refusion_mlx.cli.flags import add_decoding_args, params_from_args
    from refusion_mlx.serve.core.engine_request import resolve
    from refusion_mlx.decode.presets import PRESETS

    expected = {"block_length": 128, "blocks": 1, "slots_per_block": 4}
    prompt = ["--model", str(FIXTURE_MODEL), "--preset", "gsm8k", "--json"]
    assert generate_main([*prompt, "--prompt", "Who is Sven?", "--max-tokens", "100"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["layout"] == expected
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Who is Sven?", "max_tokens": 100}) + "\n")
    assert generate_main([*prompt, "--prompts-file", str(tmp_path / "p.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["layout"] == expected

    import argparse

    parser = argparse.ArgumentParser()
    add_decoding_args(parser)
    server = params_from_args(parser.parse_args(["--preset", "gsm8k"]))  # the server's --preset gsm8k
    request = resolve(list(range(12)), max_tokens=100, fields={}, defaults=server, context=2048)
    assert request.params.layout().describe() == expected
    for name in ("gsm8k", "math", "arc-c"):  # at its own budget, the preset's own blocks
        blocks = params_from_args(parser.parse_args(["--preset", name])).layout().block_lengths
        assert len(blocks) == PRESETS[name]["serial_num_blocks"] and sum(blocks) == 512, name
