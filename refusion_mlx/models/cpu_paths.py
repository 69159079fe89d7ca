"""The model's device-dependent operations, chosen by ``backend``'s switch:
on the GPU paths MLX's fused kernels (``mx.fast.rms_norm``,
``scaled_dot_product_attention``); on the CPU paths (the CPU has no fused
kernels) compiled or regrouped equivalents with the same arithmetic and
fewer dispatched ops (RMSNorm, grouped-query attention and its mask), and
linear layers laid out for the BLAS at load (:func:`lay_out_linears`). How
a decode pass runs on the CPU (row groups on two streams, evaluation started
every few layers, BLAS threads) is ``decode/runner.py``'s."""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import _blas
from .backend import fused_attention, gpu_paths
from .kernels import softmax


@partial(mx.compile, shapeless=True)
def _inverse_rms(x: mx.array, eps: float, inv_dim: float) -> mx.array:
    xf = x.astype(mx.float32)
    return mx.rsqrt(mx.sum(xf * xf, axis=-1, keepdims=True) * inv_dim + eps)


@partial(mx.compile, shapeless=True)
def _scale_rows(x: mx.array, weight: mx.array, inverse_rms: mx.array) -> mx.array:
    return weight * (x.astype(mx.float32) * inverse_rms).astype(x.dtype)


class RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32, then scaled in the input dtype (as HF does).

    On the GPU ``mx.fast.rms_norm`` is one fused kernel. The CPU backend has no
    such kernel and decomposes it into a chain of small ops, each dispatched on
    its own; there a compiled version (a reduction, the inverse RMS per row,
    one fused elementwise pass) makes a forward 5-10% faster on the demo model.
    """

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMS-normalise the last axis; ``weight`` broadcasts against ``x``."""
    if gpu_paths():
        if weight.ndim == 1:
            return mx.fast.rms_norm(x, weight, eps)
        return weight * mx.fast.rms_norm(x, None, eps)
    # two compiled kernels, not one: fused into the elementwise pass, the
    # rsqrt would run once per element (after the row's sum is broadcast),
    # in a loop MLX cannot vectorise (its inputs broadcast); computed per row
    # first, a wide pass's norms take ~35% less (bit for bit the same)
    return _scale_rows(x, weight, _inverse_rms(x, eps, 1.0 / x.shape[-1]))


def attend(q: mx.array, k: mx.array, v: mx.array, mask, fused: Optional[bool] = None) -> mx.array:
    """Attention of (B, H, T, D) queries, already multiplied by the softmax
    scale, over (B, K, L, D) keys and values.

    On the GPU paths: MLX's fused kernel, ``mask`` None, "causal", (T, L) or
    (B, 1, T, L) boolean, where ``backend.fused_attention`` says so, else
    :func:`unfused_attend` on the same mask. The CPU has no fused kernel and
    MLX splits that call into ~16 ops per layer, rebuilding the mask and
    broadcasting K/V over each query group; here the H/K query heads that
    share a KV head are stacked as the rows of one matrix, against a mask
    from :func:`grouped_mask` built once per forward. Same arithmetic, half
    the ops. ``fused`` (GPU paths): fused or not as the caller decided (a
    bucketed batch, ``decode/packed.py``; a fused call's mask may then be
    additive), instead of ``backend.fused_attention``.
    """
    if gpu_paths():
        if fused_attention(q.shape[2]) if fused is None else fused:
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
        return unfused_attend(q, k, v, mask)
    B, H, T, D = q.shape
    K = k.shape[1]
    scores = q.reshape(B, K, H // K * T, D) @ k.swapaxes(-1, -2)
    probs = softmax(scores + mask)
    return (probs @ v).reshape(B, H, T, D)


def unfused_attend(q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
    """The GPU paths' attention as plain ops, where a fused call would cost
    more (``backend.fused_attention``: on CUDA, cuDNN's graph per shape):
    the H/K query heads of each KV head stacked as the rows of one matmul
    (no K/V broadcast), the boolean mask applied in place (broadcast, never
    materialised per head), one float32 softmax. ``mask``: as the fused
    kernel takes it (None, "causal", (T, L), (B, 1, T, L))."""
    B, H, T, D = q.shape
    K, L = k.shape[1], k.shape[2]
    scores = (q.reshape(B, K, H // K * T, D) @ k.swapaxes(-1, -2)).reshape(B, K, H // K, T, L)
    if isinstance(mask, str):  # attention_mask makes it once per forward; a direct call here
        mask = causal_mask(T, L)
    if mask is not None:
        if mask.ndim == 4:  # (B, 1, T, L): one mask per request of a padded batch
            mask = mask[:, :, None]
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs.reshape(B, K, H // K * T, L) @ v).reshape(B, H, T, D)


def causal_mask(queries: int, keys: int) -> mx.array:
    """(queries, keys) boolean: query j sees the first keys - queries + j + 1
    keys ("causal" with the queries last). Made on the host (no kernels)."""
    return mx.array(np.arange(keys)[None, :] <= np.arange(keys - queries, keys)[:, None])


def grouped_mask(mask, queries: int, keys: int, heads: int, kv_heads: int, dtype: mx.Dtype) -> mx.array:
    """The CPU :func:`attend`'s mask: "causal" or boolean (T, L) made additive
    (0 or -inf; adding 0 leaves a score as is) and laid out like its scores,
    (1, kv_heads, heads / kv_heads * T, L), so no layer has to broadcast it."""
    if isinstance(mask, str):
        mask = causal_mask(queries, keys)
    mask = mx.where(mask, mx.array(0, dtype), mx.array(-mx.inf, dtype))
    groups = heads // kv_heads
    if mask.ndim == 3:  # one mask per row: (B, T, L) -> (B, 1, groups * T, L)
        B = mask.shape[0]
        return mx.broadcast_to(mask[:, None], (B, groups, *mask.shape[1:])).reshape(B, 1, -1, mask.shape[-1])
    mask = mx.broadcast_to(mask[None], (groups, *mask.shape)).reshape(groups * mask.shape[0], -1)
    return mx.broadcast_to(mask, (1, kv_heads, *mask.shape))


def attention_mask(mask, queries: int, keys: int, heads: int, kv_heads: int, dtype: mx.Dtype):
    """``mask`` ("causal", boolean (T, L), or (B, T, L) one per row) in the
    form :func:`attend` takes on this device: as is for the GPU's fused kernel,
    grouped and additive on the CPU. Made once per forward (or once per
    request of a packed batch)."""
    if gpu_paths():
        if isinstance(mask, str):  # the unfused attention takes it as an array, made here once
            return mask if fused_attention(queries) else causal_mask(queries, keys)
        return mask[:, None] if mask.ndim == 3 else mask
    return grouped_mask(mask, queries, keys, heads, kv_heads, dtype)


def lay_out_linears(model) -> str:
    """How the plain linear layers multiply on the CPU paths, chosen at load for the BLAS in use.

    ``"weight-major"`` where MKL runs on more than one thread: MKL computes a product of a few rows
    (``x @ w.T``, 2-32 rows) on one thread whatever its thread count, but splits the weight's rows
    among its threads in ``w @ x.T``. So each layer keeps its (out, in) weight and multiplies a pass of
    two or more rows as ``(w @ x.T).T`` (``projections.weight_major_matmul``), the tied LM head too;
    one row stays ``x @ w.T`` (weight-major gains nothing there). The 0.6B shape's 28 layers of matmuls at 16 rows took
    243 ms against 432 on this 2-core CPU, a 16-token forward ~2x a one-token one against ~3x. On one
    thread it gains nothing and on OpenBLAS (which threads ``x @ w.T``) it loses: 400 ms against 228
    (docs/benchmarks.md, "Matmuls of a few rows on the CPU"). Elsewhere ``"transposed"``:
    :func:`store_weights_transposed`. The choice is made once, for the layers there are now."""
    from .projections import Linear

    threads = _blas.mkl_threads()
    if threads is None or threads < 2:
        store_weights_transposed(model)
        return "transposed"
    for module in model.modules():
        if isinstance(module, Linear) or type(module) is nn.Embedding:
            module.weight_major = True
    return "weight-major"


def store_weights_transposed(model) -> int:
    """Store each plain linear layer's weight (out, in) as the transposed view
    of a row-major (in, out) buffer: the same array to every reader (saving,
    joining, adapters), while the matmul ``x @ weight.T`` now reads a
    row-major right-hand side. MKL's sgemm packs that faster: 4-16-token
    passes of the demo model are 10-15% faster, wide ones unchanged
    (docs/benchmarks.md). No memory is added: each old buffer goes once its
    copy is made. Returns how many layers were stored so."""
    from .projections import Linear

    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and "weight" in module and module["weight"].ndim == 2:
            module["weight"] = mx.contiguous(module["weight"].T).T
            mx.eval(module["weight"])
            count += 1
    return count
