"""What the model's confidence decides: how many tokens a decode commits per
forward, and how wide its passes are. A *profile* is the list of forwards
(``forward_replay.ForwardShape``) of a run over some prompts, ready to be
priced (``forecast``) or replayed bare at a real shape (``shapes``).

A *recorded* profile is a real model's forwards (``shapes.record``). A
*derived* profile decodes the same prompts, token counts and settings by the
decoder's rules (the plan / verify / infill loop, docs/design.md), with the model's confidence
set by one knob instead of by a model:

* each round plans every open slot of the block (one forward as wide as the
  block's masked slots; the first also carries the prompt: the prefill),
  verifies the ``k`` slots it drafted (as wide as them) and commits them;
* at or above ``S / 2`` tokens per forward (``S``: slot size) every verify
  is accepted and ``k`` averages ``c`` slots a round (``1 <= c <=`` slots
  per block);
* below it, one slot a round (the decoder's fallback when no slot passes the
  slot threshold), and after its verify ``R`` rounds of parallel infill
  (a draft and a verify each, as wide as the slot's unfinished window:
  ``S - a`` tokens, the cursor ``a`` moving ``m - 1`` tokens a round for
  ``m = ceil((S - 1) / R)`` accepted), ``R`` averaging ``S (1 - c)``.

Fractional averages are spread over the rounds by error diffusion, so the
result is deterministic; :func:`derive` searches ``c`` for the tokens per
forward asked and the profile reports what it reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .forward_replay import ForwardShape, count_by_phase
from .suite import BenchError

# The range of tokens per forward the derived profiles span by default: where
# real checkpoints are (see docs/benchmarks.md, "Real shapes"): the paper's
# 2.33x over Qwen3-8B needs at least 2.33 tokens per forward.
DEFAULT_TOKENS_PER_FORWARD = (1.5, 2.0, 2.5, 3.0)


@dataclass(frozen=True)
class Request:
    """One prompt's decode as a derived profile repeats it."""

    prompt_tokens: int
    generated: int
    slot_size: int
    block_lengths: Tuple[int, ...]


@dataclass
class Profile:
    """The forwards of a decode of the same prompts: recorded or derived."""

    label: str
    source: str  # "recorded" or "derived"
    forwards: List[ForwardShape]
    tokens: int  # tokens generated (the AR side generates as many)
    target: Optional[float] = None  # the tokens per forward asked (derived)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(len(self.forwards), 1)

    @property
    def tokens_fed(self) -> int:
        return sum(s.tokens for s in self.forwards)

    def describe(self) -> dict:
        n = max(len(self.forwards), 1)
        return {"label": self.label, "source": self.source, "target": self.target,
                "tokens": self.tokens, "forwards": len(self.forwards),
                "tokens_per_forward": round(self.tokens_per_forward, 4),
                "tokens_fed_per_forward": round(self.tokens_fed / n, 3),
                "widest_forward": max((s.tokens for s in self.forwards), default=0),
                "forwards_per_phase": count_by_phase(self.forwards)}


def requests(prompt_tokens: Sequence[int], generated: Sequence[int], params: Iterable) -> List[Request]:
    """The recorded prompts' lengths and token counts, at each case's settings."""
    out = []
    for p, n, par in zip(prompt_tokens, generated, params):
        layout = par.layout()
        out.append(Request(int(p), int(n), layout.slot_size, tuple(layout.block_lengths)))
    return out


class _Spread:
    """Error diffusion: whole numbers whose running mean follows ``mean``."""

    def __init__(self):
        self.carry = 0.0

    def take(self, mean: float) -> int:
        self.carry += mean
        n = int(math.floor(self.carry + 1e-9))
        self.carry -= n
        return n


def _infill(pos: int, k: int, S: int, rounds: int) -> List[ForwardShape]:
    """``rounds`` rounds of parallel infill of ``k`` slots after ``pos``
    committed rows: each a draft and a verify over every slot's window."""
    out = []
    m = max(1, math.ceil((S - 1) / rounds)) if rounds else 0
    for j in range(rounds):
        a = min(j * (m - 1), S - 1)
        rows = np.array([pos + i * S + t for i in range(k) for t in range(a, S)], dtype=np.int32)
        visible = pos + k * S
        mask = np.zeros((len(rows), visible), dtype=bool)
        mask[:, :pos] = True
        for r, row in enumerate(rows):  # each slot sees the committed rows and its own, causally
            first = pos + ((row - pos) // S) * S
            mask[r, first:row + 1] = True
        for phase in ("infill_draft", "infill_verify"):
            out.append(ForwardShape(len(rows), int(rows[0]), visible, rows, mask, len(rows), phase))
    return out


def _decode(req: Request, c: float, k_spread: _Spread, r_spread: _Spread) -> List[ForwardShape]:
    """One request's forwards at confidence ``c`` (the module's docstring)."""
    S, P = req.slot_size, req.prompt_tokens
    out: List[ForwardShape] = []
    committed = 0
    for length in req.block_lengths:
        open_slots = -(-length // S)
        while open_slots and committed < req.generated:
            pos, width = P + committed, open_slots * S
            if not out:
                out.append(ForwardShape(P + width, 0, P + width, None, "causal", width, "prefill"))
            else:
                out.append(ForwardShape(width, pos, pos + width, None, "causal", width, "plan"))
            if c >= 1:
                k, rounds = max(1, min(open_slots, k_spread.take(c))), 0
            else:
                k, rounds = 1, min(S, r_spread.take(S * (1.0 - c)))
            out.append(ForwardShape(k * S, pos, pos + k * S, None, "causal", k * S, "verify"))
            out += _infill(pos, k, S, rounds)
            committed += k * S
            open_slots -= k
        if committed >= req.generated:
            break
    return out


def _forwards(reqs: Sequence[Request], c: float) -> List[ForwardShape]:
    k_spread, r_spread = _Spread(), _Spread()
    return [s for r in reqs for s in _decode(r, c, k_spread, r_spread)]


def _top(reqs: Sequence[Request]) -> float:
    return float(max(-(-max(r.block_lengths) // r.slot_size) for r in reqs))


def bounds(reqs: Sequence[Request]) -> Tuple[float, float]:
    """The fewest and most tokens per forward a derived profile reaches here."""
    tokens = sum(r.generated for r in reqs)
    return tokens / len(_forwards(reqs, 0.0)), tokens / len(_forwards(reqs, _top(reqs)))


def derive(reqs: Sequence[Request], tokens_per_forward: float, label: Optional[str] = None) -> Profile:
    """The derived profile closest to ``tokens_per_forward`` (a BenchError
    when these settings cannot reach it)."""
    lo, hi = bounds(reqs)
    if not lo - 0.005 <= tokens_per_forward <= hi + 0.005:
        raise BenchError(f"--tokens-per-forward {tokens_per_forward:g} is out of reach at these settings: "
                         f"between {lo:.2f} (every slot infilled to the last token) and {hi:.2f} "
                         "(every slot of a block in one plan and one verify)")
    tokens = sum(r.generated for r in reqs)
    best, best_gap = None, math.inf
    low, high = 0.0, _top(reqs)
    for _ in range(48):  # tokens per forward grows with c: bisect, keep the closest
        c = (low + high) / 2
        forwards = _forwards(reqs, c)
        got = tokens / len(forwards)
        if abs(got - tokens_per_forward) < best_gap:
            best, best_gap = forwards, abs(got - tokens_per_forward)
        if got < tokens_per_forward:
            low = c
        else:
            high = c
    for c in (0.0, _top(reqs)):  # the ends, which bisection never tries
        forwards = _forwards(reqs, c)
        if abs(tokens / len(forwards) - tokens_per_forward) < best_gap:
            best, best_gap = forwards, abs(tokens / len(forwards) - tokens_per_forward)
    return Profile(label or f"ReFusion at {tokens_per_forward:g} tokens/forward", "derived", best, tokens,
                   target=tokens_per_forward)


def derived_range(reqs: Sequence[Request], wanted: Sequence[float]) -> Tuple[List[Profile], List[float]]:
    """Derived profiles for the values of ``wanted`` these settings reach,
    and the values they cannot."""
    lo, hi = bounds(reqs)
    fit = [t for t in wanted if lo - 0.005 <= t <= hi + 0.005]
    return [derive(reqs, t) for t in fit], [t for t in wanted if t not in fit]
