"""What a request adds to its logits: a logit bias and OpenAI's presence and frequency penalties.

ReFusion decides from probabilities: a planning draft's confidence, a verified token's probability. A
request that sets ``logit_bias``, ``presence_penalty`` or ``frequency_penalty`` decodes as if the model's
logits were, at every head row of its passes (plan, verify, infill, the constrained mode's),

    logits[j] + logit_bias[j] - frequency_penalty * c[j] - presence_penalty * (c[j] > 0)

where ``c[j]`` counts token ``j`` among the answer's tokens committed before the step (OpenAI's "text so
far"; the drafts of the step itself do not count). Drafts, confidences, verified probabilities and the
logprobs reported are all of those logits (a grammar's mask comes after). With neither set a request's
passes carry no bias and decode exactly as before.

The vector is made on the host once per step that committed something (numpy, the vocabulary's length)
and shared by the step's passes: one upload, no per-row work.
"""

from __future__ import annotations

import numbers
from typing import Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import DecodeError

MAX_PENALTY = 2.0  # OpenAI's bounds of presence_penalty and frequency_penalty
MAX_BIAS = 100.0  # ... and of each logit_bias value

Pairs = Tuple[Tuple[int, float], ...]
NAMES = ("logit_bias", "presence_penalty", "frequency_penalty")  # the settings: RefusionParams' and a request's


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


def check(logit_bias, presence_penalty, frequency_penalty) -> None:
    """The DecodeError of a bad setting (bounds as OpenAI's); nothing when all are good."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise DecodeError(f"{name} must be within [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
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
    committed tokens (:meth:`count`, from the state's commits) and the vector of its next passes
    (:meth:`vector`)."""

    def __init__(self, logit_bias: Optional[Pairs], presence: float, frequency: float, vocab: int):
        self.static = np.zeros(vocab, np.float32)
        for token, bias in logit_bias or ():
            if token >= vocab:
                raise DecodeError(f"logit_bias: token id {token} is outside the vocabulary of {vocab}")
            self.static[token] += bias
        self.presence, self.frequency = float(presence), float(frequency)
        self.counts = np.zeros(vocab, np.int64)
        self._vector: Optional[mx.array] = None

    @classmethod
    def of(cls, params, vocab: int) -> Optional["Penalties"]:
        """A request's Penalties, or None when its params set none (nothing is added to its logits)."""
        if not any(getattr(params, name) for name in NAMES):
            return None
        return cls(params.logit_bias, params.presence_penalty, params.frequency_penalty, vocab)

    def count(self, tokens: Sequence[int]) -> None:
        """Answer tokens just committed: they count from the next step on."""
        if (self.presence or self.frequency) and len(tokens):
            np.add.at(self.counts, np.asarray(tokens, np.int64), 1)
            self._vector = None

    def vector(self) -> mx.array:
        """(vocab,) float32: what each head row of the next pass adds to its logits."""
        if self._vector is None:
            v = self.static - np.float32(self.frequency) * self.counts.astype(np.float32)
            if self.presence:
                v = v - np.float32(self.presence) * (self.counts > 0)
            self._vector = mx.array(v.astype(np.float32))
        return self._vector
