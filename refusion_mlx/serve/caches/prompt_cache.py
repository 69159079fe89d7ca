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
hit marks its file used; entries evicted from memory stay on disk. A cache
whose rows an entry holds already (its tokens begin that entry's) adds
nothing and marks that entry used, so an entry is never a prefix of another
of its owner's, in memory, on disk and after a restart alike. Each owner's
entries are indexed by their tokens (:class:`.token_trie.TokenTrie`), so a
lookup, and the checks an insert makes, walk the prompt once, however many
entries are kept; a running request's rows are read by position
(``decode.prefix.held_length``), not sorted.

Every entry has an ``owner`` (``EngineRequest.cache_owner``: a hash of the
API key and ``user`` of the request that left it; "" is everyone's): a
request only ever continues -- and only ever waits for a shared prefix
(:meth:`PromptCache.waits`) of -- requests of its own owner, so the
``cached_tokens`` it is told say nothing of anyone else's prompts. An
owner of None reads and leaves nothing. The cache holds one model's
entries (the server's); ``fingerprint`` names it (the files carry it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ...decode.prefix import common_prefix, held_length, ordered
from .token_trie import TokenTrie

# tokens a request must share with one ahead of it (beyond the cache) to wait for that one's rows
SHARED_PREFIX = 16


class PromptCache:
    """An LRU of committed caches keyed by their owner and their tokens in position order."""

    def __init__(self, max_bytes: int, store=None, fingerprint: str = ""):
        self.max_bytes, self.store, self.fingerprint = max_bytes, store, fingerprint
        # (owner, tokens) -> compact cache, oldest use first
        self.entries: "OrderedDict[Tuple[str, tuple], object]" = OrderedDict()
        self.index: Dict[str, TokenTrie] = {}  # owner -> the tokens of its entries
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, ids: Sequence[int], owner: Optional[str] = "",
               running: Iterable = ()) -> Tuple[int, Optional[object]]:
        """(n, cache): a copy of the rows of ``ids[:n]`` that ``owner``'s entries hold (None when n is 0).

        ``running``: (owner, cache) of requests still decoding, whose committed
        rows (a prompt prefilled a step ago) count too when the owner is the
        same. At least one token of ``ids`` is left to prefill: the decoder's
        first pass needs one. A cache of no bytes (``--prompt-cache-bytes 0``)
        reuses nothing, running requests' rows neither: every prompt is prefilled.
        """
        n, key, cache = self._best(ids, owner, running)
        if cache is None:
            return 0, None
        if key is None:  # a running request's: its rows for positions 0..n-1
            return n, cache.fork(common_prefix(cache, ids[:n])[1])
        self.entries.move_to_end(key)  # an entry: rows in position order
        if self.store is not None:
            self.store.touch(*key)
        return n, cache.fork(range(n))

    def _best(self, ids: Sequence[int], owner: Optional[str], running: Iterable) -> Tuple[int, Optional[tuple], object]:
        """(n, key, cache): how many tokens of ``ids`` (all but the last, at most) the source holding
        the most of them holds, its key (None for a running request's cache) and that cache
        (None when no source holds any: :meth:`lookup`)."""
        if owner is None or self.max_bytes <= 0:
            return 0, None, None
        n, tokens = self.index[owner].longest(ids) if owner in self.index else (0, None)
        key = None if tokens is None else (owner, tokens)
        best = None if key is None else self.entries[key]
        for o, cache in running:
            m = held_length(cache, ids) if o == owner else 0
            if m > n:
                n, key, best = m, None, cache
        n = min(n, len(ids) - 1)
        return (n, key, best) if n > 0 else (0, None, None)

    def waits(self, ids: Sequence[int], owner: Optional[str], ahead: List[list], running: Iterable) -> bool:
        """Whether a request of ``owner`` with prompt ``ids`` waits for the prompt of
        one ahead of it to land. ``ahead``: [owner, prompt, held] of requests started
        before it whose prompts are not all in their caches yet; ``held``, how many
        tokens of that prompt the cache and ``running`` hold, is filled in when first
        needed (None till then: a turn finds it once). It waits while one of its owner
        shares ``SHARED_PREFIX`` more of its tokens than that (what any source holds
        of the part they share is the same for both prompts): that request prefills
        them (a chunk a step, in the batch's forwards), and this one then starts from
        its rows (:meth:`lookup`) -- prefilled once, with no engine turn of its own."""
        if owner is None or self.max_bytes <= 0:
            return False
        for other in ahead:
            o, prompt, held = other
            if o != owner or len(ids) <= SHARED_PREFIX or list(ids[:SHARED_PREFIX]) != list(prompt[:SHARED_PREFIX]):
                continue
            if held is None:
                held = other[2] = self._best(prompt, owner, running)[0]
            k = held + SHARED_PREFIX
            if len(ids) > k and list(ids[:k]) == list(prompt[:k]):
                return True
        return False

    def insert(self, cache, owner: Optional[str] = "") -> None:
        """Keep a compact copy of ``cache`` (a finished request's) as ``owner``'s;
        entries of that owner it extends are dropped, then the least recently
        used ones beyond the byte budget."""
        tokens, rows = ordered(cache)
        if self.max_bytes <= 0 or not tokens or owner is None:
            return
        key = (owner, tuple(tokens))
        cover = self._covering(key)
        if cover is not None:  # its rows are held already (the same tokens, or an entry they begin): used now
            self.entries.move_to_end(cover)
            self.store is None or self.store.touch(*cover)
            return
        entry = cache.fork(rows, exact=True)  # its rows alone: a short chat's entry holds no 256-row growth step
        dropped = self._add(key, entry)
        if dropped is None:
            return
        for old in dropped:
            self.store is None or self.store.remove(*old)
        if self.store is not None:
            self.store.save(owner, tokens, entry)

    def restore(self, owner: str, tokens: Sequence[int], entry) -> None:
        """Take back an entry read from the store (compact, in position order); the
        store's files of entries it extends go."""
        if self.max_bytes <= 0:
            return
        key = (owner, tuple(tokens))
        cover = self._covering(key)
        if cover is not None:  # as insert keeps them: the longer entry, used as recently as the newer file
            self.entries.move_to_end(cover)
            if cover != key and self.store is not None:
                self.store.remove(*key)
            return
        for old in self._add(key, entry) or ():
            self.store is None or self.store.remove(*old)

    def _covering(self, key: Tuple[str, tuple]) -> Optional[Tuple[str, tuple]]:
        """The key of an entry of ``key``'s owner whose tokens begin with ``key``'s (itself included), if any."""
        owner, tokens = key
        if key in self.entries:
            return key
        cover = self.index[owner].covering(tokens) if owner in self.index else None
        return None if cover is None else (owner, cover)

    def _add(self, key: Tuple[str, tuple], entry) -> Optional[list]:
        """Keep ``entry``; drop its owner's entries it extends (returned), then the least recently used
        beyond budget. An entry over the whole budget is not kept (None), and every other stays: it
        emptied the cache (a 15k-token agent request, every conversation of a 2 GiB cache)."""
        if entry.nbytes > self.max_bytes:
            return None
        owner, tokens = key
        trie = self.index.get(owner)
        extended = [(owner, t) for t in trie.prefixes(tokens) if t != tokens] if trie is not None else []
        for old in extended + [key] * (key in self.entries):
            self._drop(old)
        self.entries[key] = entry
        self.index.setdefault(owner, TokenTrie()).add(tokens)
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
        return extended

    def _drop(self, key: Tuple[str, tuple]) -> None:
        """Take an entry out of memory (the one place one goes)."""
        self.nbytes -= self.entries.pop(key).nbytes
        trie = self.index[key[0]]
        trie.remove(key[1])
        if not trie:
            del self.index[key[0]]

    def clear(self) -> None:
        """Let every entry go from memory (the engine is ending; the store keeps its files)."""
        self.entries.clear()
        self.index.clear()
        self.nbytes = 0
