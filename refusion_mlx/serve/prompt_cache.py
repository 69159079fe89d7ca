"""Committed caches kept across requests: a conversation's next turn, or a
system prompt many requests share, continues from cached keys and values
instead of prefilling them again.

An entry is a CommittedCache compacted to its rows in position order (the
conversation: prompt, then answer). A lookup finds the entry with the
longest common prefix with a new prompt and hands the request its own copy
of those rows (``CommittedCache.fork``), so entries are never written to and
any number of requests can start from one. Entries are evicted least
recently used first, beyond a byte budget (``CommittedCache.nbytes``).
With a ``store`` (:class:`.cache_files.CacheDir`), every new entry is also
written to disk, an entry replaced by its extension is deleted there, and a
hit marks its file used; entries evicted from memory stay on disk.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence, Tuple

from ..decode.prefix import ordered, prefix_length

# tokens requests must share (beyond the cache) to prefill them once for all
SHARED_PREFIX = 16


def prefill(model, cache, ids: Sequence[int]) -> None:
    """Append ``ids`` (positions after the cache's) to ``cache`` as committed
    rows: ``decode.prefill.prefill``, imported on first use (as mlx is)."""
    from ..decode.prefill import prefill as run

    run(model, cache, ids)


class PromptCache:
    """An LRU of committed caches keyed by their tokens in position order."""

    def __init__(self, max_bytes: int, store=None):
        self.max_bytes, self.store = max_bytes, store
        self.entries: "OrderedDict[tuple, object]" = OrderedDict()  # tokens -> compact cache, oldest use first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, ids: Sequence[int], running: Iterable = ()) -> Tuple[int, Optional[object]]:
        """(n, cache): a copy of the cached rows of ``ids[:n]`` (None when n is 0).

        ``running``: caches of requests still decoding, whose committed rows
        (a prompt prefilled a step ago) count too. At least one token of
        ``ids`` is left to prefill: the decoder's first pass needs one.
        """
        sources = [(tokens, cache, None) for tokens, cache in self.entries.items()]
        sources += [(tokens, c, rows) for c in running for tokens, rows in [ordered(c)]]
        best, n = None, 0
        for source in sources:
            m = prefix_length(source[0], ids)
            if m > n:
                best, n = source, m
        n = min(n, len(ids) - 1)
        if best is None or n <= 0:
            return 0, None
        tokens, cache, rows = best
        if rows is None:  # an entry: rows in position order
            self.entries.move_to_end(tokens)
            if self.store is not None:
                self.store.touch(tokens)
        return n, cache.fork(range(n) if rows is None else rows[:n])

    def start(self, model, ids: Sequence[int], running: Iterable, peers: Sequence[Sequence[int]],
              new_cache) -> Tuple[int, int, object]:
        """Where a new request's prompt ``ids`` starts: ``(cached, n, cache)``,
        the rows the cache held for it, the rows its cache holds now and that
        cache (its own; ``new_cache()`` makes an empty one). When ``peers`` (the
        prompts admitted or waiting beside it) share ``SHARED_PREFIX`` more
        tokens with it than the cache held, they are prefilled now and kept
        here, once for all of them."""
        cached, cache = self.lookup(ids, running)
        n = cached
        shared = min(len(ids) - 1, max((prefix_length(ids, p) for p in peers), default=0))
        if shared - n >= SHARED_PREFIX and self.max_bytes > 0:
            cache = cache or new_cache()
            prefill(model, cache, ids[n:shared])
            self.insert(cache)
            n = shared
        return cached, n, cache or new_cache()

    def insert(self, cache) -> None:
        """Keep a compact copy of ``cache`` (a finished request's, or a prefix
        prefilled for many); entries it extends are dropped, then the least
        recently used ones beyond the byte budget."""
        tokens, rows = ordered(cache)
        if self.max_bytes <= 0 or not tokens:
            return
        known = tuple(tokens) in self.entries
        entry = cache.fork(rows)
        for old in self._add(tuple(tokens), entry):
            self.store is None or self.store.remove(old)
        if self.store is not None:
            self.store.touch(tokens) if known else self.store.save(tokens, entry)

    def restore(self, tokens: Sequence[int], entry) -> None:
        """Take back an entry read from the store (compact, in position order); the
        store's files of entries it extends go."""
        if self.max_bytes > 0:
            for old in self._add(tuple(tokens), entry):
                self.store is None or self.store.remove(old)

    def _add(self, tokens: tuple, entry) -> list:
        """Keep ``entry``; drop the entries it extends (returned), then the least recently used beyond budget."""
        extended = [t for t in self.entries if t == tokens[:len(t)] and t != tokens]
        for old in extended + [tokens] * (tokens in self.entries):
            self.nbytes -= self.entries.pop(old).nbytes
        self.entries[tokens] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes
        return extended
