"""Drafting examples (``--draft-fraction``): every response token drafted from
the written tokens before it, as decoding drafts it."""

import json

import numpy as np
import pytest

import mlx.core as mx

from refusion_mlx.train import IGNORE, build_example, collate, refusion_loss
from refusion_mlx.train.batches import Record, iterate_batches
from refusion_mlx.errors import RefusionError
from refusion_mlx.train.examples import build_draft_example
from tests.helpers import random_config, random_model

MASK = 805


@pytest.fixture(scope="module")
def tiny():
    return random_model(random_config(), seed=4, scale=0.5)


def test_rows_labels_and_visibility():
    e = build_draft_example([1, 2, 3], [7, 8, 9], MASK)
    assert e.input_ids.tolist() == [1, 2, 3, 7, 8, 9, MASK, MASK, MASK]
    assert e.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    # response tokens predict the next one (not the prompt's last: as the hybrid AR task); masks their own
    assert e.labels.tolist() == [IGNORE, IGNORE, IGNORE, 8, 9, IGNORE, 7, 8, 9]
    assert e.mdm.tolist() == [False] * 6 + [True] * 3
    # mask k sees the prompt and the response before k (3 + k tokens), then itself
    assert e.visible.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert (e.mask_prob, e.response_length) == (1.0, 3)


def test_each_mask_sees_what_decoding_shows_it(tiny):
    """Mask k's logits equal a plain causal pass of prompt + response[:k] + one mask."""
    prompt, response = [11, 12, 13, 14], [21, 22, 23, 24, 25]
    e = build_draft_example(prompt, response, MASK)
    out = tiny(mx.array(e.input_ids[None]), mx.array(e.position_ids[None]), visible=mx.array(e.visible[None]))[0]
    for k in range(len(response)):
        row = prompt + response[:k] + [MASK]
        ref = tiny(mx.array([row]), mx.array([list(range(len(row)))]))[0, -1]
        np.testing.assert_allclose(np.array(out[len(prompt) + len(response) + k]), np.array(ref), atol=1e-4)
    # without the visibility, masks would see later tokens: different logits
    causal = tiny(mx.array(e.input_ids[None]), mx.array(e.position_ids[None]))[0]
    assert not np.allclose(np.array(causal[-1]), np.array(out[-1]), atol=1e-3)


def test_causal_visibility_is_the_plain_pass(tiny):
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(0, 800, (2, 9)).astype(np.int32))
    pos = mx.array(np.tile(np.arange(9, dtype=np.int32), (2, 1)))
    causal = mx.array(np.tile(np.arange(9, dtype=np.int32), (2, 1)))
    np.testing.assert_allclose(np.array(tiny(ids, pos, visible=causal)), np.array(tiny(ids, pos)), atol=1e-5)


@pytest.mark.parametrize("ar_weight", [1.0, 2.0])
def test_loss_of_a_mixed_batch(tiny, ar_weight):
    """A drafting row enters the loss with p = 1: the mean CE of its masks; its
    response tokens join the batch's AR mean (times ``ar_weight``). Checked
    against a row-by-row sum."""
    rng = np.random.default_rng(1)
    draft = build_draft_example([1, 2, 3], [7, 8, 9, 10], MASK)
    hybrid = build_example([4, 5], [30, 31, 32, 33, 34, 35], MASK, rng, (2,))
    batch = collate([draft, hybrid], pad_to=4)
    assert batch["visible"].shape == batch["input_ids"].shape
    assert batch["visible"][1].tolist() == list(range(batch["input_ids"].shape[1]))  # the hybrid row: causal
    loss = refusion_loss(tiny, batch, ar_weight=ar_weight).item()

    def ce(row, visible):
        ids, pos = mx.array(row.input_ids[None]), mx.array(row.position_ids[None])
        logits = tiny(ids, pos, visible=mx.array(row.visible[None])) if visible else tiny(ids, pos)
        x = logits[0].astype(mx.float32)
        logp = np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))
        return np.array([-logp[i, l] if l != IGNORE else 0.0 for i, l in enumerate(row.labels)])

    ces = [ce(draft, True), ce(hybrid, False)]
    ar = np.concatenate([c[(r.labels != IGNORE) & ~r.mdm] for c, r in zip(ces, (draft, hybrid))])
    mdm = sum(c[r.mdm].sum() / (r.mask_prob * r.response_length) for c, r in zip(ces, (draft, hybrid)))
    expected = ar_weight * (ar.mean() if ar.size else 0.0) + mdm / 2
    assert loss == pytest.approx(expected, rel=1e-4)


def test_iterate_batches_mixes_drafts_in():
    records = [Record([1, 2], list(range(10, 10 + n))) for n in (3, 4, 5, 6, 7, 8, 9, 10)]
    plain = list(iterate_batches(records, 4, MASK, np.random.default_rng(0), 64))
    again = list(iterate_batches(records, 4, MASK, np.random.default_rng(0), 64, draft_fraction=0.0))
    for a, b in zip(plain, again):  # fraction 0 draws nothing more: the paper-objective batches exactly
        assert "visible" not in a and all(np.array_equal(a[k], b[k]) for k in a)
    drafts = list(iterate_batches(records, 4, MASK, np.random.default_rng(0), 64, draft_fraction=1.0))
    assert all(b["mdm"].sum(1).tolist() == [int(r) for r in b["response_length"]] for b in drafts)
    # a record whose doubled response does not fit max_seq_length stays a hybrid example
    short = list(iterate_batches(records, 4, MASK, np.random.default_rng(0), 16, draft_fraction=1.0))
    lengths = [(b["labels"] != IGNORE).sum(1) for b in short]
    assert any("visible" in b for b in short)
    assert all(b["input_ids"].shape[1] <= 32 for b in short) and lengths


def test_draft_fraction_option(tmp_path, capsys):
    from refusion_mlx.train.__main__ import main as train_main
    from pathlib import Path

    data = Path(__file__).parent / "fixtures" / "train-data"
    folder = tmp_path / "a"
    code = train_main(["--data", str(data), "--adapter-path", str(folder), "--iters", "3", "--batch-size", "4",
                       "--num-layers", "1", "--val-batches", "1", "--draft-fraction", "0.5", "--steps-per-report", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "Iter 3: Train loss" in out
    loss = float(out.split("Iter 3: Train loss")[1].split(",")[0])
    assert np.isfinite(loss) and loss > 0
    assert json.loads((folder / "adapter_config.json").read_text())["objective"]["draft_fraction"] == 0.5
    for bad in ("1.5", "-0.1"):
        with pytest.raises(SystemExit) as exit_:
            train_main(["--data", str(data), "--draft-fraction", bad])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "--draft-fraction must be between 0 and 1" in err and len(err.strip().splitlines()) == 1


def test_ar_weight_option(tmp_path, capsys):
    """--ar-weight reaches the loss: the same seed's first training loss moves
    by (w - 1) * AR mean / B, and is recorded; zero or less exits 2."""
    from refusion_mlx.train.__main__ import main as train_main
    from pathlib import Path

    data = Path(__file__).parent / "fixtures" / "train-data"
    losses = {}
    for w in ("1", "5"):
        folder = tmp_path / w
        code = train_main(["--data", str(data), "--adapter-path", str(folder), "--iters", "1", "--batch-size", "4",
                           "--num-layers", "1", "--val-batches", "1", "--steps-per-report", "1",
                           "--steps-per-eval", "100", "--ar-weight", w])
        out = capsys.readouterr().out
        assert code == 0
        losses[w] = float(out.split("Iter 1: Train loss")[1].split(",")[0])
        assert json.loads((folder / "adapter_config.json").read_text())["objective"]["ar_weight"] == float(w)
    assert losses["5"] > losses["1"] + 0.1  # four more AR means (each ~ln V / 4 at the start)
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_:
            train_main(["--data", str(data), "--ar-weight", bad])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "--ar-weight must be positive" in err and len(err.strip().splitlines()) == 1


def test_runs_of_masks_and_what_they_see():
    """--draft-run R: masks in runs of R (the first run shorter by a draw);
    a mask sees the response before its run and its run's masks up to itself."""
    from refusion_mlx.train.examples import run_starts

    seen = set()
    for seed in range(12):
        starts = run_starts(10, 4, np.random.default_rng(seed))
        first = int(np.argmax(starts > 0)) if (starts > 0).any() else 10
        assert 1 <= first <= 4 and starts[:first].tolist() == [0] * first
        rest = starts[first:].tolist()
        assert rest == [first + (k // 4) * 4 for k in range(len(rest))]  # full runs of 4 after the first
        seen.add(first)
    assert len(seen) > 1  # the boundaries move between examples
    assert run_starts(5, 1, None).tolist() == [0, 1, 2, 3, 4]
    huge = run_starts(5, 3_000_000_000, np.random.default_rng(0))  # past int32 (a --max-seq-length that large)
    assert huge.dtype == np.int32 and huge.tolist() == [0] * 5  # one run, from the response's start
    e = build_draft_example([1, 2, 3], [7, 8, 9, 10, 11], MASK, run=3, rng=np.random.default_rng(0))
    starts = run_starts(5, 3, np.random.default_rng(0))
    assert e.input_ids.tolist() == [1, 2, 3, 7, 8, 9, 10, 11] + [MASK] * 5
    assert e.visible[8:].tolist() == (3 + starts).tolist()
    assert e.run_start[:8].tolist() == list(range(8)) and e.run_start[8:].tolist() == (8 + starts).tolist()
    with pytest.raises(RefusionError):
        build_draft_example([1], [7], MASK, run=0)
    with pytest.raises(RefusionError):
        build_draft_example([1], [7, 8], MASK, run=2)  # a draw needs a generator


def test_each_mask_of_a_run_sees_what_the_plan_shows_it(tiny):
    """Mask k of a run that starts at j: its logits equal a plain causal pass of
    prompt + response[:j] + (k - j + 1) masks, as the plan pass drafts a block."""
    from refusion_mlx.train.examples import run_starts

    prompt, response = [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]
    e = build_draft_example(prompt, response, MASK, run=3, rng=np.random.default_rng(2))
    starts = run_starts(len(response), 3, np.random.default_rng(2))
    batch = collate([e])
    out = tiny(mx.array(batch["input_ids"]), mx.array(batch["position_ids"]), visible=mx.array(batch["visible"]),
               run_start=mx.array(batch["run_start"]))[0]
    for k in range(len(response)):
        j = int(starts[k])
        row = prompt + response[:j] + [MASK] * (k - j + 1)
        ref = tiny(mx.array([row]), mx.array([list(range(len(row)))]))[0, -1]
        np.testing.assert_allclose(np.array(out[len(prompt) + len(response) + k]), np.array(ref), atol=1e-4)
    assert len(set(starts.tolist())) > 1 and (starts < np.arange(len(response))).any()  # real runs


def test_draft_run_option(tmp_path, capsys):
    from refusion_mlx.train.__main__ import main as train_main
    from pathlib import Path

    data = Path(__file__).parent / "fixtures" / "train-data"
    folder = tmp_path / "a"
    code = train_main(["--data", str(data), "--adapter-path", str(folder), "--iters", "2", "--batch-size", "4",
                       "--num-layers", "1", "--val-batches", "1", "--draft-fraction", "1", "--draft-run", "8",
                       "--steps-per-report", "2"])
    out = capsys.readouterr().out
    assert code == 0 and np.isfinite(float(out.split("Iter 2: Train loss")[1].split(",")[0]))
    assert json.loads((folder / "adapter_config.json").read_text())["objective"]["draft_run"] == 8
    with pytest.raises(SystemExit) as exit_:
        train_main(["--data", str(data), "--draft-run", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--draft-run must be at least 1" in err and len(err.strip().splitlines()) == 1
    for argv in (["--draft-run", "3000000000"], ["--draft-run", "65", "--max-seq-length", "64"]):
        with pytest.raises(SystemExit) as exit_:  # an int32 OverflowError mid-run
            train_main(["--data", str(data), "--adapter-path", str(tmp_path / "b"), "--iters", "1",
                        "--draft-fraction", "1", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
        assert "--draft-run must be at most --max-seq-length" in err


def test_loss_uses_the_runs(tiny):
    from refusion_mlx.train.objective import loss_from_logits

    e = build_draft_example([1, 2, 3], [7, 8, 9, 10, 11, 12], MASK, run=4, rng=np.random.default_rng(3))
    batch = {k: mx.array(v) for k, v in collate([e]).items()}
    logits = tiny(batch["input_ids"], batch["position_ids"], visible=batch["visible"], run_start=batch["run_start"])
    expected = loss_from_logits(logits, batch).item()
    assert refusion_loss(tiny, batch).item() == pytest.approx(expected, rel=1e-5)
    without = {k: v for k, v in batch.items() if k != "run_start"}  # each mask alone: another loss
    assert abs(refusion_loss(tiny, without).item() - expected) > 1e-4
