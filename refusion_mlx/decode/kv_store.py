"""How one layer's keys and values are kept: the storage behind a CommittedCache.

Each layer a :class:`~refusion_mlx.decode.cache.CommittedCache` holds keeps
its keys and values in a :class:`~.kv_base.KVStore` (the interface:
:mod:`.kv_base`). :class:`FloatStore` keeps keys and values as two arrays (1, kv_heads,
capacity, head_dim) in the model's dtype: a pass's write is a slice
assignment, attention reads a slice, and nothing is copied per pass or per
slot. Another way of keeping them (quantized keys and values:
``kv_quant.QuantizedStore``) is one more subclass, chosen by a
:class:`KVStorage`: the one storage setting, made once (:meth:`KVStorage.of`
from ``--kv-bits`` / ``--kv-group-size`` or a call's ``kv_bits``) and
carried whole, which also answers what a row costs and how the stored form
is named without any buffer being made (memory admission, the prompt-cache
files' fingerprint).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Type

import mlx.core as mx

from ..errors import DecodeError
from ..models.base import CacheSpec
from .kv_base import KVStore
from .kv_quant import DEFAULT_GROUP_SIZE, QuantizedStore


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
        # one scatter kernel each (an indexed assignment adds index arithmetic: ~6 more ops a call)
        index = rows[None, None, :, None]
        self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self.values = mx.put_along_axis(self.values, index, values, axis=2)

    def read(self, length: int) -> Tuple[mx.array, mx.array]:
        return self.keys[:, :, :length, :], self.values[:, :, :length, :]

    def keep(self, index: mx.array, start: int = 0) -> None:
        end = start + index.shape[0]
        kept_k = mx.take(self.keys, index, axis=2)
        kept_v = mx.take(self.values, index, axis=2)
        self.keys[:, :, start:end, :] = kept_k
        self.values[:, :, start:end, :] = kept_v

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
