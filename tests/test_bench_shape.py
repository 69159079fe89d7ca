"""python -m refusion_mlx.bench --shape: the demo model's forwards replayed at
another shape (a tiny hidden one here), against mlx-lm on the same weights."""

import json

import pytest

from refusion_mlx.bench.__main__ import main
from refusion_mlx.bench.shapes import CHIPS, Costs, build_models

KEYS = {"shape", "device", "paths", "refusion_tok_s", "ar_tok_s", "ratio", "tokens_per_forward",
        "head_reads_per_step", "weight_bytes_per_token", "flops_per_token", "forecast"}


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("shape") / "shape.json"
    assert main(["--shape", "tiny", "--prompts", "2", "--max-tokens", "16", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_shape_report_keys_and_replay(tiny_report):
    r = tiny_report
    assert KEYS <= set(r)
    assert r["shape"] == "tiny" and r["paths"] and r["device"] and r["recorded_with"] == "bundled demo model"
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


def test_forecast_rows_for_the_chips(tiny_report):
    rows = tiny_report["forecast"]
    names = [row["chip"] for row in rows]
    for chip in ("M3 Pro", "M4 Pro", "M4 Max", "M3 Ultra"):
        assert any(n.startswith(chip) for n in names)
    assert len(rows) == len(CHIPS)
    assert all(row["refusion_tok_s"] > 0 and row["ar_tok_s"] > 0 for row in rows)
    assert "not a measurement" in tiny_report["forecast_note"]


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


@pytest.mark.parametrize("argv", [["--shape", "qwen3-9b"], ["--q-bits", "4"], ["--shape", "tiny", "--q-bits", "3"]])
def test_bad_shape_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
