"""The committed sequence and its KV cache, as one object.

ReFusion's cache holds exactly the committed tokens, in commit order, each
with its own position id (as the paper lays it out). Every forward pass writes its keys
and values into the rows just after the committed ones (the *scratch* rows):

* ``extend(n)``: a pass of n tokens appended in sequence order (prefill,
  planning, global verification). ``commit`` then keeps a prefix of those
  rows; the rest are simply overwritten by the next pass ("crop").
* ``infill(k, S, a)``: k slots decoded in parallel, slot i owning scratch rows
  ``[i*S, (i+1)*S)``. Each slot sees the committed rows and its own rows only,
  through one block-diagonal mask, so the committed cache is shared and never
  copied per slot. When infill ends the slots' rows already sit in slot order
  right after the committed rows, and ``commit`` adopts them: the infill K/V
  are reused, not recomputed.

Each layer's keys and values live in a :class:`~.kv_store.KVStore` (the
float store unless a :class:`~.kv_store.KVStorage` says otherwise), made from
the model's ``cache_spec()``; this object decides which rows exist and tells
the stores. Stores are preallocated and grow in steps, so no pass
concatenates.

This object is the one holder of the committed tokens: the answer's text
(:class:`~refusion_mlx.decode.answer.AnswerText`), the terminal's slot view
and the prompt-cache lookups read them through ``token_at`` and
``in_position_order`` rather than keeping copies.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..models.base import CacheSpec
from .kv_store import KVStorage, KVStore

GROWTH_ROWS = 256  # a cache's capacity grows in multiples of these rows


class CommittedCache:
    """Committed tokens with their positions and per-layer K/V, in commit order.

    ``spec``: the model's ``cache_spec()``; only the layers it holds (a
    pipeline rank's range) have a store, the others' stay None and cost
    nothing. ``growth``: the capacity grows in multiples of these rows.
    ``storage``: how each layer's keys and values are kept."""

    def __init__(self, spec: CacheSpec, growth: int = GROWTH_ROWS, storage: Optional[KVStorage] = None):
        self.spec = spec
        self.storage = KVStorage() if storage is None else storage
        self.growth = growth
        self.tokens: List[int] = []
        self.positions: List[int] = []
        self._row_of: Dict[int, int] = {}  # position -> row, for reading in position order
        self.stores: List[Optional[KVStore]] = self._empty_stores()
        self.capacity = 0
        self.planned = 0  # the most rows a holder expects it to hold (``plan``)
        self.decoding = None  # a weak reference to the response decoding into this cache (decode/decoder.py)

    @classmethod
    def for_model(cls, model, growth: int = GROWTH_ROWS, storage: Optional[KVStorage] = None) -> "CommittedCache":
        return cls(model.cache_spec(), growth, storage)

    def take_form(self, storage: KVStorage) -> bool:
        """Keep keys and values as ``storage`` does from now on; only a cache that holds nothing yet can."""
        if self.tokens or self.capacity:
            return False
        self.storage = storage
        self.stores = self._empty_stores()
        return True

    def _empty_stores(self) -> List[Optional[KVStore]]:
        held = self.spec.held
        return [self.storage.new(self.spec) if i in held else None for i in range(self.spec.layers)]

    def _held(self) -> List[KVStore]:
        return [s for s in self.stores if s is not None]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._held())

    @property
    def next_position(self) -> int:
        """The position after the last committed one: where a prompt that continues this cache starts."""
        return max(self.positions) + 1 if self.positions else 0

    def plan(self, rows: int) -> None:
        """The most rows this cache is expected to hold (a response's prompt and whole budget): from now on
        it at least doubles its capacity when it grows, up to those rows, so a long answer copies its stores
        a few times, and a short answer of a large budget holds memory for what it wrote, not for the budget
        (a request cut to a 32k context reserved ~5 GB at the 8B shape, however short its answer). Nothing
        is allocated here."""
        self.planned = rows

    def reserve(self, rows: int, exact: bool = False) -> None:
        """Make room for ``rows`` scratch rows after the committed ones.

        Growth happens in multiples of ``growth`` rows, doubling up to what
        was planned (``plan``), and copies the stores once per growth, never
        once per token; ``exact``: just the rows (a copy kept, not grown).
        """
        need = len(self) + rows
        if need <= self.capacity:
            return
        new_capacity = need if exact else -(-need // self.growth) * self.growth
        if not exact and self.planned > new_capacity:
            new_capacity = min(max(new_capacity, 2 * self.capacity), -(-self.planned // self.growth) * self.growth)
        for store in self._held():
            store.grow(new_capacity)
        self.capacity = new_capacity

    def extend(self, n: int, settled: int = 0) -> "KVWrite":
        """A pass of n tokens after the committed ones, causal in sequence
        order. ``settled``: how many of its first rows will be committed
        whatever the pass decides (prompt tokens), which a store may keep in
        its committed form at once (``KVStore.write``)."""
        self.reserve(n)
        start = len(self)
        return KVWrite(self, start=start, rows=None, visible=start + n, mask="causal", settled=settled)

    def infill(self, num_slots: int, slot_size: int, cursor: int) -> "KVWrite":
        """A pass over tokens ``cursor..S-1`` of each of ``num_slots`` slots.

        Slot i's window goes to scratch rows ``i*S + cursor ..``; its queries
        see all committed rows plus rows ``i*S .. i*S + cursor + j`` (its own
        private prefix and its window causally), never another slot's rows.
        """
        S, a, L = slot_size, cursor, len(self)
        self.reserve(num_slots * S)
        window = S - a
        # made on the host: a few small arrays, not a dozen kernels in every infill forward
        slot = np.arange(num_slots * window) // window
        rows = L + slot * S + a + np.arange(num_slots * window) % window
        keys = np.arange(L + num_slots * S)[None, :]
        own_start = (L + slot * S)[:, None]
        mask = (keys < L) | ((keys >= own_start) & (keys <= rows[:, None]))
        return KVWrite(self, start=L, rows=mx.array(rows.astype(np.int32)), visible=L + num_slots * S,
                       mask=mx.array(mask), slots=(num_slots, S, window))

    def commit(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """Adopt the first len(tokens) scratch rows as committed."""
        if len(tokens) != len(positions):
            raise ValueError("commit needs one position per token")
        if len(self) + len(tokens) > self.capacity:
            raise ValueError("commit of rows that no pass has written")
        row = len(self)
        self.tokens.extend(int(t) for t in tokens)
        self.positions.extend(int(p) for p in positions)
        self._row_of.update((p, r) for r, p in enumerate(self.positions[row:], row))
        self._tell_stores()

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the given committed rows (in the given order); drop the rest.

        Used after a response (its slots committed beyond the answer's EOS)
        and between chat turns. Rows already in place -- the leading ``rows[i]
        == i`` -- are left alone: the stores copy only the moved rows after
        them (slots commit out of order, so the dropped rows are often
        interleaved near the end), as mlx-lm trims its cache in place.
        """
        rows = list(rows)
        start = next((i for i, r in enumerate(rows) if r != i), len(rows))
        moved = rows[start:]
        if moved:
            index = mx.array(moved, dtype=mx.int32)
            for store in self._held():
                store.keep(index, start)
        for p in self.positions[start:]:
            self._row_of.pop(p, None)
        self.tokens[start:] = [self.tokens[r] for r in moved]
        self.positions[start:] = [self.positions[r] for r in moved]
        self._row_of.update((p, r) for r, p in enumerate(self.positions[start:], start))
        self._tell_stores()

    def _adopt(self, tokens: List[int], positions: List[int]) -> None:
        self.tokens, self.positions = tokens, positions
        self._row_of = {p: r for r, p in enumerate(positions)}
        self._tell_stores()

    def _tell_stores(self) -> None:
        for store in self._held():
            store.set_committed(len(self.tokens))

    def fork(self, rows: Sequence[int], exact: bool = False) -> "CommittedCache":
        """A new cache holding copies of the given committed rows, in that order.

        How another request starts from a conversation or system prompt this
        cache already holds (a server's prompt cache): one copy per request,
        made when it is admitted, never per slot or per step. ``exact``: room
        for those rows alone (a copy kept, not grown: a prompt-cache entry),
        else whole ``growth`` steps.
        """
        rows = list(rows)
        new = CommittedCache(self.spec, self.growth, self.storage)
        if rows:
            new.capacity = len(rows) if exact else -(-len(rows) // new.growth) * new.growth
            index = mx.array(rows, dtype=mx.int32)
            new.stores = [None if s is None else s.fork(index, new.capacity) for s in self.stores]
            mx.eval(new.state())
        new._adopt([self.tokens[r] for r in rows], [self.positions[r] for r in rows])
        return new

    def free(self) -> None:
        """Drop every row and the stores' buffers with them (a request that
        left: its memory goes now, whoever still holds the object)."""
        self.stores = self._empty_stores()
        self._adopt([], [])
        self.capacity = 0

    # -- saving and restoring (the server's prompt-cache files) ---------------

    def to_arrays(self) -> Dict[str, mx.array]:
        """The committed rows as named arrays: ``tokens``, ``positions`` and
        each held layer's store's arrays, named ``{name}.{layer}`` (the float
        store's: ``keys.{layer}`` / ``values.{layer}``, (1, kv_heads, rows, head_dim))."""
        n = len(self)
        arrays = {"tokens": mx.array(self.tokens, dtype=mx.int32),
                  "positions": mx.array(self.positions, dtype=mx.int32)}
        for i, store in enumerate(self.stores):
            if store is not None:
                arrays.update((f"{name}.{i}", a) for name, a in store.to_arrays(n).items())
        return arrays

    def load_arrays(self, arrays: Dict[str, mx.array]) -> None:
        """Fill this empty cache from ``to_arrays``' output; ValueError (and the
        cache left empty) when they do not fit its stores' layers, shape or form."""
        if len(self):
            raise ValueError("load_arrays needs an empty cache")
        tokens, positions = arrays.get("tokens"), arrays.get("positions")
        if tokens is None or positions is None or tokens.ndim != 1 or tokens.shape != positions.shape:
            raise ValueError("no tokens and positions of one length")
        n = tokens.shape[0]
        if not n:
            raise ValueError("no rows")
        by_layer: Dict[str, Dict[str, mx.array]] = {}
        for key, a in arrays.items():
            name, _, layer = key.rpartition(".")
            by_layer.setdefault(layer, {})[name] = a
        self.reserve(n, exact=True)  # a kept copy (a prompt-cache entry): its rows alone
        try:
            for i, store in enumerate(self.stores):
                if store is not None:
                    store.load_arrays(by_layer.get(str(i), {}), n)
        except ValueError:
            self.free()
            raise
        mx.eval(self.state())
        self._adopt([int(t) for t in tokens.tolist()], [int(p) for p in positions.tolist()])

    # -- reading the committed tokens -----------------------------------------

    def token_at(self, position: int) -> Optional[int]:
        """The token committed at ``position``, or None if none is (yet)."""
        row = self._row_of.get(position)
        return None if row is None else self.tokens[row]

    def in_position_order(self, start_row: int = 0) -> List[Tuple[int, int, int]]:
        """``(position, row, token)`` of the rows from ``start_row`` on, by position."""
        return sorted((p, r, t) for r, (p, t) in enumerate(zip(self.positions, self.tokens))
                      if r >= start_row)

    def state(self) -> List[mx.array]:
        """Arrays to evaluate so the committed rows are materialised."""
        return [a for s in self._held() for a in s.state()]


class KVWrite:
    """Where one forward pass writes its K/V and what its queries may see."""

    def __init__(self, cache: CommittedCache, start: int, rows: Optional[mx.array],
                 visible: int, mask, slots: Optional[Tuple[int, int, int]] = None, settled: int = 0):
        self.cache = cache
        self.start = start
        self.rows = rows
        self.visible = visible
        self.mask = mask
        self.slots = slots  # an infill pass: (slots, slot size, window per slot)
        self.settled = settled  # leading rows committed whatever the pass decides (prompt tokens)

    def layer(self, i: int) -> "_LayerWrite":
        return _LayerWrite(self, i)

    @property
    def tokens(self) -> int:
        """How many tokens the pass writes."""
        return self.visible - self.start if self.rows is None else int(self.rows.shape[0])

    def split(self, at: int) -> Optional[Tuple["KVWrite", "KVWrite"]]:
        """This pass as two, the first about ``at`` tokens long, each
        attending exactly as its tokens did in the whole pass; None when it
        cannot be cut there.

        A causal pass: its first ``at`` tokens, then the rest, which see the
        first's rows as committed ones. An infill pass: its first slots (``at``
        rounded to whole windows), whose rows and keys all lie before the
        other slots' (each slot sees only the committed rows and its own),
        then the other slots."""
        if self.slots is not None:
            count, size, window = self.slots
            first = round(at / window)
            if not 0 < first < count:
                return None
            cut, seen = first * window, self.start + first * size
            return (KVWrite(self.cache, self.start, self.rows[:cut], seen, self.mask[:cut, :seen],
                            (first, size, window)),
                    KVWrite(self.cache, self.start, self.rows[cut:], self.visible, self.mask[cut:],
                            (count - first, size, window)))
        if self.rows is not None or self.mask != "causal":
            return None
        cut = self.start + at
        return (KVWrite(self.cache, self.start, None, cut, "causal", settled=min(self.settled, at)),
                KVWrite(self.cache, cut, None, self.visible, "causal", settled=max(0, self.settled - at)))


class _LayerWrite:
    """One layer's share of a pass: its rows written to that layer's store."""

    __slots__ = ("write", "store")

    def __init__(self, write: KVWrite, index: int):
        self.write, self.store = write, write.cache.stores[index]

    def update(self, keys: mx.array, values: mx.array) -> None:
        """Write this pass's keys and values (1, K, n, D) into their rows."""
        w = self.write
        if w.rows is None:
            self.store.write(keys, values, w.start, w.settled)
        else:
            self.store.write_rows(keys, values, w.rows, w.visible)

    def fetch(self, length: Optional[int] = None):
        """The first ``length`` rows of keys and values (default: the rows this
        pass sees). Past ``visible`` they are stale scratch rows, and zeros past
        the cache's capacity: a padded batch (``decode.packed``) masks them."""
        return self.store.read_padded(self.write.visible if length is None else length)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        """Write this pass's keys and values, then attend over the rows it sees
        (``mask``: the pass's mask in the form ``cpu_paths.attend`` takes)."""
        self.update(k, v)
        return self.store.attend(q, mask, self.write.visible)
