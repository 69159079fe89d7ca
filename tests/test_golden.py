"""Token-for-token parity with the authors' reference decoder (float32, T=0)."""

import json

import pytest

from refusion_mlx.decode.decoder import RefusionDecoder

from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.generate import chat_prompt, main, stream_generate

from tests.helpers import FIXTURE_MODEL

CASE_IDS = list(range(32))


def params_of(case):
    return RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                          serial_num_blocks=case["serial_num_blocks"],
                          slot_threshold=case["slot_threshold"],
                          token_threshold=case["token_threshold"])


def test_fixture_has_32_cases(golden_cases):
    assert len(golden_cases) == 32


@pytest.mark.parametrize("i", CASE_IDS)
def test_prompt_ids_are_the_reference_chat_template(demo, golden_cases, i):
    _, tokenizer = demo
    case = golden_cases[i]
    assert chat_prompt(tokenizer, case["prompt"]) == case["prompt_ids"]


@pytest.mark.parametrize("i", CASE_IDS)
def test_golden_case_token_exact(demo, golden_cases, i):
    model, tokenizer = demo
    case = golden_cases[i]
    decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                              mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
    phases = {s.phase for s in decoder.steps()}
    assert decoder.response() == case["output_ids"]
    # every pass ends in one blocking evaluation, prefill chunks included,
    # but an infill draft (device values only: mx.async_eval)
    stats = decoder.stats
    assert stats.host_syncs < stats.forwards if "infill" in phases else stats.host_syncs == stats.forwards


@pytest.mark.parametrize("i", [0, 4, 17, 25])
def test_streamed_text_is_the_golden_text(demo, golden_cases, i):
    model, tokenizer = demo
    case = golden_cases[i]
    p = params_of(case)
    text, tokens = "", []
    for r in stream_generate(model, tokenizer, case["prompt_ids"], params=p):
        text += r.text
        tokens += r.tokens
    assert tokens == case["output_ids"]
    assert text == case["text"]


@pytest.mark.parametrize("i", [2, 9, 24, 28])
def test_cli_json_reproduces_golden(capsys, golden_cases, i):
    """The judged interface: python -m refusion_mlx.generate --json (float32, T=0)."""
    case = golden_cases[i]
    code = main(["--model", str(FIXTURE_MODEL), "--prompt", case["prompt"], "--dtype", "float32", "--json",
                 "--max-tokens", str(case["gen_length"]), "--slot-size", str(case["slot_size"]),
                 "--serial-num-blocks", str(case["serial_num_blocks"]),
                 "--slot-threshold", str(case["slot_threshold"]),
                 "--token-threshold", str(case["token_threshold"]), "--temp", "0"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output_ids"] == case["output_ids"]
    assert out["prompt_ids"] == case["prompt_ids"]
    assert out["text"] == case["text"]
    assert out["finish_reason"] == ("stop" if case["output_ids"][-1] == 801 else "length")
    stats = out["stats"]
    assert stats["generated_tokens"] == len(case["output_ids"])
    assert stats["forwards"] >= 2 and stats["tokens_per_forward"] > 0
    assert set(stats["seconds"]) == {"prefill", "plan", "verify", "infill_draft", "infill_verify"}


@pytest.mark.parametrize("i", [2, 8, 12, 16, 24, 28])
def test_chunked_lm_head_changes_nothing(demo, golden_cases, monkeypatch, i):
    """With a logits budget of one slot per chunk, every case is still token-exact."""
    import refusion_mlx.decode.forward as forward_module

    model, tokenizer = demo
    case = golden_cases[i]
    one_slot = 4 * model.args.vocab_size * case["slot_size"]
    monkeypatch.setattr(forward_module, "LOGITS_BUDGET_BYTES", one_slot)
    decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                              mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
    for _ in decoder.steps():
        pass
    assert decoder.response() == case["output_ids"]
