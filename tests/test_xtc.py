"""XTC (mlx-lm's "exclude top choices", decode/probs.py ``XTC``) on the planning drafts: what it drops is what
mlx-lm's ``apply_xtc`` drops, each sampled row tosses its own coin, greedy decoding ignores it as mlx-lm's
does, and a seeded request decodes alike alone and in a batch."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.batch import BatchGenerator, batch_generate
from refusion_mlx.decode.params import make_params
from refusion_mlx.decode.probs import XTC, Drafting, row_statistics
from refusion_mlx.errors import DecodeError
from refusion_mlx.generate import chat_prompt

from tests.helpers import FIXTURE_MODEL

COUNT = "Count from 1 to 20."  # the fixture model's sampled answer (seed 3) changes under XTC at 0.05


def log_probs(rows: int, vocab: int, seed: int) -> mx.array:
    """Rows with a few likely tokens each (several above a threshold of 0.1), as log-probabilities."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    logits[:, :6] += rng.uniform(2, 5, size=(rows, 6)).astype(np.float32)
    x = mx.array(logits)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def keep_mask(vocab: int, ids) -> mx.array:
    keep = np.zeros(vocab, dtype=bool)
    keep[list(ids)] = True
    return mx.array(keep)


@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.2])
def test_xtc_drops_what_mlx_lms_apply_xtc_drops(threshold):
    from mlx_lm.sample_utils import apply_xtc

    rows, vocab, special = 6, 40, [2, 31]
    x = log_probs(rows, vocab, seed=int(threshold * 100))
    ours = XTC(1.0, threshold, mx.zeros(rows), keep_mask(vocab, special))(x, slice(0, rows))
    theirs = apply_xtc(x, 1.0, threshold, special)  # probability 1: mlx-lm's coin always comes up
    dropped = np.isneginf(np.array(ours))
    assert (dropped == np.isneginf(np.array(theirs))).all()
    assert dropped.any() and not dropped[:, special].any()
    kept = np.where(dropped, -np.inf, np.array(x))
    assert (np.array(ours)[~dropped] == kept[~dropped]).all()  # what stays is untouched


def test_each_row_tosses_its_own_coin():
    rows, vocab = 4, 40
    x = log_probs(rows, vocab, seed=1)
    coins = mx.array([0.1, 0.9, 0.49, 0.51])
    out = np.array(XTC(0.5, 0.1, coins, keep_mask(vocab, []))(x, slice(0, rows)))
    assert [bool(np.isneginf(row).any()) for row in out] == [True, False, True, False]
    later = np.array(XTC(0.5, 0.1, mx.array([0.9, 0.9, 0.1, 0.1, 0.9, 0.9]), keep_mask(vocab, []))(x, slice(2, 6)))
    assert [bool(np.isneginf(row).any()) for row in later] == [True, True, False, False]  # the pass's rows 2-5


def test_a_draft_under_xtc_is_the_least_likely_token_above_the_threshold():
    """Three tokens pass 0.1 (0.5, 0.3, 0.15): the two likelier go and the draft is the third, noise or not;
    a token XTC keeps (an end id) stays a candidate."""
    vocab = 12
    probs = np.full(vocab, 0.05 / (vocab - 3), dtype=np.float32)
    probs[[4, 7, 9]] = [0.5, 0.3, 0.15]
    logits = mx.array(np.log(probs)[None].repeat(2, axis=0))
    for keep, draft in (([], 9), ([4], 4)):
        xtc = XTC(1.0, 0.1, mx.zeros(2), keep_mask(vocab, keep))
        d = Drafting(temperature=1.0, noise=mx.zeros((2, vocab)), xtc=xtc)
        drafted, p_draft, _ = row_statistics(logits, 0, [(d, 2)], None)
        assert np.array(drafted).tolist() == [draft, draft]
        assert np.allclose(np.array(p_draft), probs[draft])  # its probability under the plain softmax


def test_greedy_decoding_ignores_xtc_as_mlx_lm_does(demo, golden_cases):
    model, tokenizer = demo
    case = golden_cases[4]
    common = dict(max_tokens=case["gen_length"], slot_size=case["slot_size"],
                  serial_num_blocks=case["serial_num_blocks"], slot_threshold=case["slot_threshold"],
                  token_threshold=case["token_threshold"])
    [result] = batch_generate(model, tokenizer, [case["prompt_ids"]],
                              [make_params(**common, xtc_probability=1.0, xtc_threshold=0.01)])
    assert result.output_ids == case["output_ids"]


def test_a_seeded_request_under_xtc_decodes_alike_alone_and_in_a_batch(demo):
    model, tokenizer = demo
    ids = chat_prompt(tokenizer, COUNT)
    sampled = dict(max_tokens=32, temperature=1.0, seed=3)
    params = [make_params(**sampled, xtc_probability=1.0, xtc_threshold=0.05), make_params(**sampled),
              make_params(max_tokens=32, xtc_probability=1.0, xtc_threshold=0.05),
              make_params(**sampled, xtc_probability=0.5, xtc_threshold=0.01), make_params(max_tokens=32)]
    together = batch_generate(model, tokenizer, [ids] * len(params), params, max_batch=8)
    for p, result in zip(params, together):
        [alone] = batch_generate(model, tokenizer, [ids], [p])
        assert result.output_ids == alone.output_ids, p
    assert together[0].output_ids != together[1].output_ids  # XTC changed the sampled answer
    assert together[2].output_ids == together[4].output_ids  # and not the greedy one


def test_the_end_ids_and_the_newline_are_never_dropped(demo):
    model, tokenizer = demo
    gen = BatchGenerator(model, tokenizer)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert set(gen.xtc_keep()) == {*newline, tokenizer.eos_token_id, *gen.stop_ids()}
    gen.insert(COUNT, make_params(max_tokens=8, temperature=1.0, xtc_probability=0.5))
    gen.insert(COUNT, make_params(max_tokens=8, temperature=1.0))
    xtc, plain = (member.decoder.state for member in gen.waiting)
    kept = np.flatnonzero(np.array(xtc.xtc_kept)).tolist()
    assert kept == sorted({*newline, tokenizer.eos_token_id}) and plain.xtc_keep == ()


def test_the_settings_are_checked_where_they_are_made():
    for bad, message in (({"xtc_probability": 1.5}, "xtc_probability must be within [0, 1], got 1.5"),
                         ({"xtc_probability": -0.1}, "xtc_probability must be within [0, 1]"),
                         ({"xtc_threshold": 0.6}, "xtc_threshold must be within [0, 0.5], got 0.6"),
                         ({"xtc_threshold": "0.1"}, "xtc_threshold must be within")):
        with pytest.raises(DecodeError) as err:
            make_params(**bad)
        assert message in str(err.value), (bad, err.value)
    assert make_params().xtc_probability == 0 and make_params().xtc_threshold == 0.1  # mlx-lm's defaults


def test_generate_takes_mlx_lms_flags(demo):
    """``--xtc-probability`` and ``--xtc-threshold`` as mlx-lm's generate takes them; one out of bounds is one
    line and exit 1."""
    model, tokenizer = demo
    run = lambda *argv: subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--prompt", COUNT,
                                        "--model", str(FIXTURE_MODEL), "--dtype", "float32",  # the fixture's
                                        "--max-tokens", "32", "--temp", "1", "--seed", "3", "--json", *argv],
                                       capture_output=True, text=True, timeout=120)
    done = run("--xtc-probability", "1", "--xtc-threshold", "0.05")
    assert done.returncode == 0, done.stderr
    p = make_params(max_tokens=32, temperature=1.0, seed=3, xtc_probability=1.0, xtc_threshold=0.05)
    [same] = batch_generate(model, tokenizer, [chat_prompt(tokenizer, COUNT)], [p])
    assert json.loads(done.stdout)["output_ids"] == same.output_ids
    bad = run("--xtc-threshold", "0.7")
    assert bad.returncode == 1 and bad.stderr == "error: --xtc-threshold must be within [0, 0.5], got 0.7\n", \
        bad.stderr
