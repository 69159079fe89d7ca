"""The interface of one layer's keys and values: :class:`KVStore`.

:class:`~refusion_mlx.decode.cache.CommittedCache` decides which rows exist
(the committed tokens in commit order, then the scratch rows a pass writes)
and keeps tokens and positions; each layer it holds keeps its keys and values
in a :class:`KVStore`, made from the model's ``cache_spec()``. A store only
holds rows: it writes a pass's rows (a contiguous range, or given row
indices), reads the first n for attention, keeps or copies rows in a given
order, grows, and turns its committed rows into named arrays and back (the
prompt-cache files). It is told how many leading rows are committed
(:meth:`KVStore.set_committed`), so a store may keep committed rows in
another form than the rows passes write. A kind that can attend for a
whole padded batch in one call per layer says so with
:meth:`KVStore.attend_batch`.

The kinds -- the float store and the storage setting that chooses a kind:
:mod:`.kv_store`; quantized codes: :mod:`.kv_quant` -- build on this module.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..models.base import CacheSpec
from ..models.cpu_paths import attend


class KVStore:
    """One layer's keys and values for one sequence, row by row.

    Rows ``[0, committed)`` hold committed tokens; rows after them are
    scratch, written by passes and either committed or overwritten later.
    A subclass is made as ``Kind(spec, **settings)`` and answers the
    classmethods with the same settings."""

    # A padded batch attends over this kind's rows read back in the model's
    # dtype (:meth:`read_padded`), so MLX's fused kernel can take them at bucketed
    # shapes (``backend.bucketed_attention``); False for a kind whose batch
    # attends through its own call (:meth:`attend_batch`).
    FLOAT_ROWS = True

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.capacity = 0  # rows held, committed and scratch

    # -- what a kind of store costs, known without a buffer -------------------

    @classmethod
    def row_bytes(cls, spec: CacheSpec) -> int:
        """Bytes of keys and values one row costs in one layer."""
        raise NotImplementedError

    @classmethod
    def scratch_row_bytes(cls, spec: CacheSpec, **settings) -> int:
        """Bytes one scratch row (a row a pass writes, not yet committed)
        costs in one layer besides ``row_bytes``: 0 where scratch rows are
        kept in the rows held (the float store), more where they are kept
        in another form until committed."""
        return 0

    @classmethod
    def describe(cls, spec: CacheSpec) -> str:
        """The stored form's name (its dtype, and any settings): files
        written in another form must not be read back as this one."""
        raise NotImplementedError

    @classmethod
    def check(cls, spec: Optional[CacheSpec], **settings) -> None:
        """A one-line DecodeError for settings this kind cannot keep (for
        ``spec``'s layers, when given); the base takes what its constructor takes."""

    @classmethod
    def attend_batch(cls, q: mx.array, stores: List["KVStore"], padding) -> Optional[mx.array]:
        """(B, H, maxN, D) padded queries over each of a batch's ``stores``
        (one per request, this pass's rows written) in one call, with the
        batch's ``padding`` (``decode.packed.PackedWrite``); None: this kind
        has no such call, and the batch reads each store's rows
        (:meth:`read_padded`, through the cache layer's ``_LayerWrite.fetch``)
        into one float attention."""
        return None

    # -- rows -----------------------------------------------------------------

    def grow(self, capacity: int) -> None:
        """Hold ``capacity`` rows (more than now), keeping every row held."""
        raise NotImplementedError

    def write(self, keys: mx.array, values: mx.array, start: int, settled: int = 0) -> None:
        """Write (1, kv_heads, n, head_dim) keys and values into rows ``start
        .. start + n``; the first ``settled`` of them will be committed
        whatever the pass decides (prompt tokens): a store may keep them in
        their committed form at once."""
        raise NotImplementedError

    def write_rows(self, keys: mx.array, values: mx.array, rows: mx.array, end: Optional[int] = None) -> None:
        """Write (1, kv_heads, n, head_dim) keys and values into the given n
        rows, all before ``end`` (the rows the pass sees; None: the capacity)."""
        raise NotImplementedError

    def read(self, length: int) -> Tuple[mx.array, mx.array]:
        """Keys and values of the first ``length`` rows (at most the capacity),
        each (1, kv_heads, length, head_dim) in the model's dtype."""
        raise NotImplementedError

    def read_padded(self, length: int) -> Tuple[mx.array, mx.array]:
        """:meth:`read`, with zero rows past the capacity up to ``length``
        (a padded batch reads every request's view as long as the widest,
        and masks what is not its own: ``decode.packed``)."""
        keys, values = self.read(min(length, self.capacity))
        if length > self.capacity:
            pad = [(0, 0), (0, 0), (0, length - self.capacity), (0, 0)]
            keys, values = mx.pad(keys, pad), mx.pad(values, pad)
        return keys, values

    def attend(self, q: mx.array, mask, length: int) -> mx.array:
        """Attention of queries ``q`` (scaled) over the first ``length`` rows
        (``mask`` in the form ``cpu_paths.attend`` takes)."""
        keys, values = self.read(length)
        return attend(q, keys, values, mask)

    def set_committed(self, count: int) -> None:
        """Rows ``[0, count)`` are the committed ones from now on: told after
        every commit (rows the passes wrote, adopted as they are), keep, fork
        and load. The float store keeps all rows alike and ignores it."""

    def keep(self, index: mx.array, start: int = 0) -> None:
        """Rows ``[start, start + n)`` become the rows ``index`` (n of them,
        committed ones, none before ``start``) in that order, in place; rows
        before ``start`` stay as they are and are not copied."""
        raise NotImplementedError

    def fork(self, index: mx.array, capacity: int) -> "KVStore":
        """A new store of this kind with ``capacity`` rows, its first ones
        copies of the rows ``index`` (committed ones) in that order."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes the store's buffers hold (every row held, not only the committed ones)."""
        raise NotImplementedError

    def state(self) -> List[mx.array]:
        """Arrays to evaluate so the written rows are materialised."""
        raise NotImplementedError

    # -- saving and restoring (the server's prompt-cache files) ---------------

    def to_arrays(self, rows: int) -> Dict[str, mx.array]:
        """The first ``rows`` rows as named arrays (the cache names them
        ``{name}.{layer}`` in a file)."""
        raise NotImplementedError

    def load_arrays(self, arrays: Dict[str, mx.array], rows: int) -> None:
        """Fill the first ``rows`` rows (held already) from ``to_arrays``'
        output; ValueError when the arrays are not this store's form and shape."""
        raise NotImplementedError
