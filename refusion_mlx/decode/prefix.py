"""How much of a token sequence a committed cache already holds: its rows in
position order and their longest common prefix with new prompt ids (what the
chat session and the server's prompt cache reuse instead of prefilling)."""

from __future__ import annotations

from typing import List, Sequence, Tuple


def ordered(cache) -> Tuple[List[int], List[int]]:
    """(tokens, rows): the cache's rows for positions 0, 1, 2, ... up to the first gap."""
    ordered_rows = cache.in_position_order()
    n = next((i for i, (p, _, _) in enumerate(ordered_rows) if p != i), len(ordered_rows))
    return [t for _, _, t in ordered_rows[:n]], [r for _, r, _ in ordered_rows[:n]]


def prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def held_length(cache, ids: Sequence[int]) -> int:
    """How many leading tokens of ``ids`` the cache holds at positions 0, 1, 2, ...
    (up to the first gap), read by position: in time that grows with that
    count, not with the cache's rows (a running request's cache, read at each
    admission)."""
    n = 0
    while n < len(ids) and cache.token_at(n) == ids[n]:
        n += 1
    return n


def common_prefix(cache, ids: Sequence[int]) -> tuple:
    """(n, rows): the cache's rows for positions 0..n-1, whose tokens equal ids[:n].

    The cache holds rows in commit order; in position order they are the
    conversation so far. A gap in the positions ends the usable prefix.
    """
    tokens, rows = ordered(cache)
    n = prefix_length(tokens, ids)
    return n, rows[:n]
