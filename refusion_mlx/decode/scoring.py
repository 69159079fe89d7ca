"""Log-likelihoods of given text: each token of a sequence scored by the
model, for evaluation (lm-evaluation-harness's ``loglikelihood`` requests,
the server's ``echo`` + ``logprobs``).

Two estimators, both built lazily and evaluated with one ``mx.eval`` (one
host synchronisation for the whole request list):

* :func:`score_ar` -- the autoregressive reading (REFUSION.md §8, the AR
  task; the verification's reading of §4b): the sequence is fed once,
  causal, every token at its true position, and token i is scored by the
  softmax of the logits at token i-1 (a real token's logits predict the next
  token). :class:`ARScorer` feeds it into a cache in chunks, as a prompt's
  prefill, scoring each chunk's rows as it goes (a row's numbers never
  depend on the rows scored beside it). Optionally one mask token after the
  sequence at the next position gives the greedy draft of the answer's first
  token, as the plan pass would draw it at temperature 0 (§4a).
* :func:`score_mc` -- the masked-diffusion Monte Carlo estimator of the
  authors' ``eval.py``: ``mc_num`` samples, each masking a stratified random
  number of the continuation's tokens; the cross-entropy of each masked
  token, divided by the sample's mask ratio, summed and averaged over the
  samples, is the negative log-likelihood bound. Each sample is laid out as
  training's MDM task lays it out (§8): the context, the continuation's
  unmasked tokens, then its masked tokens as the mask id, each at its true
  position and scored by its own logits (§1). Attention is causal in
  sequence order and every sample starts with the same context at the same
  positions, so the context's keys and values are the same in every sample:
  :class:`MCScorer` feeds the context once into a committed cache (in
  chunks, as a prompt's prefill), then each step feeds a few samples'
  continuations as the slots of one infill pass over it (each slot sees the
  context and its own rows, as in the decoder's infill): the context once
  and ``mc_num`` continuations, not ``mc_num`` whole sequences. Each step is
  evaluated, so memory stays flat in ``mc_num``; the server interleaves the
  steps with decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .._threads import free_streams_at_thread_end
from ..errors import DecodeError
from ..models.kernels import logsumexp
from .cache import CommittedCache
from .forward import head_chunk_rows
from .kv_store import KVStorage
from .params import seed_bits
from .prefill import PREFILL_CHUNK, chunks
from .prompt import token_ids
from .runner import Runner
from .token_scores import check_top

MC_ROWS = 16  # samples per forward of the Monte Carlo estimator (built lazily, evaluated together)


@dataclass
class Scored:
    """One sequence's scores. ``logprobs[i]``: the log-probability of token
    i (None for the first token, which nothing predicts, and for tokens the
    estimator does not score). ``top``: per token, the ``top`` most likely
    (id, log-probability) pairs under the same distribution (empty where
    ``logprobs`` is None). ``next_token`` / ``next_logprob`` / ``next_top``:
    the greedy draft after the sequence when asked for."""

    logprobs: List[Optional[float]]
    top: List[List[tuple]] = field(default_factory=list)
    next_token: Optional[int] = None
    next_logprob: Optional[float] = None
    next_top: List[tuple] = field(default_factory=list)


def _row_stats(logits: mx.array, tokens: mx.array, top: int):
    """log-probability of ``tokens`` (one per row) and the ``top`` best (ids, log-probabilities)."""
    logits = logits.astype(mx.float32)
    lse = logsumexp(logits)
    picked = mx.take_along_axis(logits, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0] - lse
    if top <= 0:
        return picked, None, None
    ids = mx.argpartition(-logits, kth=top - 1, axis=-1)[:, :top]
    vals = mx.take_along_axis(logits, ids, axis=-1) - lse[:, None]
    order = mx.argsort(-vals, axis=-1)
    return picked, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def _head_stats(model, hidden: mx.array, tokens: mx.array, top: int):
    """The LM head over ``hidden`` (N, dim) in chunks: per row the log-probability of its
    token and its top pairs (device arrays, unevaluated)."""
    per = head_chunk_rows(model.args.vocab_size)
    parts = [_row_stats(model.head(hidden[i:i + per]), tokens[i:i + per], top)
             for i in range(0, hidden.shape[0], per)]
    return tuple(None if col[0] is None else (mx.concatenate(col) if len(col) > 1 else col[0])
                 for col in zip(*parts))


def scored_ids(model, ids, what: str = "the sequence scored") -> List[int]:
    """``ids`` as token ids within the model's vocabulary, or one DecodeError."""
    out, vocab = token_ids(ids, what), model.args.vocab_size
    bad = [t for t in out if not 0 <= t < vocab]
    if bad:
        raise DecodeError(f"{what}: token id {bad[0]} is outside the vocabulary of {vocab}")
    return out


def check_length(model, n: int, drafted: bool) -> None:
    """The DecodeError of a sequence of ``n`` tokens (and, ``drafted``, a mask after it) past the model's
    context, as the decoder refuses a prompt and budget past it (``decoder.check_context``)."""
    limit = model.args.max_position_embeddings
    if n + drafted > limit:
        raise DecodeError(f"the sequence scored ({n} tokens)" + (" + the drafted token" if drafted else "")
                          + f" exceeds the model's context of {limit} positions")


class ARScorer:
    """The AR estimator of one sequence a chunk at a time: :meth:`step`
    feeds the next chunk (at most ``chunk`` tokens) into the scorer's cache
    and scores its rows (evaluated: nothing but the cache is held after
    it); :meth:`result` once :attr:`finished`. ``top`` and ``next_mask``
    as :func:`score_ar`; ``storage``: how the cache keeps the keys and
    values (a :class:`~.kv_store.KVStorage`; None: the model's dtype)."""

    def __init__(self, model, ids: Sequence[int], top: int = 0, next_mask: Optional[int] = None,
                 chunk: int = PREFILL_CHUNK, storage: Optional[KVStorage] = None):
        free_streams_at_thread_end()
        self.model, self.ids = model, scored_ids(model, ids)
        self.top = check_top(top, model.args.vocab_size, "top")
        if next_mask is not None:
            scored_ids(model, [next_mask], "the mask id")
        check_length(model, len(self.ids), next_mask is not None)
        self.extra = next_mask is not None
        self.k = max(top, 1 if self.extra else 0)
        sequence = self.ids + ([next_mask] if self.extra else [])
        self.cache = CommittedCache.for_model(model, storage=storage)
        # one token, nothing drafted: nothing to score
        self._chunks = chunks(sequence if len(sequence) >= 2 else [], 0, chunk)
        self._parts: List[tuple] = []
        self.finished = len(sequence) < 2

    def step(self) -> None:
        """Feed and score the next chunk."""
        part, positions = next(self._chunks)
        start, n = positions[0], len(self.ids)
        h = Runner.of(self.model).hidden(mx.array(part, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                                         self.cache.extend(len(part), settled=len(part)))
        # the rows scored: a real token's before the last (it predicts the next), the mask's (the draft)
        rows = [p for p in positions if p < n - 1 or p == n]
        follow = [self.ids[p + 1] if p < n - 1 else 0 for p in rows]
        if rows:
            wanted = h[mx.array([p - start for p in rows], dtype=mx.int32)]
            stats = _head_stats(self.model, wanted, mx.array(follow, dtype=mx.int32), self.k)
            mx.eval(*[a for a in stats if a is not None], self.cache.state())
            self._parts.append(tuple(None if a is None else np.array(a) for a in stats))
        else:
            mx.eval(h, self.cache.state())  # h: every rank's sends run (see MCScorer.step)
        self.cache.commit(part, positions)
        self.finished = positions[-1] == n - 1 + self.extra

    def result(self) -> Scored:
        """The sequence's scores once :attr:`finished`."""
        self.cache.free()
        r, top, n = self.ids, self.top, len(self.ids) - 1
        if not self._parts:
            return Scored([None] * len(r))
        lp, ids, vals = (None if col[0] is None else np.concatenate(col) for col in zip(*self._parts))
        s = Scored([None] + [float(x) for x in lp[:n]])
        if top > 0:
            s.top = [[]] + [_pairs(ids[i], vals[i], top) for i in range(n)]
        if self.extra:
            s.next_token, s.next_logprob = int(ids[n][0]), float(vals[n][0])
            s.next_top = _pairs(ids[n], vals[n], top)
        return s


def score_ar(model, rows: Sequence[Sequence[int]], top: int = 0, next_mask: Optional[int] = None,
             kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None,
             storage: Optional[KVStorage] = None) -> List[Scored]:
    """The AR estimator over ``rows`` (token-id lists): token i of a row
    scored under the logits at i-1. ``top``: also the ``top`` most likely
    tokens at every scored position (an integer from 0 to the vocabulary's
    size - 1, as ``logprobs`` everywhere; else a DecodeError). ``next_mask``: the mask id, to draft the
    token after each row (a mask at the next position, which sees the whole
    row: the plan's greedy first draft). Each row on its own
    (:class:`ARScorer`), so its numbers do not depend on the rows beside
    it: lm-eval's scores are the same alone and concurrent. ``kv_bits`` (4
    or 8) and ``kv_group_size``: read the text through a quantized cache, as
    a server with ``--kv-bits`` does (or ``storage``, a
    :class:`~.kv_store.KVStorage` already made), as ``stream_generate``
    takes them. A row (with ``next_mask``, and its mask) past the model's
    context is a DecodeError, as a prompt past it is to the decoder."""
    storage = KVStorage.given(storage, kv_bits, kv_group_size, model)
    out = []
    for r in rows:
        scorer = ARScorer(model, r, top, next_mask, storage=storage)
        while not scorer.finished:
            scorer.step()
        out.append(scorer.result())
    return out


def _pairs(ids: np.ndarray, vals: np.ndarray, top: int) -> List[tuple]:
    return [(int(i), float(v)) for i, v in zip(ids[:top], vals[:top])]


def mc_masks(target_len: int, mc_num: int, rng: np.random.Generator) -> np.ndarray:
    """(mc_num, target_len) bool: which continuation tokens each sample masks.
    As the authors' ``_forward_process``: the counts are stratified over
    1..target_len from one random start, then each sample's masked positions
    are a random subset of that size."""
    samples = mc_samples(target_len, mc_num, rng)
    return np.stack([next(samples) for _ in range(mc_num)])


def mc_samples(target_len: int, mc_num: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """:func:`mc_masks`' rows one at a time, drawn from ``rng`` in the same
    order (so a sample's mask is the same whether drawn alone or with all)."""
    k = int(rng.integers(1, target_len + 1))
    counts = np.round(np.linspace(k, k + (mc_num - 1) * (target_len / mc_num), mc_num)).astype(int)
    counts = ((counts - 1) % target_len) + 1
    for c in counts:
        mask = np.zeros(target_len, bool)
        mask[rng.permutation(target_len)[:c]] = True
        yield mask


class MCScorer:
    """The Monte Carlo estimator of :func:`score_mc`, a piece at a time:
    :meth:`step` feeds the next chunk of the context into the scorer's
    cache until all of it is there, then scores the next ``rows`` samples
    (one infill pass over the cache, evaluated: the memory held does not
    grow with ``mc_num``); :meth:`result` gives the estimate once every
    sample is in. ``storage``: as :class:`ARScorer`'s."""

    def __init__(self, model, ids: Sequence[int], context: int, mask_id: int, mc_num: int = 128,
                 seed: int = 0, draft_top: Optional[int] = None, chunk: int = PREFILL_CHUNK,
                 storage: Optional[KVStorage] = None):
        free_streams_at_thread_end()
        self.model, self.ids, self.context, self.mask_id = model, scored_ids(model, ids), context, mask_id
        scored_ids(model, [mask_id], "the mask id")
        self.mc_num = mc_num
        self.draft_top = None if draft_top is None else check_top(draft_top, model.args.vocab_size, "draft_top")
        n = len(self.ids)
        if isinstance(context, bool) or not isinstance(context, int) or not 0 < context < n:
            raise DecodeError(f"context: how many of the sequence's first tokens are the context (the tokens after "
                              f"them are scored): 1 to {n - 1} for its {n} tokens, got {context!r}")
        if isinstance(mc_num, bool) or not isinstance(mc_num, int) or mc_num < 1:
            raise DecodeError(f"mc_num must be a positive integer, got {mc_num!r}")
        check_length(model, n, draft_top is not None)
        self.samples = mc_samples(n - context, mc_num, np.random.default_rng(seed_bits(seed)))
        self.cache = CommittedCache.for_model(model, storage=storage)
        self._context = chunks(self.ids[:context], 0, chunk)
        self.done, self.total = 0, None

    @property
    def finished(self) -> bool:
        return self.done >= self.mc_num

    @property
    def fed(self) -> bool:
        """Whether the whole context is in the cache."""
        return len(self.cache) == self.context

    def _forward(self, tokens, positions, write) -> mx.array:
        return Runner.of(self.model).hidden(mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                                            write)

    def step(self, rows: int = MC_ROWS) -> None:
        """The next piece: a chunk of the context, or (the context fed) the
        next ``rows`` samples (fewer at the end)."""
        if not self.fed:
            part, positions = next(self._context)
            h = self._forward(part, positions, self.cache.extend(len(part), settled=len(part)))
            # the context's keys and values (nothing else of the pass is kept), and the pass's output: under a
            # pipeline a rank's keys and values need none of its sends, which the next rank's wait for
            mx.eval(h, self.cache.state())
            self.cache.commit(part, positions)
            return
        rows = min(rows, self.mc_num - self.done)
        ids, context, n = self.ids, self.context, len(self.ids)
        target, seq = n - context, np.array(ids, np.int32)
        masks = np.stack([next(self.samples) for _ in range(rows)])
        ratio = masks.sum(axis=1) / target  # p of each sample
        # slot b: the continuation's unmasked tokens, then its masked ones as the mask id
        masked = np.arange(target)[None, :] >= target - masks.sum(axis=1)[:, None]
        order = np.stack([context + np.concatenate([np.flatnonzero(~m), np.flatnonzero(m)]) for m in masks])
        tokens = np.where(masked, self.mask_id, seq[order])
        h = self._forward(tokens.reshape(-1), order.reshape(-1), self.cache.infill(rows, target, 0))
        at = np.flatnonzero(masked.reshape(-1))
        flat = h[mx.array(at, dtype=mx.int32)]
        truth = seq[order.reshape(-1)[at]]
        lp, _, _ = _head_stats(self.model, flat, mx.array(truth, dtype=mx.int32), 0)
        weight = 1.0 / ratio[at // target]
        where = order.reshape(-1)[at] - context  # each masked row's continuation offset
        onehot = mx.array((where[:, None] == np.arange(target)[None, :]).astype(np.float32) * weight[:, None])
        share = (lp[:, None] * onehot).sum(axis=0)
        self.total = share if self.total is None else self.total + share
        mx.eval(self.total)  # one host synchronisation per step; nothing of the step is held after it
        self.done += rows

    def result(self) -> Scored:
        """The estimate (and the draft after the sequence, when asked), once :attr:`finished`."""
        ids, n = self.ids, len(self.ids)
        total = self.total / self.mc_num
        draft = None
        if self.draft_top is not None:  # the continuation and a mask after it, over the cached context
            tail = ids[self.context:] + [self.mask_id]
            h = self._forward(tail, list(range(self.context, n + 1)), self.cache.extend(len(tail)))[-1:]
            draft = _head_stats(self.model, h, mx.zeros((1,), mx.int32), max(self.draft_top, 1))[1:]
        mx.eval(total, *(draft or ()))
        self.cache.free()
        out = Scored([None] * self.context + [float(x) for x in np.array(total)])
        if draft is not None:
            top_ids, top_values = np.array(draft[0])[0], np.array(draft[1])[0]
            out.next_token, out.next_logprob = int(top_ids[0]), float(top_values[0])
            out.next_top = _pairs(top_ids, top_values, self.draft_top)
        return out


def score_mc(model, ids: Sequence[int], context: int, mask_id: int, mc_num: int = 128,
             seed: int = 0, draft_top: Optional[int] = None, kv_bits: Optional[int] = None,
             kv_group_size: Optional[int] = None, storage: Optional[KVStorage] = None) -> Scored:
    """The Monte Carlo estimator of ``ids[context:]`` given ``ids[:context]``.
    Per continuation token, its share of the estimate (the mean over the
    samples of its weighted cross-entropy where masked, negated); they sum to
    the estimate. Context tokens are not scored (None). ``draft_top``: also
    draft the token after ``ids`` (a mask at the next position, as
    :func:`score_ar`), with this many top tokens. The context fed once,
    then :data:`MC_ROWS` samples per forward (:class:`MCScorer`). ``kv_bits``,
    ``kv_group_size``, ``storage``: as :func:`score_ar`'s; past the context, its DecodeError."""
    scorer = MCScorer(model, ids, context, mask_id, mc_num, seed, draft_top,
                      storage=KVStorage.given(storage, kv_bits, kv_group_size, model))
    while not scorer.finished:
        scorer.step(MC_ROWS)
    return scorer.result()
