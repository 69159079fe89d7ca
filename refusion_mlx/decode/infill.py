"""(c) Parallel infill (REFUSION.md §4c): the selected slots, decoded side by side.

Each slot is its own sequence that sees the committed cache and its own
tokens only: the slots are packed in one pass whose block-diagonal mask
keeps them apart (``CommittedCache.infill``), so the committed cache is
shared, never copied per slot. A common cursor ``a`` marks how many leading
tokens of every slot are already in the slot's private rows. Each round is
two passes over tokens ``a..S-1`` of every slot:

1. *draft*: unaccepted tokens as the mask id; each becomes the argmax at
   its own position (no sampling);
2. *verify*: the filled window; a token is accepted if its probability
   under the logits one position before exceeds the threshold, or the token
   before it was accepted before this round, or it opens the window; flags
   are then made prefix-closed. Each round accepts at least one new token
   per slot. An accepted EOS drops the slots after the first one holding it.

When every token is accepted, the slots' K/V already sit in their scratch
rows in slot order: :mod:`refusion_mlx.decode.commit` adopts them as is.
"""

from __future__ import annotations

from typing import Generator, List, Tuple

import mlx.core as mx
import numpy as np

from .forward import HeadOutput, Pass, PassResult
from .probs import Drafting
from .state import DecodeState

GREEDY = Drafting()


def infill(state: DecodeState, tokens: np.ndarray, accepted: np.ndarray, positions: List[int],
           scores=None) -> Generator[Pass, PassResult, Tuple[np.ndarray, bool]]:
    """Rounds of draft and verify passes until every token is accepted.

    A generator: it yields the passes and receives their results. Returns
    the surviving slots' tokens (k', S) and whether EOS was found.
    ``scores``: a ``token_scores.SlotScores`` that takes each token's numbers
    in the round that accepts it (a request that asked for logprobs).
    """
    S, tau = state.slot_size, state.params.token_threshold
    tokens = tokens.copy()
    tags = np.cumprod(accepted, axis=1).astype(bool)
    pos = np.array(positions, dtype=np.int32).reshape(-1, S)
    a, eos_found = 0, False
    for _ in range(S):
        if tags.all():
            break
        k, width = tokens.shape[0], S - a
        write = state.cache.infill(k, S, a)  # the same rows and mask for draft and verify
        window_pos = mx.array(pos[:, a:].reshape(-1))
        held = mx.array(tags[:, a:].reshape(-1))
        known = mx.array(tokens[:, a:].reshape(-1))
        drafted = yield infill_draft_pass(state.mask_id, held, known, window_pos, write)
        checked = yield infill_verify_pass(drafted["filled"], window_pos, write, k, width, state.top)
        tokens[:, a:] = checked["tokens"]
        before = np.concatenate([np.ones((k, 1), bool), tags[:, a:-1]], axis=1)
        held_before = tags[:, a:].copy()
        tags[:, a:] = np.cumprod((checked["probs"] > tau) | before, axis=1).astype(bool)
        if scores is not None:
            scores.accept(tags[:, a:] & ~held_before, a, checked)
        tokens, tags, pos, found = cut_after_eos(tokens, tags, pos, a, state.eos_id)
        if found and scores is not None:
            scores.keep(tokens.shape[0])
        eos_found |= found
        m = int(tags[:, a:].sum(axis=1).min())
        a += m - 1 if not tags.all() else m
    return tokens, eos_found


def infill_draft_pass(mask_id: int, held: mx.array, known: mx.array, positions: mx.array, write) -> Pass:
    """Unaccepted tokens as masks; each becomes its position's argmax."""
    masked = mx.where(held, known, mask_id)

    def derive(h: HeadOutput):
        return {}, {"filled": mx.where(held, known, h.draft.astype(known.dtype))}

    return Pass("infill_draft", masked, positions, write, head_rows=int(masked.shape[0]),
                drafting=GREEDY, derive=derive)


def infill_verify_pass(filled: mx.array, positions: mx.array, write, k: int, width: int, top: int = 0) -> Pass:
    """The filled window, scored token by token with the logits before it
    (``top``: and the top tokens of those rows, for the answer's logprobs)."""
    window = filled.reshape(k, width)
    follow = mx.concatenate([window[:, 1:], mx.zeros((k, 1), window.dtype)], axis=1).reshape(-1)

    def derive(h: HeadOutput):
        # column 0 (the window's first token) is accepted outright: its value is unused
        probs = mx.concatenate([mx.zeros((k, 1), mx.float32), h.p_follow.reshape(k, width)[:, :-1]], axis=1)
        host = {"tokens": window, "probs": probs}
        if h.top_ids is not None:  # token j's row is j - 1
            host.update(top_ids=h.top_ids.reshape(k, width, top)[:, :-1],
                        top_values=h.top_logprobs.reshape(k, width, top)[:, :-1])
        return host, {}

    return Pass("infill_verify", filled, positions, write, head_rows=int(filled.shape[0]),
                follow=follow, derive=derive, top=top)


def cut_after_eos(tokens: np.ndarray, tags: np.ndarray, pos: np.ndarray, a: int, eos_id: int):
    """Keep the slots up to the first one holding an accepted EOS (marked
    fully accepted); returns the arrays and whether EOS was found."""
    eos_rows = np.any((tokens[:, a:] == eos_id) & tags[:, a:], axis=1)
    if not eos_rows.any():
        return tokens, tags, pos, False
    first = int(np.argmax(eos_rows))
    tokens, tags, pos = tokens[: first + 1], tags[: first + 1], pos[: first + 1]
    tags[first] = True
    return tokens, tags, pos, True
