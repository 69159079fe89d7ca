"""Keys and values kept quantized (``--kv-bits``): a sibling of the float store.

:class:`QuantizedStore` keeps each layer's *committed* rows in MLX's
quantized layout (``mx.quantize`` along head_dim: ``bits``-bit codes packed
in uint32 words, a scale and a bias per ``group_size`` values, in the
model's dtype), the layout mlx-lm's ``QuantizedKVCache`` uses. Its *scratch*
rows -- the ones a pass writes after the committed rows: a prompt chunk,
plan and verify passes, the infill slots' private rows -- stay exactly as
the pass computed them, in the model's dtype, and are quantized once, when
the cache commits them (:meth:`QuantizedStore.set_committed`). No pass
quantizes or dequantizes its own rows, and an infill round reads its slot's
earlier rows as they were computed.

Attention over both: one softmax over the committed rows' scores and the
scratch rows' scores. On the GPU paths the committed rows are read through
MLX's quantized matmul (``mx.quantized_matmul`` for q·k and p·v, as
mlx-lm's quantized attention does; :func:`split_attend`), a batch of
requests in one call per layer (:meth:`QuantizedStore.attend_batch`, used by
``decode/packed.py``); on the CPU paths the visible committed rows are
dequantized (:func:`dequantize`) and the float attention runs
(docs/benchmarks.md: faster there than the quantized matmul).

What a row costs is known without a buffer (``row_bytes``, and
``scratch_row_bytes`` for the rows a pass holds in the model's dtype on
top), so memory admission counts what is really held; ``describe`` names
the form for the prompt-cache files. Choose it with
``kv_store.KVStorage.of(bits, group_size)``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..errors import DecodeError
from ..models import backend
from ..models.base import CacheSpec
from ..models.cpu_paths import attend
from .kv_base import KVStore

KV_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize takes
DEFAULT_GROUP_SIZE = 64  # mlx-lm's

Codes = Tuple[mx.array, mx.array, mx.array]  # packed codes (uint32), scales, biases
_PARTS = ("packed", "scales", "biases")


def check_settings(bits, group_size, head_dim: Optional[int] = None) -> None:
    """A one-line DecodeError for bits or a group size the store cannot keep."""
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise DecodeError(f"kv_bits must be 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise DecodeError(f"kv_group_size must be 32, 64 or 128, got {group_size!r}")
    if head_dim is not None and head_dim % group_size:
        raise DecodeError(f"kv_group_size {group_size} does not divide the model's head dimension {head_dim}")


class QuantizedStore(KVStore):
    """Committed rows as quantized codes, keys and values stacked (2,
    kv_heads, capacity, ·): one quantize, slice and dequantize serves both;
    the scratch rows after them as the passes wrote them.

    The buffers hold ``capacity`` rows of codes; the first ``coded`` rows
    are codes: the committed ones, and a pass's settled rows (prompt tokens,
    committed whatever the pass decides: quantized as they are written, as
    mlx-lm's quantized cache does with a prompt, so no request holds a
    prompt chunk in float). The scratch is two float arrays holding rows
    ``[coded, coded + n)``, made by the passes (the pass's own keys and
    values when it writes right after the coded rows: nothing copied), and
    dropped when rows are committed or kept: every pass writes the scratch
    rows it reads (the decoder's passes do)."""

    FLOAT_ROWS = False  # a batch attends through the codes (attend_batch)

    def __init__(self, spec: CacheSpec, bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE):
        check_settings(bits, group_size, spec.head_dim)
        super().__init__(spec)
        self.bits, self.group_size = bits, group_size
        self.codes: Optional[Codes] = None  # keys at [0], values at [1]
        self.scratch: Optional[Tuple[mx.array, mx.array]] = None
        self.committed = 0  # as the cache tells it
        self.coded = 0  # rows kept as codes: the committed ones and a pass's settled rows

    # -- what a row costs -----------------------------------------------------

    @classmethod
    def row_bytes(cls, spec: CacheSpec, bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE) -> int:
        check_settings(bits, group_size, spec.head_dim)
        words, groups = spec.head_dim * bits // 32, spec.head_dim // group_size
        return 2 * spec.kv_heads * (words * 4 + 2 * groups * spec.dtype.size)

    @classmethod
    def scratch_row_bytes(cls, spec: CacheSpec, bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE) -> int:
        """A scratch row is kept in the model's dtype, besides its row of codes."""
        return 2 * spec.kv_heads * spec.head_dim * spec.dtype.size

    @classmethod
    def describe(cls, spec: CacheSpec, bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE) -> str:
        return f"{spec.dtype} quantized to {bits} bits in groups of {group_size}"

    @classmethod
    def check(cls, spec: Optional[CacheSpec], bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        check_settings(bits, group_size, None if spec is None else spec.head_dim)

    @classmethod
    def attend_batch(cls, q: mx.array, stores: List[KVStore], padding) -> Optional[mx.array]:
        """One call per layer for a batch whose stores all keep codes of the
        same settings and hold committed rows (:func:`batched_attend`); else None."""
        kinds = {(s.bits, s.group_size) if isinstance(s, QuantizedStore) else None for s in stores}
        if len(kinds) != 1 or None in kinds:
            return None
        committed, spans, mask = padding.split([s.coded for s in stores])
        return batched_attend(q, stores, committed, spans, mask) if spans[0] else None

    # -- rows -----------------------------------------------------------------

    def _zeros(self, rows: int, stacked: int = 2) -> Codes:
        D, K = self.spec.head_dim, self.spec.kv_heads
        return (mx.zeros((stacked, K, rows, D * self.bits // 32), mx.uint32),
                mx.zeros((stacked, K, rows, D // self.group_size), self.spec.dtype),
                mx.zeros((stacked, K, rows, D // self.group_size), self.spec.dtype))

    def grow(self, capacity: int) -> None:
        more = self._zeros(capacity - self.capacity)
        self.codes = more if self.codes is None else tuple(
            mx.concatenate([a, b], axis=2) for a, b in zip(self.codes, more))
        self.capacity = capacity

    def _quantize_into(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Quantize float rows into the codes' rows ``start ..``."""
        end = start + keys.shape[2]
        rows = mx.concatenate([keys, values])
        for buffer, part in zip(self.codes, mx.quantize(rows, group_size=self.group_size, bits=self.bits)):
            buffer[:, :, start:end, :] = part

    def _held(self) -> int:
        return 0 if self.scratch is None else self.scratch[0].shape[2]

    def _scratch(self, rows: int) -> Tuple[mx.array, mx.array]:
        """The first ``rows`` scratch rows, zeros where none was written."""
        held = self._held()
        if held >= rows:
            return tuple(a[:, :, :rows, :] for a in self.scratch)
        pad = (1, self.spec.kv_heads, rows - held, self.spec.head_dim)
        if not held:
            return mx.zeros(pad, self.spec.dtype), mx.zeros(pad, self.spec.dtype)
        return tuple(mx.concatenate([a, mx.zeros(pad, a.dtype)], axis=2) for a in self.scratch)

    def write(self, keys: mx.array, values: mx.array, start: int, settled: int = 0) -> None:
        n, c = keys.shape[2], self.coded
        if start < c:
            if start + n > c:
                raise ValueError("a write across the end of the coded rows")
            self._quantize_into(start, keys, values)
            return
        if settled and start == c:  # prompt rows: codes at once, the rest of the pass as scratch
            self._quantize_into(start, keys[:, :, :settled], values[:, :, :settled])
            self.coded = c = start = start + settled
            self.scratch = None
            keys, values, n = keys[:, :, settled:], values[:, :, settled:], n - settled
            if not n:
                return
        offset, held = start - c, self._held()
        if offset == 0 and n >= held:  # a pass's own rows, kept as computed
            self.scratch = (keys, values)
        elif offset == held:  # right after them: the second row group of a pass
            self.scratch = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.scratch, (keys, values)))
        else:
            at = mx.array([offset])
            self.scratch = tuple(mx.slice_update(a, b, at, axes=(2,))
                                 for a, b in zip(self._scratch(max(held, offset + n)), (keys, values)))

    def write_rows(self, keys: mx.array, values: mx.array, rows: mx.array, end: Optional[int] = None) -> None:
        """The rows must be scratch rows, all before ``end`` (the pass's visible rows)."""
        end = self.capacity if end is None else end
        index = mx.broadcast_to((rows - self.coded)[None, None, :, None], keys.shape)
        self.scratch = tuple(mx.put_along_axis(a, index, b, axis=2)
                             for a, b in zip(self._scratch(max(self._held(), end - self.coded)), (keys, values)))

    def _codes(self, rows: int) -> Tuple[Codes, Codes]:
        """The first ``rows`` rows' codes: (keys', values'), each (1, kv_heads, rows, ·) x 3."""
        codes = [a[:, :, :rows, :] for a in self.codes]
        return tuple(a[:1] for a in codes), tuple(a[1:] for a in codes)

    def read(self, length: int) -> Tuple[mx.array, mx.array]:
        c = min(self.coded, length)
        if not c:
            return self._scratch(length)
        both = dequantize(tuple(a[:, :, :c, :] for a in self.codes), self.bits, self.group_size)
        if length == c:
            return both[:1], both[1:]
        return tuple(mx.concatenate([a, b], axis=2) for a, b in zip((both[:1], both[1:]), self._scratch(length - c)))

    def attend(self, q: mx.array, mask, length: int) -> mx.array:
        c = min(self.coded, length)
        if c and backend.gpu_paths():
            keys, values = self._codes(c)
            scratch = self._scratch(length - c) if length > c else (None, None)
            return split_attend(q, keys, values, *scratch, mask, self.bits, self.group_size)
        return attend(q, *self.read(length), mask)

    def set_committed(self, count: int) -> None:
        """Scratch rows that became committed are quantized now (once); the
        rest of the scratch is dropped."""
        c = self.coded
        if count > c and self.scratch is not None:
            n = min(count - c, self._held())
            self._quantize_into(c, *(a[:, :, :n, :] for a in self.scratch))
        if count != c or count != self.committed:
            self.scratch = None
        self.committed = self.coded = count

    def keep(self, index: mx.array, start: int = 0) -> None:
        end = start + index.shape[0]
        for buffer in self.codes:
            buffer[:, :, start:end, :] = mx.take(buffer, index, axis=2)

    def fork(self, index: mx.array, capacity: int) -> "QuantizedStore":
        """Copies of committed rows, committed in the new store; codes copied as they are."""
        new = type(self)(self.spec, self.bits, self.group_size)
        new.grow(capacity)
        n = index.shape[0]
        for a, b in zip(self.codes, new.codes):
            b[:, :, :n, :] = mx.take(a, index, axis=2)
        new.committed = new.coded = n
        return new

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())

    def state(self) -> List[mx.array]:
        out = [] if self.codes is None else list(self.codes)
        return out + ([] if self.scratch is None else list(self.scratch))

    # -- saving and restoring -------------------------------------------------

    def to_arrays(self, rows: int) -> Dict[str, mx.array]:
        """``keys_packed``, ``keys_scales``, ``keys_biases`` and the same for
        values: the committed rows' codes, (1, kv_heads, rows, ·) each."""
        return {f"{name}_{part}": a for name, codes in zip(("keys", "values"), self._codes(rows))
                for part, a in zip(_PARTS, codes)}

    def load_arrays(self, arrays: Dict[str, mx.array], rows: int) -> None:
        for name in ("keys", "values"):
            for part, like in zip(_PARTS, self._zeros(rows, 1)):
                a = arrays.get(f"{name}_{part}")
                if a is None or a.shape != like.shape or a.dtype != like.dtype:
                    raise ValueError(f"its arrays are not {self.bits}-bit codes in groups of "
                                     f"{self.group_size} of this cache's layers, heads or dtype")
        for part, buffer in zip(_PARTS, self.codes):
            buffer[:, :, :rows, :] = mx.concatenate([arrays[f"keys_{part}"], arrays[f"values_{part}"]])
        self.scratch, self.committed, self.coded = None, rows, rows


# -- attention over committed codes and scratch rows ---------------------------


def dequantize(codes: Codes, bits: int, group_size: int) -> mx.array:
    """Float rows of codes (..., rows, ·). On the GPU paths ``mx.dequantize``;
    on the CPU paths the codes' bytes read as uint8 (4-bit: two nibbles, low
    first, as ``mx.quantize`` packs them little-endian) times the scales plus
    the biases, the same arithmetic in ~2.7x (8-bit) and ~1.8x (4-bit) less
    time on this CPU than MLX's CPU dequantize (docs/benchmarks.md)."""
    packed, scales, biases = codes
    if backend.gpu_paths():
        return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    *lead, rows, _ = packed.shape
    values = packed.view(mx.uint8)
    if bits == 4:
        values = mx.stack([values & 15, values >> 4], axis=-1)
    values = values.reshape(*lead, rows, scales.shape[-1], group_size).astype(scales.dtype)
    return (values * scales[..., None] + biases[..., None]).reshape(*lead, rows, -1)


def split_attend(q: mx.array, keys: Codes, values: Codes, scratch_keys: Optional[mx.array],
                 scratch_values: Optional[mx.array], mask, bits: int, group_size: int) -> mx.array:
    """Attention of (B, H, T, D) queries (scaled) over C committed rows kept
    as codes (B, K, C, ·) followed by S scratch rows (B, K, S, D) in float
    (None: none), through ``mx.quantized_matmul``: one softmax over the
    C + S scores. ``mask``: None, "causal", or boolean (T, C + S) or
    (B, 1, T, C + S), True where a query sees a key."""
    B, H, T, D = q.shape
    K = keys[0].shape[1]
    q = q.reshape(B, K, H // K, T, D)  # each KV head's query heads together
    per_head = [tuple(a[:, :, None] for a in codes) for codes in (keys, values)]
    scores = mx.quantized_matmul(q, *per_head[0], transpose=True, group_size=group_size, bits=bits)
    C = scores.shape[-1]
    if scratch_keys is not None:
        scores = mx.concatenate([scores, q @ scratch_keys[:, :, None].swapaxes(-1, -2)], axis=-1)
    if isinstance(mask, str):
        L = scores.shape[-1]
        mask = mx.arange(L)[None, :] <= mx.arange(L - T, L)[:, None]
    if mask is not None:
        scores = mx.where(mask if mask.ndim < 4 else mask[:, :, None], scores, mx.finfo(scores.dtype).min)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(probs[..., :C], *per_head[1], transpose=False, group_size=group_size, bits=bits)
    if scratch_values is not None:
        out = out + probs[..., C:] @ scratch_values[:, :, None]
    return out.reshape(B, H, T, D)


def batched_attend(q: mx.array, stores: Sequence[QuantizedStore], committed: Sequence[int],
                   spans: Tuple[int, int], mask: mx.array) -> mx.array:
    """One call for a padded batch: (B, H, maxN, D) queries over each
    request's committed codes padded to ``spans[0]`` rows, then its scratch
    rows padded to ``spans[1]`` (padding reads as zeros; ``mask``
    (B, 1, maxN, spans[0] + spans[1]) hides it)."""
    max_c, max_s = spans
    keys: List[List[mx.array]] = [[] for _ in range(3)]
    values: List[List[mx.array]] = [[] for _ in range(3)]
    scratch: Tuple[List[mx.array], List[mx.array]] = ([], [])
    for store, c in zip(stores, committed):
        for gathered, codes in zip((keys, values), store._codes(c)):
            for part, a in zip(gathered, codes):
                part.append(mx.pad(a, [(0, 0), (0, 0), (0, max_c - c), (0, 0)]) if max_c > c else a)
        if max_s:
            for part, a in zip(scratch, store._scratch(max_s)):
                part.append(a)
    joined = [tuple(mx.concatenate(p) for p in gathered) for gathered in (keys, values)]
    rows = [mx.concatenate(p) for p in scratch] if max_s else [None, None]
    first = stores[0]
    return split_attend(q, *joined, *rows, mask, first.bits, first.group_size)
