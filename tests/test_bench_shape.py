"""python -m refusion_mlx.bench --shape: the demo model's forwards (or
--record-with's) and derived profiles at real checkpoints' tokens per
forward, priced and replayed at another shape (a tiny hidden one here),
against mlx-lm on the same weights."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from refusion_mlx.bench.__main__ import main
from refusion_mlx.bench.forecast import CHIPS, MEASURED_ON_H100
from refusion_mlx.bench.profiles import DEFAULT_TOKENS_PER_FORWARD, bounds, derive, requests
from refusion_mlx.bench.shape_report import format_shape_report
from refusion_mlx.bench.shapes import Costs, build_models
from refusion_mlx.bench.suite import BenchError
from refusion_mlx.decode.params import make_params

FIXTURE = "tests/fixtures/tiny-refusion"
KEYS = {"shape", "device", "paths", "refusion_tok_s", "ar_tok_s", "ratio", "tokens_per_forward",
        "head_reads_per_step", "weight_bytes_per_token", "flops_per_token", "forecast", "profiles",
        "recorded_with", "measured_on", "forecast_for"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("shape") / "shape.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--shape", "tiny", "--prompts", "2", "--max-tokens", "16", "--json", str(out)]) == 0
    return json.loads(out.read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):
    """The hidden fixture model records; one derived profile; nothing timed."""
    out = tmp_path_factory.mktemp("shape") / "fixture.json"
    assert main(["--shape", "tiny", "--prompts", "2", "--max-tokens", "16", "--record-with", FIXTURE,
                 "--tokens-per-forward", "1.5", "--forecast-only", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_shape_report_keys_and_replay(tiny_run):
    r, _ = tiny_run
    assert KEYS <= set(r)
    assert r["shape"] == "tiny" and r["paths"] and r["device"] and r["recorded_with"] == "bundled demo model"
    assert r["measured_on"] == "cpu" and r["forecast_for"] == "Apple GPUs"
    assert r["prompts"] == 2 and r["forwards"] == r["replayed_forwards"] > 0
    assert r["forwards"] == sum(r["forwards_per_phase"].values())
    assert r["refusion_tok_s"] > 0 and r["ar_tok_s"] > 0 and r["ratio"] > 0
    assert r["ar_forwards"] == sum(r["generated_tokens"])  # prompt forward + one per further token
    assert r["head_reads_per_step"] >= 1
    for side in ("refusion", "ar"):
        assert r["weight_bytes_per_token"][side] > 0 and r["flops_per_token"][side] > 0
    # more tokens per forward: fewer weight bytes per token
    assert r["tokens_per_forward"] > 1
    assert r["weight_bytes_per_token"]["refusion"] < r["weight_bytes_per_token"]["ar"]


def test_profiles_table_spans_real_checkpoints_and_keeps_the_demo_apart(tiny_run):
    r, text = tiny_run
    derived = [p for p in r["profiles"] if p["source"] == "derived"]
    recorded = [p for p in r["profiles"] if p["source"] == "recorded"]
    assert [p["target"] for p in derived] == list(DEFAULT_TOKENS_PER_FORWARD) and not r["out_of_reach"]
    assert len(recorded) == 1 and recorded[0]["recorded_with"] == "bundled demo model"
    assert recorded[0]["tokens_per_forward"] == pytest.approx(r["tokens_per_forward"], abs=1e-3)
    for p in derived:  # as close as whole forwards allow: one forward more or less
        assert p["tokens_per_forward"] == pytest.approx(p["target"], abs=p["target"] ** 2 / p["tokens"])
        assert p["measured"] is None  # the CPU times the recorded forwards only
        for row in p["forecast"]:  # a forward never costs less than AR's: the ratio stays under tok/fwd
            assert 0 < row["ratio"] <= p["tokens_per_forward"] + 1e-3
    # fewer tokens per forward, more forwards, each the cheaper for it
    assert [p["forwards"] for p in derived] == sorted((p["forwards"] for p in derived), reverse=True)
    assert derived[0]["forecast"][0]["ratio"] < recorded[0]["forecast"][0]["ratio"]
    assert r["forecast"] == recorded[0]["forecast"]  # the documented key: the recorded profile's chips
    assert [row["chip"] for row in r["forecast"]] == [c.name for c in CHIPS]
    assert "not a measurement" in r["forecast_note"]
    assert [h["measured_ratio"] for h in r["h100"]] == [m for _, _, _, m, _ in MEASURED_ON_H100]
    # the printout: the forecast labelled for Apple GPUs and as ceilings, each row's footnote, the demo's
    # row labelled as the demo's, the CPU's measurement labelled as a CPU's
    forecast_at = text.index("forecast for Apple GPUs, AT MOST")
    assert text.index("measured on this CPU") > forecast_at  # the CPU: forecast first
    assert "a CPU's timing, not an Apple GPU's" in text
    for target in DEFAULT_TOKENS_PER_FORWARD:
        assert f"ReFusion at {target:g} tok/forward [a]" in text
    assert "the demo model's own, not real [b]" in text and "No real checkpoint is known" in text
    assert "[a] derived, not recorded" in text and "[c] each forward priced" in text
    assert "1.68x measured, 6.81x forecast" in text


def test_recording_with_the_fixture_changes_the_forecast(tiny_run, fixture_run):
    demo, _ = tiny_run
    r = fixture_run
    assert r["recorded_with"] == FIXTURE and r["measured_on"] is None
    assert r["refusion_tok_s"] is None and r["replayed_forwards"] == 0
    mine = [p for p in r["profiles"] if p["source"] == "recorded"][0]
    demo_mine = [p for p in demo["profiles"] if p["source"] == "recorded"][0]
    # another model, another confidence: other tokens per forward, and the forecast follows them
    assert r["tokens_per_forward"] != demo["tokens_per_forward"]
    assert mine["tokens_per_forward"] == pytest.approx(r["tokens_per_forward"], abs=1e-3)
    assert mine["forwards"] != demo_mine["forwards"]
    more = mine["tokens_per_forward"] > demo_mine["tokens_per_forward"]
    for row, demo_row in zip(mine["forecast"], demo_mine["forecast"]):
        assert (row["ratio"] > demo_row["ratio"]) == more
        assert (row["refusion_tok_s"] > demo_row["refusion_tok_s"]) == more
        assert row["ar_tok_s"] == demo_row["ar_tok_s"]  # the same prompts and tokens for AR
    # --tokens-per-forward: one derived profile, at that figure
    derived = [p for p in r["profiles"] if p["source"] == "derived"]
    assert [p["target"] for p in derived] == [1.5] and r["tokens_per_forward_range"] == [1.5]
    assert derived[0]["tokens_per_forward"] == pytest.approx(1.5, abs=1.5 ** 2 / derived[0]["tokens"])
    text = format_shape_report(r)
    assert f"[b] the forwards {FIXTURE} made" in text and "recorded with your model [b]" in text
    assert "the demo model's own" not in text and "not measured (--forecast-only)" in text


def test_derived_profile_follows_the_decoders_rules():
    """At the demo's own tokens per forward the derivation gives the demo's
    forwards at these settings (4 prompts of the suite, budget 64: its
    recording in docs/benchmarks.md), and below slot/2 it infills."""
    params = make_params(gen_length=64)
    reqs = requests([18, 20, 20, 22], [64, 64, 64, 53], [params] * 4)
    demo = derive(reqs, 6.81)
    assert len(demo.forwards) == 36
    assert demo.describe()["forwards_per_phase"] == {"prefill": 4, "plan": 14, "verify": 18,
                                                     "infill_draft": 0, "infill_verify": 0}
    low = derive(reqs, 1.5)
    assert low.tokens_per_forward == pytest.approx(1.5, abs=0.02)
    phases = low.describe()["forwards_per_phase"]
    assert phases["infill_draft"] == phases["infill_verify"] > 0
    first = low.forwards[0]
    assert first.phase == "prefill" and first.tokens == 18 + 16 and first.head_rows == 16
    for s in low.forwards[1:]:
        if s.phase == "plan":  # as wide as the block's open slots, whole slots
            assert s.tokens % 4 == 0 and s.tokens <= 16 and s.head_rows == s.tokens
        if s.phase.startswith("infill"):  # scattered writes, each slot seeing itself and the committed rows
            assert s.rows is not None and s.mask.shape == (s.tokens, s.visible) and s.mask[:, :s.start].all()
    lo, hi = bounds(reqs)
    assert lo < 1.0 < 2.0 < hi < 8.0
    with pytest.raises(BenchError, match="out of reach"):
        derive(reqs, hi + 1)


def test_derived_profiles_replay_and_compare_on_a_gpu_report():
    """The replay of derived profiles (what a GPU runs), and the GPU's
    report: the measurement first, the forecast beside it with the gap."""
    from refusion_mlx.bench.compare import resolve_all
    from refusion_mlx.bench.shapes import run_shape
    from refusion_mlx.bench.suite import Suite, load_suite

    suite = load_suite("default")
    cases = Suite(suite.name, suite.cases[:1], suite.defaults, suite.source)
    params = resolve_all(cases, None, {"gen_length": 16})
    r = run_shape("tiny", cases, params, tokens_per_forward=1.0, measure_profiles=True)
    for p in r["profiles"]:
        m = p["measured"]
        assert m["tok_s"] > 0 and m["ratio"] > 0
        assert m["forecast_ratio"] == p["bandwidth_bound_ratio"]
        assert m["measured_over_forecast"] == pytest.approx(m["ratio"] / m["forecast_ratio"], rel=1e-2)
    r["measured_on"] = "gpu"  # how the report reads where MLX computes on a GPU
    text = format_shape_report(r)
    assert text.index("measured on this GPU") < text.index("forecast for Apple GPUs")
    assert "measured / forecast" in text and "ReFusion at 1 tok/forward [a]" in text


def test_lazy_costs_equal_the_computed_ones():
    lazy, _ = build_models("tiny", q_bits=4, materialize=False)
    real, _ = build_models("tiny", q_bits=4, ar=False)
    a, b = Costs.of(lazy), Costs.of(real)
    assert (a.body_bytes, a.head_bytes, a.body_params) == (b.body_bytes, b.head_bytes, b.body_params)


def test_head_reads_count_the_chunks():
    model, _ = build_models("tiny", ar=False)
    c = Costs.of(model)
    assert c.head_reads(0) == 0 and c.head_reads(1) == 1
    assert c.head_reads(c.per_chunk) == 1 and c.head_reads(c.per_chunk + 1) == 2
    # tied embeddings: the head reads the embedding table, the body does not
    assert c.head_bytes == model.model.embed_tokens.weight.nbytes


def test_quantized_shape_shares_weights_with_mlx_lm():
    model, ar_model = build_models("tiny", q_bits=4)
    assert Costs.of(model).head_bytes < model.args.vocab_size * model.args.hidden_size * 4 / 4
    assert ar_model.model.embed_tokens.weight is not None


@pytest.mark.parametrize("argv", [["--shape", "qwen3-9b"], ["--q-bits", "4"], ["--shape", "tiny", "--q-bits", "3"],
                                  ["--shape", "tiny", "--tokens-per-forward", "0"],
                                  ["--shape", "tiny", "--tokens-per-forward", "two"],
                                  ["--record-with", FIXTURE], ["--tokens-per-forward", "2"], ["--forecast-only"],
                                  ["--shape", "tiny", "--model", "a", "--record-with", "b"]])
def test_bad_shape_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_missing_record_folder_is_one_line(tmp_path, capsys):
    assert main(["--shape", "tiny", "--record-with", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such model folder" in err[0]


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_batch_times_requests_at_once_against_one_at_a_time(tmp_path, capsys, set_paths, paths):
    """--batch N: each profile's requests (in turn) packed step by step, as
    continuous batching runs them, against the same N one at a time."""
    set_paths(paths)
    out = tmp_path / "batch.json"
    assert main(["--shape", "tiny", "--prompts", "2", "--max-tokens", "16", "--batch", "3",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    generated = r["generated_tokens"]
    for p in [p for p in r["profiles"] if p["measured"]]:
        b = p["batched"]
        assert b["requests"] == 3 and b["tokens"] == generated[0] + generated[1] + generated[0]
        assert b["serial_seconds"] > 0 and b["batched_seconds"] > 0
        assert b["speedup"] == pytest.approx(b["serial_seconds"] / b["batched_seconds"], rel=1e-3)
    assert "at once / one" in capsys.readouterr().out


def test_split_requests_follows_each_requests_forwards():
    from refusion_mlx.bench.forward_replay import split_requests

    params = make_params(gen_length=16, slot_size=4, block_length=8)
    reqs = requests([20, 33, 7], [16, 9, 12], [params] * 3)
    profile = derive(reqs, 2.0)
    parts = split_requests(profile.forwards)
    assert len(parts) == 3 and [s for part in parts for s in part] == profile.forwards
    assert all(part[0].start == 0 and all(s.start > 0 for s in part[1:]) for part in parts)


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_packed_bare_writes_compute_what_each_request_computes_alone(set_paths, paths):
    """The batched replay's packed forward (bare stores, PackedWrite) gives
    each request the hidden states it gets alone."""
    import mlx.core as mx
    import numpy as np

    from refusion_mlx.bench.forward_replay import BareCache, BareWrite, ForwardShape
    from refusion_mlx.decode.packed import PackedWrite
    from refusion_mlx.decode.runner import Runner

    set_paths(paths)
    model, _ = build_models("tiny", "float32", ar=False)
    runner = Runner.of(model)
    rng = np.random.default_rng(0)
    mask = rng.random((4, 12)) < 0.5
    mask[:, :8] = True
    shapes = [ForwardShape(5, 7, 12, phase="plan"), ForwardShape(3, 9, 12, phase="verify"),
              ForwardShape(4, 8, 12, np.arange(8, 12, dtype=np.int32), mask, phase="infill_draft")]
    tokens = [mx.array(rng.integers(0, 4096, s.tokens), dtype=mx.int32) for s in shapes]
    positions = [mx.arange(s.start, s.start + s.tokens, dtype=mx.int32) for s in shapes]
    caches = [BareCache(model, 12) for _ in shapes]
    for c in caches:  # the same committed rows before every pass
        for store in c.stores:
            store.keys = mx.random.normal(store.keys.shape, key=mx.random.key(1))
            store.values = mx.random.normal(store.values.shape, key=mx.random.key(2))
    alone = [runner.hidden(t, p, BareWrite(c, s)) for t, p, c, s in zip(tokens, positions, caches, shapes)]
    mx.eval(alone)
    packed = runner.hidden(mx.concatenate(tokens), mx.concatenate(positions),
                           PackedWrite([BareWrite(c, s) for c, s in zip(caches, shapes)], [s.tokens for s in shapes]))
    assert np.allclose(np.array(packed), np.array(mx.concatenate(alone)), atol=1e-5)


@pytest.mark.parametrize("argv", [["--batch", "2"], ["--shape", "tiny", "--batch", "0"]])
def test_bad_batch_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_weight_reads_follow_mlx_metal_kernels():
    """gemv / gemv_wide / GEMM for bf16; qmv(_wide) below the chip's row limit, split-K GEMM from it."""
    from refusion_mlx.bench.forecast import Chip, qmv_row_limit, weight_reads

    m4, m2 = Chip("M4 Max", 546, 36.8, 16), Chip("M2", 100, 7, 14)
    ultra = Chip("M3 Ultra", 819, 56.4, 15, ultra=True)
    assert [weight_reads(r, 4096, 4096, None, m4) for r in (1, 2, 5, 6, 10, 11, 15, 16, 32)] == \
        [1, 1, 1, 2, 2, 3, 3, 1, 1]
    assert [weight_reads(r, 4096, 4096, None, m2) for r in (1, 6, 15)] == [1, 1, 1]
    assert qmv_row_limit(4096, 4096, m4) == 15 and qmv_row_limit(4096, 24576, m4) == 13
    assert qmv_row_limit(2048, 2048, m4) == 13 and qmv_row_limit(4096, 4096, ultra) == 18
    assert qmv_row_limit(4096, 4096, m2) == 10 and qmv_row_limit(4096, 4096, Chip("M5", 1, 1, 17)) == 25
    assert [weight_reads(r, 4096, 4096, 4, m4) for r in (1, 5, 6, 14, 15, 32)] == [1, 1, 2, 3, 1, 1]
    assert [weight_reads(r, 4096, 4096, 4, m2) for r in (1, 5, 9, 10)] == [1, 5, 9, 1]


def test_apple_forecast_prices_the_kernels_rereads():
    """A 10-row forward of 4-bit weights streams each matrix twice on an M4 Max
    (qmv_wide); a 1-row or 16-row bf16 one once."""
    from refusion_mlx.bench.forecast import REFERENCE_CHIP, OnAppleGPU

    model, _ = build_models("refusion-8b", "bfloat16", 4, materialize=False)
    costs = Costs.of(model)
    plain, apple = OnAppleGPU(costs, None), OnAppleGPU(costs, 4)
    one_pass = plain.forward(10, 300, 10)[0]
    matrices = sum(p for _, _, p in costs.matrices) * costs.body_bytes / costs.body_params
    assert apple.forward(10, 300, 10, REFERENCE_CHIP)[0] == pytest.approx(one_pass + matrices + costs.head_bytes)
    assert apple.forward(1, 300, 1, REFERENCE_CHIP)[0] == pytest.approx(plain.forward(1, 300, 1)[0])
    assert OnAppleGPU(costs, None).forward(16, 300, 16, REFERENCE_CHIP)[0] == pytest.approx(
        plain.forward(16, 300, 16)[0])


def test_forecast_says_the_quantization_and_widths_it_assumes(tmp_path, capsys):
    assert main(["--shape", "refusion-8b", "--dtype", "bfloat16", "--q-bits", "4", "--forecast-only",
                 "--prompts", "1", "--max-tokens", "16"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "[d] 4-bit weights (group size 64, bfloat16 activations)" in text and "M4 Max qkv 13, o 15, gate_up 13, down 13" in text
    assert main(["--shape", "tiny", "--dtype", "bfloat16", "--forecast-only", "--prompts", "1", "--max-tokens",
                 "16"]) == 0
    assert "[d] bfloat16 weights" in (text := " ".join(capsys.readouterr().out.split()))
    assert "2-15 rows once per 5 rows on M3 and later" in text
    assert main(["--shape", "tiny", "--forecast-only", "--prompts", "1", "--max-tokens", "16"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # float32: the footnote called them bfloat16/float16
    assert "[d] float32 weights" in text and "once at every width" in text and "bfloat16/float16" not in text


def test_forecast_names_the_mlx_whose_kernels_it_follows(capsys):
    """The Metal kernels the forecast follows depend on MLX's version (gemv_wide is new in MLX 0.32.1, and the
    project allows 0.32): footnote [d] names the one they were read from, for every kind of weights."""
    for flags in ([], ["--dtype", "bfloat16"], ["--dtype", "bfloat16", "--q-bits", "4"]):
        assert main(["--shape", "tiny", "--forecast-only", "--prompts", "1", "--max-tokens", "16", *flags]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "streamed as MLX 0.32.1's Metal kernels stream them (gemv_wide is new in 0.32.1" in text, flags


def test_float32_weights_are_streamed_once_at_every_width():
    """gemv_wide (a pass per 5 rows) serves float16 and bfloat16 only: float32 takes gemv or a GEMM, one pass
    (the forecast priced float32 as bf16); quantized weights are qmv(_wide) whatever the activations."""
    from refusion_mlx.bench.forecast import REFERENCE_CHIP, OnAppleGPU, weight_reads

    m4 = REFERENCE_CHIP
    assert [weight_reads(r, 4096, 4096, None, m4, "float32") for r in (1, 2, 6, 11, 15, 16)] == [1] * 6
    assert [weight_reads(r, 4096, 4096, None, m4, "float16") for r in (2, 6, 11)] == [1, 2, 3]
    assert weight_reads(6, 4096, 4096, 4, m4, "float32") == weight_reads(6, 4096, 4096, 4, m4, "bfloat16") == 2
    model, _ = build_models("qwen3-0.6b", "float32", None, materialize=False)
    costs = Costs.of(model)
    assert OnAppleGPU(costs, None, "float32").forward(10, 300, 10, m4)[0] == pytest.approx(
        OnAppleGPU(costs, None, "float32").forward(10, 300, 10)[0])
    assert OnAppleGPU(costs, None, "bfloat16").forward(10, 300, 10, m4)[0] > \
        OnAppleGPU(costs, None, "float32").forward(10, 300, 10, m4)[0]


def test_float32_forecast_is_bandwidth_bound_at_the_tokens_per_forward(capsys):
    """bench --shape qwen3-0.6b --forecast-only (float32) printed 1.16/1.44/1.55/1.99x, bf16's prices."""
    assert main(["--shape", "qwen3-0.6b", "--forecast-only", "--json", "-"]) == 0
    r = json.loads(capsys.readouterr().out)
    for p in r["profiles"]:
        assert p["bandwidth_bound_ratio"] == pytest.approx(p["tokens_per_forward"], abs=0.01)


def test_cost_curve_interpolates_and_prices(tmp_path, capsys):
    from refusion_mlx.bench.cost_curve import CostCurve

    rows = [{"phase": "ar", "width": 1, "kv_len": kv, "ms": ms} for kv, ms in ((100, 8.0), (1000, 10.0))]
    rows += [{"phase": p, "width": w, "kv_len": kv, "ms": base + w + kv / 100, "attention": a}
             for p, base in (("plan", 10.0), ("verify", 11.0), ("infill", 20.0))
             for a in ("fused", "unfused") for w in (1, 4, 16) for kv in (100, 1000)]
    curve = CostCurve(rows)  # no auto rows: fused for one query row, unfused for more
    assert curve.ms("verify", 4, 100) == pytest.approx(11 + 4 + 1)
    assert curve.ms("plan", 10, 550) == pytest.approx(10 + 10 + 5.5)  # between widths and cache lengths
    assert curve.ms("infill_draft", 32, 1000) == pytest.approx((20 + 16 + 10) * 2)  # past the widest: in proportion
    assert curve.ms("prefill", 4, 5000) == pytest.approx(10 + 4 + 10)  # held past the longest cache
    assert curve.ar_ms(550) == pytest.approx(9.0)
    rows[-1] = {**rows[-1], "attention": "auto"}  # auto rows where there are some: only those
    assert CostCurve(rows).table == {"infill": {1000: [(16, 20 + 16 + 10)]}}
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"shape": "tiny", "device": "gpu (test)", "forward_cost": [
        {**r, "dtype": "float32", "q_bits": None} for r in rows[:-1]]}))
    out = tmp_path / "shape.json"
    assert main(["--shape", "tiny", "--prompts", "2", "--max-tokens", "16", "--forecast-only",
                 "--cost-curve", str(path), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cost_curve"] == {"file": str(path), "device": "gpu (test)", "priced_as": {}}  # every phase measured
    for p in r["profiles"]:
        c = p["from_curve"]
        assert c["refusion_tok_s"] > 0 and c["ratio"] == pytest.approx(c["ar_seconds"] / c["refusion_seconds"], 1e-3)
    assert "priced from the cost of a forward by width measured on gpu (test)" in capsys.readouterr().out
    # the file's own dtype named, with the flag: 4-bit bf16 rows asked for at the default float32 said only "no
    # forwards in float32, 4-bit"
    for argv, needle in ((["--dtype", "bfloat16"], "has no forwards in bfloat16; it holds float32 (pass --dtype "
                                                   "float32)"),
                         (["--shape", "qwen3-0.6b"], "measured tiny, not qwen3-0.6b")):
        argv = ["--shape", "tiny", "--forecast-only", "--cost-curve", str(path)] + argv
        assert main(argv) == 1
        assert needle in capsys.readouterr().err
    assert main(["--shape", "tiny", "--forecast-only", "--cost-curve", str(tmp_path / "nowhere.json")]) == 1
    assert "no such file" in capsys.readouterr().err
    path.write_text("[1, 2]")
    assert main(["--shape", "tiny", "--forecast-only", "--cost-curve", str(path)]) == 1
    assert "not a cost curve" in capsys.readouterr().err


def test_a_cost_curve_says_which_phase_it_priced_from_another(tmp_path, capsys):
    """gpu_record.sh's 4-bit run measures plan and infill only: the verify passes were priced at plan's rows
    and nothing said so. They still are (a verify pass is a plan pass of its width), and the report names it."""
    rows = [{"phase": "ar", "width": 1, "kv_len": 256, "ms": 8.0, "attention": None}]
    rows += [{"phase": p, "width": w, "kv_len": 256, "ms": 10.0 + w, "attention": "auto"} for p in ("plan", "infill")
             for w in (1, 4, 16)]
    path = tmp_path / "fc-q4.json"
    path.write_text(json.dumps({"shape": "tiny", "device": "gpu (test)", "forward_cost": [
        {**r, "dtype": "float32", "q_bits": 4} for r in rows]}))
    out = tmp_path / "shape.json"
    assert main(["--shape", "tiny", "--q-bits", "4", "--prompts", "2", "--max-tokens", "16", "--forecast-only",
                 "--cost-curve", str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cost_curve"]["priced_as"] == {"verify": "plan"}
    said = " ".join(capsys.readouterr().out.split())
    assert f"note: {path} has no verify forwards of these weights: the verify passes are priced as plan passes" in said


def test_a_cost_curve_prices_the_runtimes_settings_only(tmp_path, capsys):
    """A GPU record tags each row with the switches it ran under: the rows of REFUSION_MLX_OVERLAP=on and of
    the 4-bit padding off and on are a candidate's, and were mixed into the runtime's curve (two points at
    one width and cache length, the price between them arbitrary)."""
    from refusion_mlx.bench.cost_curve import CostCurve

    def row(phase, width, ms, **switches):
        return {"phase": phase, "width": width, "kv_len": 256, "ms": ms, "dtype": "bfloat16", "q_bits": None,
                "attention": None if phase == "ar" else "auto", "overlap": "auto", "qmm_pad": "auto", **switches}

    rows = [row("ar", 1, 8.0), row("plan", 1, 10.0), row("plan", 16, 20.0),
            row("plan", 16, 60.0, overlap="on"), row("plan", 4, 90.0, qmm_pad="off"), row("plan", 4, 5.0, qmm_pad="on")]
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"shape": "tiny", "forward_cost": rows}))
    curve = CostCurve.load(str(record), "bfloat16", None, "tiny")
    assert curve.table == {"plan": {256: [(1, 10.0), (16, 20.0)]}} and curve.ms("plan", 16, 256) == 20.0
    # a forward_cost run of a candidate's (its rows untagged, its switches the file's) prices nothing
    untagged = [{k: v for k, v in r.items() if k not in ("overlap", "qmm_pad")} for r in rows[:3]]
    run = tmp_path / "fc-bf16-overlap.json"
    run.write_text(json.dumps({"shape": "tiny", "switches": {"overlap": "on", "qmm_pad": "auto"},
                               "forward_cost": untagged}))
    assert main(["--shape", "tiny", "--dtype", "bfloat16", "--forecast-only", "--cost-curve", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only a candidate's" in err[0], err
    run.write_text(json.dumps({"shape": "tiny", "switches": {"overlap": "auto"}, "forward_cost": untagged}))
    assert CostCurve.load(str(run), "bfloat16", None, "tiny").table == {"plan": {256: [(1, 10.0), (16, 20.0)]}}


def test_json_dash_keeps_standard_output_json(capsys):
    """``--json -``: the forecast shown before the timing went to standard output ahead of the JSON."""
    assert main(["--shape", "tiny", "--prompts", "1", "--max-tokens", "16", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert set(json.loads(out)) >= {"shape", "forecast", "profiles"}
    assert "shape tiny" in err


@pytest.mark.parametrize("content, says", [
    ({"forward_cost": [{"dtype": "float32", "q_bits": None}]}, "forward_cost[0] has no phase"),
    ({"forward_cost": "abc"}, "\"forward_cost\" is 'abc', not a list of rows"),
    ({"forward_cost": [1]}, "forward_cost[0] is not a row"),
    ({"forward_cost": [{"phase": "plan", "width": 0, "kv_len": 1, "ms": 1}]}, "forward_cost[0] has width 0"),
    ({"forward_cost": [{"phase": "plan", "width": 1, "kv_len": 1, "ms": "x"}]}, "forward_cost[0] has ms 'x'"),
    ({"forward_cost": [{"phase": "decode", "width": 1, "kv_len": 1, "ms": 1}]}, "has phase 'decode'"),
    ([1], "no \"forward_cost\" list"), ("{", "not JSON"), (None, "is a folder, not a cost curve file")])
def test_a_malformed_cost_curve_is_one_line(content, says, tmp_path, capsys):
    """A --cost-curve file that is no cost curve: one line naming the file and what is wrong (a row without a
    phase was a KeyError, a string of rows an AttributeError, a folder "no such file")."""
    path = tmp_path / "curve.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content if isinstance(content, str) else json.dumps({"shape": "tiny", **content}
                                                                           if isinstance(content, dict) else content))
    assert main(["--shape", "tiny", "--forecast-only", "--cost-curve", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and says in err[0], err


def test_a_cost_curve_must_say_its_shape(tmp_path, capsys):
    """A curve that does not say the shape it measured prices nothing (a GPU record had no "shape":
    bench --shape qwen3-0.6b priced 0.6B from the 8B curve); the checked-in record says refusion-8b."""
    from refusion_mlx.bench.cost_curve import CostCurve

    record = Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "nvidia-h200-2026-11-28.json"
    assert CostCurve.load(str(record), "bfloat16", None, "refusion-8b").ar
    data = json.loads(record.read_text())
    assert main(["--shape", "qwen3-0.6b", "--dtype", "bfloat16", "--forecast-only", "--cost-curve", str(record)]) == 1
    assert "measured refusion-8b, not qwen3-0.6b" in capsys.readouterr().err
    del data["shape"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert main(["--shape", "qwen3-0.6b", "--dtype", "bfloat16", "--forecast-only", "--cost-curve", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not say which model shape it measured" in err[0] and '"shape"' in err[0]



def test_the_demo_models_count_is_the_headers(tiny_run):
    """The footnote on the demo's recorded forwards says the count the comparison's header says."""
    from refusion_mlx.bench.report import format_parameters, model_shape
    from refusion_mlx.models.loading import load

    r, text = tiny_run
    model, _ = load(None)
    assert r["recorded_parameters"] == model_shape(model)["parameters"]
    assert f"a {format_parameters(r['recorded_parameters'])}-parameter model" in " ".join(text.split())
