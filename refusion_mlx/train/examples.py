"""One training example of ReFusion's hybrid objective, built from token ids.

The response (its tokens plus EOS) is cut into slots of one size drawn from
{4, 8, 16, 32} (the last slot may be shorter). With t ~ U(0, 1) each slot is
masked independently with probability p = (1 - eps) * t + eps. The sequence
the causal model sees is

* the prompt (no loss);
* the unmasked slots in a random order: each token is labelled with the next
  token *of its own slot*, a slot's last token with nothing (AR task);
* the masked slots in their original order: every token replaced by the mask
  id and labelled with its own token (MDM task).

Every token keeps its true position id (RoPE sees real positions; attention is
causal in sequence order, as in decoding). All randomness comes from the
``numpy.random.Generator`` passed in, so an example is reproducible.

:func:`build_draft_example` is this project's addition (the trainer's
``--draft-fraction``, off by default): the condition decoding drafts every
token under, taught at every response position at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import RefusionError

SLOT_SIZES: Tuple[int, ...] = (4, 8, 16, 32)
EPSILON = 1e-3
IGNORE = -100  # label of a token without loss


@dataclass
class Example:
    """The arrays of one sequence, unpadded, in sequence order."""

    input_ids: np.ndarray      # (T,) int32
    position_ids: np.ndarray   # (T,) int32
    labels: np.ndarray         # (T,) int32, IGNORE where no loss
    mdm: np.ndarray            # (T,) bool, True exactly at the mask tokens
    mask_prob: float           # p of this example
    response_length: int       # response tokens (EOS included)
    slot_size: int
    visible: Optional[np.ndarray] = None  # (T,) int32: keys each token sees (None: causal)
    run_start: Optional[np.ndarray] = None  # (T,) int32: first key of its own run (None: itself)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def slot_bounds(length: int, size: int) -> List[Tuple[int, int]]:
    """[start, end) of each slot of a ``length``-token response; the last may be shorter."""
    return [(s, min(s + size, length)) for s in range(0, length, size)]


def mask_probability(t: float, eps: float = EPSILON) -> float:
    """p = (1 - eps) * t + eps: never 0, so 1/p stays bounded by 1/eps."""
    return (1.0 - eps) * t + eps


def build_example(prompt_ids: Sequence[int], response_ids: Sequence[int], mask_id: int,
                  rng: np.random.Generator, slot_sizes: Sequence[int] = SLOT_SIZES,
                  eps: float = EPSILON) -> Example:
    """The training arrays of one (prompt, response) pair.

    ``response_ids`` is the whole response, EOS included (the dataset appends
    it). Draws, in this order: the slot size, t, one mask coin per slot, the
    order of the unmasked slots.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
    response = np.asarray(response_ids, dtype=np.int32).reshape(-1)
    if response.size == 0:
        raise RefusionError("a training example needs at least one response token (EOS)")
    if not slot_sizes or any(int(s) < 1 for s in slot_sizes):
        raise RefusionError(f"slot sizes must be positive integers, got {list(slot_sizes)}")
    P, L = prompt.size, response.size
    size = int(rng.choice(np.asarray(slot_sizes)))
    p = mask_probability(float(rng.random()), eps)
    slots = slot_bounds(L, size)
    masked = rng.random(len(slots)) < p
    visible = [i for i in range(len(slots)) if not masked[i]]
    visible = [visible[i] for i in rng.permutation(len(visible))]

    ids, pos, labels, mdm = [prompt], [np.arange(P, dtype=np.int32)], [np.full(P, IGNORE, np.int32)], \
        [np.zeros(P, bool)]
    for i in visible:  # AR task: next token of the same slot
        s, e = slots[i]
        ids.append(response[s:e])
        pos.append(np.arange(P + s, P + e, dtype=np.int32))
        lab = np.full(e - s, IGNORE, np.int32)
        lab[:-1] = response[s + 1:e]
        labels.append(lab)
        mdm.append(np.zeros(e - s, bool))
    for i in np.flatnonzero(masked):  # MDM task: own token at a mask id, original order
        s, e = slots[i]
        ids.append(np.full(e - s, mask_id, np.int32))
        pos.append(np.arange(P + s, P + e, dtype=np.int32))
        labels.append(response[s:e].copy())
        mdm.append(np.ones(e - s, bool))
    return Example(np.concatenate(ids).astype(np.int32), np.concatenate(pos), np.concatenate(labels),
                   np.concatenate(mdm), float(p), int(L), size)


def build_draft_example(prompt_ids: Sequence[int], response_ids: Sequence[int], mask_id: int,
                        run: int = 1, rng: Optional[np.random.Generator] = None) -> Example:
    """Every response token drafted from the written tokens before it.

    Decoding writes no token from next-token logits: it drafts each one from
    a mask at its position that sees the committed tokens (plan, and infill
    after a slot's accepted prefix), and the next-token logits only verify.
    The hybrid examples above put most masks after other masks, so a small
    model learns a decision such as where a count ends at the real tokens
    (AR task) but not at the mask that drafts it. This example asks it of
    every response position at once:

    * the prompt (no loss) and the response in order, each response token
      labelled with the next one (AR task, the whole response one slot);
    * then one mask per response position k, labelled with token k, that
      attends to the prompt, the response before k and itself only
      (``visible``; the model builds the attention from it).

    With ``run`` > 1 the masks come in runs of ``run`` consecutive positions
    (the first run shorter, by a draw from ``rng``, so that run boundaries
    fall anywhere): a mask sees the response before its run and the masks of
    its run before it -- the plan pass, which drafts a block of masks after
    the committed text. A count's end is then drafted up to ``run - 1``
    masks away from the last written number, as the plan drafts it.

    It enters the loss as an example whose every response token is masked
    (``mask_prob`` 1): the mean cross-entropy of its masks.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
    response = np.asarray(response_ids, dtype=np.int32).reshape(-1)
    if response.size == 0:
        raise RefusionError("a training example needs at least one response token (EOS)")
    if run < 1:
        raise RefusionError(f"a run of masks needs at least one mask, got {run}")
    P, L = prompt.size, response.size
    ids = np.concatenate([prompt, response, np.full(L, mask_id, np.int32)])
    pos = np.concatenate([np.arange(P + L, dtype=np.int32), np.arange(P, P + L, dtype=np.int32)])
    labels = np.full(P + 2 * L, IGNORE, np.int32)
    labels[P:P + L - 1] = response[1:]  # as the hybrid's AR task: no label leaves the prompt
    labels[P + L:] = response
    mdm = np.zeros(P + 2 * L, bool)
    mdm[P + L:] = True
    starts = run_starts(L, run, rng)  # response position where each mask's run begins
    visible = np.concatenate([np.arange(P + L, dtype=np.int32), P + starts])
    run_start = None
    if run > 1:
        run_start = np.concatenate([np.arange(P + L, dtype=np.int32), P + L + starts])
    return Example(ids, pos, labels, mdm, 1.0, int(L), int(L), visible, run_start)


def run_starts(length: int, run: int, rng: Optional[np.random.Generator]) -> np.ndarray:
    """(length,) int32: the first position of the run each position falls in.

    Runs are ``run`` long; the first is 1..run long (drawn), so that over
    examples every position is some run's k-th mask for every k < run."""
    k = np.arange(length, dtype=np.int32)
    if run == 1:
        return k
    if rng is None:
        raise RefusionError("runs of masks longer than one need a random generator")
    shift = int(rng.integers(run))  # positions before the first full run
    k = k.astype(np.int64)  # run and shift may pass int32's range (a run longer than any response)
    return np.where(k < shift, 0, shift + (k - shift) // run * run).astype(np.int32)
