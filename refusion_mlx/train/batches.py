"""From tokenized records to padded batches: length limits, collation, iteration.

As in mlx-lm, records are sorted by length and cut into batches of similar
lengths once; each pass over the data visits those batches in a new random
order. Every time a record is used it gets a fresh example (slot size, mask
draws and slot order), so the model never sees the same corruption twice.
Batch lengths are rounded up to a multiple of ``pad_to`` (32) so a compiled
step sees few distinct shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..errors import RefusionError
from .examples import IGNORE, SLOT_SIZES, Example, build_draft_example, build_example

PAD_TO = 32


@dataclass
class Record:
    """One tokenized training pair; ``where`` names its file and line for errors."""

    prompt: List[int]
    response: List[int]  # EOS included
    where: str = ""

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


def fit_length(records: Sequence[Record], max_seq_length: int) -> int:
    """Cut responses so every sequence fits ``max_seq_length``; return how many were cut.

    A prompt that leaves no room for a single response token is an error
    (the example could teach nothing).
    """
    if max_seq_length < 2:
        raise RefusionError(f"--max-seq-length must be at least 2, got {max_seq_length}")
    cut = 0
    for r in records:
        if len(r.prompt) >= max_seq_length:
            raise RefusionError(f"{r.where}: the prompt has {len(r.prompt)} tokens, no room for a response "
                                f"within --max-seq-length {max_seq_length}")
        if len(r) > max_seq_length:
            r.response = r.response[:max_seq_length - len(r.prompt)]
            cut += 1
    return cut


def padded_length(length: int, max_seq_length: Optional[int] = None, pad_to: int = PAD_TO) -> int:
    """``length`` rounded up to a multiple of ``pad_to``, at most ``max_seq_length``."""
    n = -(-length // pad_to) * pad_to
    if max_seq_length is not None:
        n = min(n, max(max_seq_length, length))
    return n


def collate(examples: Sequence[Example], max_seq_length: Optional[int] = None,
            pad_to: int = PAD_TO, pad_id: int = 0) -> Dict[str, np.ndarray]:
    """Right-padded numpy arrays of a batch (pads: ``pad_id`` at position 0, label IGNORE).

    With a drafting example in it (:func:`build_draft_example`), the batch
    also holds ``visible`` (B, T): the causal ``arange(T)`` except at its masks
    (and ``run_start`` (B, T), ``arange(T)`` except at them, with runs of masks).
    """
    B = len(examples)
    T = padded_length(max(len(e) for e in examples), max_seq_length, pad_to)
    batch = {
        "input_ids": np.full((B, T), pad_id, np.int32),
        "position_ids": np.zeros((B, T), np.int32),
        "labels": np.full((B, T), IGNORE, np.int32),
        "mdm": np.zeros((B, T), bool),
        "mask_prob": np.array([e.mask_prob for e in examples], np.float32),
        "response_length": np.array([e.response_length for e in examples], np.int32),
    }
    for i, e in enumerate(examples):
        n = len(e)
        batch["input_ids"][i, :n] = e.input_ids
        batch["position_ids"][i, :n] = e.position_ids
        batch["labels"][i, :n] = e.labels
        batch["mdm"][i, :n] = e.mdm
    if any(e.visible is not None for e in examples):
        batch["visible"] = np.tile(np.arange(T, dtype=np.int32), (B, 1))
        for i, e in enumerate(examples):
            if e.visible is not None:
                batch["visible"][i, :len(e)] = e.visible
    if any(e.run_start is not None for e in examples):
        batch["run_start"] = np.tile(np.arange(T, dtype=np.int32), (B, 1))
        for i, e in enumerate(examples):
            if e.run_start is not None:
                batch["run_start"][i, :len(e)] = e.run_start
    return batch


def batch_tokens(batch: Dict[str, np.ndarray]) -> int:
    """Real (non-pad) tokens of a collated batch: prompt plus response of every row."""
    return int((batch["position_ids"] > 0).sum() + batch["position_ids"].shape[0])


def batch_indices(records: Sequence[Record], batch_size: int) -> List[List[int]]:
    """Indices sorted by length, cut into full batches (a remainder is left out, as in mlx-lm)."""
    if batch_size < 1:
        raise RefusionError(f"--batch-size must be at least 1, got {batch_size}")
    order = sorted(range(len(records)), key=lambda i: len(records[i]))
    return [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]


def make_example(record: Record, mask_id: int, rng: np.random.Generator, slot_sizes: Sequence[int],
                 draft_fraction: float = 0.0, max_seq_length: Optional[int] = None,
                 draft_run: int = 1) -> Example:
    """A hybrid example, or with probability ``draft_fraction`` a drafting one
    (its masks in runs of ``draft_run``).

    At fraction 0 no extra draw is made, so runs reproduce the paper-objective ones."""
    if draft_fraction > 0 and rng.random() < draft_fraction and \
            (max_seq_length is None or len(record) + len(record.response) <= max_seq_length):
        return build_draft_example(record.prompt, record.response, mask_id, draft_run, rng)
    return build_example(record.prompt, record.response, mask_id, rng, slot_sizes)


def iterate_batches(records: Sequence[Record], batch_size: int, mask_id: int, rng: np.random.Generator,
                    max_seq_length: Optional[int] = None, loop: bool = False,
                    slot_sizes: Sequence[int] = SLOT_SIZES, pad_id: int = 0,
                    pad_to: int = PAD_TO, draft_fraction: float = 0.0,
                    by_length: bool = True, draft_run: int = 1) -> Iterator[Dict[str, np.ndarray]]:
    """Collated batches of fresh examples; forever with ``loop``.

    Records must already fit ``max_seq_length`` (see :func:`fit_length`).
    With ``draft_fraction`` > 0 each example is a drafting example with that
    probability (when its doubled response still fits ``max_seq_length``),
    its masks in runs of ``draft_run``.
    ``by_length`` (mlx-lm's way, least padding): batches of records of about
    one length, the same batches every pass in a shuffled order. Without it
    every pass deals the records into new batches at random: rows of one
    length share a decision's position (where a count ends), and a batch of
    them rewards a position rule over reading the prompt. The order comes
    from ``rng`` alone: a generator seeded anew gives the same batches.
    """
    groups = batch_indices(records, batch_size)
    if not groups:
        raise RefusionError(f"{len(records)} examples are fewer than the batch size {batch_size}")
    while True:
        if not by_length:
            deal = rng.permutation(len(records)).tolist()
            groups = [deal[i:i + batch_size] for i in range(0, len(deal) - batch_size + 1, batch_size)]
        for g in rng.permutation(len(groups)):
            examples = [make_example(records[i], mask_id, rng, slot_sizes, draft_fraction, max_seq_length,
                                     draft_run)
                        for i in groups[g]]
            yield collate(examples, max_seq_length, pad_to, pad_id)
        if not loop:
            return
