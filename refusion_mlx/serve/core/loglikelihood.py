"""Scoring prompts: the engine's side of log-likelihood requests.

A scoring request (OpenAI's ``echo`` with ``logprobs``, :mod:`..protocols.openai_echo`)
carries a :class:`Scoring` and runs no decoder: the engine hands every
scoring request it admits in a turn to :func:`score_jobs`, which scores them
with :mod:`refusion_mlx.decode.scoring` -- the AR estimator (``"ar"``, the
default) for all of them with one host synchronisation, the Monte Carlo
estimator (``"mc"``, ``mc_num`` samples, the continuation after
``context_tokens``) one request at a time -- and returns each one's
:class:`~.outcome.Outcome` (its :class:`~.outcome.ScoredPrompt`) or the
:class:`~.refusal.Refusal` it failed with. The engine ends them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from ...distributed.group import is_link_failure
from .outcome import Outcome, ScoredPrompt, Usage
from .refusal import Reason, Refusal

log = logging.getLogger("refusion_mlx.server")

MC_NUM = 128  # the authors' eval.py default


@dataclass(frozen=True)
class Scoring:
    """How a prompt is scored: the ``estimator`` ("ar" or "mc"), the ``top``
    alternatives per token, the drafted tokens after the prompt (``extra``:
    0 or 1), for "mc" the samples, the context's length (the continuation
    after it is scored) and the seed; ``logprobs``: whether the answer shows
    the tokens' scores (echo alone: only the text)."""

    estimator: str = "ar"
    top: int = 0
    extra: int = 1
    mc_num: int = MC_NUM
    context_tokens: Optional[int] = None
    seed: int = 0
    logprobs: bool = True


def scored_prompt(tokenizer, ids: List[int], scored, spec: Scoring) -> ScoredPrompt:
    """The prompt ``ids`` and the ``spec.extra`` drafted token after it, from a ``decode.scoring.Scored``."""
    extra, top = spec.extra, spec.top
    tokens = list(ids) + ([scored.next_token] if extra else [])
    values = list(scored.logprobs) + ([scored.next_logprob] if extra else [])
    tops = list(scored.top) if scored.top else [[] for _ in ids]
    if extra:
        tops.append(scored.next_top)
    pieces = [tokenizer.decode([t]) for t in tokens]
    alternatives = [None if value is None or top <= 0 else [(tokenizer.decode([t]), lp) for t, lp in pairs[:top]]
                    for value, pairs in zip(values, tops)]
    text = tokenizer.decode(list(ids)) + (pieces[-1] if extra else "")
    return ScoredPrompt(text, pieces, values, alternatives, spec.logprobs)


def score_jobs(model, tokenizer, jobs: list) -> List[Tuple[object, Union[Outcome, Refusal]]]:
    """Score the scoring ``jobs`` (on every rank): each job with its Outcome,
    or the Refusal it failed with (a bug or out of memory fails the jobs it
    touches; the server stays up)."""
    from ...decode.scoring import score_ar, score_mc

    mask_id = int(model.args.mask_token_id)
    ar = [j for j in jobs if j.request.scoring.estimator == "ar"]
    results, out = {}, []
    try:
        if ar:
            top = max(j.request.scoring.top for j in ar)
            for job, s in zip(ar, score_ar(model, [j.request.prompt_ids for j in ar], top, mask_id)):
                results[id(job)] = s
    except Exception as e:
        if is_link_failure(e):
            raise
        log.exception("scoring failed")
        out += [(job, Refusal(Reason.STEP_FAILED, f"scoring failed: {type(e).__name__}")) for job in ar]
        jobs = [j for j in jobs if j not in ar]
    for job in jobs:
        spec, ids = job.request.scoring, job.request.prompt_ids
        try:
            scored = results.get(id(job)) or score_mc(model, ids, spec.context_tokens, mask_id, spec.mc_num,
                                                     spec.seed, spec.top if spec.extra else None)
            prompt = scored_prompt(tokenizer, ids, scored, spec)
        except Exception as e:
            if is_link_failure(e):
                raise
            log.exception("scoring failed")
            out.append((job, Refusal(Reason.STEP_FAILED, f"scoring failed: {type(e).__name__}")))
            continue
        out.append((job, Outcome("length", Usage(len(ids), spec.extra), scored=prompt)))
    return out
