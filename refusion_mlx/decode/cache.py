"""The committed sequence and its KV cache, as one object.

ReFusion's cache holds exactly the committed tokens, in commit order, each
with its own position id (REFUSION.md §3). Every forward pass writes its keys
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

Buffers are preallocated and grow in steps, so no pass concatenates.

This object is the one holder of the committed tokens: the answer's text
(:class:`~refusion_mlx.decode.answer.AnswerText`), the terminal's slot view
and the prompt-cache lookups read them through ``token_at`` and
``in_position_order`` rather than keeping copies.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..models.cpu_paths import attend

GROWTH_STEP = 256


class CommittedCache:
    """Committed tokens with their positions and per-layer K/V, in commit order.

    ``held``: the layers whose K/V this process computes (a pipeline rank's
    range, ``Model.layer_range``); the others' stay None and cost nothing."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: mx.Dtype = mx.float32, step: int = GROWTH_STEP, held: Optional[range] = None):
        self.num_layers = num_layers
        self.held = range(num_layers) if held is None else held
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.step = step
        self.tokens: List[int] = []
        self.positions: List[int] = []
        self._row_of: Dict[int, int] = {}  # position -> row, for reading in position order
        self.keys: List[Optional[mx.array]] = [None] * num_layers
        self.values: List[Optional[mx.array]] = [None] * num_layers
        self.capacity = 0

    @classmethod
    def for_model(cls, model, step: int = GROWTH_STEP) -> "CommittedCache":
        spec = model.cache_spec()
        return cls(spec.layers, spec.kv_heads, spec.head_dim, spec.dtype, step, spec.held)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values) if k is not None)

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` scratch rows after the committed ones.

        Growth happens in multiples of ``step`` and copies the buffer once per
        growth, never once per token.
        """
        need = len(self) + rows
        if need <= self.capacity:
            return
        new_capacity = -(-need // self.step) * self.step
        grow = new_capacity - self.capacity
        shape = (1, self.num_kv_heads, grow, self.head_dim)
        for i in self.held:
            pad = mx.zeros(shape, self.dtype)
            if self.keys[i] is None:
                self.keys[i], self.values[i] = pad, mx.zeros(shape, self.dtype)
            else:
                self.keys[i] = mx.concatenate([self.keys[i], pad], axis=2)
                self.values[i] = mx.concatenate([self.values[i], pad], axis=2)
        self.capacity = new_capacity

    def extend(self, n: int) -> "KVWrite":
        """A pass of n tokens after the committed ones, causal in sequence order."""
        self.reserve(n)
        start = len(self)
        return KVWrite(self, start=start, rows=None, visible=start + n, mask="causal")

    def infill(self, num_slots: int, slot_size: int, cursor: int) -> "KVWrite":
        """A pass over tokens ``cursor..S-1`` of each of ``num_slots`` slots.

        Slot i's window goes to scratch rows ``i*S + cursor ..``; its queries
        see all committed rows plus rows ``i*S .. i*S + cursor + j`` (its own
        private prefix and its window causally), never another slot's rows.
        """
        S, a, L = slot_size, cursor, len(self)
        self.reserve(num_slots * S)
        window = S - a
        slot = mx.arange(num_slots * window) // window
        offset = mx.arange(num_slots * window) % window
        rows = L + slot * S + a + offset
        keys = mx.arange(L + num_slots * S)[None, :]
        own_start = (L + slot * S)[:, None]
        mask = (keys < L) | ((keys >= own_start) & (keys <= rows[:, None]))
        return KVWrite(self, start=L, rows=rows, visible=L + num_slots * S, mask=mask,
                       slots=(num_slots, S, window))

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

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the given committed rows (in the given order); drop the rest.

        Used between chat turns to drop slots committed beyond the answer's EOS.
        """
        rows = list(rows)
        if rows == list(range(len(rows))):
            for p in self.positions[len(rows):]:
                self._row_of.pop(p, None)
            del self.tokens[len(rows):], self.positions[len(rows):]
            return
        index = mx.array(rows, dtype=mx.int32)
        for i in self.held:
            kept_k = mx.take(self.keys[i], index, axis=2)
            kept_v = mx.take(self.values[i], index, axis=2)
            self.keys[i][:, :, : len(rows), :] = kept_k
            self.values[i][:, :, : len(rows), :] = kept_v
        self._adopt([self.tokens[r] for r in rows], [self.positions[r] for r in rows])

    def _adopt(self, tokens: List[int], positions: List[int]) -> None:
        self.tokens, self.positions = tokens, positions
        self._row_of = {p: r for r, p in enumerate(positions)}

    def fork(self, rows: Sequence[int]) -> "CommittedCache":
        """A new cache holding copies of the given committed rows, in that order.

        How another request starts from a conversation or system prompt this
        cache already holds (a server's prompt cache): one copy per request,
        made when it is admitted, never per slot or per step.
        """
        rows = list(rows)
        new = CommittedCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.step, self.held)
        if rows:
            new.reserve(len(rows))
            index = mx.array(rows, dtype=mx.int32)
            for i in self.held:
                new.keys[i][:, :, : len(rows), :] = mx.take(self.keys[i], index, axis=2)
                new.values[i][:, :, : len(rows), :] = mx.take(self.values[i], index, axis=2)
            mx.eval(new.state())
        new._adopt([self.tokens[r] for r in rows], [self.positions[r] for r in rows])
        return new

    def free(self) -> None:
        """Drop every row and the buffers with them (a request that left: its
        memory goes now, whoever still holds the object)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self._adopt([], [])
        self.capacity = 0

    # -- saving and restoring (the server's prompt-cache files) ---------------

    def to_arrays(self) -> Dict[str, mx.array]:
        """The committed rows as named arrays: ``tokens``, ``positions`` and
        ``keys.{layer}`` / ``values.{layer}`` of shape (1, kv_heads, rows, head_dim)."""
        n = len(self)
        arrays = {"tokens": mx.array(self.tokens, dtype=mx.int32),
                  "positions": mx.array(self.positions, dtype=mx.int32)}
        for i in range(self.num_layers):
            arrays[f"keys.{i}"] = self.keys[i][:, :, :n, :]
            arrays[f"values.{i}"] = self.values[i][:, :, :n, :]
        return arrays

    def load_arrays(self, arrays: Dict[str, mx.array]) -> None:
        """Fill this empty cache from ``to_arrays``' output; ValueError (and the
        cache left empty) when they do not fit its layers, heads or dtype."""
        if len(self):
            raise ValueError("load_arrays needs an empty cache")
        tokens, positions = arrays.get("tokens"), arrays.get("positions")
        if tokens is None or positions is None or tokens.ndim != 1 or tokens.shape != positions.shape:
            raise ValueError("no tokens and positions of one length")
        n = tokens.shape[0]
        shape = (1, self.num_kv_heads, n, self.head_dim)
        keys = [arrays.get(f"keys.{i}") for i in range(self.num_layers)]
        values = [arrays.get(f"values.{i}") for i in range(self.num_layers)]
        if not n or any(a is None or a.shape != shape or a.dtype != self.dtype for a in keys + values):
            raise ValueError("its arrays do not fit this cache's layers, heads or dtype")
        self.reserve(n)
        for i in range(self.num_layers):
            self.keys[i][:, :, :n, :] = keys[i]
            self.values[i][:, :, :n, :] = values[i]
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
        return [a for a in self.keys + self.values if a is not None]


class KVWrite:
    """Where one forward pass writes its K/V and what its queries may see."""

    def __init__(self, cache: CommittedCache, start: int, rows: Optional[mx.array],
                 visible: int, mask, slots: Optional[Tuple[int, int, int]] = None):
        self.cache = cache
        self.start = start
        self.rows = rows
        self.visible = visible
        self.mask = mask
        self.slots = slots  # an infill pass: (slots, slot size, window per slot)

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
        return (KVWrite(self.cache, self.start, None, cut, "causal"),
                KVWrite(self.cache, cut, None, self.visible, "causal"))


class _LayerWrite:
    __slots__ = ("write", "index")

    def __init__(self, write: KVWrite, index: int):
        self.write, self.index = write, index

    def update(self, keys: mx.array, values: mx.array) -> None:
        """Write this pass's keys and values (1, K, n, D) into their rows."""
        w, c, i = self.write, self.write.cache, self.index
        if w.rows is None:
            end = w.start + keys.shape[2]
            c.keys[i][:, :, w.start:end, :] = keys
            c.values[i][:, :, w.start:end, :] = values
        else:
            c.keys[i][:, :, w.rows, :] = keys
            c.values[i][:, :, w.rows, :] = values

    def fetch(self, length: Optional[int] = None):
        """The first ``length`` rows of keys and values (default: the rows this
        pass sees). Past ``visible`` they are stale scratch rows, and zeros past
        the buffer's capacity: a padded batch (``decode.packed``) masks them."""
        c, i = self.write.cache, self.index
        length = self.write.visible if length is None else length
        keys, values = c.keys[i][:, :, :length, :], c.values[i][:, :, :length, :]
        if length > c.capacity:
            pad = [(0, 0), (0, 0), (0, length - c.capacity), (0, 0)]
            keys, values = mx.pad(keys, pad), mx.pad(values, pad)
        return keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.update(keys, values)
        return self.fetch()

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        """Write this pass's keys and values, then attend over the rows it sees
        (``mask``: the pass's mask in the form ``cpu_paths.attend`` takes)."""
        keys, values = self.update_and_fetch(k, v)
        return attend(q, keys, values, mask)
