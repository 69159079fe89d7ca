"""Attention for several requests' passes packed into one forward.

``run_passes`` feeds the passes of a batch as one sequence, so every weight
is read once per step; attention must still keep each request to its own
cache and pass (REFUSION.md §3-§4). A :class:`PackedWrite` stands in for the
``KVWrite`` of one pass: rows ``[start, end)`` of the packed sequence belong
to one request, write into its cache and attend to it alone. Two ways:

* **GPU paths: one kernel call per layer.** The queries are laid out as a
  padded batch (B, H, maxN, D), each request's keys and values as its first
  maxV cache rows (B, K, maxV, D) -- maxN and maxV the batch's longest pass
  and widest view -- and one (B, 1, maxN, maxV) mask hides the padding and
  keeps each request's own visibility (causal, or its infill slots'
  block-diagonal mask). One ``scaled_dot_product_attention`` then serves the
  batch, and the outputs are unpadded into the packed order. The price is
  a gather: each layer copies B x maxV cache rows of keys and values into
  the padded batch, which the attention kernel then reads (see
  docs/benchmarks.md): at ReFusion-8B's shape (36 layers, 8 KV
  heads of 128, bfloat16) 144 KiB per row, so a batch of 8 at 1,000 visible
  rows copies ~1.2 GB a step against ~16 GB of weights read once. The
  committed caches themselves are never copied, and each request keeps its
  own buffer (a prompt cache forks it, a chat continues it).
* **CPU paths: one call per request.** MLX's CPU backend has no fused
  attention; there each request's store attends over exactly its visible
  rows (``KVStore.attend``: the grouped-query attention of
  ``models.cpu_paths.attend`` for the float store): no gather, and on the
  demo model no slower than the padded batch (docs/benchmarks.md).

Quantized caches (``decode/kv_quant.py``): the padded batch gathers each
request's committed rows as codes (padded to the batch's most committed
rows) and its scratch rows in float (padded to the widest scratch), and one
``KVStore.attend_batch`` call per layer (the quantized kind's) reads the codes through MLX's
quantized matmul; the mask is the same per-request mask, its columns laid
out as codes then scratch rows.

The padding, masks and index arrays are made once per forward, on first use.

**Bucketed shapes** (``REFUSION_MLX_ATTENTION=bucketed``,
``backend.bucketed_attention``): a backend that plans per exact shape
(cuDNN, behind MLX's fused attention on CUDA) would plan again for every
pass, since every pass sees a new number of keys. There a pass of two or
more rows -- a lone request's too (:func:`padded`) -- attends as a padded
batch whose query rows are padded to a power of two and whose keys are read
to a length of ``backend.key_bucket``, the extra keys masked (the mask made
additive once per forward): one shape serves a whole run of passes, and
``backend.plans_shape`` keeps the shapes a thread plans under MLX's
cache, new ones past it attending unfused.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..models import backend
from ..models.cpu_paths import attend, attention_mask
from .cache import KVWrite


def padded(write, tokens: int):
    """The write a pass of ``tokens`` rows attends through: a lone request's
    write (a ``KVWrite``, or the bench's stand-in) as a padded batch of one
    where its shapes are bucketed (``backend.bucketed_attention``, a store
    kind whose rows are read as floats), else ``write`` itself."""
    if write.mask is not None and backend.bucketed_attention(tokens) and _float_rows([write]):
        return PackedWrite([write], [tokens], batched=True)
    return write


def _float_rows(writes) -> bool:
    """Whether every write's stores are of a kind read back as float rows (``KVStore.FLOAT_ROWS``)."""
    return all(type(store).FLOAT_ROWS for w in writes for store in w.cache.stores if store is not None)


class PackedWrite:
    """The KV writes of several requests' passes in one forward.

    ``batched``: attend as one padded batch (one kernel call per layer; the
    GPU paths' default) or request by request (the CPU paths').
    """

    def __init__(self, writes: Sequence[KVWrite], lengths: Sequence[int],
                 batched: Optional[bool] = None):
        offsets = np.cumsum([0, *lengths]).tolist()
        self.segments = [(w, offsets[i], offsets[i + 1]) for i, w in enumerate(writes)]
        self.mask = None  # Runner.hidden: no shared mask, the packed write brings its own
        self.batched = backend.gpu_paths() if batched is None else batched
        self._masks: Optional[List] = None
        self._padding: Optional["_Padding"] = None

    def layer(self, i: int) -> "_PackedLayer":
        return _PackedLayer(self, i)

    @property
    def tokens(self) -> int:
        """How many tokens the packed passes write, all requests together."""
        return self.segments[-1][2]

    def split(self, at: int) -> Optional["tuple"]:
        """The batch as two, cut between the requests nearest ``at`` rows:
        each request attends to its own cache alone, so the two halves never
        see each other (``runner.row_groups``)."""
        cuts = [start for _, start, _ in self.segments[1:]]
        if not cuts:
            return None
        j = 1 + min(range(len(cuts)), key=lambda i: abs(cuts[i] - at))
        halves = [self.segments[:j], self.segments[j:]]
        return tuple(PackedWrite([w for w, _, _ in part], [end - start for _, start, end in part], self.batched)
                     for part in halves)

    def masks(self, heads: int, kv_heads: int, dtype: mx.Dtype) -> List:
        """One attention mask per request (the request-by-request way)."""
        if self._masks is None:
            self._masks = [attention_mask(w.mask, end - start, w.visible, heads, kv_heads, dtype)
                           for w, start, end in self.segments]
        return self._masks

    def padding(self, heads: int, kv_heads: int, dtype: mx.Dtype, bucketed: bool = False) -> "_Padding":
        """The padded batch's shape, index arrays and mask (the batched way);
        ``bucketed``: at bucketed shapes (this module's docstring)."""
        if self._padding is None:
            self._padding = _Padding(self.segments, heads, kv_heads, dtype, bucketed)
        return self._padding


class _Padding:
    """Where each packed row sits in the padded batch, and the batch's mask."""

    def __init__(self, segments, heads: int, kv_heads: int, dtype: mx.Dtype, bucketed: bool = False):
        lengths = [end - start for _, start, end in segments]
        self.batch = len(segments)
        self.max_rows = max(lengths)
        self.max_visible = max(w.visible for w, _, _ in segments)
        self.bucketed = bucketed
        if bucketed:
            self.max_rows = backend.row_bucket(self.max_rows)
            self.max_visible = backend.key_bucket(self.max_visible)
        self._fused: Optional[tuple] = None  # (fused or not, the mask it takes), on first use
        if all(n == self.max_rows for n in lengths):
            self.pad_index = self.unpad_index = None  # nothing to pad: reshapes do
        else:
            pad = np.zeros((self.batch, self.max_rows), np.int32)  # padding rows read row 0
            unpad = []
            for b, (_, start, end) in enumerate(segments):
                pad[b, :end - start] = np.arange(start, end)
                unpad.extend(range(b * self.max_rows, b * self.max_rows + end - start))
            self.pad_index = mx.array(pad.reshape(-1))
            self.unpad_index = mx.array(np.array(unpad, np.int32))
        masks = [self._segment_mask(w, end - start) for w, start, end in segments]
        self.mask = attention_mask(mx.stack(masks), self.max_rows, self.max_visible,
                                   heads, kv_heads, dtype)
        self._segments, self._masks = segments, masks
        self._split: Optional[tuple] = None

    def split(self, coded: Sequence[int]) -> tuple:
        """For caches kept as codes, ``coded`` rows each (the same in every
        layer): (``coded``, (most coded rows, widest scratch), the
        (B, 1, maxN, both) boolean mask with each request's keys laid out as
        its coded rows, padded, then its scratch rows, padded)."""
        if self._split is None:
            committed = list(coded)
            max_c = max(committed)
            max_s = max(w.visible - c for (w, _, _), c in zip(self._segments, committed))
            out = []
            for mask, c in zip(self._masks, committed):
                cols = np.concatenate([np.arange(max_c), c + np.arange(max_s)])
                valid = np.concatenate([np.arange(max_c) < c, cols[max_c:] < self.max_visible])
                cols = np.minimum(cols, self.max_visible - 1).astype(np.int32)
                out.append(mx.take(mask, mx.array(cols), axis=1) & mx.array(valid)[None])
            self._split = (committed, (max_c, max_s), mx.stack(out)[:, None])
        return self._split

    def attend(self, q: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        """The padded batch's attention over the keys and values read for it.
        Bucketed: fused where ``backend.plans_shape`` allows this shape (the
        mask made additive in the queries' dtype once, so no layer converts
        it), else unfused; the keys contiguous so their strides follow from
        their shape."""
        if not self.bucketed:
            return attend(q, keys, values, self.mask)
        if self._fused is None:
            B, H, T, D = q.shape
            fused = backend.plans_shape((B, H, keys.shape[1], T, keys.shape[2], D, str(q.dtype)))
            mask = mx.where(self.mask, mx.array(0, q.dtype), mx.array(-mx.inf, q.dtype)) if fused else self.mask
            self._fused = (fused, mask)
        fused, mask = self._fused
        if fused and keys.shape[0] == 1:
            keys, values = mx.contiguous(keys), mx.contiguous(values)
        return attend(q, keys, values, mask, fused=fused)

    def _segment_mask(self, write: KVWrite, rows: int) -> mx.array:
        """(maxN, maxV) bool: the request's own mask, padded. Padding keys are
        hidden; padding query rows see key 0 only (a finite row, discarded)."""
        n, v = self.max_rows, self.max_visible
        if isinstance(write.mask, str):  # causal: row j sees the first visible - rows + j + 1 keys
            j = np.arange(n)[:, None]
            mask = (np.arange(v)[None, :] < write.visible - rows + j + 1) & (j < rows)
            mask[rows:, 0] = True
            return mx.array(mask)
        mask = write.mask
        if v > write.visible:
            mask = mx.pad(mask, [(0, 0), (0, v - write.visible)])
        if n > rows:
            filler = np.zeros((n - rows, v), bool)
            filler[:, 0] = True
            mask = mx.concatenate([mask, mx.array(filler)])
        return mask

    def pad(self, x: mx.array) -> mx.array:
        """(1, H, N, D) packed rows -> (B, H, maxN, D)."""
        _, H, _, D = x.shape
        if self.pad_index is not None:
            x = mx.take(x, self.pad_index, axis=2)
        return x.reshape(H, self.batch, self.max_rows, D).transpose(1, 0, 2, 3)

    def unpad(self, x: mx.array) -> mx.array:
        """(B, H, maxN, D) -> (1, H, N, D) packed rows."""
        _, H, _, D = x.shape
        x = x.transpose(1, 0, 2, 3).reshape(1, H, self.batch * self.max_rows, D)
        return x if self.unpad_index is None else mx.take(x, self.unpad_index, axis=2)


class _PackedLayer:
    __slots__ = ("packed", "index")

    def __init__(self, packed: PackedWrite, index: int):
        self.packed, self.index = packed, index

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask=None) -> mx.array:
        """(1, H, N, D) packed queries (and this pass's K/V, written to each
        request's cache) -> (1, H, N, D): each request over its own rows
        (with its own mask: the packed pass has no shared ``mask``)."""
        if self.packed.batched:
            return self._attend_batched(q, k, v)
        masks = self.packed.masks(q.shape[1], k.shape[1], q.dtype)
        outs = []
        for (write, start, end), mask in zip(self.packed.segments, masks):
            layer = write.layer(self.index)
            outs.append(layer.attend(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], mask))
        return mx.concatenate(outs, axis=2)

    def _attend_batched(self, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        segments = self.packed.segments
        layers = [write.layer(self.index) for write, _, _ in segments]
        stores = [layer.store for layer in layers]
        bucketed = (backend.bucketed_attention(max(end - start for _, start, end in segments))
                    and all(type(store).FLOAT_ROWS for store in stores))
        padding = self.packed.padding(q.shape[1], k.shape[1], q.dtype, bucketed)
        for layer, (_, start, end) in zip(layers, segments):
            layer.update(k[:, :, start:end], v[:, :, start:end])
        out = type(stores[0]).attend_batch(padding.pad(q), stores, padding)  # one call, where the kind has it
        if out is not None:
            return padding.unpad(out)
        keys, values = zip(*(layer.fetch(padding.max_visible) for layer in layers))
        return padding.unpad(padding.attend(padding.pad(q), mx.concatenate(keys), mx.concatenate(values)))
