"""(b) Global verification (REFUSION.md §4b): check the selected drafts in one pass.

The selected slots' drafts, concatenated in position order, are fed once at
their positions after the cache, keeping their K/V. Token j's verified
probability is that of the drafted token under the logits at j-1; inside a
slot, tokens 1..S-1 take it, token 0 keeps its planning probability and is
always accepted. The longest accepted prefix decides what is committed
(:mod:`refusion_mlx.decode.commit`).
"""

from __future__ import annotations

from typing import List, Tuple

import mlx.core as mx
import numpy as np

from .forward import HeadOutput, Pass
from .state import DecodeState


def verify_pass(state: DecodeState, drafts: mx.array, confidence: np.ndarray,
                selected: List[int]) -> Tuple[Pass, List[int]]:
    """The verification pass and the positions of its tokens."""
    S = state.slot_size
    chosen = mx.take(drafts, mx.array(selected, dtype=mx.int32), axis=0).reshape(-1)
    positions = [state.response_start + state.open_slots[i] + j for i in selected for j in range(S)]
    follow = mx.concatenate([chosen[1:], mx.zeros((1,), chosen.dtype)])  # each row scores the next token
    first = mx.array(confidence[selected], dtype=mx.float32)

    def derive(h: HeadOutput):
        verified = h.p_follow.reshape(-1, S)[:, :-1]  # token j under the logits at j - 1
        probs = mx.concatenate([first[:, None], verified], axis=1)
        host = {"tokens": chosen.reshape(-1, S), "probs": probs}
        if h.top_ids is not None:  # token j's row is j - 1 (token 0's is the plan's)
            host.update(top_ids=h.top_ids.reshape(-1, S, state.top)[:, :-1],
                        top_values=h.top_logprobs.reshape(-1, S, state.top)[:, :-1])
        return host, {}

    return Pass("verify", chosen, mx.array(positions, dtype=mx.int32), state.cache.extend(len(positions)),
                head_rows=len(positions), follow=follow, derive=derive, top=state.top), positions


def accepted(probs: np.ndarray, threshold: float) -> np.ndarray:
    """Accept flags: verified probability above ``threshold``; each slot's
    first token always."""
    flags = probs > threshold
    flags[:, 0] = True
    return flags
