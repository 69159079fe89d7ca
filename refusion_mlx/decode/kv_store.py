"""How one layer's keys and values are kept: the storage behind a CommittedCache.

:class:`~refusion_mlx.decode.cache.CommittedCache` decides which rows exist
(the committed tokens in commit order, then the scratch rows a pass writes)
and keeps tokens and positions; each layer it holds keeps its keys and values
in a :class:`KVStore`, made from the model's ``cache_spec()``. A store only
holds rows: it writes a pass's rows (a contiguous range, or given row
indices), reads the first n for attention, keeps or copies rows in a given
order, grows, and turns its committed rows into named arrays and back (the
prompt-cache files). It is told how many leading rows are committed
(:meth:`KVStore.set_committed`), so a store may keep committed rows in
another form than the rows passes write; the float store keeps all alike.

:class:`FloatStore` keeps keys and values as two arrays (1, kv_heads,
capacity, head_dim) in the model's dtype: a pass's write is a slice
assignment, attention reads a slice, and nothing is copied per pass or per
slot. Another way of keeping them (quantized keys and values:
``kv_quant.QuantizedStore``) is one more subclass, chosen by a
:class:`KVStorage`: the one storage setting, made once (:meth:`KVStorage.of`
from ``--kv-bits`` / ``--kv-group-size`` or a call's ``kv_bits``) and
carried whole, which also answers what a row costs and how the stored form
is named without any buffer being made (memory admission, the prompt-cache
files' fingerprint). A kind that can attend for a whole padded batch in one
call per layer says so with :meth:`KVStore.attend_batch`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Type

import mlx.core as mx

from ..errors import DecodeError
from ..models.base import CacheSpec
from ..models.cpu_paths import attend


class KVStore:
    """One layer's keys and values for one sequence, row by row.

    Rows ``[0, committed)`` hold committed tokens; rows after them are
    scratch, written by passes and either committed or overwritten later.
    A subclass is made as ``Kind(spec, **settings)`` and answers the
    classmethods with the same settings."""

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
        (:meth:`fetch` through the cache layer) into one float attention."""
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

    def keep(self, index: mx.array) -> None:
        """Rows ``[0, n)`` become the rows ``index`` (n of them, committed
        ones) in that order, in place."""
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


class FloatStore(KVStore):
    """Keys and values as two (1, kv_heads, capacity, head_dim) arrays in the
    model's dtype; growth concatenates zero rows, once per growth."""

    def __init__(self, spec: CacheSpec):
        super().__init__(spec)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    @classmethod
    def row_bytes(cls, spec: CacheSpec) -> int:
        return 2 * spec.kv_heads * spec.head_dim * spec.dtype.size

    @classmethod
    def describe(cls, spec: CacheSpec) -> str:
        return str(spec.dtype)

    def grow(self, capacity: int) -> None:
        shape = (1, self.spec.kv_heads, capacity - self.capacity, self.spec.head_dim)
        pad = mx.zeros(shape, self.spec.dtype)
        if self.keys is None:
            self.keys, self.values = pad, mx.zeros(shape, self.spec.dtype)
        else:
            self.keys = mx.concatenate([self.keys, pad], axis=2)
            self.values = mx.concatenate([self.values, pad], axis=2)
        self.capacity = capacity

    def write(self, keys: mx.array, values: mx.array, start: int, settled: int = 0) -> None:
        end = start + keys.shape[2]
        self.keys[:, :, start:end, :] = keys
        self.values[:, :, start:end, :] = values

    def write_rows(self, keys: mx.array, values: mx.array, rows: mx.array, end: Optional[int] = None) -> None:
        self.keys[:, :, rows, :] = keys
        self.values[:, :, rows, :] = values

    def read(self, length: int) -> Tuple[mx.array, mx.array]:
        return self.keys[:, :, :length, :], self.values[:, :, :length, :]

    def keep(self, index: mx.array) -> None:
        n = index.shape[0]
        kept_k = mx.take(self.keys, index, axis=2)
        kept_v = mx.take(self.values, index, axis=2)
        self.keys[:, :, :n, :] = kept_k
        self.values[:, :, :n, :] = kept_v

    def fork(self, index: mx.array, capacity: int) -> "FloatStore":
        new = type(self)(self.spec)
        new.grow(capacity)
        n = index.shape[0]
        new.keys[:, :, :n, :] = mx.take(self.keys, index, axis=2)
        new.values[:, :, :n, :] = mx.take(self.values, index, axis=2)
        return new

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def state(self) -> List[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def to_arrays(self, rows: int) -> Dict[str, mx.array]:
        """``keys`` and ``values``, (1, kv_heads, rows, head_dim) each."""
        return {"keys": self.keys[:, :, :rows, :], "values": self.values[:, :, :rows, :]}

    def load_arrays(self, arrays: Dict[str, mx.array], rows: int) -> None:
        shape = (1, self.spec.kv_heads, rows, self.spec.head_dim)
        keys, values = arrays.get("keys"), arrays.get("values")
        if any(a is None or a.shape != shape or a.dtype != self.spec.dtype for a in (keys, values)):
            raise ValueError("its arrays do not fit this cache's layers, heads or dtype")
        self.keys[:, :, :rows, :] = keys
        self.values[:, :, :rows, :] = values


class KVStorage:
    """How a cache keeps each layer's keys and values: ``kind``, a KVStore
    subclass (FloatStore by default), made with ``settings`` (keyword
    arguments of its constructor and classmethods; none for FloatStore).
    A value: two equal settings are one storage."""

    def __init__(self, kind: Optional[Type[KVStore]] = None, **settings):
        self.kind = FloatStore if kind is None else kind
        self.settings = settings

    @classmethod
    def of(cls, bits: Optional[int] = None, group_size: Optional[int] = None, model=None) -> "KVStorage":
        """The storage of ``kv_bits`` / ``kv_group_size``: the float store
        without bits, else quantized codes (group size 64 unless given); with
        ``model``, checked against its head dimension too. A bad setting is
        one DecodeError."""
        if bits is None:
            if group_size is not None:
                raise DecodeError("kv_group_size needs kv_bits (4 or 8)")
            return cls()
        from .kv_quant import DEFAULT_GROUP_SIZE, QuantizedStore  # the quantized kind builds on this module

        storage = cls(QuantizedStore, bits=bits, group_size=DEFAULT_GROUP_SIZE if group_size is None else group_size)
        return storage.check(model)

    @classmethod
    def given(cls, storage: Optional["KVStorage"], bits: Optional[int], group_size: Optional[int],
              model=None) -> "KVStorage":
        """A call's storage: ``storage`` as made (by ``cli.storage_from_args``, a server's config), or
        made of ``kv_bits`` / ``kv_group_size``, not both; checked against ``model`` when given."""
        if storage is not None and (bits is not None or group_size is not None):
            raise DecodeError("give storage or kv_bits / kv_group_size, not both")
        return storage.check(model) if storage is not None else cls.of(bits, group_size, model)

    @property
    def bits(self) -> Optional[int]:
        """Bits per kept key and value (None: the model's dtype), as ``/health`` and ``/metrics`` show them."""
        return self.settings.get("bits")

    @property
    def group_size(self) -> Optional[int]:
        return self.settings.get("group_size")

    def check(self, model=None) -> "KVStorage":
        """Itself, once its kind takes its settings (for ``model``'s layers, when given); else a DecodeError."""
        self.kind.check(None if model is None else model.cache_spec(), **self.settings)
        return self

    def new(self, spec: CacheSpec) -> KVStore:
        """An empty store for one layer of ``spec``."""
        return self.kind(spec, **self.settings)

    def row_bytes(self, spec: CacheSpec) -> int:
        """Bytes of keys and values one row costs in one layer."""
        return self.kind.row_bytes(spec, **self.settings)

    def scratch_row_bytes(self, spec: CacheSpec) -> int:
        """Bytes one scratch row costs in one layer besides ``row_bytes``."""
        return self.kind.scratch_row_bytes(spec, **self.settings)

    def describe(self, spec: CacheSpec) -> str:
        """The stored form's name, as the prompt-cache files' fingerprint takes it."""
        return self.kind.describe(spec, **self.settings)

    def __eq__(self, other) -> bool:
        return isinstance(other, KVStorage) and (self.kind, self.settings) == (other.kind, other.settings)

    def __hash__(self) -> int:
        return hash((self.kind, tuple(sorted(self.settings.items()))))

    def __repr__(self) -> str:
        settings = "".join(f", {k}={v!r}" for k, v in self.settings.items())
        return f"KVStorage({self.kind.__name__}{settings})"
