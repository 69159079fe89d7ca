"""Scoring a prompt: ``echo`` with ``logprobs`` on ``/v1/completions``.

What lm-evaluation-harness's ``local-completions`` sends for its
``loglikelihood`` requests (``"echo": true, "logprobs": 1, "max_tokens":
1``, the prompt being context + continuation): the prompt's own tokens come
back with their log-probabilities in OpenAI's legacy ``logprobs`` object
(``tokens``, ``token_logprobs`` -- the first null --, ``top_logprobs``,
``text_offset``), followed by ``max_tokens`` (0 or 1) drafted tokens.

A scoring request runs no decoder: the engine runs every scoring request
it admits in a turn (:func:`run_scoring`) with :mod:`refusion_mlx.decode.scoring`
-- the AR estimator (``logprob_estimator: "ar"``, the default) for all of
them with one host synchronisation, the Monte Carlo
estimator (``"mc"``, ``mc_num`` samples, the continuation after
``context_tokens``) one request at a time -- then answers each at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional

from ..distributed.group import is_link_failure
from .refusal import Reason, Refusal

log = logging.getLogger("refusion_mlx.server")

ESTIMATORS = ("ar", "mc")
MC_NUM = 128  # the authors' eval.py default
MAX_TOP = 20


@dataclass(frozen=True)
class Scoring:
    """How a prompt is scored: the ``estimator`` ("ar" or "mc"), the ``top``
    alternatives per token (``logprobs``), the drafted tokens after the
    prompt (``extra``: ``max_tokens`` 0 or 1), for "mc" the samples, the
    context's length (the continuation after it is scored) and the seed;
    ``logprobs``: whether the answer carries the logprobs object."""

    estimator: str = "ar"
    top: int = 0
    extra: int = 1
    mc_num: int = MC_NUM
    context_tokens: Optional[int] = None
    seed: int = 0
    logprobs: bool = True  # the logprobs object is wanted (echo alone: only the text)


def context_tokens(body, index: int) -> Optional[int]:
    """The request's ``context_tokens`` for its prompt ``index`` (one for all, or one per prompt)."""
    given = body.context_tokens
    if isinstance(given, list):
        if len(given) != len(body.prompt):
            raise Refusal(Reason.INVALID_VALUE, f"context_tokens: {len(given)} values for {len(body.prompt)} "
                                                "prompts", "context_tokens")
        return given[index]
    return given


def scoring_of(body, ids: List[int], context_tokens: Optional[int]) -> Optional[Scoring]:
    """The request's Scoring (None: a plain generation), checked against its prompt ``ids``."""
    echo, estimator = bool(body.echo), body.logprob_estimator
    for name in ("logprob_estimator", "mc_num", "context_tokens"):
        if getattr(body, name) is not None and not echo:
            raise Refusal(Reason.UNSUPPORTED, f"{name}: only with echo (scoring the prompt)", name)
    if not echo:  # a generation (its logprobs: the generated tokens', serve/logprobs.py)
        if body.max_tokens == 0:
            raise Refusal(Reason.INVALID_VALUE, "max_tokens: 0 only with echo", "max_tokens")
        return None
    extra = body.max_tokens or 0  # echo without max_tokens: the prompt alone
    if extra > 1:
        raise Refusal(Reason.UNSUPPORTED, "echo: supported with max_tokens 0 or 1 (scoring the prompt)", "echo")
    estimator = estimator or "ar"
    if estimator == "mc":
        if context_tokens is None:
            raise Refusal(Reason.INVALID_VALUE, 'context_tokens: logprob_estimator "mc" scores the continuation '
                                                "after the prompt's first context_tokens tokens; give it",
                          "context_tokens")
        if not 0 < context_tokens < len(ids):
            raise Refusal(Reason.INVALID_VALUE, f"context_tokens: must leave 1 to {len(ids) - 1} of the prompt's "
                                                f"{len(ids)} tokens to score, got {context_tokens}", "context_tokens")
    elif body.mc_num is not None or context_tokens is not None:
        name = "mc_num" if body.mc_num is not None else "context_tokens"
        raise Refusal(Reason.UNSUPPORTED, f'{name}: only with logprob_estimator "mc"', name)
    return Scoring(estimator, body.logprobs or 0, extra, body.mc_num or MC_NUM, context_tokens,
                   body.seed if body.seed is not None else 0, body.logprobs is not None)


def logprobs_object(tokenizer, ids: List[int], scored, top: int, extra: int) -> tuple:
    """(text, OpenAI's legacy ``logprobs``) of the prompt ``ids`` and the
    ``extra`` drafted token after it, from a ``decode.scoring.Scored``."""
    def piece(t: int) -> str:
        return tokenizer.decode([t])

    tokens = list(ids) + ([scored.next_token] if extra else [])
    values = list(scored.logprobs) + ([scored.next_logprob] if extra else [])
    tops = list(scored.top) if scored.top else [[] for _ in ids]
    if extra:
        tops.append(scored.next_top)
    pieces = [piece(t) for t in tokens]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    top_json = []
    for value, pairs in zip(values, tops):
        if value is None or top <= 0:
            top_json.append(None)
            continue
        entry = {}
        for t, lp in pairs[:top]:
            entry.setdefault(piece(t), lp)
        top_json.append(entry or {pieces[len(top_json)]: value})  # mc: no alternatives, the token itself
    text = tokenizer.decode(list(ids)) + (pieces[-1] if extra else "")
    return text, {"tokens": pieces, "token_logprobs": values, "top_logprobs": top_json, "text_offset": offsets}


def run_scoring(engine, admitted: list) -> list:
    """Score the scoring requests among the ``admitted`` jobs and answer each
    (on every rank; rank 0's jobs post their events; a failure fails the jobs
    it touches); returns the others, ``(index, job)``, for the decoder."""
    jobs = [j for j in admitted if j.request.scoring is not None]
    if jobs:
        _score(engine, jobs)
    return [(i, j) for i, j in enumerate(admitted) if j.request.scoring is None]


def _score(engine, jobs: list) -> None:
    from ..decode.scoring import score_ar, score_mc

    mask_id = int(engine.model.args.mask_token_id)
    ar = [j for j in jobs if j.request.scoring.estimator == "ar"]
    results = {}
    try:
        if ar:
            top = max(j.request.scoring.top for j in ar)
            for job, s in zip(ar, score_ar(engine.model, [j.request.prompt_ids for j in ar], top, mask_id)):
                results[id(job)] = s
    except Exception as e:  # a bug or out of memory: these requests fail, the server stays up
        if is_link_failure(e):
            raise
        log.exception("scoring failed")
        for job in ar:
            engine._close(job, "failed", Refusal(Reason.STEP_FAILED, f"scoring failed: {type(e).__name__}"))
        jobs = [j for j in jobs if j not in ar]
    for job in jobs:
        spec = job.request.scoring
        try:
            scored = results.get(id(job)) or score_mc(engine.model, job.request.prompt_ids, spec.context_tokens,
                                                     mask_id, spec.mc_num, spec.seed,
                                                     spec.top if spec.extra else None)
            text, logprobs = logprobs_object(engine.tokenizer, job.request.prompt_ids, scored, spec.top,
                                             spec.extra)
        except Exception as e:
            if is_link_failure(e):
                raise
            log.exception("scoring failed")
            engine._close(job, "failed", Refusal(Reason.STEP_FAILED, f"scoring failed: {type(e).__name__}"))
            continue
        job.post("start")
        job.shaper.completion_tokens = spec.extra
        outcome = job.outcome("length", None)
        outcome.update(text=text, logprobs=logprobs if spec.logprobs else None)
        engine._close(job, "completed")
        job.post("done", outcome)
