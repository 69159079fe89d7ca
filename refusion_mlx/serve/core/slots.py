"""The answer's slots as a stream shows them (``stream_options.include_commits``):
the layout of its blocks, and each step's commits with their positions in the
answer, ids and the text of each token. The web page's slot view draws these."""

from __future__ import annotations

from typing import List

from ...decode.answer import end_ids


def answer_blocks(request) -> List[int]:
    """The lengths of the answer's blocks, the last cut at max_tokens."""
    blocks, left = [], request.max_tokens
    for length in request.layout.block_lengths:
        if left <= 0:
            break
        blocks.append(min(length, left))
        left -= length
    return blocks


def step_commits(tokenizer, request, response) -> dict:
    """A step's commits: per slot, its answer positions (0: the answer's first
    token; those past max_tokens left out), token ids and each token's own text
    (null: the end of the answer), in commit order."""
    start, end = len(request.prompt_ids), request.max_tokens
    ends, vocab = end_ids(tokenizer), len(tokenizer)
    slots = []
    for commit in response.commits:
        kept = [(p - start, t) for p, t in zip(commit.positions, commit.tokens) if p - start < end]
        if kept:
            slots.append({"positions": [p for p, _ in kept], "ids": [t for _, t in kept],
                          "pieces": [None if t in ends else tokenizer.decode([t]) if t < vocab else ""
                                     for _, t in kept]})
    return {"step": response.step + 1, "phase": response.phase, "slots": slots}
