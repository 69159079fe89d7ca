"""The probability each generated token was accepted under (the answer's
``logprobs``), kept beside the decoding decisions; only for a request that
asks for them (``RefusionDecoder(..., logprobs=k)``).

A slot's first token is accepted under its planning probability (REFUSION.md
§4a: the draft's softmax probability at its mask); every other token under
its verified probability (§4b, §4c: the softmax probability of the token
under the logits one position before it) in the verification that accepted
it -- the global verification, or the infill round in which it was
accepted. With ``k`` > 0, the ``k`` most likely tokens of that same row come
with it (the constrained mode, ``constrain.py``, keeps none). The numbers
are the ones the decisions were made from: fetched
with the step's one host synchronisation, no extra one (the top tokens ride
in the same fetch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from ..errors import DecodeError

FLOOR = float(np.log(np.float32(1e-45)))  # log of float32's smallest probability: never -inf in JSON


def check_top(value, vocab: int, name: str) -> int:
    """``value`` as a count of top tokens per token (an integer from 0 to ``vocab`` - 1, not a bool), or one
    DecodeError naming ``name``: the rule of every caller's ``logprobs`` / ``top``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < vocab:
        raise DecodeError(f"{name} must be an integer from 0 to {vocab - 1} (top tokens per token), got {value!r}")
    return int(value)


def unscored(param: str, constraint_name: str) -> str:
    """Why ``param`` (logprobs) is refused beside a constraint: the constrained mode (``constrain.py``)
    decides tokens without the slots' scores, so an answer's tokens would have none."""
    return f"{param}: not supported with an answer constrained by {constraint_name}"


def logprob(p: float) -> float:
    return min(0.0, float(np.log(p))) if p > 0 else FLOOR  # (a float32 softmax can round past 1)


@dataclass
class SlotScores:
    """The selected slots' tokens (k, S): the probability each was accepted
    under, and (top > 0) the top tokens and log-probabilities of its row (k, S, top)."""

    probs: np.ndarray
    ids: Optional[np.ndarray] = None
    values: Optional[np.ndarray] = None

    @classmethod
    def after_verify(cls, planned, checked, selected: List[int]) -> "SlotScores":
        """From the plan's and the verification's results: token 0 of each slot
        from its planning row, token j from the verification's row j - 1."""
        probs = np.array(checked["probs"], np.float64)
        if "top_ids" not in checked.host:
            return cls(probs)
        first_ids, first_values = planned["top_ids"][selected], planned["top_values"][selected]
        ids = np.concatenate([first_ids[:, None], checked["top_ids"]], axis=1)
        values = np.concatenate([first_values[:, None], checked["top_values"]], axis=1)
        return cls(probs, ids, values)

    def accept(self, newly: np.ndarray, a: int, checked) -> None:
        """An infill round accepted ``newly`` (k, S - a): their numbers are this round's."""
        window = self.probs[:, a:]
        window[newly] = np.asarray(checked["probs"], np.float64)[newly]
        if self.ids is not None:
            ids, values = checked["top_ids"], checked["top_values"]  # (k, S - a - 1): rows before tokens 1..
            rows, cols = np.nonzero(newly[:, 1:])
            self.ids[rows, a + 1 + cols] = ids[rows, cols]
            self.values[rows, a + 1 + cols] = values[rows, cols]

    def keep(self, rows: int) -> None:
        """Keep the first ``rows`` slots (infill found EOS in the last of them)."""
        self.probs = self.probs[:rows]
        if self.ids is not None:
            self.ids, self.values = self.ids[:rows], self.values[:rows]

    def entries(self, end: int) -> List[Tuple[float, list]]:
        """The first ``end`` tokens in slot order: (log-probability, [(id, log-probability), ...])."""
        probs = self.probs.reshape(-1)[:end]
        if self.ids is None:
            return [(logprob(p), []) for p in probs]
        ids = self.ids.reshape(-1, self.ids.shape[-1])[:end]
        values = self.values.reshape(-1, self.values.shape[-1])[:end]
        return [(logprob(p), [(int(i), float(v)) for i, v in zip(ri, rv)]) for p, ri, rv in zip(probs, ids, values)]
