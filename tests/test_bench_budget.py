"""Both sides of the comparison get the same budget: N answer tokens, and an EOS
after them may end the answer ("stop") on either side. ReFusion's gen_length
excludes EOS; mlx-lm's max_tokens counts it, so the AR side asks for one more."""

import pytest

from refusion_mlx.bench.compare import load_models
from refusion_mlx.bench.runs import run_ar, run_refusion
from refusion_mlx.decode.params import make_params
from refusion_mlx.decode.stream import chat_prompt


@pytest.fixture(scope="module")
def sides():
    model, tokenizer, ar_model = load_models(None)
    tokenizer.eos_token_ids = {tokenizer.eos_token_id}  # as run_benchmark sets it
    return model, tokenizer, ar_model, chat_prompt(tokenizer, "Tell me about Uma.")


def test_an_eos_right_after_the_budget_ends_the_answer_on_both_sides(sides):
    model, tokenizer, ar_model, ids = sides
    free = run_ar(ar_model, tokenizer, ids, 256)
    assert free.finish_reason == "stop" and free.output_ids[-1] == tokenizer.eos_token_id
    n = free.generated_tokens - 1  # the answer's tokens before its EOS
    at = run_ar(ar_model, tokenizer, ids, n)
    assert (at.generated_tokens, at.finish_reason, at.output_ids) == (n + 1, "stop", free.output_ids)
    rf = run_refusion(model, tokenizer, ids, make_params(gen_length=n))
    assert rf.generated_tokens <= n + 1  # ReFusion's budget: n answer tokens, then maybe its EOS


def test_a_cut_answer_has_the_budgets_tokens(sides):
    model, tokenizer, ar_model, ids = sides
    free = run_ar(ar_model, tokenizer, ids, 256)
    n = free.generated_tokens - 3
    cut = run_ar(ar_model, tokenizer, ids, n)
    assert (cut.generated_tokens, cut.finish_reason) == (n, "length")
    assert cut.output_ids == free.output_ids[:n]
    assert cut.text == tokenizer.decode(free.output_ids[:n])
    assert cut.forwards >= n and cut.lookahead_forwards >= 1  # the step past the budget is not counted
