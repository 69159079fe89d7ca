"""Scoring a prompt on ``/v1/completions``: ``echo`` with ``logprobs``.

What lm-evaluation-harness's ``local-completions`` sends for its
``loglikelihood`` requests (``"echo": true, "logprobs": 1, "max_tokens":
1``, the prompt being context + continuation): the prompt's own tokens come
back with their log-probabilities in OpenAI's legacy ``logprobs`` object
(``tokens``, ``token_logprobs`` -- the first null --, ``top_logprobs``,
``text_offset``), followed by ``max_tokens`` (0 or 1) drafted tokens.
:func:`scoring_of` reads a body's :class:`~..core.loglikelihood.Scoring`; the
engine scores it (:mod:`..core.loglikelihood`); :func:`legacy_logprobs` writes it.
"""

from __future__ import annotations

from typing import List, Optional

from ...decode.penalties import active
from ..core.loglikelihood import MAX_SCORE_WORK, MC_NUM, Scoring
from ..core.outcome import ScoredPrompt
from ..core.refusal import Reason, Refusal
from .openai_logprobs import legacy_top


def context_tokens(body, index: int) -> Optional[int]:
    """The request's ``context_tokens`` for its prompt ``index`` (one for all, or one per prompt)."""
    given = body.context_tokens
    if isinstance(given, list):
        if len(given) != len(body.prompt):
            raise Refusal(Reason.INVALID_VALUE, f"context_tokens: {len(given)} values for {len(body.prompt)} "
                                                "prompts", "context_tokens")
        return given[index]
    return given


def scoring_of(body, ids: List[int], context_tokens: Optional[int], index: int = 0) -> Optional[Scoring]:
    """The request's Scoring (None: a plain generation), checked against its prompt ``ids`` (``index``: its
    place in the request's list of prompts)."""
    echo, estimator = bool(body.echo), body.logprob_estimator
    for name in ("logprob_estimator", "mc_num", "context_tokens"):
        if getattr(body, name) is not None and not echo:
            raise Refusal(Reason.UNSUPPORTED, f"{name}: only with echo (scoring the prompt)", name)
    if not echo:  # a generation (its logprobs: the generated tokens')
        if body.max_tokens == 0:
            raise Refusal(Reason.INVALID_VALUE, "max_tokens: 0 only with echo", "max_tokens")
        return None
    extra = body.max_tokens or 0  # echo without max_tokens: the prompt alone
    if extra > 1:
        raise Refusal(Reason.UNSUPPORTED, "echo: supported with max_tokens 0 or 1 (scoring the prompt)", "echo")
    changed = active(body)  # the settings that change the logits (not an empty bias, a 0, a repetition 1)
    if changed:
        raise Refusal(Reason.UNSUPPORTED, f"{changed[0]}: not with echo (the prompt is scored under the model's "
                                          "own logits)", changed[0])
    estimator = estimator or "ar"
    if estimator == "mc":
        if context_tokens is None:
            raise Refusal(Reason.INVALID_VALUE, 'context_tokens: logprob_estimator "mc" scores the continuation '
                                                "after the prompt's first context_tokens tokens; give it",
                          "context_tokens")
        if not 0 < context_tokens < len(ids):
            raise Refusal(Reason.INVALID_VALUE, context_refusal(body, ids, context_tokens, index), "context_tokens")
    elif body.mc_num is not None or context_tokens is not None:
        name = "mc_num" if body.mc_num is not None else "context_tokens"
        raise Refusal(Reason.UNSUPPORTED, f'{name}: only with logprob_estimator "mc"', name)
    spec = Scoring(estimator, body.logprobs or 0, extra, body.mc_num or MC_NUM, context_tokens,
                   body.seed if body.seed is not None else 0, body.logprobs is not None)
    check_work([spec.work(len(ids))], "mc_num" if estimator == "mc" else "prompt")
    return spec


def context_refusal(body, ids: List[int], given: int, index: int) -> str:
    """Why ``given`` cannot split prompt ``index`` (``ids``) into a context and a continuation to score."""
    where = f"prompt {index} (of {len(body.prompt)})" if len(body.prompt) > 1 else "the prompt"
    meaning = "how many of its first tokens are the context; the tokens after them are scored"
    if len(ids) < 2:
        return (f"context_tokens: {where} has 1 token; \"mc\" needs 2 at least, a context and a token to score "
                f"(context_tokens: {meaning})")
    return (f"context_tokens: {where} has {len(ids)} tokens, so context_tokens ({meaning}) must be 1 to "
            f"{len(ids) - 1}; got {given}")


def check_work(work, param: str) -> None:
    """A 400 when scoring would take more than :data:`MAX_SCORE_WORK` token-forwards
    (``Scoring.work``, summed over a request's prompts)."""
    if sum(work) > MAX_SCORE_WORK:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: scoring this request takes {sum(work)} token-forwards (the "
                                            "prompt's tokens; with mc, the context once and the scored tokens x "
                                            f"mc_num; summed over its prompts); the most is {MAX_SCORE_WORK}",
                      param)


def legacy_logprobs(scored: ScoredPrompt) -> Optional[dict]:
    """OpenAI's legacy ``logprobs`` of a scored prompt (None when not asked)."""
    if not scored.shown:
        return None
    offsets, at = [], 0
    for n in scored.chars if scored.chars is not None else [len(p) for p in scored.pieces]:
        offsets.append(at)
        at += n
    # null where the token has no score (the first; mc: the context); mc has no alternatives: the token itself
    tops = [None if pairs is None else legacy_top(pairs, piece, value)
            for piece, value, pairs in zip(scored.pieces, scored.values, scored.top)]
    return {"tokens": list(scored.pieces), "token_logprobs": list(scored.values), "top_logprobs": tops,
            "text_offset": offsets}
