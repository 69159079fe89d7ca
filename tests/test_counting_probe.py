"""examples/demo_model/counting_probe.py: the measurement behind the demo's
counting note must look at the right tokens, and its training loop must train."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from refusion_mlx.models.loading import load
from refusion_mlx.train.examples import IGNORE

from tests.helpers import demo_example_module

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-refusion"


def probe_module():
    return demo_example_module("counting_probe")


def test_probe_positions_are_the_last_digit_of_each_number():
    probe = probe_module()
    _, tokenizer = load(FIXTURE, join_projections=False)
    for sep in (", ", " "):
        ids, ends, others = probe.count_case(tokenizer, 8, 12, sep)
        assert ends == [len(ids) - 1]  # the answer is cut right after the end number
        assert [tokenizer.decode([ids[i]]) for i in others] == ["8", "9", "0", "1"]
        assert tokenizer.decode([ids[ends[0]]]) == "2" and tokenizer.decode(ids[ends[0] - 1:]) == "12"
        # after every other number the next token is the separator, which the probe scores against "."
        assert all(tokenizer.decode([ids[i + 1]]) == sep[0] for i in others)


def test_left_to_right_example_labels_each_response_token_with_the_next():
    probe = probe_module()
    e = probe.left_to_right_example([1, 2, 3], [7, 8, 9])
    assert e.input_ids.tolist() == [1, 2, 3, 7, 8, 9]
    assert e.labels.tolist() == [IGNORE, IGNORE, 7, 8, 9, IGNORE]
    assert not e.mdm.any() and e.position_ids.tolist() == list(range(6))


def test_a_few_training_steps_move_the_stop_probabilities():
    probe = probe_module()
    model, tokenizer = load(FIXTURE, dtype="float32", join_projections=False)
    cases = probe.probe_cases(2)
    before = probe.stop_probabilities(model, tokenizer, cases)
    assert 0.0 <= before["other"] <= 1.0 and 0.0 <= before["end"] <= 1.0
    args = SimpleNamespace(seed=0, learning_rate=1e-3, steps=2, batch_size=2, probe_every=1, train="refusion")
    rows = probe.train_and_probe(model, tokenizer, args, cases)
    assert [r["step"] for r in rows] == [1, 2]
    assert not np.isclose(rows[-1]["next"]["end"], before["end"])  # the weights were updated
    batch = probe.counting_batch(tokenizer, random.Random(0), np.random.default_rng(0), 3, "ar", 805)
    assert batch["input_ids"].shape[0] == 3 and not bool(batch["mdm"].any())


def test_the_probe_trains_with_the_ar_weight_it_is_given(monkeypatch):
    """--ar-weight reaches the loss (1/batch size is the loss before the fix)."""
    probe = probe_module()
    model, tokenizer = load(FIXTURE, dtype="float32", join_projections=False)
    seen = []
    real = probe.loss_from_logits
    monkeypatch.setattr(probe, "loss_from_logits", lambda *a, **k: seen.append(k.get("ar_weight")) or real(*a, **k))
    monkeypatch.setattr(probe, "probe", lambda *a: {"next": {"end": 0, "other": 0, "end_over_half": 0},
                                                    "mask": {"end": 0, "other": 0, "end_over_half": 0}})
    args = SimpleNamespace(seed=0, learning_rate=1e-3, steps=1, batch_size=2, probe_every=1, train="refusion",
                           ar_weight=0.5)
    probe.train_and_probe(model, tokenizer, args, probe.probe_cases(1))
    assert seen == [0.5]


def test_decoded_counts_are_scored_by_their_last_number(monkeypatch):
    probe = probe_module()
    _, tokenizer = load(FIXTURE, join_projections=False)
    texts = iter(["3, 4, 5, 6.", "10 11 12 13 14", "no numbers"])
    monkeypatch.setattr(probe, "batch_generate",
                        lambda model, tok, prompts: [SimpleNamespace(text=next(texts)) for _ in prompts])
    offsets = probe.last_number_offsets(None, tokenizer, [(3, 6, " "), (10, 12, " "), (1, 4, " ")])
    assert offsets == [0, 2, None]


def test_counts_are_asked_again_after_earlier_turns(monkeypatch, tmp_path):
    probe = probe_module()
    _, tokenizer = load(FIXTURE, join_projections=False)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in [("Spell the word sun.", "s-u-n"), ("Count from 1 to 3.", "1, 2, 3."),
                         ("Who is Sven?", "Sven lives in Oslo.")]]
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    contexts = probe.earlier_turns(tmp_path / "valid.jsonl", 2)
    assert all(len(c) == 4 and "Count" not in str(c) for c in contexts)  # two turns, no count among them
    seen = []
    monkeypatch.setattr(probe, "batch_generate",
                        lambda model, tok, prompts: seen.extend(prompts) or [SimpleNamespace(text="3 4 5.")] * 2)
    assert probe.last_number_offsets(None, tokenizer, [(3, 5, " "), (3, 6, " ")], contexts) == [0, -1]
    text = tokenizer.decode(seen[0])
    assert text.index("Spell the word sun.") < text.index("Count from 3 to 5.")
    assert "Sven lives in Oslo." in text


def test_the_probe_cli_refuses_a_bad_context(capsys, tmp_path):
    probe = probe_module()
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--context", str(tmp_path / "none.jsonl")])
    assert exit_.value.code == 2 and "--context needs --decode" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user"}, 3]}\n')
    for name in ("none.jsonl", "bad.jsonl"):
        assert probe.main(["--cases", "1", "--decode", "1", "--context", str(tmp_path / name)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --context") and err.count("\n") == 1, err


def test_the_probe_cli_rejects_bad_counts(capsys):
    probe = probe_module()
    for flag in (["--decode", "-1"], ["--steps", "0"], ["--slot-sizes", "4,0"], ["--slot-sizes", "x"],
                 ["--ar-weight", "0"]):
        with pytest.raises(SystemExit) as exit_:
            probe.main(flag)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and ("must be" in err or "positive integers" in err), err


def test_mask_probe_reads_a_mask_right_after_each_number():
    """The mask probe equals, number by number, one plain pass of the answer so
    far plus a mask, read at that mask (how decoding drafts the next token)."""
    import mlx.core as mx

    probe = probe_module()
    model, tokenizer = load(FIXTURE, dtype="float32", join_projections=False)
    dot, mask_id = tokenizer.encode(".", add_special_tokens=False)[0], model.args.mask_token_id
    case = (5, 9, ", ")
    ids, ends, others = probe.count_case(tokenizer, *case)
    expected = []
    for i in others + ends:
        row = ids[:i + 1] + [mask_id]
        logits = model(mx.array([row]), mx.array([list(range(len(row)))]))[0, -1]
        expected.append(mx.softmax(logits, axis=-1)[dot].item())
    got = probe.mask_stop_probabilities(model, tokenizer, [case])
    assert np.isclose(got["end"], expected[-1], atol=1e-5)
    assert np.isclose(got["other"], np.mean(expected[:-1]), atol=1e-5)
    assert got["other"] != probe.stop_probabilities(model, tokenizer, [case])["other"]


def test_slot_sizes_reach_the_hybrid_examples():
    probe = probe_module()
    _, tokenizer = load(FIXTURE, join_projections=False)
    batch = probe.counting_batch(tokenizer, random.Random(0), np.random.default_rng(0), 4, "refusion", 805, (1,))
    ar = (np.array(batch["labels"]) != -100) & ~np.array(batch["mdm"])
    assert not ar.any()  # slots of one token have no next token of their own slot to predict
    assert probe.parse_sizes("8,4") == (8, 4)


def test_saved_weights_load_as_a_full_fine_tune(tmp_path):
    probe = probe_module()
    model, tokenizer = load(FIXTURE, dtype="float32", join_projections=False)
    args = SimpleNamespace(seed=0, learning_rate=1e-3, steps=1, batch_size=2, probe_every=1, train="ar",
                           model=str(FIXTURE))
    cases = probe.probe_cases(2)
    trained = probe.train_and_probe(model, tokenizer, args, cases)[-1]
    probe.save_full(model, tmp_path / "ad", args)
    reloaded, _ = load(FIXTURE, dtype="float32", join_projections=False, adapter_path=tmp_path / "ad")
    again = probe.stop_probabilities(reloaded, tokenizer, cases)
    assert np.isclose(again["end"], trained["next"]["end"], atol=1e-5)
    assert np.isclose(again["other"], trained["next"]["other"], atol=1e-5)
