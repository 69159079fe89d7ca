"""Log-likelihoods of given text (decode/scoring.py): the AR estimator against
a direct computation, the Monte Carlo estimator's masks and determinism, and
the demo's own multiple-choice questions ranked by both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.scoring import mc_masks, score_ar, score_mc
from refusion_mlx.decode.stream import chat_prompt, generate

TASK = Path(__file__).resolve().parents[1] / "examples" / "lm_eval_recipe" / "demo_facts.jsonl"


def direct_logprobs(model, ids):
    """Token i under log_softmax of the plain causal pass's logits at i - 1."""
    logits = model(mx.array([ids]), mx.arange(len(ids))).astype(mx.float32)[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])


def test_ar_estimator_is_the_causal_pass_read_one_token_ahead(demo):
    model, tok = demo
    long = chat_prompt(tok, "Where does Jonas live?") + tok.encode("Jonas lives in Oslo.")
    short = long[:-4]
    both = score_ar(model, [long, short], top=3, next_mask=model.args.mask_token_id)
    for ids, scored in zip((long, short), both):
        assert scored.logprobs[0] is None and len(scored.logprobs) == len(ids)
        np.testing.assert_allclose(scored.logprobs[1:], direct_logprobs(model, ids), atol=2e-4)
        for value, top in zip(scored.logprobs[1:], scored.top[1:]):  # the best first, the token's own among them
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True) and value <= top[0][1] + 1e-6
    assert score_ar(model, [long[:1]])[0].logprobs == [None]  # one token: nothing to score
    alone = score_ar(model, [short])[0]  # a row's numbers do not depend on the rows beside it
    assert alone.logprobs == both[1].logprobs
    # the token drafted after the prompt is the decoder's first greedy token
    prompt = chat_prompt(tok, "Who is Sven?")
    drafted = score_ar(model, [prompt], top=1, next_mask=model.args.mask_token_id)[0]
    first = tok.encode(generate(model, tok, prompt, max_tokens=1))
    assert drafted.next_token == first[0] and drafted.next_logprob < 0


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_ar_estimator_in_chunks_is_the_whole_pass(demo, set_paths, paths):
    """Fed in chunks of 6 tokens through its cache (the server's pieces),
    the AR estimator scores every token and drafts the next as one pass does."""
    from refusion_mlx.decode.scoring import ARScorer

    set_paths(paths)
    model, tok = demo
    ids = chat_prompt(tok, "Where does Jonas live?") + tok.encode("Jonas lives in Oslo.")
    scorer = ARScorer(model, ids, top=2, next_mask=model.args.mask_token_id, chunk=6)
    steps = 0
    while not scorer.finished:
        scorer.step()
        steps += 1
    assert steps == -(-(len(ids) + 1) // 6)
    chunked = scorer.result()
    whole = score_ar(model, [ids], top=2, next_mask=model.args.mask_token_id)[0]
    np.testing.assert_allclose(chunked.logprobs[1:], whole.logprobs[1:], atol=1e-5)
    np.testing.assert_allclose(chunked.logprobs[1:], direct_logprobs(model, ids), atol=2e-4)
    assert [[t for t, _ in top] for top in chunked.top] == [[t for t, _ in top] for top in whole.top]
    assert chunked.next_token == whole.next_token and chunked.next_logprob == pytest.approx(whole.next_logprob, abs=1e-5)


def test_mc_masks_are_stratified_and_seeded():
    masks = mc_masks(7, 32, np.random.default_rng(0))
    counts = masks.sum(axis=1)
    assert counts.min() >= 1 and counts.max() <= 7 and len(set(counts)) == 7  # every ratio drawn
    assert (mc_masks(7, 32, np.random.default_rng(0)) == masks).all()
    assert (mc_masks(7, 32, np.random.default_rng(1)) != masks).any()


def test_mc_estimator_sums_its_shares_and_is_deterministic(demo):
    model, tok = demo
    context = chat_prompt(tok, "Where does Jonas live?") + tok.encode("Jonas lives in")
    ids = context + tok.encode(" Oslo.")
    a = score_mc(model, ids, len(context), model.args.mask_token_id, mc_num=16, seed=3)
    b = score_mc(model, ids, len(context), model.args.mask_token_id, mc_num=16, seed=3)
    assert a.logprobs[:len(context)] == [None] * len(context)
    assert a.logprobs == b.logprobs and all(v <= 0 for v in a.logprobs[len(context):])
    with pytest.raises(ValueError):
        score_mc(model, ids, len(ids), model.args.mask_token_id)
    # the token drafted after the prompt (max_tokens 1) is the AR scorer's, in the same evaluation
    drafted = score_mc(model, ids, len(context), model.args.mask_token_id, mc_num=4, draft_top=2)
    ar = score_ar(model, [ids], top=2, next_mask=model.args.mask_token_id)[0]
    assert drafted.next_token == ar.next_token and [t for t, _ in drafted.next_top] == [t for t, _ in ar.next_top]
    assert [v for _, v in drafted.next_top] == pytest.approx([v for _, v in ar.next_top], abs=1e-4)


def direct_mc(model, ids, context, mask_id, mc_num, seed):
    """The Monte Carlo estimate as the authors' eval.py computes it: every
    sample a whole causal forward of the context, the continuation's
    unmasked tokens and its masked ones (REFUSION.md §8), no cache."""
    n, target = len(ids), len(ids) - context
    total = np.zeros(target)
    for m in mc_masks(target, mc_num, np.random.default_rng(seed)):
        order = np.concatenate([np.arange(context), context + np.flatnonzero(~m), context + np.flatnonzero(m)])
        masked = np.arange(n) >= n - m.sum()
        tokens = np.where(masked, mask_id, np.array(ids)[order])
        logits = model(mx.array(tokens[None].astype(np.int32)), mx.array(order[None].astype(np.int32))).astype(mx.float32)[0]
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for row in np.flatnonzero(masked):
            total[order[row] - context] += lp[row, ids[order[row]]] / (m.sum() / target)
    return total / mc_num


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_mc_estimator_feeds_the_context_once_and_is_the_whole_forward_estimate(demo, set_paths, paths):
    """The context goes into a cache once (in chunks: 7 tokens here), each
    step's samples are the slots of one infill pass over it: the same
    estimate as a whole forward per sample, token by token."""
    from refusion_mlx.decode.scoring import MCScorer

    set_paths(paths)
    model, tok = demo
    context = chat_prompt(tok, "Where does Jonas live?") + tok.encode("Jonas lives in")
    ids = context + tok.encode(" Oslo, in the north.")
    scorer = MCScorer(model, ids, len(context), model.args.mask_token_id, mc_num=12, seed=5, chunk=7)
    steps = 0
    while not scorer.fed:
        scorer.step(5)
        steps += 1
    assert steps == -(-len(context) // 7) and scorer.done == 0 and len(scorer.cache) == len(context)
    while not scorer.finished:
        scorer.step(5)  # 5, 5, then 2 samples
        steps += 1
    assert steps == -(-len(context) // 7) + 3
    got = scorer.result().logprobs[len(context):]
    want = direct_mc(model, ids, len(context), model.args.mask_token_id, 12, 5)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def demo_questions():
    return [json.loads(line) for line in TASK.read_text().splitlines()]


def test_the_demo_ranks_the_right_answer_of_its_own_questions_first(demo):
    """The local multiple-choice task (the lm-eval recipe's): facts about the
    demo's fictional people, four choices each. Both estimators, as lm-eval
    scores a choice: the continuation's tokens after the context's."""
    model, tok = demo
    rows = demo_questions()[::6]  # 9 of the 51: the test stays fast
    right = {"ar": 0, "mc": 0}
    for r in rows:
        context = chat_prompt(tok, r["question"]) + tok.encode(r["stem"])
        seqs = [context + tok.encode(r["stem"] + c)[len(tok.encode(r["stem"])):] for c in r["choices"]]
        ar = [sum(s.logprobs[len(context):]) for s in score_ar(model, seqs)]
        mc = [sum(score_mc(model, s, len(context), model.args.mask_token_id, 16).logprobs[len(context):])
              for s in seqs]
        right["ar"] += int(np.argmax(ar)) == r["answer"]
        right["mc"] += int(np.argmax(mc)) == r["answer"]
    assert right["ar"] >= 0.8 * len(rows) and right["mc"] >= 0.8 * len(rows), right  # chance: a quarter


def test_the_lm_eval_recipe_runs_lm_eval_as_this_pythons_module(tmp_path, monkeypatch):
    """lm_eval installed in this Python but its script not on PATH (a venv not activated, pip --user):
    the recipe runs ``python -m lm_eval``, where it said "lm_eval is not installed"."""
    import importlib.util
    import subprocess

    fake = tmp_path / "site" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no lm_eval script anywhere on it
    spec = importlib.util.spec_from_file_location("lm_eval_recipe_run", TASK.parent / "run.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    class Server:
        def terminate(self):
            pass

        def wait(self, timeout):
            pass

    calls = []
    monkeypatch.setattr(recipe, "start_server", lambda model, port, preset=None: Server())
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(sys, "argv", ["run.py", "--tasks", "demo_facts", "--output", str(tmp_path / "out")])
    assert recipe.main() == 0
    assert [cmd[:3] for cmd in calls] == [[sys.executable, "-m", "lm_eval"]]


def test_every_scoring_pass_fits_the_blas_threads_to_its_rows(demo, monkeypatch, set_paths):
    """A scoring pass runs outside the decoder's steps (``Runner.hidden`` makes its own row groups): it fits
    the BLAS's threads to its rows as a decode step does, a wide chunk split in two row groups on two
    streams (one thread each), a narrow one alone; nothing on the GPU paths."""
    from refusion_mlx import _blas
    from refusion_mlx.decode import runner
    from refusion_mlx.decode.scoring import ARScorer

    model, tok = demo
    fitted = []
    monkeypatch.setattr(_blas, "fit_rows", lambda rows, split=False: fitted.append((rows, split)))
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runner._blas, "small_model", lambda: True)
    ids = (chat_prompt(tok, "Where does Jonas live?") + tok.encode("Jonas lives in Oslo.")) * 3
    assert len(ids) > runner.SPLIT_ROWS + 8
    for paths in ("cpu", "gpu"):
        set_paths(paths)
        fitted.clear()
        scorer = ARScorer(model, ids, chunk=runner.SPLIT_ROWS + 8)
        while not scorer.finished:
            scorer.step()
        tail = len(ids) - runner.SPLIT_ROWS - 8
        assert fitted == ([(runner.SPLIT_ROWS + 8, True), (tail, tail >= runner.SPLIT_ROWS)] if paths == "cpu" else [])
