"""Scoring prompts: the engine's side of log-likelihood requests, scheduled
like decoding.

A scoring request (OpenAI's ``echo`` with ``logprobs``,
:mod:`..protocols.openai_echo`) carries a :class:`Scoring` and runs no
decoder. The engine admits it like any request -- a batch row, and its
memory (:func:`scoring_rows`: the rows its forwards hold) against
``--max-kv-bytes`` -- and gives it a :class:`ScoringTask`, which does a
bounded piece of work each turn beside the batch's decoding step: a chunk
of the AR estimator's causal pass over the prompt (``logprob_estimator:
"ar"``, the default: :class:`~refusion_mlx.decode.scoring.ARScorer`), or a piece of
the Monte Carlo estimator (``"mc"``:
:class:`~refusion_mlx.decode.scoring.MCScorer`): a chunk of the context
into its cache, then :data:`SCORE_TOKENS` worth of samples' continuations
over it, each step evaluated, so memory stays flat in ``mc_num``. A client that leaves stops
it at the next turn. When done, the task gives the job's
:class:`~.outcome.Outcome` (its :class:`~.outcome.ScoredPrompt`, and the
drafted token's end as a generated token's: :func:`drafted_text`); a failure
is the :class:`~.refusal.Refusal` the engine ends it with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from ...decode.answer import end_ids
from ...decode.scoring import MC_ROWS, ARScorer, MCScorer
from ...distributed.group import is_link_failure
from .outcome import Outcome, ScoredPrompt, Usage
from .refusal import Reason, Refusal
from .text import CharCounter, TextShaper, token_piece

log = logging.getLogger("refusion_mlx.server")

MC_NUM = 128  # the authors' eval.py default
SCORE_TOKENS = 2048  # tokens one Monte Carlo step feeds (at least one sample's continuation)
# token-forwards one request may ask, summed over its prompts: "ar" the prompt's tokens, "mc" the
# context once and the scored tokens mc_num times
MAX_SCORE_WORK = 1 << 22


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

    def work(self, tokens: int) -> int:
        """Token-forwards scoring a prompt of ``tokens`` takes (bounded by :data:`MAX_SCORE_WORK`)."""
        if self.estimator != "mc":
            return tokens
        return self.context_tokens + self.mc_num * (tokens - self.context_tokens)

    def rows_per_step(self, tokens: int) -> int:
        """Samples one Monte Carlo step takes for a prompt of ``tokens`` (at most ``decode.scoring``'s
        MC_ROWS: the same chunks, so the same numbers, as ``score_mc`` for short continuations)."""
        return max(1, min(self.mc_num, MC_ROWS, SCORE_TOKENS // max(tokens - (self.context_tokens or 0), 1)))


def scoring_rows(request) -> Tuple[int, int]:
    """The KV rows a scoring request's cache holds while it runs, what
    admission reserves for it, and how many of them its widest pass holds in
    float besides until it is done (with ``--kv-bits``): "ar", the prompt and
    the drafted token's mask, every row kept as it is written (a prompt's
    rows), none in float; "mc", the context (kept so), then a step's
    samples' continuations (or the continuation and the drafted token) after
    it, which a pass writes."""
    spec, n = request.scoring, len(request.prompt_ids)
    if spec.estimator == "mc":
        target = n - spec.context_tokens
        widest = max(spec.rows_per_step(n) * target, target + spec.extra)
        return spec.context_tokens + widest, widest
    return n + spec.extra, 0


class ScoringTask:
    """One scoring job's work, a piece per turn (:meth:`step`)."""

    def __init__(self, request, mask_id: int, storage=None):
        self.request, self.spec, self.mask_id = request, request.scoring, mask_id
        self.storage = storage  # the server's KVStorage (--kv-bits), as its decoding caches keep keys and values
        self.scorer = None  # the estimator's, made at the first step

    def step(self, model, tokenizer) -> Optional[Union[Outcome, Refusal]]:
        """This turn's piece: None while work is left, then the Outcome (or
        the Refusal it failed with: a bug or out of memory fails this request,
        the server stays up; a lost rank is raised)."""
        spec, ids = self.spec, self.request.prompt_ids
        try:
            if self.scorer is None:
                self.scorer = (MCScorer(model, ids, spec.context_tokens, self.mask_id, spec.mc_num, spec.seed,
                                        spec.top if spec.extra else None, storage=self.storage)
                               if spec.estimator == "mc" else ARScorer(model, ids, spec.top,
                                                                       self.mask_id if spec.extra else None,
                                                                       storage=self.storage))
            if not self.scorer.finished:
                self.scorer.step(*([spec.rows_per_step(len(ids))] if spec.estimator == "mc" else []))
            if not self.scorer.finished:
                return None
            return scored_outcome(tokenizer, ids, self.scorer.result(), spec, self.request.stop)
        except Exception as e:
            if is_link_failure(e):
                raise
            log.exception("scoring failed")
            return Refusal(Reason.STEP_FAILED, f"scoring failed: {type(e).__name__}")


def drafted_text(tokenizer, token: int, stop) -> Tuple[str, str, Optional[str]]:
    """The drafted token's text as a generated one's: (its text, the finish reason, the stop string that
    cut it). An end id (EOS) ends the answer without text ("stop"); a ``stop`` string in its text cuts it
    there ("stop"); else its whole text, the one token asked ("length")."""
    if token in end_ids(tokenizer):
        return "", "stop", None
    shaper = TextShaper(stop, tokenizer.eos_token_id)
    text, reason = shaper.feed(tokenizer.decode([token]), [token], final=True)
    return text, reason or "length", shaper.hit


def scored_outcome(tokenizer, ids: List[int], scored, spec: Scoring, stop=()) -> Outcome:
    """The prompt ``ids`` and the ``spec.extra`` drafted token after it, from a ``decode.scoring.Scored``:
    the drafted token's text under generation's rules (:func:`drafted_text`; its score is shown whatever
    its text, as OpenAI's and vLLM's legacy echo show an end token's: the client's count of the prompt's
    tokens stays whole)."""
    extra, top = spec.extra, spec.top
    tokens = list(ids) + ([scored.next_token] if extra else [])
    values = list(scored.logprobs) + ([scored.next_logprob] if extra else [])
    tops = list(scored.top) if scored.top else [[] for _ in ids]
    if extra:
        tops.append(scored.next_top)
    named = [token_piece(tokenizer, t) for t in tokens]
    # None where nothing scored the token (the first; mc: the context), as the answer's top_logprobs show it
    alternatives = [None if value is None else [(token_piece(tokenizer, t)[0], lp) for t, lp in pairs[:top]]
                    for value, pairs in zip(values, tops)]
    tail, reason, hit = drafted_text(tokenizer, tokens[-1], stop) if extra else ("", "length", None)
    count = CharCounter()
    prompt = ScoredPrompt(tokenizer.decode(list(ids)) + tail, [name for name, _ in named], values, alternatives,
                          spec.logprobs, [count(raw) for _, raw in named])
    return Outcome(reason, Usage(len(ids), extra), hit, scored=prompt)
