"""Commit: accepted slots join the committed sequence and its cache.

After verification (REFUSION.md §4b) the accepted prefix is committed when
it holds an EOS (up to and including it) or at least one whole slot; after
infill (§4c) the surviving slots are committed in slot order up to the
first EOS. Either way the K/V the pass computed for those tokens already sit
right after the committed rows: committing is bookkeeping, never a copy or
a recomputation. When an EOS is committed, the open slots at or after its
slot's *position* close -- never one before it (§5.1: no holes).

These functions decide; :meth:`DecodeState.commit` applies the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set

import numpy as np

from .state import DecodeState


@dataclass
class Commit:
    """A commit decision: ``tokens[:end]`` at ``positions[:end]``, and the
    open slots (indices into ``open_slots``) that close."""

    phase: str
    tokens: np.ndarray  # flat, in slot order
    end: int
    positions: List[int]
    closed: Set[int]


def after_verify(state: DecodeState, tokens: np.ndarray, accepted: np.ndarray, positions: List[int],
                 selected: List[int]) -> Optional[Commit]:
    """The verification's accepted prefix if it holds EOS or a whole slot;
    None sends the selected slots to infill."""
    S = state.slot_size
    flat = tokens.reshape(-1)
    prefix = int(np.cumprod(accepted.reshape(-1)).sum())
    eos_at = np.flatnonzero(flat[:prefix] == state.eos_id)
    if eos_at.size:
        end, eos_slot = int(eos_at[0]) + 1, int(eos_at[0]) // S
        closed = close_from(set(selected[: eos_slot + 1]), selected, state.open_slots, eos_slot)
    elif prefix >= S:
        end = (prefix // S) * S
        closed = set(selected[: prefix // S])
    else:
        return None
    return Commit("verify", flat, end, positions, closed)


def after_infill(state: DecodeState, final: np.ndarray, eos_found: bool, positions: List[int],
                 selected: List[int]) -> Commit:
    """The infilled slots up to the first EOS; they close."""
    flat = final.reshape(-1)
    eos_at = np.flatnonzero(flat == state.eos_id)
    end = int(eos_at[0]) + 1 if eos_at.size else flat.size
    closed = set(selected)
    if eos_found:  # close by the EOS slot's block position: no holes (§5.1)
        closed = close_from(closed, selected, state.open_slots, eos_slot=final.shape[0] - 1)
    return Commit("infill", flat, end, positions, closed)


def close_from(closed: Set[int], selected: List[int], open_slots: List[int], eos_slot: int) -> Set[int]:
    """Add every open slot at or after the EOS slot's position to ``closed``."""
    eos_start = open_slots[selected[eos_slot]]
    return closed | {i for i, o in enumerate(open_slots) if o >= eos_start}
