"""The generated tokens' log-probabilities (decode/token_scores.py): the
probability the decoder accepted each token under -- the plan's for a
slot's first token, the verification's for the others -- carried beside
the decisions without changing them."""

from __future__ import annotations

import numpy as np
import pytest

from refusion_mlx.decode.batch import BatchGenerator
from refusion_mlx.decode.params import make_params
from refusion_mlx.decode.scoring import score_ar
from refusion_mlx.decode.stream import chat_prompt

PROMPTS = ["Who is Sven?", "Count from 17 to 38.", "Sort these numbers: 67, 4, 77, 15, 70",
           "Reverse the words: sugar forest orange"]


def run(model, tok, requests):
    """Decode (prompt, params, logprobs) requests in one batch: each one's ids and scores."""
    gen = BatchGenerator(model, tok)
    uids = [gen.insert(chat_prompt(tok, p), params, logprobs=k) for p, params, k in requests]
    out = {u: ([], []) for u in uids}
    while gen.has_work:
        for r in gen.step():
            out[r.uid][0].extend(r.tokens)
            if r.logprobs is not None:
                out[r.uid][1].extend(r.logprobs)
    return [out[u] for u in uids]


@pytest.mark.parametrize("settings", [{}, {"slot_size": 8, "block_length": 32, "token_threshold": 0.9}])
def test_scores_change_no_decision_alone_or_batched(demo, settings):
    model, tok = demo
    params = make_params(max_tokens=48, **settings)
    plain = run(model, tok, [(p, params, None) for p in PROMPTS])
    mixed = run(model, tok, [(p, params, 3 if i % 2 == 0 else None) for i, p in enumerate(PROMPTS)])
    alone = run(model, tok, [(PROMPTS[0], params, 0)])
    assert [ids for ids, _ in mixed] == [ids for ids, _ in plain] and alone[0][0] == plain[0][0]
    for i, (ids, scores) in enumerate(mixed):
        if i % 2:
            assert scores == []
            continue
        assert len(scores) == len(ids)
        for t, (lp, top) in zip(ids, scores):
            assert lp <= 0 and len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert dict(top).get(t, lp) == pytest.approx(lp, abs=1e-4)  # the row that scored it ranks it so
    assert [lp for lp, _ in alone[0][1]] == pytest.approx([lp for lp, _ in mixed[0][1]], abs=1e-5)
    assert alone[0][1][0][1] == []  # logprobs=0: no top tokens


def test_first_token_is_the_plans_and_the_rest_the_verifications(demo):
    """One slot accepted whole at verification: token 0 under its mask's
    probability (the drafted token of the AR scorer, a mask after the
    prompt), tokens 1.. under the causal reading of prompt + slot."""
    model, tok = demo
    prompt = chat_prompt(tok, "Who is Sven?")
    ((ids, scores),) = run(model, tok, [("Who is Sven?", make_params(max_tokens=4), 1)])
    assert len(ids) == 4
    drafted = score_ar(model, [prompt], top=1, next_mask=model.args.mask_token_id)[0]
    assert drafted.next_token == ids[0] and scores[0][0] == pytest.approx(drafted.next_logprob, abs=1e-4)
    read = score_ar(model, [prompt + ids])[0].logprobs[len(prompt) + 1:]
    np.testing.assert_allclose([lp for lp, _ in scores[1:]], read, atol=1e-4)


def test_logprobs_with_a_constraint_are_refused_as_the_server_refuses_them(demo):
    """The constrained mode keeps no slots' scores: the library refuses the pair (it once answered with a
    None for every token), in the server's words."""
    from refusion_mlx.decode.grammar import Constraint
    from refusion_mlx.decode.stream import stream_generate
    from refusion_mlx.errors import DecodeError

    model, tok = demo
    prompt = chat_prompt(tok, "Give Sven's facts as JSON.")
    with pytest.raises(DecodeError, match="^logprobs: not supported with an answer constrained by json_schema$"):
        next(stream_generate(model, tok, prompt, max_tokens=16, logprobs=3, json_schema={"type": "object"}))
    gen = BatchGenerator(model, tok)
    with pytest.raises(DecodeError, match="logprobs: not supported with an answer constrained by grammar"):
        gen.insert(prompt, make_params(max_tokens=16), constraint=Constraint.lark('start: "a"'), logprobs=0)
    assert not gen.has_work
