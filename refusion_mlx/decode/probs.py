"""The per-token numbers the decisions are made from, kept on the device:
planning drafts, softmax probabilities, verified next-token probabilities.

Every head row yields up to three numbers, computed from one ``logsumexp``
(one reduction: no vocabulary-sized softmax copy, which is what keeps many
parallel slots and many requests from multiplying peak memory):

* ``draft``: the row's draft token -- argmax, or a Gumbel-max sample at
  temperature > 0 (planning only);
* ``p_draft``: the draft's probability under the plain softmax of the row;
* ``p_follow``: the probability of a given token under the row's logits --
  the token *after* the row's own in its slot, which is how verification
  scores a drafted token with the logits one position before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..models.kernels import logsumexp

# Float32 logits alive at once: the LM head runs over the rows of a step in
# chunks of at most this size, so many parallel slots do not multiply the
# vocabulary-sized working set (151671 columns: ~55 rows per chunk).
LOGITS_BUDGET_BYTES = 32 << 20

# Below this temperature the draw is formed from the gaps to each row's best
# logit (1/T overflows float32 near 1e-38; the draw is the argmax long before).
TINY_TEMPERATURE = 1e-6


@dataclass
class Drafting:
    """How one pass draws its drafts (REFUSION.md §4a, §5.3).

    At temperature 0 the draft is the argmax (the filters are not applied:
    top-k / top-p / min-p cannot change it, and mlx-lm's greedy sampler
    skips XTC too). Above 0 it is ``argmax(filtered / T + Gumbel)``: a sample
    from the softmax at temperature T of the logits left by mlx-lm's top-p,
    min-p, XTC and top-k filters -- the same distribution the reference draws
    with ``exp(l) / E**T`` in float64 when no filter is set, formed in
    float32 log space (Metal has no float64).
    """

    temperature: float = 0.0
    noise: Optional[mx.array] = None  # (rows, vocab) Gumbel noise at temperature > 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc: Optional["XTC"] = None  # mlx-lm's XTC, between min-p and top-k as mlx-lm chains them

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def scores(self, logits: mx.array, lse: mx.array, first: int) -> mx.array:
        """What the argmax runs over, for this pass's rows from its row ``first`` on."""
        x = logits
        rows = slice(first, first + logits.shape[0])
        noise = self.noise[rows]
        filters = self._filters(logits.shape[-1], rows)
        if filters:
            x = logits - lse[:, None]  # mlx-lm's filters take log-probabilities
            for f in filters:
                x = f(x)
        if self.temperature < TINY_TEMPERATURE:
            # 1/T would overflow float32 (inf * 0 is NaN): scale the gaps to the
            # row's best instead, which keeps the best at 0 and the rest finite
            # or -inf, so the draw is the argmax with noise breaking exact ties.
            gap = x - mx.max(x, axis=-1, keepdims=True)
            return mx.where(gap == 0, 0.0, gap / self.temperature) + noise
        return x * (1.0 / self.temperature) + noise

    def _filters(self, vocab: int, rows: slice) -> list:
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        out = []
        if 0 < self.top_p < 1.0:
            out.append(lambda x: apply_top_p(x, self.top_p))
        if self.min_p != 0.0:
            out.append(lambda x: apply_min_p(x, self.min_p))
        if self.xtc is not None:
            out.append(lambda x: self.xtc(x, rows))
        if 0 < self.top_k < vocab:
            out.append(lambda x: apply_top_k(x, self.top_k))
        return out


@dataclass
class XTC:
    """mlx-lm's XTC ("exclude top choices", ``sample_utils.apply_xtc``) on a pass's sampled rows: where its
    coin comes up (a chance of ``probability``), a row loses every token more likely than the least likely
    one above ``threshold``, so that one, and what is less likely, remain; none go unless two pass it. The
    ``keep`` tokens never go (mlx-lm's special tokens: the end ids and a newline). mlx-lm tosses one coin a
    step; a pass drafts many tokens at once, so here each row tosses its own, as each step of mlx-lm's does,
    drawn from the request's key (a seeded request draws alike alone and in a batch)."""

    probability: float
    threshold: float
    coins: mx.array  # (rows,) uniform in [0, 1): the row's tokens go where its coin is under ``probability``
    keep: mx.array  # (vocab,) booleans: the tokens XTC leaves

    def __call__(self, x: mx.array, rows: slice) -> mx.array:
        """``x``: log-probabilities of the rows ``rows`` of the pass (what the filters before left)."""
        probs = mx.softmax(x, axis=-1, precise=True)
        least = mx.min(mx.where(probs > self.threshold, probs, mx.inf), axis=-1, keepdims=True)
        drop = (probs > least) & ~self.keep & (self.coins[rows] < self.probability)[:, None]
        return mx.where(drop, -mx.inf, x)


def gumbel_noise(key: Optional[mx.array], rows: int, vocab: int, slot_size: int) -> mx.array:
    """Gumbel noise for ``rows`` planning rows, one key per chunk of whole
    slots (the chunks of the logits budget), so no two rows share noise.
    ``key`` None: MLX's global generator (an unseeded request)."""
    keys = mx.random.split(key, rows) if key is not None else None
    per_chunk = slot_size * max(1, LOGITS_BUDGET_BYTES // (4 * vocab * slot_size))
    parts = [-mx.log(-mx.log(mx.random.uniform(shape=(min(per_chunk, rows - i), vocab),
                                               key=None if keys is None else keys[i])))
             for i in range(0, rows, per_chunk)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def top_logprobs(logits: mx.array, k: int, lse: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """The ``k`` most likely tokens of each row of float32 ``logits`` and their
    log-probabilities, best first: (ids, values), each (rows, k)."""
    lse = logsumexp(logits) if lse is None else lse
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logits, ids, axis=-1) - lse[:, None]
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def picked_probs(logits: mx.array, lse: mx.array, tokens: mx.array) -> mx.array:
    """Softmax probability of ``tokens`` (one per row) under float32 ``logits``."""
    picked = mx.take_along_axis(logits, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    return mx.exp(picked - lse)


def row_statistics(logits: mx.array, first: int,
                   drafting: Optional[Sequence[Tuple[Optional[Drafting], int]]],
                   follow: Optional[mx.array],
                   allowed: Optional[mx.array] = None) -> Tuple[Optional[mx.array], ...]:
    """(draft, p_draft, p_follow) for a chunk of head rows starting at row ``first``.

    ``drafting``: each pass's Drafting (or None) and its number of head rows,
    in row order over the whole step (None: no drafts wanted). ``follow``:
    one token per row of this chunk (None: no verification wanted).
    ``allowed``: (rows, vocab) booleans of a constrained request's grammar
    (None: every token): the others' logits become -inf, so drafts are
    allowed tokens and probabilities are over the allowed ones.
    """
    if allowed is not None:
        logits = mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
    lse = logsumexp(logits)
    draft = p_draft = p_follow = None
    if drafting is not None:
        draft = mx.argmax(_draft_scores(logits, lse, first, drafting), axis=-1)
        p_draft = picked_probs(logits, lse, draft)
    if follow is not None:
        p_follow = picked_probs(logits, lse, follow)
    return draft, p_draft, p_follow


def _draft_scores(logits: mx.array, lse: mx.array, first: int,
                  drafting: Sequence[Tuple[Optional[Drafting], int]]) -> mx.array:
    """The logits themselves when every row of the chunk is greedy; else each
    sampling pass's rows replaced by its scores."""
    rows = logits.shape[0]
    spans: List[Tuple[Optional[Drafting], int, int, int]] = []  # drafting, chunk start, end, pass row
    start = 0
    for d, n in drafting:
        a, b = max(start, first), min(start + n, first + rows)
        if a < b:
            spans.append((d, a - first, b - first, a - start))
        start += n
    if all(d is None or d.greedy for d, *_ in spans):
        return logits
    parts = []
    for d, a, b, own in spans:
        if d is None or d.greedy:
            parts.append(logits[a:b])
        else:
            parts.append(d.scores(logits[a:b], lse[a:b], own))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
