"""logit_bias, presence_penalty, frequency_penalty and repetition_penalty (decode/penalties.py): a request
decodes exactly as the same model would with those applied to its logits, alone and in a batch, on every
interface."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.params import make_params
from refusion_mlx.decode.penalties import repeat_penalised
from refusion_mlx.decode.prefill import prefill
from refusion_mlx.errors import DecodeError

CASES = (4, 7, 27)  # golden cases whose answers repeat tokens (a person's facts, a times table, counting)


def settings(case, **kw):
    return make_params(max_tokens=case["gen_length"], slot_size=case["slot_size"],
                       serial_num_blocks=case["serial_num_blocks"], slot_threshold=case["slot_threshold"],
                       token_threshold=case["token_threshold"], **kw)


def decode(model, tokenizer, case, params, head_bias=None, monkeypatch=None, head=None):
    """A case decoded alone; ``head_bias(decoder)``: a (vocab,) array the model's head adds to every row;
    ``head(decoder, logits)``: what the model's head gives instead of its logits."""
    decoder = RefusionDecoder(model, case["prompt_ids"], params, mask_id=model.args.mask_token_id,
                              eos_id=tokenizer.eos_token_id)
    if head_bias is not None:
        head = lambda decoder, logits: logits + head_bias(decoder)
    if head is not None:
        plain = type(model).head.__get__(model)
        monkeypatch.setattr(model, "head", lambda h: head(decoder, plain(h)), raising=False)
    for _ in decoder.steps():
        pass
    if head is not None:
        monkeypatch.undo()
    return decoder.response()


def committed(decoder):
    """The answer's committed tokens now (the head runs before its step commits)."""
    state = decoder.state
    return [t for p, _, t in state.cache.in_position_order(state.start) if p >= state.response_start]


def committed_counts(decoder, vocab):
    """How often each token is among the answer's committed tokens now."""
    return np.bincount(np.asarray(committed(decoder), np.int64), minlength=vocab).astype(np.float32)


@pytest.fixture(scope="module")
def cases(golden_cases):
    return [golden_cases[i] for i in CASES]


def test_a_logit_bias_decodes_as_a_model_with_the_bias_in_its_head(demo, cases, monkeypatch):
    model, tokenizer = demo
    vocab = model.args.vocab_size
    for case in cases:
        plain = decode(model, tokenizer, case, settings(case))
        assert plain == case["output_ids"]
        banned = max(set(plain) - {tokenizer.eos_token_id}, key=plain.count)  # its most repeated token
        favoured = (banned + 1) % vocab
        bias = {str(banned): -100, favoured: 3.5}
        vector = np.zeros(vocab, np.float32)
        vector[banned], vector[favoured] = -100, 3.5
        biased = decode(model, tokenizer, case, settings(case, logit_bias=bias))
        assert banned not in biased and biased != plain, (plain, biased)
        assert biased == decode(model, tokenizer, case, settings(case), lambda _: mx.array(vector), monkeypatch)


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), (-0.5, 0.8)])
def test_penalties_decode_as_a_model_penalised_by_the_answer_committed_so_far(demo, cases, monkeypatch, presence,
                                                                             frequency):
    model, tokenizer = demo
    vocab = model.args.vocab_size

    def penalised(decoder):
        c = committed_counts(decoder, vocab)
        return mx.array(-frequency * c - presence * (c > 0).astype(np.float32))

    changed = 0
    for case in cases:
        params = settings(case, presence_penalty=presence, frequency_penalty=frequency)
        got = decode(model, tokenizer, case, params)
        assert got == decode(model, tokenizer, case, settings(case), penalised, monkeypatch)
        changed += got != case["output_ids"]
    assert changed, "no penalty changed an answer: nothing was tested"


@pytest.mark.parametrize("penalty", [1.6, 0.5])
def test_a_repetition_penalty_decodes_as_a_model_penalised_on_the_prompt_and_the_answer_so_far(demo, cases,
                                                                                             monkeypatch, penalty):
    """HF's and vLLM's rule: the logits of the tokens the prompt or the committed answer has are divided by
    the penalty where positive, multiplied by it elsewhere; before a bias is added."""
    model, tokenizer = demo
    vocab = model.args.vocab_size

    def penalised(decoder, logits):
        seen = np.zeros(vocab, np.bool_)
        seen[[*decoder.prompt, *committed(decoder)]] = True
        d = mx.array(np.where(seen, penalty, 1.0).astype(np.float32))
        logits = logits.astype(mx.float32)
        return mx.where(logits > 0, logits / d, logits * d) + bias

    changed = 0
    for case in cases:
        bias = mx.zeros((vocab,))
        got = decode(model, tokenizer, case, settings(case, repetition_penalty=penalty))
        assert got == decode(model, tokenizer, case, settings(case), monkeypatch=monkeypatch, head=penalised)
        changed += got != case["output_ids"]
        bias = mx.array(np.where(np.arange(vocab) == case["output_ids"][0], 2.0, 0.0).astype(np.float32))
        with_bias = decode(model, tokenizer, case, settings(case, repetition_penalty=penalty,
                                                            logit_bias={case["output_ids"][0]: 2.0}))
        assert with_bias == decode(model, tokenizer, case, settings(case), monkeypatch=monkeypatch, head=penalised)
    assert changed, "no penalty changed an answer: nothing was tested"
    for off in (0, 1):  # mlx-lm's and HF's "off"
        assert decode(model, tokenizer, cases[0], settings(cases[0], repetition_penalty=off)) == \
            cases[0]["output_ids"]
    logits = mx.array([[2.0, -2.0, 0.0, 3.0]])
    assert repeat_penalised(logits, mx.array([2.0, 2.0, 2.0, 1.0])).tolist() == [[1.0, -4.0, 0.0, 3.0]]


def test_a_repetition_penalty_counts_the_conversation_in_the_cache(demo, cases):
    """A prompt continued from a cache that holds its first part (a chat's turns, the server's prompt cache)
    decodes as the whole prompt does: the tokens the cache holds are context the penalty sees."""
    model, tokenizer = demo
    case = cases[2]
    params = settings(case, repetition_penalty=1.8)
    whole = decode(model, tokenizer, case, params)
    for k in (len(case["prompt_ids"]) // 2, len(case["prompt_ids"]) - 1):
        cache = CommittedCache.for_model(model)
        prefill(model, cache, case["prompt_ids"][:k])
        decoder = RefusionDecoder(model, case["prompt_ids"][k:], params, mask_id=model.args.mask_token_id,
                                  eos_id=tokenizer.eos_token_id, cache=cache)
        for _ in decoder.steps():
            pass
        assert decoder.response() == whole, k


def test_a_batch_of_biased_penalised_and_plain_requests_decodes_each_as_alone(demo, cases):
    model, tokenizer = demo
    banned = max(cases[1]["output_ids"], key=cases[1]["output_ids"].count)
    params = [settings(cases[0], logit_bias={"9": -100, "10": 2}), settings(cases[1]),
              settings(cases[2], presence_penalty=1.0, frequency_penalty=0.5),
              settings(cases[0], frequency_penalty=2.0), settings(cases[1], logit_bias={banned: -100}),
              settings(cases[2], repetition_penalty=1.8), settings(cases[0], repetition_penalty=1.3,
                                                                   presence_penalty=0.5)]
    prompts = [c["prompt_ids"] for c in (cases[0], cases[1], cases[2], cases[0], cases[1], cases[2], cases[0])]
    together = batch_generate(model, tokenizer, prompts, params, max_batch=8)
    for prompt, p, result in zip(prompts, params, together):
        alone = decode(model, tokenizer, {"prompt_ids": prompt}, p)
        assert result.output_ids == alone, p
    assert together[1].output_ids == cases[1]["output_ids"]  # the plain one, as the reference decodes it
    assert banned not in together[4].output_ids and banned in together[1].output_ids  # the bias is its own


def test_the_settings_are_checked_where_they_are_made(demo, cases):
    for bad, message in (({"presence_penalty": 2.5}, "presence_penalty must be within [-2, 2]"),
                         ({"frequency_penalty": True}, "frequency_penalty must be within"),
                         ({"logit_bias": {"x": 1}}, "logit_bias: keys are token ids"),
                         ({"logit_bias": {"5": 100.5}}, "within [-100, 100], got 100.5"),
                         ({"logit_bias": {"5": None}}, "logit_bias: values are numbers"),
                         ({"logit_bias": [5]}, "logit_bias must be an object"),
                         ({"logit_bias": {"-3": 1}}, "token id -3 is negative"),
                         ({"repetition_penalty": -0.5}, "repetition_penalty must be within [0, 10] (0 and 1: off)"),
                         ({"repetition_penalty": "1.2"}, "repetition_penalty must be within")):
        with pytest.raises(DecodeError) as err:
            make_params(**bad)
        assert message in str(err.value), (bad, err.value)
    assert make_params(logit_bias={}).logit_bias is None and make_params().presence_penalty == 0
    assert make_params().repetition_penalty == 1
    model, tokenizer = demo
    with pytest.raises(DecodeError, match="token id 816 is outside the vocabulary of 806"):
        RefusionDecoder(model, cases[0]["prompt_ids"], make_params(logit_bias={816: -1}),
                        mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)


def test_the_commands_take_the_flags():
    """--logit-bias (a JSON object), --presence-penalty, --frequency-penalty and --repetition-penalty; a bad
    one is one line and exit 1 (argparse's 2 for text that is no JSON object)."""
    import argparse

    from refusion_mlx.cli.flags import json_object

    run = lambda *argv: subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--max-tokens", "16",
                                        "--prompt", "Count from 1 to 20.", "--json", *argv],
                                       capture_output=True, text=True, timeout=120)
    biased = run("--logit-bias", '{"5": 100}', "--presence-penalty", "0.5", "--repetition-penalty", "1.5")
    assert biased.returncode == 0 and json.loads(biased.stdout)["output_ids"] == [5] * 16, biased.stderr
    for text, why in (("{5: 1}", "not JSON"), ("[5]", "not a JSON object")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            json_object(text)
    for argv, line in ((["--frequency-penalty", "-2.5"], "error: --frequency-penalty must be within"),
                       (["--repetition-penalty", "12"], "error: --repetition-penalty must be within [0, 10]"),
                       (["--logit-bias", '{"99999": 1}'], "error: logit_bias: token id 99999 is outside")):
        bad = run(*argv)
        assert bad.returncode == 1 and line in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, (
            argv, bad.returncode, bad.stderr)


def test_a_constrained_answer_keeps_to_its_schema_under_a_bias():
    """The constrained mode's passes carry the bias too; the grammar's mask comes after it."""
    from refusion_mlx.decode.grammar import Constraint
    from refusion_mlx.models.loading import load

    model, tokenizer = load(None, dtype="float32")  # the bundled demo: it writes its people's facts as JSON
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "pet": {"enum": ["cat", "turtle"]}},
              "required": ["name", "city", "pet"], "additionalProperties": False}  # the README's
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Give Sven's facts as JSON."}],
                                           add_generation_prompt=True)
    sven = tokenizer.encode("Sven")
    assert len(sven) == 1
    plain, biased = batch_generate(model, tokenizer, [prompt, prompt],
                                   [make_params(max_tokens=64), make_params(max_tokens=64, logit_bias={sven[0]: -100})],
                                   constraints=[Constraint.json_schema(schema)] * 2)
    assert json.loads(plain.text)["name"] == "Sven" and sven[0] in plain.output_ids
    assert set(json.loads(biased.text)) == {"name", "city", "pet"} and sven[0] not in biased.output_ids
