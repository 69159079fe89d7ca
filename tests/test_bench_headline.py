"""The comparison's headline compares the same work: time to answer over every
prompt and tokens/s on the prompts both sides answered alike, not the tokens/s
of whatever each side wrote (a runaway answer to the budget is many fast tokens)."""

import pytest

from refusion_mlx.bench.compare import format_report, summarize
from refusion_mlx.bench.runs import RunResult
from refusion_mlx.bench.suite import Case, Suite
from refusion_mlx.decode.params import make_params

ENV = {"model": "m", "model_shape": {"model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 1,
                                     "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
                                     "intermediate_size": 8, "vocab_size": 10, "parameters": 100,
                                     "quantized": False},
       "blas": "OpenBLAS", "dtype": "float32", "device": "cpu", "mlx": "x", "mlx_lm": "x",
       "refusion_mlx": "x", "python": "3"}


def run(side, tokens, wall, finish, ids=None):
    ids = ids if ids is not None else list(range(tokens))
    return RunResult(side, tokens, tokens, wall, wall / 10, {}, 0.01, 1, 1, finish, ids)


@pytest.fixture
def result():
    # prompt 1: ReFusion runs away to the budget (512 tokens, 0.44 s), AR answers 82 tokens in 0.18 s;
    # prompt 2: both stop at EOS with 19 and 18 tokens; prompt 3: AR answers EOS alone
    sides = [(run("refusion", 512, 0.44, "length"), run("ar", 82, 0.18, "stop")),
             (run("refusion", 19, 0.012, "stop"), run("ar", 18, 0.044, "stop", list(range(1, 19)))),
             (run("refusion", 26, 0.023, "stop"), run("ar", 1, 0.008, "stop", [9]))]
    suite = Suite("s", [Case("f", f"p{i}") for i in range(3)])
    runs = [{"refusion": [rf], "ar": [ar]} for rf, ar in sides]
    params = [make_params(gen_length=512)] * 3
    return summarize(suite, [[1, 2]] * 3, params, runs, ("refusion", "ar"), ENV,
                     {"preset": None, "repeat": 1, "warmup": 0})


def test_the_summary_leads_with_the_same_work(result):
    s = result["summary"]
    assert s["time_to_answer_ratio"] == pytest.approx((0.18 + 0.044 + 0.008) / (0.44 + 0.012 + 0.023), rel=1e-3)
    assert s["matched_prompts"] == [2]  # the runaway and the EOS-only answer are not the same work
    assert s["matched_tokens_per_second_ratio"] == pytest.approx((19 / 0.012) / (18 / 0.044), rel=1e-3)
    assert s["budget_hits"] == {"refusion": 1, "ar": 0}
    assert [c["match"] for c in result["cases"]] == [None, "length", None]
    assert result["cases"][0]["time_ratio"] == pytest.approx(0.18 / 0.44, rel=1e-3)
    # the plain tokens/s ratio stays, secondary: it rewards the runaway answer
    assert result["total"]["ratio"] > 1 > s["time_to_answer_ratio"]


def test_the_report_shows_how_each_answer_ended(result):
    text = format_report(result)
    head = [line for line in text.splitlines() if line.startswith("ReFusion vs AR, same work")]
    assert len(head) == 1
    assert "time to answer 0.49x over all 3 prompts" in head[0]
    assert "on the 1/3 matched prompts" in head[0]
    table = text.splitlines()
    header = next(line for line in table if line.startswith("#"))
    assert "end" in header.split() and "x time" in header and "match" in header.split()
    first = next(line for line in table if line.startswith("1 "))
    assert " LEN " in first and "0.41" in first  # cut at the budget; AR answered in 0.41x the time
    assert "ended at the budget: ReFusion 1, AR 0" in text
