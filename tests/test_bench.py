"""python -m refusion_mlx.bench: end to end on the demo model, the report's
keys, parameter layering, and one-line errors. No timing assertions: speed
targets live in docs/benchmarks.md (benchmarks.overhead, .scaling)."""

import json
import subprocess
import sys

import pytest

from refusion_mlx import bench
from refusion_mlx.bench.suite import BenchError, load_suite, parse_suite, resolve_params
from refusion_mlx.errors import DecodeError
from refusion_mlx.decode.presets import PRESETS

TINY = {
    "name": "tiny",
    "defaults": {"gen_length": 32, "slot_size": 4, "serial_num_blocks": 4,
                 "slot_threshold": 0.6, "token_threshold": 0.3},
    "prompts": [
        {"family": "times-table", "prompt": "Write the multiplication table of 7 up to 5."},
        {"family": "facts", "prompt": "Tell me about Uma.", "params": {"slot_size": 8, "serial_num_blocks": 2}},
    ],
}

SIDE_KEYS = {"generated_tokens", "forwards", "tokens_per_forward", "tokens_per_second",
             "decode_tokens_per_second", "wall_seconds", "prefill_seconds", "phase_seconds",
             "other_seconds", "peak_memory_gb", "host_syncs", "steps"}


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    path = tmp_path_factory.mktemp("suite") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def cli_run(tiny_suite, tmp_path_factory):
    """One CLI run shared by the end-to-end tests (loading mlx-lm is the slow part)."""
    out = tmp_path_factory.mktemp("out") / "bench.json"
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main(["--suite", str(tiny_suite), "--warmup", "1", "--repeat", "1", "--json", str(out)])
    return rc, stdout.getvalue(), json.loads(out.read_text())


def test_end_to_end_both_sides_produce_tokens(cli_run):
    rc, _, result = cli_run
    assert rc == 0
    assert len(result["cases"]) == 2
    for case in result["cases"]:
        for side in ("refusion", "ar"):
            assert case[side]["generated_tokens"] > 0
            assert case[side]["forwards"] > 0
            assert SIDE_KEYS <= set(case[side])
            assert case[side]["output_ids"]
        assert case["ratio"] > 0 and case["decode_ratio"] > 0
        assert isinstance(case["same_answer"], bool)
    assert set(result["cases"][0]["refusion"]["phase_seconds"]) == {
        "prefill", "plan", "verify", "infill_draft", "infill_verify"}
    assert set(result["cases"][0]["ar"]["phase_seconds"]) == {"prefill", "steps"}


def test_json_has_documented_keys(cli_run):
    _, _, result = cli_run
    assert set(result) == {"meta", "cases", "total", "summary"}
    meta = result["meta"]
    for key in ("blas", "dtype", "device", "mlx", "mlx_lm", "refusion_mlx", "model", "model_shape",
                "suite", "prompts", "preset", "repeat", "warmup"):
        assert key in meta
    assert meta["dtype"] == "float32"
    assert meta["model_shape"]["vocab_size"] == 816  # the demo: 806 + Qwen3's tool tokens and JSON punctuation
    total = result["total"]
    assert {"refusion", "ar", "ratio", "decode_ratio", "same_answers"} <= set(total)
    assert total["refusion"]["generated_tokens"] == sum(
        c["refusion"]["generated_tokens"] for c in result["cases"])
    assert total["ratio"] == pytest.approx(
        total["refusion"]["tokens_per_second"] / total["ar"]["tokens_per_second"], rel=1e-2)
    # per-case parameters: suite defaults, then the case's own
    assert result["cases"][0]["params"]["slot_size"] == 4
    assert result["cases"][1]["params"]["slot_size"] == 8
    assert result["cases"][1]["params"]["blocks"] == 2


def test_table_printed(cli_run):
    _, out, _ = cli_run
    assert "BLAS:" in out and "dtype: float32" in out and "device:" in out
    assert "mlx-lm" in out and "hidden 256, 4 layers" in out
    assert "ReFusion" in out and "AR" in out and "tok/fwd" in out
    assert "ReFusion vs AR, same work: time to answer" in out and "ReFusion / AR tokens per second" in out
    assert "wrote" in out


def test_counting_is_consistent(cli_run):
    _, _, result = cli_run
    for case in result["cases"]:
        ar = case["ar"]
        # AR: one forward per token after the prompt's, plus the prompt's own call(s)
        assert ar["forwards"] >= ar["generated_tokens"]
        assert len(ar["output_ids"]) == ar["generated_tokens"]
        rf = case["refusion"]
        assert len(rf["output_ids"]) == rf["generated_tokens"]
        for side in (ar, rf):
            if side["finish_reason"] == "stop":
                assert side["output_ids"][-1] == 801  # EOS counted on both sides


def test_api_without_ar(tiny_suite):
    result = bench.run_benchmark(suite=str(tiny_suite), warmup=0, repeat=1, ar=False,
                                 overrides={"gen_length": 16})
    assert "ar" not in result["total"] and "ratio" not in result["total"]
    assert all(c["params"]["gen_length"] == 16 for c in result["cases"])
    text = bench.format_report(result)
    assert "ReFusion" in text and "ReFusion / AR tokens per second" not in text


def test_a_sampled_comparison_says_the_ar_side_is_greedy(tiny_suite):
    result = bench.run_benchmark(suite=str(tiny_suite), warmup=0, repeat=1,
                                 overrides={"gen_length": 16, "temperature": 0.8, "seed": 3})
    assert "(a temperature is ReFusion's: mlx-lm's side decodes greedily)" in bench.format_report(result)
    greedy = bench.run_benchmark(suite=str(tiny_suite), warmup=0, repeat=1, overrides={"gen_length": 16})
    assert "greedily" not in bench.format_report(greedy)


def test_default_suite_covers_the_demo_families():
    suite = load_suite("default")
    families = {c.family for c in suite.cases}
    assert families >= {"counting", "times-table", "arithmetic", "facts", "python", "reverse", "sort"}
    params = resolve_params(suite, suite.cases[0])
    assert (params.gen_length, params.slot_size, params.slot_threshold, params.token_threshold) == (512, 4, 0.6, 0.3)
    assert params.layout().block_lengths == [16] * 32


def test_parameter_layers():
    suite = parse_suite({"defaults": {"block_length": 8, "slot_size": 4},
                         "prompts": [{"prompt": "x", "params": {"token_threshold": 0.5}}]})
    case = suite.cases[0]
    p = resolve_params(suite, case)
    assert p.block_length == 8 and p.token_threshold == 0.5
    p = resolve_params(suite, case, "gsm8k")  # the preset's blocks (512 / its count) replace the suite's
    assert len(p.layout().block_lengths) == PRESETS["gsm8k"]["serial_num_blocks"] and p.block_length == 128
    assert p.token_threshold == PRESETS["gsm8k"]["token_threshold"]
    p = resolve_params(suite, case, "gsm8k", {"token_threshold": 0.9, "gen_length": 256})
    assert p.token_threshold == 0.9 and p.gen_length == 256
    with pytest.raises(DecodeError):
        resolve_params(suite, case, None, {"slot_size": 3})  # 8 is no multiple of 3


@pytest.mark.parametrize("data", [
    [], {"prompts": []}, {"prompts": [{"prompt": ""}]}, {"prompts": ["x"], "defaults": {"bogus": 1}},
    {"prompts": [{"prompt": "x", "system": 3}]},
])
def test_bad_suites(data):
    with pytest.raises(BenchError):
        parse_suite(data)


@pytest.mark.parametrize("argv", [
    ["--bogus"], ["--repeat", "0"], ["--warmup", "-1"], ["--slot-size", "x"], ["--slot-size", "0"],
    ["--preset", "nope"], ["--slot-threshold", "2"], ["--dtype", "int8"], ["--json", ""],
])
def test_bad_flags_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1 and "error" in err


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "3"], "--rounds goes with --concurrency"),
    (["--prompts", "2"], "--prompts goes with --shape"),
    (["--budgets", "8"], "--budgets goes with --layouts"),
    (["--data", "/nonexistent.jsonl"], "--data goes with --layouts"),
    (["--http"], "--http goes with --concurrency"),
    (["--concurrency", "1", "--layouts", "16"], "--layouts and --concurrency are separate measurements"),
    (["--shape", "qwen3-0.6b", "--forecast-only", "--layouts", "16"], "--shape and --layouts are separate"),
])
def test_a_flag_of_another_measurement_is_refused(argv, message, capsys):
    """Flags that only one measurement reads were ignored without it, and of two measurements one ran."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_the_report_never_overwrites_an_input(tmp_path, capsys):
    suite = tmp_path / "s.json"
    suite.write_text('{"prompts": [{"prompt": "Who is Sven?"}]}')
    for argv in (["--suite", str(suite), "--json", str(suite)],
                 ["--layouts", "16", "--data", str(suite), "--json", str(tmp_path / "." / "s.json")]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and "is an input of this run" in capsys.readouterr().err
    assert suite.read_text() == '{"prompts": [{"prompt": "Who is Sven?"}]}'


def test_concurrency_compares_with_one_client_wherever_it_is_listed():
    from refusion_mlx.bench.concurrency import baseline

    levels = [{"clients": 4, "tokens_per_second": 400.0}, {"clients": 1, "tokens_per_second": 100.0}]
    assert baseline(levels) == (1, 100.0) and baseline(levels[:1]) == (4, 400.0) and baseline([]) == (1, 0.0)


def test_layouts_decode_under_the_preset(monkeypatch, capsys):
    """--preset sets the thresholds the layouts sweep decodes with, under explicit flags (it was ignored)."""
    from refusion_mlx.bench import layouts
    from refusion_mlx.decode.params import make_params

    seen = []

    def captured(args, model, tokenizer, suite, bases, log):
        seen.append(bases[0])
        return {"layouts": [], "data": "suite prompts", "rows": 0, "table": ""}

    monkeypatch.setattr(layouts, "run_layouts", captured)
    assert bench.main(["--layouts", "16", "--preset", "gsm8k"]) == 0
    assert bench.main(["--layouts", "16", "--preset", "gsm8k", "--slot-threshold", "0.5"]) == 0
    gsm8k = make_params(preset="gsm8k")
    assert (seen[0].slot_threshold, seen[0].token_threshold) == (gsm8k.slot_threshold, gsm8k.token_threshold)
    assert seen[1].slot_threshold == 0.5 and seen[1].token_threshold == gsm8k.token_threshold
    assert seen[0].slot_threshold != make_params().slot_threshold


def test_layouts_decode_under_the_suites_settings(monkeypatch, tmp_path):
    """A --suite file's decoding settings reach the layouts sweep, layered as everywhere in bench (suite < prompt
    < --preset < flags; --data's rows: the suite's defaults); they were dropped for the decoder's defaults."""
    from refusion_mlx.bench import layouts

    seen = []
    decoded = layouts.stream_generate
    monkeypatch.setattr(layouts, "stream_generate", lambda *a, params, **k: seen.append(params) or decoded(
        *a, params=params, **k))
    suite = tmp_path / "thr.json"
    suite.write_text(json.dumps({"name": "thr", "defaults": {"slot_threshold": 0.95, "token_threshold": 0.9},
                                 "prompts": [{"prompt": "Count from 3 to 7.", "params": {"slot_threshold": 0.99}},
                                             "Who is Sven?"]}))
    sweep = ["--suite", str(suite), "--layouts", "default", "--budgets", "8", "--slot-sizes", "4"]
    assert bench.main(sweep) == 0
    assert [(p.slot_threshold, p.token_threshold, p.gen_length) for p in seen] == [(0.99, 0.9, 8), (0.95, 0.9, 8)]
    seen.clear()
    assert bench.main([*sweep, "--token-threshold", "0.5"]) == 0
    assert [p.token_threshold for p in seen] == [0.5, 0.5]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Who is Sven?"},
                                             {"role": "assistant", "content": "x"}]}) + "\n")
    seen.clear()
    assert bench.main([*sweep, "--data", str(data)]) == 0
    assert [(p.slot_threshold, p.token_threshold) for p in seen] == [(0.95, 0.9)]


def test_bad_suite_file_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert bench.main(["--suite", str(bad)]) == 1
    assert bench.main(["--suite", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)


def test_unwritable_json_one_line(tiny_suite, tmp_path, capsys):
    for where in (tmp_path / "no" / "such" / "x.json", tmp_path):  # found before the benchmark runs
        assert bench.main(["--suite", str(tiny_suite), "--json", str(where)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"cannot write {where}" in err and "benchmark" not in err


def test_json_dash_is_standard_output(tiny_suite, tmp_path, capsys, monkeypatch):
    """``--json -`` writes the report to standard output and the table to standard error, as
    ``--json -`` does in other tools: it wrote a file named ``-``."""
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--suite", str(tiny_suite), "--warmup", "0", "--repeat", "1", "--no-ar",
                       "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert set(json.loads(out)) == {"meta", "cases", "total"}
    assert "ReFusion" in err and "tok/s" in err
    assert not (tmp_path / "-").exists()
    header = next(line for line in err.splitlines() if line.startswith("#"))
    # Without the AR side its columns are left out, not shown as dashes.
    assert "tok/fwd" in header and not {"AR steps", "x time", "match"} & set(header.split("  "))
    assert "AR's" not in err


def test_missing_model_one_line_exit_1(tmp_path):
    """Through ``python -m``, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "refusion_mlx.bench", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "no model folder" in proc.stderr and "Traceback" not in proc.stderr


def test_concurrency_levels_decode_the_same_workload(tiny_suite, tmp_path, capsys):
    out = tmp_path / "levels.json"
    assert bench.main(["--suite", str(tiny_suite), "--concurrency", "1,2,3", "--rounds", "2",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    levels = report["levels"]
    assert [lv["clients"] for lv in levels] == [1, 2, 3]
    assert len({lv["tokens"] for lv in levels}) == 1 and levels[0]["tokens"] > 0  # same answers at every level
    assert len({lv["requests"] for lv in levels}) == 1
    assert levels[0]["steps"] > levels[2]["steps"]  # shared forwards: fewer steps
    assert "tok/s" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--concurrency", "0,2"], ["--concurrency", "x"], ["--concurrency", "2", "--rounds", "0"]])
def test_concurrency_bad_flags(flags, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_concurrency_through_the_server(tiny_suite, tmp_path):
    out = tmp_path / "http.json"
    assert bench.main(["--suite", str(tiny_suite), "--concurrency", "1,2", "--http", "--rounds", "1",
                       "--json", str(out)]) == 0
    levels = json.loads(out.read_text())["http_levels"]
    assert [lv["clients"] for lv in levels] == [1, 2]
    assert levels[0]["tokens"] == levels[1]["tokens"] > 0 and levels[0]["requests"] == 2
    # counted as in process, EOS included (the server's usage leaves it out)
    assert bench.main(["--suite", str(tiny_suite), "--concurrency", "1", "--rounds", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["levels"][0]["tokens"] == levels[0]["tokens"]


def test_conversation_reuses_the_previous_turns(tiny_suite, tmp_path):
    out = tmp_path / "conv.json"
    assert bench.main(["--suite", str(tiny_suite), "--conversation", "3", "--json", str(out)]) == 0
    sides = json.loads(out.read_text())["conversation"]
    reuse, fresh = sides["reuse"], sides["no reuse"]
    assert all(r["cached_tokens"] == 0 for r in fresh)
    assert reuse[0]["cached_tokens"] == 0
    for prev, row in zip(reuse, reuse[1:]):  # the previous prompt and answer come from the cache
        assert row["cached_tokens"] >= prev["prompt_tokens"] + prev["answer_tokens"] - 2
        assert row["prefilled_tokens"] < row["prompt_tokens"] // 2
    assert sum(r["prefilled_tokens"] for r in reuse) < sum(r["prefilled_tokens"] for r in fresh)
    # what a perfect cache would prefill (new since the last turn, the answer's EOS counted as cached) is
    # what the server prefilled with reuse
    from refusion_mlx.bench.serving import new_since_previous_turn

    assert new_since_previous_turn(reuse)[1:] == [r["prefilled_tokens"] for r in reuse[1:]]


CONVERSATION = {"name": "conversation", "defaults": {"slot_size": 4, "slot_threshold": 0.6, "token_threshold": 0.3},
                "prompts": [{"prompt": "Compute 45 + 27."}, {"prompt": "Please multiply 23 and 11."},
                            {"prompt": "Tell me about Uma."}]}


def test_conversation_sends_both_servers_the_same_prompts(tmp_path, capsys):
    """The server without the prompt cache is sent the history of the one with it (each had sent its own
    answers: once one answer differed, the rows compared two conversations, 846 prompt tokens against 870);
    the turns whose answers differ are listed, and a turn whose max_tokens the server cut to fit the
    context says so (X-Max-Tokens-Cut)."""
    from refusion_mlx.bench.serving import conversation
    from refusion_mlx.decode.stream import chat_prompt
    from refusion_mlx.serve.http_server import RefusionServer

    suite, out = tmp_path / "conversation.json", tmp_path / "out.json"
    suite.write_text(json.dumps(CONVERSATION))
    assert bench.main(["--suite", str(suite), "--conversation", "3", "--max-tokens", "2020", "--json", str(out)]) == 0
    result, report = json.loads(out.read_text()), capsys.readouterr().out
    reuse, fresh = result["conversation"]["reuse"], result["conversation"]["no reuse"]
    assert [r["prompt_tokens"] for r in fresh] == [r["prompt_tokens"] for r in reuse]
    differ = [a["turn"] for a, b in zip(reuse, fresh) if a["answer"] != b["answer"]]
    assert result["differing_answers"] == differ and result["same_answers"] == (not differ)
    assert ("differ on" if differ else "the same on all 3 turns") in report
    # 17 + 2020 tokens fit the 2048-token context; the later turns' prompts do not leave room for 2020
    assert reuse[0]["max_tokens_cut"] is None and all(r["max_tokens_cut"].startswith("2020 -> ") for r in reuse[1:])
    assert "\n2* " in report and "turn 3 2020 -> " in report
    # the history sent is the given answers, not the server's own
    questions = [c["prompt"] for c in CONVERSATION["prompts"]]
    answers = ["Forty-two, as every guide says.", "Two hundred and fifty-three.", ""]
    with RefusionServer(None, port=0, prompt_cache_bytes=0) as srv:
        rows = conversation(srv.url, questions, answers, max_tokens=8)
        tokenizer = srv.engine.tokenizer
    messages = [{"role": role, "content": text} for q, a in zip(questions, answers)
                for role, text in (("user", q), ("assistant", a))]
    assert [r["prompt_tokens"] for r in rows] == [len(chat_prompt(tokenizer, messages[:k])) for k in (1, 3, 5)]


def test_count_layout_is_the_references_rule():
    """--layouts count: the old count rule made a 128-token budget 32 blocks of one slot each."""
    from refusion_mlx.bench.layouts import reference_block_count

    assert reference_block_count(128, 4) == 32 and reference_block_count(512, 4) == 32


def test_layouts_sweep(tmp_path, capsys):
    """--layouts: per budget, slot size and layout, the resolved layout, tokens per
    forward, tokens/s and exact matches; the old count rule plans one slot per
    block at a 64-token budget, the default several."""
    data = tmp_path / "rows.jsonl"
    rows = [("Who is Sven?", "x"), ("Count from 3 to 7.", "3, 4, 5, 6, 7."), ("Spell the word cat.", "c-a-t")]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in rows))
    out = tmp_path / "layouts.json"
    assert bench.main(["--layouts", "default,count,2s", "--budgets", "64", "--slot-sizes", "4",
                       "--data", str(data), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tok/forward" in printed and "slots/block" in printed
    result = json.loads(out.read_text())
    by = {r["layout"]: r for r in result["layouts"]}
    assert (by["default"]["block_length"], by["default"]["blocks"], by["default"]["slots_per_block"]) == (16, 4, 4)
    assert (by["count"]["block_length"], by["count"]["slots_per_block"]) == (4, 1)
    assert by["2s"]["block_length"] == 8
    for r in by.values():
        assert r["rows"] == 3 and r["forwards"] > 0 and r["tokens_per_second"] > 0
        assert r["tokens_per_forward"] == pytest.approx(r["tokens"] / r["forwards"], abs=1e-3)
        assert 0 <= r["correct"] <= 3 and r["accuracy"] == pytest.approx(r["correct"] / 3, abs=1e-3)


@pytest.mark.parametrize("flags, message", [
    (["--layouts", "wide"], "--layouts"),
    (["--layouts", "16", "--budgets", "0"], "--budgets"),
    (["--layouts", "16", "--slot-sizes", "4,x"], "--slot-sizes"),
])
def test_layouts_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_layouts_bad_data_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for path, message in ((tmp_path / "missing.jsonl", "no such file"), (bad, "bad.jsonl:1")):
        assert bench.main(["--layouts", "16", "--data", str(path)]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_every_mode_records_its_settings(tiny_suite, tmp_path, capsys):
    """--concurrency, --http, --conversation and --layouts write what they ran: suite, preset, decoding
    settings, KV cache, chat template and dtype; the concurrency table's header says how it decoded."""
    runs = {"levels": ["--concurrency", "1", "--rounds", "1", "--max-tokens", "16", "--kv-bits", "8"],
            "http": ["--concurrency", "1", "--http", "--rounds", "1", "--max-tokens", "16"],
            "conversation": ["--conversation", "2", "--max-tokens", "16"],
            "layouts": ["--layouts", "default", "--budgets", "16", "--slot-sizes", "4"]}
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        assert bench.main(["--suite", str(tiny_suite), *flags, "--json", str(out)]) == 0
        s = json.loads(out.read_text())["settings"]
        assert (s["suite"], s["preset"], s["dtype"], s["chat_template"]) == ("tiny", None, "float32", True), name
        assert {"kv_bits", "kv_group_size", "params", "overrides", "adapter_path"} <= set(s), name
        if name != "layouts":
            assert s["params"][0]["gen_length"] == 16 and s["params"][0]["slot_size"] == 4, name
    assert json.loads((tmp_path / "levels.json").read_text())["settings"]["kv_bits"] == 8
    assert json.loads((tmp_path / "layouts.json").read_text())["settings"]["budgets"] == [16]
    bench.main(["--suite", str(tiny_suite), "--concurrency", "1", "--rounds", "1", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert "suite: tiny (2 prompts) | preset: none | decoding: per prompt" in out


def test_no_chat_template_is_refused_where_prompts_are_chats(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--conversation", "2", "--no-chat-template"])
    assert e.value.code == 2 and "--no-chat-template does not go with --conversation" in capsys.readouterr().err


def test_the_settings_line_counts_one_block_in_the_singular():
    from refusion_mlx.bench.compare import params_dict, settings_line
    from refusion_mlx.decode.params import make_params

    meta = {"suite": "s", "prompts": 1, "preset": None}
    one = settings_line(meta, [params_dict(make_params(max_tokens=64, block_length=64))])
    many = settings_line(meta, [params_dict(make_params(max_tokens=64, block_length=16))])
    assert "1 block of 64" in one and "4 blocks of 16" in many
