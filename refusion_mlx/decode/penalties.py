"""What a request does to its logits: a logit bias, OpenAI's presence and frequency penalties, and the
repetition penalty of HF transformers, vLLM and mlx-lm.

ReFusion decides from probabilities: a planning draft's confidence, a verified token's probability. A
request that sets ``logit_bias``, ``presence_penalty``, ``frequency_penalty`` or ``repetition_penalty``
decodes as if the model's logits ``l`` were, at every head row of its passes (plan, verify, infill, the
constrained mode's),

    r(l[j]) + logit_bias[j] - frequency_penalty * c[j] - presence_penalty * (c[j] > 0)

where ``c[j]`` counts token ``j`` among the answer's tokens committed before the step (OpenAI's "text so
far"; the drafts of the step itself do not count), and ``r`` is the repetition penalty ``p`` on the tokens
the context has -- the prompt, the conversation before it in the cache, the answer's committed tokens --
``l / p`` where ``l > 0``, ``l * p`` elsewhere (HF's and vLLM's rule; mlx-lm's counts only the last 20
tokens before the one it decodes, an order a decoder that commits out of order has not), and ``l`` on the
others. Drafts, confidences, verified probabilities and the logprobs reported are all of those logits (a
grammar's mask comes after). With none set a request's passes carry nothing and decode exactly as before.

The vectors are made on the host once per step that committed something (numpy, the vocabulary's length)
and shared by the step's passes: one upload, no per-row work.
"""

from __future__ import annotations

import numbers
from typing import List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import DecodeError

MAX_PENALTY = 2.0  # OpenAI's bounds of presence_penalty and frequency_penalty
MAX_BIAS = 100.0  # ... and of each logit_bias value
MAX_REPETITION = 10.0  # repetition_penalty's bound (0 and 1 are off, as mlx-lm and HF have them)

Pairs = Tuple[Tuple[int, float], ...]
# The settings (RefusionParams', a request's) and their values that change nothing (None: a request's unset
# field; a repetition penalty of 0 is mlx-lm's off, 1 HF's)
OFF = {"logit_bias": (None, (), {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
       "repetition_penalty": (None, 0, 1)}
NAMES = tuple(OFF)


def active(settings) -> List[str]:
    """The names of the settings of ``settings`` (RefusionParams, a request's body) that change the logits."""
    return [name for name, off in OFF.items() if getattr(settings, name) not in off]


def bias_pairs(value) -> object:
    """A logit bias as sorted (token id, bias) pairs where its keys are token ids (ints, or their decimal
    strings as a JSON object has them) and its values numbers; anything else as given, for
    :func:`check` to refuse. None and an empty mapping: None."""
    if isinstance(value, Mapping):
        if not value:
            return None
        try:
            pairs = tuple(sorted((_token_id(k), _bias_value(v)) for k, v in value.items()))
        except (TypeError, ValueError):
            return value
        return pairs
    return value


def _token_id(key) -> int:
    if isinstance(key, bool):
        raise TypeError(key)
    if isinstance(key, numbers.Integral):
        return int(key)
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    raise ValueError(key)


def _bias_value(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(value)
    return float(value)


def check(logit_bias, presence_penalty, frequency_penalty, repetition_penalty=1.0) -> None:
    """The DecodeError of a bad setting (bounds as OpenAI's); nothing when all are good."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise DecodeError(f"{name} must be within [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
    value = repetition_penalty
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_REPETITION:
        raise DecodeError(f"repetition_penalty must be within [0, {MAX_REPETITION:g}] (0 and 1: off), got {value!r}")
    if logit_bias is None:
        return
    if isinstance(logit_bias, Mapping):  # bias_pairs left it: a key or a value it could not read
        for k, v in logit_bias.items():
            try:
                _token_id(k)
            except (TypeError, ValueError):
                raise DecodeError(f"logit_bias: keys are token ids (integers), got {k!r}") from None
            try:
                _bias_value(v)
            except TypeError:
                raise DecodeError(f"logit_bias: values are numbers, got {v!r} for token {k}") from None
    if not isinstance(logit_bias, tuple):
        raise DecodeError("logit_bias must be an object of token ids to biases ({\"50256\": -100}), got "
                          f"{type(logit_bias).__name__}")
    for token, bias in logit_bias:
        if token < 0:
            raise DecodeError(f"logit_bias: token id {token} is negative")
        if not -MAX_BIAS <= bias <= MAX_BIAS:
            raise DecodeError(f"logit_bias: the bias of token {token} must be within [-{MAX_BIAS:g}, "
                              f"{MAX_BIAS:g}], got {bias:g}")


class Penalties:
    """One request's bias and penalties over a vocabulary of ``vocab`` tokens, with the counts of its answer's
    committed tokens (:meth:`count`, from the state's commits), the tokens its context has (``context``, the
    cache's and the prompt's, and the commits) and the vectors of its next passes (:meth:`vector`,
    :meth:`divisors`)."""

    def __init__(self, logit_bias: Optional[Pairs], presence: float, frequency: float, vocab: int,
                 repetition: float = 1.0, context: Sequence[int] = ()):
        self.static = np.zeros(vocab, np.float32)
        for token, bias in logit_bias or ():
            if token >= vocab:
                raise DecodeError(f"logit_bias: token id {token} is outside the vocabulary of {vocab}")
            self.static[token] += bias
        self.presence, self.frequency = float(presence), float(frequency)
        self.adds = bool(logit_bias) or bool(self.presence or self.frequency)
        self.repetition = 1.0 if repetition in OFF["repetition_penalty"] else float(repetition)
        self.counts = np.zeros(vocab, np.int64)
        self.seen = np.zeros(vocab, np.bool_)
        self.seen[np.asarray(context, np.int64)] = True
        self._vector: Optional[mx.array] = None
        self._divisors: Optional[mx.array] = None

    @classmethod
    def of(cls, params, vocab: int, context: Sequence[int] = ()) -> Optional["Penalties"]:
        """A request's Penalties, or None when its params set none (nothing is done to its logits).
        ``context``: the tokens before its answer (the repetition penalty's)."""
        if not active(params):
            return None
        return cls(params.logit_bias, params.presence_penalty, params.frequency_penalty, vocab,
                   params.repetition_penalty, context)

    def count(self, tokens: Sequence[int]) -> None:
        """Answer tokens just committed: they count from the next step on."""
        if not len(tokens):
            return
        ids = np.asarray(tokens, np.int64)
        if self.presence or self.frequency:
            np.add.at(self.counts, ids, 1)
            self._vector = None
        if self.repetition != 1.0 and not self.seen[ids].all():
            self.seen[ids] = True
            self._divisors = None

    def vector(self) -> Optional[mx.array]:
        """(vocab,) float32: what each head row of the next pass adds to its logits (None: nothing)."""
        if self._vector is None and self.adds:
            v = self.static - np.float32(self.frequency) * self.counts.astype(np.float32)
            if self.presence:
                v = v - np.float32(self.presence) * (self.counts > 0)
            self._vector = mx.array(v.astype(np.float32))
        return self._vector

    def divisors(self) -> Optional[mx.array]:
        """(vocab,) float32: the repetition penalty on the tokens the context has, 1 on the others; each head
        row of the next pass divides its positive logits by it and multiplies the others (None: nothing)."""
        if self._divisors is None and self.repetition != 1.0:
            self._divisors = mx.array(np.where(self.seen, np.float32(self.repetition), np.float32(1.0)))
        return self._divisors


def repeat_penalised(logits: mx.array, divisors: mx.array) -> mx.array:
    """``logits`` under a repetition penalty: each divided by its token's divisor where positive, multiplied
    by it elsewhere (a divisor of 1 leaves a logit exactly as it was)."""
    return mx.where(logits > 0, logits / divisors, logits * divisors)
