"""(a) Plan (REFUSION.md §4a): draft every open slot of the block from masks.

One pass over all open slots, every token the mask id, at their true
positions after the cache (the very first pass also carries the prompt's
tail: that is the prefill). Its K/V are thrown away. Each position gets a
draft and its probability; a slot's confidence is its first token's.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import numpy as np

from .forward import HeadOutput, Pass
from .probs import XTC, Drafting, gumbel_noise
from .state import DecodeState


def plan_pass(state: DecodeState, tail: List[int]) -> Pass:
    """The planning pass of the block's open slots; ``tail``: prompt tokens
    still to prefill (only on the first pass), fed first at their own positions."""
    S = state.slot_size
    n = len(state.open_slots) * S
    positions = list(range(state.response_start - len(tail), state.response_start)) + \
        [state.response_start + o + j for o in state.open_slots for j in range(S)]
    tokens = tail + [state.mask_id] * n
    return Pass("prefill" if tail else "plan", mx.array(tokens, dtype=mx.int32),
                mx.array(positions, dtype=mx.int32), state.cache.extend(len(tokens), settled=len(tail)), head_rows=n,
                drafting=drafting(state, n), derive=lambda h: _confidence(h, S), top=state.top)


def drafting(state: DecodeState, rows: int) -> Drafting:
    """This pass's drafting: greedy, or sampled with fresh noise from the
    request's own key (its draws never depend on other requests)."""
    p = state.params
    noise = xtc = None
    if p.temperature > 0:
        noise = gumbel_noise(state.next_key(), rows, state.vocab, p.slot_size)
        if p.xtc_probability > 0:  # a key of its own: a seeded request without XTC draws as it always has
            coins = mx.random.uniform(shape=(rows,), key=state.next_key())
            xtc = XTC(p.xtc_probability, p.xtc_threshold, coins, state.xtc_kept)
    return Drafting(p.temperature, noise, p.top_p, p.top_k, p.min_p, xtc)


def _confidence(h: HeadOutput, S: int):
    """Host: each slot's confidence (and with ``top``, its first row's top tokens); device: the drafts (n, S)."""
    host = {"confidence": h.p_draft[::S]}
    if h.top_ids is not None:
        host.update(top_ids=h.top_ids[::S], top_values=h.top_logprobs[::S])
    return host, {"drafts": h.draft.reshape(-1, S)}


def select(confidence: np.ndarray, threshold: float) -> List[int]:
    """Every slot more confident than ``threshold``; if none, the single most
    confident one. In position order."""
    selected = [i for i, c in enumerate(confidence) if c > threshold]
    return selected or [int(np.argmax(confidence))]
