"""The per-token numbers the decisions are made from, kept on the device:
planning drafts, softmax probabilities, verified next-token probabilities."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

def draft_tokens(logits: mx.array, temperature: float, key: Optional[mx.array]) -> mx.array:
    """Planning drafts: argmax, or Gumbel-max sampling at temperature > 0.

    The reference draws ``exp(l) / E**T`` with E ~ Exp(1) in float64; its
    argmax equals that of ``l / T + Gumbel`` which we form in float32 log
    space (Metal has no float64) -- the same distribution without overflow.
    """
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    gumbel = -mx.log(-mx.log(mx.random.uniform(shape=logits.shape, key=key)))
    return mx.argmax(logits * (1.0 / temperature) + gumbel, axis=-1)


def token_probs(logits: mx.array, tokens: mx.array) -> mx.array:
    """Softmax probability of ``tokens`` under float32 ``logits`` (row-wise).

    ``logsumexp`` is one reduction: no vocabulary-sized temporaries, which is
    what keeps many parallel slots from multiplying peak memory.
    """
    picked = mx.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return mx.exp(picked - mx.logsumexp(logits, axis=-1))


def next_token_probs(logits: mx.array, tokens: mx.array) -> mx.array:
    """Verified probability of token j under the logits at j-1, for j >= 1.

    Each row is paired with the token after it, so the reductions run on the
    whole (contiguous) logits and only the small result is shifted. Column 0
    is left at 0: its verified probability is never used (in global
    verification each slot's first token keeps its planning probability, in
    infill the window's first token is accepted outright).
    """
    pad = mx.zeros((*tokens.shape[:-1], 1), tokens.dtype)
    following = mx.concatenate([tokens[..., 1:], pad], axis=-1)
    probs = token_probs(logits, following)
    return mx.concatenate([pad.astype(mx.float32), probs[..., :-1]], axis=-1)


# Float32 logits alive at once: the LM head runs over whole slots' rows in
# chunks of at most this size, so many parallel slots do not multiply the
# vocabulary-sized working set (151671 columns: ~55 rows per chunk).
LOGITS_BUDGET_BYTES = 32 << 20
