"""The decoder's speed tools (benchmarks.overhead, .scaling,
.profile_decoder) run small on the demo model (no timing assertions), and
the real-shape checkpoints they measure (convert.make_checkpoint)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import (constrained, forward_cost, forward_timing, gpu_record, grammar_engines, mc_scoring, overhead,
                        profile_decoder, scaling, soak, speed_common)
from refusion_mlx.bench import forward_replay
from refusion_mlx.errors import RefusionError


def test_speed_model_shapes_have_the_published_sizes():
    """The benchmark's realistic models come from convert.make_checkpoint."""
    import math

    from convert.make_checkpoint import make_config, tensor_shapes

    config = make_config("0.6b")
    assert config["vocab_size"] == 151671 and config["mask_token_id"] == 151670
    assert config["eos_token_id"] == 801  # the demo tokenizer's <|im_end|>
    count = lambda c: sum(math.prod(s) for _, s in tensor_shapes(c))  # noqa: E731
    assert round(count(config) / 1e6) == 596  # Qwen3-0.6B
    assert round(count(make_config("1.7b")) / 1e8) == 17


def test_generated_speed_model_loads_and_decodes(tmp_path):
    import refusion_mlx as rm
    from convert.make_checkpoint import make_checkpoint
    from refusion_mlx.decode.decoder import RefusionDecoder
    from refusion_mlx.decode.params import RefusionParams

    out = make_checkpoint(tmp_path / "tiny", "tiny", "safetensors", vocab_size=1500)
    model, tokenizer = rm.load(out)
    assert model.args.vocab_size == 1500 and model.args.mask_token_id == 805  # the demo tokenizer's <|mask|>
    assert len(tokenizer) < model.args.vocab_size  # a padded vocabulary
    dec = RefusionDecoder(model, [1, 2, 3], RefusionParams(gen_length=8, slot_size=4, block_length=8),
                          mask_id=805, eos_id=tokenizer.eos_token_id)
    list(dec.steps())
    assert dec.stats.forwards > 0


def test_overhead_on_demo(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert overhead.main(["--modes", "reference,infill", "--gen-length", "16", "--block-length", "8",
                          "--prompt-tokens", "16", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for mode in ("reference", "infill"):
        r = result["modes"][mode]
        assert r["overhead"] > 0 and r["bare_seconds"] > 0
        assert r["forwards"] == len(r["forward_tokens"]) == sum(r["forwards_per_phase"].values())
        assert r["host_syncs_per_step"] > 0
    assert "overhead" in capsys.readouterr().out


def test_overhead_on_a_suite_counts_the_host_time_per_step(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert overhead.main(["--suite", "default", "--cases", "2", "--gen-length", "16", "--serial-num-blocks", "2",
                          "--slot-threshold", "0.6", "--token-threshold", "0.3", "--repeat", "1",
                          "--json", str(out)]) == 0
    r = json.loads(out.read_text())["modes"]["suite"]
    assert r["prompts"] == 2 and r["params"]["serial_num_blocks"] == 2 and r["params"]["gen_length"] == 16
    assert r["forwards"] == len(r["forward_tokens"]) == sum(r["forwards_per_phase"].values())
    assert r["decoder_host_seconds"] > 0 and r["bare_host_seconds"] > 0
    assert r["host_ms_per_step"] == pytest.approx(r["decoder_host_seconds"] / r["steps"] * 1000, abs=1e-3)
    assert "extra host ms/step" in capsys.readouterr().out


def test_phase_tags_follow_the_decoder_loop():
    import refusion_mlx as rm
    from refusion_mlx.decode.decoder import RefusionDecoder
    from refusion_mlx.decode.params import RefusionParams

    model, tokenizer = rm.load()
    rec = forward_replay.RecordingModel(model)
    dec = RefusionDecoder(rec, [800, 265, 198, 801], RefusionParams(gen_length=8, slot_size=4, block_length=8,
                                                                    slot_threshold=0, token_threshold=1.0),
                          mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
    list(dec.steps())
    phases = [s.phase for s in rec.shapes()]
    assert phases[:2] == ["prefill", "verify"]
    assert phases[2:] == ["infill_draft", "infill_verify"] * ((len(phases) - 2) // 2)
    assert len(phases) == dec.stats.forwards


def test_scaling_on_demo(tmp_path):
    out = tmp_path / "scaling.json"
    assert scaling.main(["--budgets", "16,32", "--prompts", "16,32", "--prompt-budget", "16",
                         "--slots", "1,2", "--long-prompt", "48", "--block-length", "8",
                         "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["gen_length"] for r in result["budgets"]] == [16, 32]
    assert [r["prompt_tokens"] for r in result["prompts"]] == [16, 32]
    assert [r["slots"] for r in result["slots"]] == [1, 2]
    assert {"budget_max_deviation", "slots_peak_ratio", "slots_above_weights_ratio"} <= set(result["summary"])


def test_scaling_ignore_eos_decodes_the_whole_budget(tmp_path):
    """A random prompt often ends the answer at once; --ignore-eos (the
    decoder's eos_id None) decodes every token of the budget."""
    runs = {}
    for flags in ([], ["--ignore-eos"]):
        out = tmp_path / f"scaling{len(flags)}.json"
        assert scaling.main(["--sections", "budgets", "--budgets", "48", "--budget-prompt", "64", *flags,
                             "--json", str(out)]) == 0
        runs[bool(flags)] = json.loads(out.read_text())["budgets"][0]["generated_tokens"]
    assert runs[True] == 48 > runs[False]


def test_profile_on_demo(tmp_path):
    out = tmp_path / "profile.json"
    assert profile_decoder.main(["--cases", "1", "--gen-length", "16", "--block-length", "8", "--top", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["forwards"] > 0 and len(result["top"]) == 5


def spy(monkeypatch, module, name):
    """Calls of ``module.name`` (a script's ``decode`` or ``score_mc``), each as (args, kwargs, result)."""
    real, calls = getattr(module, name), []

    def recorded(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    monkeypatch.setattr(module, name, recorded)
    return calls


def test_overhead_measures_the_whole_budget_and_honours_the_shared_flags(tmp_path, monkeypatch):
    """The random prompt's runs decode the budget (they measured the demo's
    3-token answer); --no-ignore-eos stops at EOS; --kv-bits reaches the
    decoder's caches and the bare replays."""
    base = ["--modes", "parallel", "--gen-length", "16", "--block-length", "8", "--prompt-tokens", "16",
            "--repeat", "1"]
    out = {}
    for name, flags in (("default", []), ("stop", ["--no-ignore-eos"]), ("q8", ["--kv-bits", "8"])):
        calls = spy(monkeypatch, overhead, "decode")
        path = tmp_path / f"{name}.json"
        assert overhead.main(base + flags + ["--json", str(path)]) == 0
        out[name] = json.loads(path.read_text())["modes"]["parallel"]
        storages = {None if kw.get("storage") is None else kw["storage"].bits for _, kw, _ in calls}
        assert storages == {8 if name == "q8" else None}
    assert out["default"]["generated_tokens"] == 16 and out["default"]["ignore_eos"] is True
    assert out["stop"]["generated_tokens"] < 16 and out["stop"]["ignore_eos"] is False
    assert "quantized to 8 bits" in out["q8"]["kv_cache"] and out["q8"]["generated_tokens"] == 16


def test_profile_honours_the_shared_flags(tmp_path, monkeypatch):
    """--slot-size, --ignore-eos and --kv-bits reach every decoder run (they were read and dropped)."""
    calls = spy(monkeypatch, profile_decoder, "decode")
    out = tmp_path / "profile.json"
    assert profile_decoder.main(["--cases", "1", "--gen-length", "16", "--block-length", "8", "--slot-size", "8",
                                 "--ignore-eos", "--kv-bits", "4", "--top", "5", "--json", str(out)]) == 0
    assert calls and all(args[3].slot_size == 8 and kw["ignore_eos"] and kw["storage"].bits == 4
                         for args, kw, _ in calls)
    assert all(dec.stats.generated_tokens == 16 for _, _, (_, dec) in calls)
    result = json.loads(out.read_text())
    assert (result["slot_size"], result["ignore_eos"], result["kv_bits"]) == (8, True, 4)


def test_mc_scoring_keeps_its_cache_as_kv_bits_says(tmp_path, monkeypatch):
    calls = spy(monkeypatch, mc_scoring, "score_mc")
    assert mc_scoring.main(["--shapes", "12:4", "--mc-num", "2", "--kv-bits", "8",
                            "--json", str(tmp_path / "s.json")]) == 0
    assert [kw["storage"].bits for _, kw, _ in calls] == [8]


def test_profile_counts_the_whole_model_as_model_python():
    """The model's Python is every family's file, what they share, the joined
    projections and the runner that drives a decode pass, not Qwen3's file alone."""
    import refusion_mlx.decode.cache as cache
    import refusion_mlx.decode.kv_store as kv_store
    import refusion_mlx.decode.runner as runner
    import refusion_mlx.models.causal_lm as causal_lm
    import refusion_mlx.models.llama as llama
    import refusion_mlx.models.projections as projections
    import refusion_mlx.models.qwen3 as qwen3

    for module in (qwen3, llama, causal_lm, projections, runner):
        assert profile_decoder.bucket_of(module.__file__, "f") == "model Python + graph building", module
    for module in (cache, kv_store):
        assert profile_decoder.bucket_of(module.__file__, "f").startswith("cache Python"), module
    assert profile_decoder.bucket_of("/somewhere/else.py", "f") == "other Python"


@pytest.mark.parametrize("main, argv", [
    (overhead.main, ["--modes", "fast"]), (overhead.main, ["--repeat", "0"]),
    (overhead.main, ["--serial-num-blocks", "2"]),  # the suite's settings need --suite
    (scaling.main, ["--sections", "bogus"]), (scaling.main, ["--budgets", "0"]),
    (profile_decoder.main, ["--cases", "-1"]),
    # shared flags a script cannot honour are refused, not ignored
    (profile_decoder.main, ["--seed", "5"]),  # the suite's prompts, greedy: no seed to take
    (mc_scoring.main, ["--slot-size", "8"]), (mc_scoring.main, ["--ignore-eos"]),  # no decoder runs
    (overhead.main, ["--suite", "default", "--seed", "5"]),  # the seed of the random prompt
    (overhead.main, ["--suite", "default", "--prompt-tokens", "8"]),
    (overhead.main, ["--suite", "default", "--modes", "parallel"]),
])
def test_script_bad_flags_exit_2(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_script_missing_model_exit_1(tmp_path, capsys):
    assert overhead.main(["--model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:")


def test_scaling_truncate_forgets_the_rows_after_the_prompt(demo):
    """The slots table cuts the shared cache back to the prompt after each run."""
    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.prefill import prefill

    model, _ = demo
    cache = CommittedCache.for_model(model)
    prefill(model, cache, [1, 2, 3, 4, 5])
    before = cache.to_arrays()["keys.1"]
    scaling.truncate(cache, 9)  # past the end: nothing to forget
    assert cache.tokens == [1, 2, 3, 4, 5]
    scaling.truncate(cache, 2)
    assert cache.tokens == [1, 2] and cache.positions == [0, 1]
    assert (cache.to_arrays()["keys.1"] == before[:, :, :2]).all().item()


def test_gather_bytes_counts_every_view_padded_to_the_widest(demo):
    """The batched attention's gather: B x widest view rows of K and V, every layer."""
    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.packed import PackedWrite

    model, _ = demo
    writes = [CommittedCache.for_model(model).extend(n) for n in (3, 5)]
    a = model.args
    assert speed_common.gather_bytes(PackedWrite(writes, [3, 5]), a.num_key_value_heads, a.head_dim, 4,
                                     a.num_hidden_layers) \
        == 2 * 2 * 5 * a.num_key_value_heads * a.head_dim * 4 * a.num_hidden_layers


@pytest.mark.parametrize("tool", [overhead, scaling, profile_decoder, soak, constrained, grammar_engines])
def test_every_tool_names_its_command(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--help"])
    name = tool.__name__.split(".")[-1]
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: python -m benchmarks.{name} ")


def test_grammar_engines_runs_on_the_demo_vocabulary(tmp_path, capsys):
    """The demo's vocabulary is its model's embedding rows (816 since its tool tokens): a hard-coded 806
    made llguidance refuse the tokenizer with a traceback."""
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit) as e:
        grammar_engines.main(["--vocab", "demo", "--engines", "llguidance", "--repeat", "1", "--json", str(out)])
    assert e.value.code == 0
    assert "11/11" in capsys.readouterr().out and out.is_file()


def test_tools_run_from_the_repository_root():
    """``python -m benchmarks.NAME`` from a checkout, as docs/benchmarks.md writes it."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--help"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m benchmarks.soak "), proc.stderr


@contextlib.contextmanager
def device_paths(name: str):
    """Run on the CPU or the GPU code paths (``REFUSION_MLX_PATHS``), whatever this machine is."""
    from refusion_mlx.models import backend

    old = os.environ.get(backend.ENV)
    os.environ[backend.ENV] = name
    try:
        backend.mode()
        yield
    finally:
        if old is None:
            os.environ.pop(backend.ENV)
        else:
            os.environ[backend.ENV] = old
        backend.mode()


@pytest.fixture(scope="module")
def cost_run(tmp_path_factory):
    """The forward-cost instrument, small: the tiny shape on the GPU paths,
    attention fused, unfused and bucketed, every phase, two widths, one cache length."""
    from refusion_mlx.models import backend

    out = tmp_path_factory.mktemp("cost")
    with device_paths("gpu"):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert forward_cost.main(["--shape", "tiny", "--widths", "1,4", "--kv", "16", "--repeat", "1",
                                      "--attention", "fused,unfused,bucketed", "--json", str(out / "fc-bf16.json")]) == 0
            assert forward_cost.main(["--shape", "tiny", "--q-bits", "4", "--dtype", "bfloat16", "--widths", "8",
                                      "--kv", "16", "--repeat", "1", "--phases", "plan",
                                      "--json", str(out / "fc-q4.json")]) == 0
            with backend.setting(backend.OVERLAP_ENV, "on"):  # a candidate switch's run, as gpu_record.sh makes
                assert forward_cost.main(["--shape", "tiny", "--widths", "1,4", "--kv", "16", "--repeat", "1",
                                          "--attention", "bucketed", "--no-split", "--no-ar",
                                          "--json", str(out / "fc-bf16-overlap.json")]) == 0
    return out, printed.getvalue()


def test_forward_cost_on_the_cpu_paths(tmp_path, capsys):
    """The instrument as a reviewer runs it on a CPU (the CPU paths; the fixture above runs the GPU ones),
    small: every phase, two widths, one cache length, two repeats: the table's columns, every row's spread,
    parts and AR ratio, the AR rows, the load and the warnings."""
    path = tmp_path / "fc-cpu.json"
    with device_paths("cpu"):
        assert forward_cost.main(["--shape", "tiny", "--widths", "1,4", "--kv", "16", "--repeat", "2",
                                  "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    header = next(line for line in out.splitlines() if line.startswith("attention"))
    assert header.split() == ["attention", "phase", "width", "kv", "ms", "min", "spread", "build", "proj", "mlp",
                              "attn", "head", "other", "x", "AR"]
    assert "load average (1, 5, 15 min)" in out and "mlx-lm" in out
    r = json.loads(path.read_text())
    assert r["paths"] == "cpu" and r["shape"] == "tiny" and r["settings"]["repeat"] == 2 and r["complete"] is True
    assert r["blas"] and f"BLAS: {r['blas']}" in out  # its threads decide a small matmul's cost on a busy CPU
    from refusion_mlx import _blas  # and how the linears are laid out for them (cpu_paths.lay_out_linears):

    # a small model's narrow passes run on one thread, as loading sets it (weight-major would gain nothing),
    # whatever count an earlier test left; only a count the user chose is kept
    many = _blas.user_chose_threads() and (_blas.mkl_threads() or 0) > 1
    assert r["linears"] == ("weight-major" if many else "transposed")
    assert f"; linears: {r['linears']}" in out
    rows = [x for x in r["forward_cost"] if x["phase"] != "ar"]
    assert {(x["attention"], x["phase"], x["width"]) for x in rows} == {
        ("auto", p, w) for p in ("plan", "verify", "infill") for w in (1, 4)}
    check_cost_rows(rows, paths="cpu")
    assert all(x["spread"] is not None for x in rows)  # two repeats: a spread
    (ar,) = [x for x in r["forward_cost"] if x["phase"] == "ar"]
    assert ar["samples"] == 2 * len(rows) and ar["ms_min"] <= ar["ms"] <= ar["ms_max"]
    load = r["load"]
    assert load["cores"] == os.cpu_count() and set(load) == {"cores", "start", "end", "peak_1min"}
    if hasattr(os, "getloadavg"):
        assert len(load["start"]) == len(load["end"]) == 3 and load["peak_1min"] >= 0
    assert isinstance(r["warnings"], list)
    assert [line for line in err.splitlines() if line.startswith("warning: ")] == [f"warning: {w}" for w in
                                                                                  r["warnings"]]


def test_forward_cost_keeps_every_row_it_finished_when_cut(tmp_path, monkeypatch, capsys):
    """One process measures --attention auto,bucketed (gpu_record.sh's fc-bf16) and wrote its JSON only at
    the end: cut during bucketed, it lost auto's rows too. The file now holds each row as it is measured."""
    path = tmp_path / "fc-bf16.json"
    timed, calls = forward_cost.forward_ms, []

    def cut(*args, **kwargs):  # the fifth forward timed: bucketed's first, after auto's 4 rows
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # a kill at the call's limit, as far as the file can tell
        return timed(*args, **kwargs)

    monkeypatch.setattr(forward_cost, "forward_ms", cut)
    assert forward_cost.main(["--shape", "tiny", "--widths", "1,4", "--kv", "16", "--repeat", "1", "--phases",
                              "plan,verify", "--attention", "auto,bucketed", "--no-split", "--json", str(path)]) == 130
    r = json.loads(path.read_text())
    rows = [x for x in r["forward_cost"] if x["phase"] != "ar"]
    assert r["complete"] is False and {(x["attention"], x["phase"], x["width"]) for x in rows} == {
        ("auto", p, w) for p in ("plan", "verify") for w in (1, 4)}
    (ar,) = [x for x in r["forward_cost"] if x["phase"] == "ar"]
    assert ar["samples"] == 4  # AR's forwards beside the rows kept
    assert not [p for p in tmp_path.iterdir() if p.name != path.name]  # no temporary file left beside it
    capsys.readouterr()
    assert gpu_record.main([str(tmp_path), "--commit", "x", "--record", str(tmp_path / "record.json")]) == 0
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["runs"][0]["complete"] is False and len(record["forward_cost"]) == 5
    assert "note: fc-bf16.json's run was cut before its end" in capsys.readouterr().out


@pytest.mark.parametrize("fixed", [False, True])
def test_forward_cost_measures_each_row_at_its_cache_length(fixed, monkeypatch, capsys):
    """One cache was shared by every phase and width at a length and grew a row per forward: rows labelled
    256 were measured at 256-364 cached rows, AR's too. Each row now starts from its length: its forwards at
    a new length each (a phase's apart from another's, so that no plan and verify pass of a width repeat a
    shape), a few rows past it, as its kv_range says; with --fixed-kv every forward, AR's too, at the length."""
    seen, ar_seen = [], []
    write, once = forward_timing.Filled.write, forward_timing.AROneToken.once

    def spy_write(self, phase, width):
        seen.append((phase, width, len(self.cache)))
        return write(self, phase, width)

    def spy_once(self, *args, **kwargs):
        took = once(self, *args, **kwargs)
        ar_seen.append(self.cache[0].offset - 1)  # the rows it attended before its own
        return took

    monkeypatch.setattr(forward_timing.Filled, "write", spy_write)
    monkeypatch.setattr(forward_timing.AROneToken, "once", spy_once)
    repeat = 3
    assert forward_cost.main(["--shape", "tiny", "--widths", "1,4", "--kv", "16,40", "--repeat", str(repeat),
                              "--no-split", "--json", "-"] + (["--fixed-kv"] if fixed else [])) == 0
    r = json.loads(capsys.readouterr().out)
    rows = [x for x in r["forward_cost"] if x["phase"] != "ar"]
    assert len(seen) == len(rows) * (repeat + 1)  # each row's forwards, the untimed one first
    paired = []  # the cache lengths AR's forwards should have seen: its untimed one at each length, then ours
    for i, x in enumerate(rows):
        mine = seen[i * (repeat + 1):(i + 1) * (repeat + 1)]
        assert {(ph, w) for ph, w, _ in mine} == {(x["phase"], x["width"])}
        lengths = [n for _, _, n in mine[1:]]
        paired += ([x["kv_len"]] if i == 0 or rows[i - 1]["kv_len"] != x["kv_len"] else []) + lengths
        if fixed:
            assert lengths == [x["kv_len"]] * repeat and mine[0][2] == x["kv_len"]
        else:
            p = ("plan", "verify", "infill").index(x["phase"])
            assert lengths == [x["kv_len"] + p + 3 * k for k in range(repeat)]
        assert x["kv_range"] == [min(lengths), max(lengths)]
    assert ar_seen == paired  # AR at the very length of the forward it is paired with
    for ar in (x for x in r["forward_cost"] if x["phase"] == "ar"):
        at = [x["kv_range"] for x in rows if x["kv_len"] == ar["kv_len"]]
        assert ar["kv_range"] == [min(a for a, _ in at), max(b for _, b in at)]


def test_forward_cost_rows_parts_and_ar(cost_run):
    out, printed = cost_run
    r = json.loads((out / "fc-bf16.json").read_text())
    assert r["linears"] == "as loaded"  # the GPU paths lay nothing out
    rows = [x for x in r["forward_cost"] if x["phase"] != "ar"]
    assert {(x["attention"], x["phase"], x["width"]) for x in rows} == {
        (a, p, w) for a in ("fused", "unfused", "bucketed") for p in ("plan", "verify", "infill") for w in (1, 4)}
    ar = [x for x in r["forward_cost"] if x["phase"] == "ar"]
    assert len(ar) == 1 and ar[0]["width"] == 1 and ar[0]["kv_len"] == 16 and ar[0]["ms"] > 0
    assert ar[0]["samples"] == len(rows)  # one AR forward timed beside each of the rows' (--repeat 1)
    for x in rows + ar:  # the graph is built before it is evaluated: part of the forward's time
        assert 0 < x["build_ms"] < x["ms"]
    check_cost_rows(rows, paths="gpu")
    assert r["paths"] == "gpu" and r["shape"] == "tiny"
    assert "x AR" in printed and "mlx-lm" in printed
    q = json.loads((out / "fc-q4.json").read_text())["forward_cost"]
    wide = [x for x in q if x["phase"] == "plan"][0]
    assert wide["q_bits"] == 4 and wide["qmm"] > 0 and wide["qmm_rows7"] > 0


def check_cost_rows(rows: list, paths: str) -> None:
    """What every row of a forward_cost run holds: its spread over the repeats,
    the parts and what the whole leaves of them, AR's forward beside it."""
    for x in rows:
        assert x["ms"] > 0 and x["kv_len"] == 16 and x["dtype"] == "float32" and x["q_bits"] is None, paths
        assert 0 < x["ms_min"] <= x["ms"] <= x["ms_max"]
        assert x["spread"] is None or x["spread"] == pytest.approx((x["ms_max"] - x["ms_min"]) / x["ms"], abs=1e-2)
        assert all(x[k] >= 0 for k in forward_cost.PARTS)
        rest = x["ms"] - sum(x[k] for k in forward_cost.PARTS)  # parts alone may add up to more than the whole
        assert x["split_exceeds_total"] is (rest < 0)
        assert x["other"] == pytest.approx(rest, abs=1e-3) if x["other"] is not None else rest < 0
        assert x["ar_ms"] > 0 and x["x_ar"] > 0


def test_forward_cost_says_spread_load_and_noise():
    """The warnings (one line each): a load average above the cores, repeats far apart; none on a quiet run.
    A row whose parts exceed the whole shows <0 and says why, where it was a silent '-'."""
    from benchmarks import forward_cost_report as report

    row = {"attention": "auto", "phase": "plan", "width": 4, "kv_len": 256, "build_ms": 1.0, "proj": 3.0,
           "mlp": 3.0, "attn": 1.0, "head": 1.0, "other": None, "split_exceeds_total": True, "x_ar": 1.5,
           **report.spread([0.005, 0.006, 0.020])}
    assert (row["ms"], row["ms_min"], row["ms_max"], row["spread"]) == (6.0, 5.0, 20.0, 2.5)
    ar = {"phase": "ar", "width": 1, "kv_len": 256, "build_ms": 0.5, "samples": 3, **report.spread([0.004] * 3)}
    noisy = {"rows": [row], "ar": [ar], "sync_ms": 0.01,
             "load": {"cores": 2, "start": [5.0, 4.0, 3.0], "end": [1.0, 1.0, 1.0], "peak_1min": 5.0}}
    said = report.warnings(noisy)
    assert len(said) == 2 and "above the 2 cores (5 at the start" in said[0]
    assert "1 of 2 rows' repeats differ by more than 50%" in said[1] and "5.000-20.000 ms" in said[1]
    quiet = {**noisy, "rows": [{**row, **report.spread([0.005, 0.0051])}],
             "load": {"cores": 2, "start": [0.1] * 3, "end": [0.2] * 3, "peak_1min": 0.2}}
    assert report.warnings(quiet) == []
    printed = io.StringIO()
    report.print_tables(noisy, printed)
    table = printed.getvalue()
    assert "spread" in table and "250%" in table and " <0 " in table and "in 1 of 1 rows the parts alone took longer" \
        in table and "load average (1, 5, 15 min) on 2 cores: [5.0, 4.0, 3.0]" in table


def test_forward_cost_infill_layout():
    assert forward_timing.infill_layout(1) == (1, 3) and forward_timing.infill_layout(2) == (1, 2)
    assert forward_timing.infill_layout(4) == (1, 0) and forward_timing.infill_layout(32) == (8, 0)


@pytest.mark.parametrize("argv, says", [
    (["--widths", "6"], "whole slots"), (["--phases", "decode"], "'decode' is not one of plan, verify, infill"),
    (["--attention", "flash"], "'flash' is not one of auto, fused, unfused, bucketed"),
    (["--repeat", "0"], "--repeat"), (["--kv", "0"], "--kv"), (["--widths", "1,,4"], "an empty item"),
    (["--kv", "256,"], "an empty item"), (["--phases", "plan,"], "an empty item"),
    (["--kv", "256,100000", "--widths", "1", "--repeat", "1", "--phases", "plan"],
     "--kv: 100000 cached rows and the passes after them reach position 100006, past "
                             "tiny's context of 40960 (max_position_embeddings)")])  # was measured without a word
def test_forward_cost_bad_flags_exit_2(argv, says, capsys):
    """One line naming what is wrong (a list flag's choices; an empty item refused, not skipped)."""
    with pytest.raises(SystemExit) as e:
        forward_cost.main(["--shape", "tiny"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "<lambda>" not in err[0]


@pytest.mark.parametrize("tool", ["forward_cost", "kernel_count", "matmul_rows"])
def test_a_speed_tool_names_the_listed_shapes_only(tool, capsys):
    """--shape nope listed the tests' hidden shape tiny among the choices."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{tool}").main(["--shape", "nope"])
    assert e.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.endswith("unknown shape 'nope'; known: qwen3-0.6b, qwen3-1.7b, qwen3-4b, refusion-8b") and "tiny" not in err


def test_gpu_record_from_the_runs(cost_run, tmp_path, capsys):
    """The record's keys, from the instrument's and bench --shape's JSON."""
    from refusion_mlx.bench.__main__ import main as bench_main

    out, _ = cost_run
    call2 = tmp_path / "call2"  # a second device call's files come back in a folder of their own
    call2.mkdir()
    assert bench_main(["--shape", "tiny", "--prompts", "2", "--max-tokens", "16", "--batch", "2",
                       "--json", str(call2 / "shape-tiny-auto.json")]) == 0
    (call2 / "log.txt").write_text("== golden cases, float32\n33 passed, 47 deselected in 40.16s\n")
    # the derived profiles are replayed on a GPU only: a device's run of them, as its JSON has it
    gpu = json.loads((call2 / "shape-tiny-auto.json").read_text())
    gpu["profiles"].append({"source": "derived", "tokens_per_forward": 2.5, "measured": {"tok_s": 50.0, "ratio": 1.6},
                            "batched": {"requests": 2, "speedup": 1.8}})
    (call2 / "shape-tiny-bucketed.json").write_text(json.dumps(gpu))
    path = tmp_path / "record.json"
    assert gpu_record.main([str(out), str(call2), "--commit", "abc", "--record", str(path)]) == 0
    record = json.loads(path.read_text())
    assert {"device", "mlx_version", "commit", "forward_cost", "vs_ar", "targets", "golden"} <= set(record)
    assert record["commit"] == "abc" and record["golden"].startswith("33 passed")
    assert record["shape"] == "tiny"  # what bench --cost-curve checks a record against
    assert record["runs"] and all({"file", "load", "warnings"} <= set(r) for r in record["runs"])  # how busy
    assert any(x["phase"] == "ar" for x in record["forward_cost"])
    # each row carries its run's switches; the overlap run is compared with the same forwards without it
    assert {(x["overlap"], x["qmm_pad"]) for x in record["forward_cost"]} == {("auto", "auto"), ("on", "auto")}
    (overlap,) = [d for d in record["decisions"] if d["switch"] == "overlap"]
    assert overlap["pairs"] == 6 and overlap["suggests"] in ("on", "auto")  # 3 phases x 2 widths, bucketed
    (row,) = record["vs_ar"]
    assert {"tokens_per_forward", "dtype", "q_bits", "refusion_tok_s", "ar_tok_s", "ratio"} <= set(row)
    assert row["attention"] == "bucketed" and row["batched"]["requests"] == 2
    assert (row["tokens_per_forward"], row["refusion_tok_s"], row["ratio"]) == (2.5, 50.0, 1.6)
    assert "wrote" in capsys.readouterr().out
    assert gpu_record.record_name("gpu (NVIDIA H200)", "2026-11-28") == "nvidia-h200-2026-11-28.json"


def test_gpu_record_without_runs_is_one_line(tmp_path, capsys):
    assert gpu_record.main([str(tmp_path)]) == 1
    assert gpu_record.main([str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no fc-*.json" in err[0] and "no such folder" in err[1]
    for name, device in (("a", "gpu (NVIDIA H100)"), ("b", "gpu (NVIDIA H200)")):  # one record, one device
        (tmp_path / name).mkdir()
        (tmp_path / name / "fc-bf16.json").write_text(json.dumps({"device": device, "forward_cost": [
            {"phase": "ar", "width": 1, "kv_len": 256, "dtype": "bfloat16", "q_bits": None, "ms": 8.0}]}))
    assert gpu_record.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "2 devices" in err and "NVIDIA H100" in err


AR_ROW = {"phase": "ar", "width": 1, "kv_len": 256, "dtype": "bfloat16", "q_bits": None, "ms": 8.0}
SHAPE_RUN = {"device": "x", "dtype": "bfloat16", "q_bits": None, "ar_tok_s": 9.0}


@pytest.mark.parametrize("name, content, says", [
    ("fc-x.json", {}, "fc-x.json has no forward_cost; it should be the list of rows"),
    ("fc-x.json", [1, 2], "fc-x.json is not a JSON object of the GPU record: [1, 2]"),
    ("fc-x.json", {"forward_cost": [{"phase": "plan"}], "device": "x"}, "fc-x.json: forward_cost[0] has no width"),
    ("fc-x.json", {"forward_cost": [{**AR_ROW, "phase": "plan"}], "device": "x"}, "forward_cost[0] has no attention"),
    ("fc-x.json", {"forward_cost": [AR_ROW], "device": "x", "switches": ["on"]}, "has switches ['on']"),
    ("shape-bf16-auto.json", {"device": "x"}, "shape-bf16-auto.json has no profiles"),
    ("shape-bf16-auto.json", {**SHAPE_RUN, "profiles": [{"source": "derived", "measured": {"tok_s": 1.0}}]},
     "profiles[0] has no tokens_per_forward"),
    ("shape-bf16-auto.json", {**SHAPE_RUN, "profiles": [
        {"source": "derived", "tokens_per_forward": 2.5, "measured": {"tok_s": 1.0}}]}, "profiles[0].measured has no ratio"),
    ("run.json", {"date": "2026-12-06"}, "run.json has no tree")])
def test_gpu_record_of_a_malformed_file_is_one_line(name, content, says, tmp_path, capsys):
    """JSON that parses but is not what the record reads: one line naming the file and what it lacks, exit 1,
    as for a file that does not parse (KeyError 'forward_cost', 'profiles', 'width' and an AttributeError
    were tracebacks)."""
    (tmp_path / "fc-ok.json").write_text(json.dumps({"device": "x", "forward_cost": [AR_ROW]}))
    (tmp_path / name).write_text(json.dumps(content))
    assert gpu_record.main([str(tmp_path), "--record", str(tmp_path / "record.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / name) in err[0] and says in err[0], err
    assert not (tmp_path / "record.json").exists()


def test_gpu_record_targets_for_each_attention_measured():
    """The runtime's choice (unfused rows stand in for auto on CUDA) and the
    bucketed candidate each get the issue's targets, named apart."""
    def row(attention, width, ms, q_bits=None):
        return {"attention": attention, "phase": "plan", "width": width, "kv_len": 1024, "dtype": "bfloat16",
                "q_bits": q_bits, "ms": ms}

    fc = [{"phase": "ar", "width": 1, "kv_len": 1024, "dtype": "bfloat16", "q_bits": None, "ms": 10.0},
          row("fused", 1, 12.0), row("unfused", 16, 26.0), row("bucketed", 16, 14.0)]
    vs = [{"tokens_per_forward": 2.5, "dtype": "bfloat16", "q_bits": None, "attention": a, "refusion_tok_s": 1,
           "ar_tok_s": 1, "ratio": r} for a, r in (("auto", 0.9), ("bucketed", 1.6))]
    got = [t for mode in ("auto", *gpu_record.CANDIDATES) for t in gpu_record.targets(fc, vs, mode)]
    by_name = {t["target"]: t for t in got}
    assert len(got) == 4
    plain = by_name["a 16-token forward at most 1.5x AR's one-token forward (bf16), every phase and KV length"]
    assert plain["measured_worst"] == 2.6 and not plain["met"]
    bucketed = by_name["a 16-token forward at most 1.5x AR's one-token forward (bf16, attention bucketed), "
                       "every phase and KV length"]
    assert bucketed["measured_worst"] == 1.4 and bucketed["met"]
    assert not by_name["ReFusion / AR at least 1.5x at 2.5 tokens per forward (bf16)"]["met"]
    assert by_name["ReFusion / AR at least 1.5x at 2.5 tokens per forward (bf16, attention bucketed)"]["met"]
    assert "build_ms_width_16" not in plain  # rows from before the instrument timed the graph's building
    timed = [{**r, "build_ms": r["ms"] / 4} for r in fc]
    plain = gpu_record.targets(timed, vs)[0]
    assert plain["build_ms_width_16"] == 6.5 and plain["build_ms_ar"] == 2.5


def test_gpu_record_decisions_compare_each_switch_on_like_forwards():
    """Each switch measured both ways: its candidate's time over the other's for forwards alike in
    all else; a candidate's rows never count toward the runtime's targets."""
    def row(width, ms, attention="auto", overlap="auto", qmm_pad="auto", q_bits=None, kv=1024):
        return {"attention": attention, "phase": "plan", "width": width, "kv_len": kv, "dtype": "bfloat16",
                "q_bits": q_bits, "ms": ms, "overlap": overlap, "qmm_pad": qmm_pad}

    fc = [{"phase": "ar", "width": 1, "kv_len": 1024, "dtype": "bfloat16", "q_bits": None, "ms": 10.0,
           "overlap": "auto", "qmm_pad": "auto"},
          row(1, 12.0), row(1, 12.0, "bucketed"),  # one row: not a comparison of attention
          row(16, 30.0), row(16, 15.0, "bucketed"), row(32, 40.0), row(32, 30.0, "bucketed"),
          row(16, 24.0, overlap="on"), row(16, 14.0, "bucketed", overlap="on"),  # overlap: 0.8x and 0.93x
          row(4, 17.0, "bucketed", qmm_pad="off", q_bits=4), row(4, 5.0, "bucketed", qmm_pad="on", q_bits=4),
          row(8, 5.0, "bucketed", qmm_pad="off", q_bits=4), row(8, 5.0, "bucketed", qmm_pad="on", q_bits=4)]
    got = {d["switch"]: d for d in gpu_record.decisions(fc)}
    assert got["attention"]["pairs"] == 2 and got["attention"]["median_ratio"] == 0.625  # (0.5 + 0.75) / 2
    assert got["attention"]["best_ratio"] == 0.5 and got["attention"]["suggests"] == "bucketed"
    assert got["overlap"]["pairs"] == 2 and got["overlap"]["suggests"] == "on"
    assert got["qmm_pad"]["pairs"] == 1 and got["qmm_pad"]["median_ratio"] == 0.294  # 8 rows: not padded
    slower = [dict(r, ms=r["ms"] * 3) if r.get("attention") == "bucketed" and r["width"] > 1 else r for r in fc]
    assert {d["switch"]: d["suggests"] for d in gpu_record.decisions(slower)}["attention"] == "auto"
    (plain,) = [t for t in gpu_record.targets(fc, []) if "bf16" in t["target"]]
    assert plain["measured_median"] == 3.0  # the overlap run's faster 16-token forward is not the runtime's


def test_gpu_record_golden_line_per_attention(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("== 1 golden cases, float32 (attention auto)\n...\n33 passed in 3s\n"
                   "== 2 golden cases, float32 (attention bucketed)\n1 failed, 32 passed in 4s\n== done\n")
    assert gpu_record.golden_line(log) == "auto: 33 passed in 3s; bucketed: 1 failed, 32 passed in 4s"
    assert gpu_record.golden_line(tmp_path / "none.txt") is None


def test_scoring_benchmark_rows(tmp_path, capsys):
    """benchmarks.mc_scoring, small: the estimator and the whole-forward
    reference give the same estimate; a malformed shape is one line."""
    out = tmp_path / "scoring.json"
    assert mc_scoring.main(["--shapes", "30:4,12:6", "--mc-num", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["scored"], r["mc_num"]) for r in rows] == [(30, 4, 6), (12, 6, 6)]
    assert all(r["max_difference"] < 1e-4 and r["context_once_s"] > 0 and r["whole_forwards_s"] > 0 for r in rows)
    assert "speed-up" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        mc_scoring.main(["--shapes", "30:0"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("attention", ["auto", "unfused", "bucketed"])
def test_kernels_per_forward_stay_few(monkeypatch, attention):
    """benchmarks.kernel_count on the tiny shape (2 layers): an infill pass
    launches no more kernels a layer than a plan pass of its width (its K/V
    rows one scatter each, its mask made on the host), the unfused or padded
    attention at most 4 a layer more than the fused kernel, and every
    forward fewer than mlx-lm's one-token forward; mx.fast is left as it was."""
    from benchmarks import kernel_count
    from refusion_mlx.bench.shapes import build_models
    from refusion_mlx.models import backend

    monkeypatch.setenv(backend.ATTENTION_ENV, attention)
    fast = mx_fast_functions()
    model, ar_model = build_models("tiny", "bfloat16")
    rows = kernel_count.count(model, ar_model, ["plan", "verify", "infill"], [1, 8], 40)
    assert mx_fast_functions() == fast
    got = {(r["phase"], r["width"]): r["kernels"] for r in rows}
    fused = 45  # a plan pass with the fused kernel: 2 layers and what a forward makes once
    for width in (1, 8):
        # (a padded batch pads an infill pass's own mask: two kernels a forward)
        assert got[("infill", width)] <= got[("plan", width)] + 2 == got[("verify", width)] + 2, got
        assert got[("plan", width)] <= fused + 4 * len(model.layers), got
    assert max(v for (phase, _), v in got.items() if phase != "ar") < got[("ar", 1)], got
    # each graph is built 21 times from the same cache: the last one is the first one's (a build left in the cache
    # would change it)
    once = kernel_count.count(model, ar_model, ["plan", "infill"], [8], 40, repeat=0)
    assert [r["kernels"] for r in once] == [got[("plan", 8)], got[("infill", 8)], got[("ar", 1)]]
    assert all(r["build_ms"] > 0 for r in rows)


def test_kernel_count_prints_its_table(capsys):
    from benchmarks import kernel_count

    assert kernel_count.main(["--shape", "tiny", "--widths", "1,4", "--kv", "30"]) == 0
    out = capsys.readouterr().out
    assert "kernels / layer" in out and "build ms" in out and "mx.fast" in out and out.count("\nplan ") == 2
    with pytest.raises(SystemExit) as e:
        kernel_count.main(["--shape", "tiny", "--widths", "6"])
    assert e.value.code == 2


def test_matmul_rows_times_each_product_by_rows(tmp_path, capsys, monkeypatch):
    """benchmarks.matmul_rows on the tiny shape: every product at every row count, its table and JSON; a
    product that computes something else is refused in one line before any timing."""
    import json

    from benchmarks import matmul_rows

    out = tmp_path / "rows.json"
    assert matmul_rows.main(["--shape", "tiny", "--rows", "1,3", "--repeat", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "8 linears of 2 layers" in printed and "(w @ x.T).T ms" in printed and "BLAS:" in printed
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["rows"], r["product"]) for r in rows) == sorted(
        (m, p) for m in (1, 3) for p in matmul_rows.PRODUCTS)
    assert all(r["ms"] >= r["ms_min"] > 0 for r in rows)
    monkeypatch.setitem(matmul_rows.PRODUCTS, "(w @ x.T).T", lambda x, w, t: (w @ x.T).T + 1)
    assert matmul_rows.main(["--shape", "tiny", "--rows", "1", "--repeat", "1"]) == 1
    assert capsys.readouterr().err.strip() == "error: (w @ x.T).T differs from x @ w.T on this device"


def mx_fast_functions():
    import mlx.core as mx

    return [getattr(mx.fast, n) for n in ("rms_norm", "rope", "scaled_dot_product_attention")]


def test_gpu_record_script_parses_and_names_its_steps(tmp_path):
    """benchmarks/gpu_record.sh: valid bash; an unknown step is one line and exit 2
    (a lent GPU's minutes are not spent on a typo)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_record.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(["bash", str(script), str(tmp_path / "out"), "fc-bf17"], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable, "SHAPE": "tiny"}, timeout=120)
    assert run.returncode == 2 and "unknown step fc-bf17" in run.stderr
    for step in ("fc-bf16", "golden", "shape-bf16", "fc-q4", "shape-q4"):
        assert f"    {step})" in script.read_text()
    wheels = script.with_name("gpu_wheels.sh")  # the CUDA wheels in two carryable pieces
    assert subprocess.run(["bash", "-n", str(wheels)]).returncode == 0
    run = subprocess.run(["bash", str(wheels), "unpack"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == "usage: benchmarks/gpu_wheels.sh [prepare|check|install|verify]"


def test_forward_cost_json_to_stdout(capsys):
    """``--json -``: the JSON alone on standard output, the tables on standard
    error (as bench's --json -), and no file named ``-``."""
    argv = ["--shape", "tiny", "--widths", "1", "--kv", "16", "--repeat", "1", "--phases", "plan", "--no-split"]
    assert forward_cost.main(argv + ["--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["forward_cost"] and "x AR" in err and not Path("-").exists()


@pytest.mark.parametrize("where", ["folder", "missing/x.json", "/proc/x.json"])
def test_forward_cost_unwritable_json_fails_first(where, tmp_path, capsys):
    """A --json path that cannot be written fails in one line before the measurement, not after it."""
    path = str(tmp_path) if where == "folder" else where if where.startswith("/") else str(tmp_path / where)
    assert forward_cost.main(["--shape", "tiny", "--widths", "1", "--kv", "16", "--json", path]) == 1
    out, err = capsys.readouterr()
    assert "building" not in out + err and err.strip().splitlines() == [err.strip()] and "cannot write" in err


def test_speed_scripts_refuse_json_stdout_where_the_report_is():
    """A script that prints its report on standard output refuses ``--json -`` (it wrote a file named -)."""
    from benchmarks.speed_common import check_json_path

    with pytest.raises(RefusionError, match="give the JSON a file"):
        check_json_path("-")
    check_json_path("-", stdout=True)


def test_gpu_record_of_two_shapes_is_refused(cost_run, tmp_path):
    """One record is one shape's: a cost curve of one priced as another was the bug."""
    out, _ = cost_run
    other = tmp_path / "other"
    other.mkdir()
    run = json.loads((out / "fc-q4.json").read_text())
    (other / "fc-other.json").write_text(json.dumps({**run, "shape": "qwen3-0.6b"}))
    with pytest.raises(RefusionError, match="2 model shapes"):
        gpu_record.build([out, other], commit="abc")

