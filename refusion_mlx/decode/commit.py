"""Commit: accepted slots join the committed sequence and its cache.

After verification (REFUSION.md §4b) the accepted prefix is committed when
it holds an EOS (up to and including it) or at least one whole slot; after
infill (§4c) the surviving slots are committed in slot order up to the
first EOS. Either way the K/V the pass computed for those tokens already sit
right after the committed rows: committing is bookkeeping, never a copy or
a recomputation. When an EOS is committed, the open slots at or after its
slot's *position* close -- never one before it (§5.1: no holes).
"""

from __future__ import annotations

from typing import List, Optional, Set

import numpy as np

from .stats import SlotCommit, Step


def after_verify(dec, tokens: np.ndarray, accepted: np.ndarray, positions: List[int],
                 selected: List[int], open_slots: List[int]) -> Optional[Step]:
    """Commit the verification's accepted prefix if it holds EOS or a whole
    slot; None sends the selected slots to infill."""
    S = dec.params.slot_size
    flat = tokens.reshape(-1)
    prefix = int(np.cumprod(accepted.reshape(-1)).sum())
    eos_at = np.flatnonzero(flat[:prefix] == dec.eos_id)
    if eos_at.size:
        end, eos_slot = int(eos_at[0]) + 1, int(eos_at[0]) // S
        closed = close_from(set(selected[: eos_slot + 1]), selected, open_slots, eos_slot)
    elif prefix >= S:
        end = (prefix // S) * S
        closed = set(selected[: prefix // S])
    else:
        return None
    return commit_slots(dec, "verify", flat, end, positions, closed, open_slots)


def after_infill(dec, final: np.ndarray, eos_found: bool, positions: List[int],
                 selected: List[int], open_slots: List[int]) -> Step:
    """Commit the infilled slots up to the first EOS; close them."""
    flat = final.reshape(-1)
    eos_at = np.flatnonzero(flat == dec.eos_id)
    end = int(eos_at[0]) + 1 if eos_at.size else flat.size
    closed = set(selected)
    if eos_found:  # close by the EOS slot's block position: no holes (§5.1)
        closed = close_from(closed, selected, open_slots, eos_slot=final.shape[0] - 1)
    return commit_slots(dec, "infill", flat, end, positions, closed, open_slots)


def close_from(closed: Set[int], selected: List[int], open_slots: List[int], eos_slot: int) -> Set[int]:
    """Add every open slot at or after the EOS slot's position to ``closed``."""
    eos_start = open_slots[selected[eos_slot]]
    return closed | {i for i, o in enumerate(open_slots) if o >= eos_start}


def commit_slots(dec, phase: str, flat: np.ndarray, end: int, positions: List[int],
                 closed: Set[int], open_slots: List[int]) -> Step:
    """Commit ``flat[:end]`` (whole slots, the last maybe cut after EOS) and
    close the ``closed`` slots; the Step says which slots were committed."""
    S = dec.params.slot_size
    tokens = flat[:end].tolist()
    dec.cache.commit(tokens, positions[:end])
    dec.stats.committed_tokens += len(tokens)
    if dec.eos_id in tokens:
        dec.eos_committed = True
    commits = [SlotCommit(positions[i:min(i + S, end)], flat[i:min(i + S, end)].tolist())
               for i in range(0, end, S)]
    open_slots[:] = [o for i, o in enumerate(open_slots) if i not in closed]
    return Step(phase, commits, dec.stats)


def response(dec) -> List[int]:
    """Committed response ids in position order, up to and including the first EOS."""
    cache = dec.cache
    pairs = sorted((p, t) for p, t in zip(cache.positions[dec.start:], cache.tokens[dec.start:])
                   if p >= dec.response_start)
    out = []
    for _, t in pairs:
        out.append(t)
        if t == dec.eos_id:
            break
    return out


def settle(dec) -> None:
    """Drop committed rows beyond the answer's EOS, so the cache holds
    exactly the conversation so far and a next turn can continue it."""
    answer = response(dec)
    if not answer or answer[-1] != dec.eos_id:
        return
    last = dec.response_start + len(answer) - 1
    cache = dec.cache
    rows = [r for r, p in enumerate(cache.positions) if r < dec.start or p <= last]
    if len(rows) < len(cache):
        cache.keep(rows)
