"""RoPE from a per-token position id: ReFusion commits slots out of order, so
each token is rotated by its own position, not its place in the sequence."""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import ConfigError
from . import backend


def rope_scale(scaling: Optional[Dict[str, Any]]) -> float:
    """Position divisor of the RoPE scaling config; only none/default/linear exist here."""
    if not scaling:
        return 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return 1.0
    if kind == "linear":
        factor = float(scaling.get("factor", 1.0))
        if factor <= 0:
            raise ConfigError("config.json: rope_scaling factor must be positive")
        return factor
    raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (none or linear)")


class PositionalRoPE:
    """RoPE from a per-token position array (non-interleaved halves).

    The angles are formed exactly as Hugging Face does (float32 inverse
    frequencies times float32 positions), so logits match the PyTorch model.
    """

    def __init__(self, head_dim: int, base: float, scaling: Optional[Dict[str, Any]]):
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv_freq = (1.0 / (np.float64(base) ** exponents.astype(np.float64))).astype(np.float32)
        inv_freq = inv_freq / np.float32(rope_scale(scaling))
        self.inv_freq = mx.array(inv_freq)

    def angles(self, positions: mx.array, dtype: mx.Dtype = mx.float32) -> Tuple[mx.array, mx.array]:
        """cos and sin for positions (T,) -> (T, head_dim/2), or for a batch
        (B, T) -> (B, 1, T, head_dim/2), broadcasting over the heads; computed
        in float32 and given in ``dtype`` (the rotation's: cast once per
        forward, not in every layer)."""
        theta = positions.astype(mx.float32)[..., None] * self.inv_freq
        if positions.ndim == 2:
            theta = theta[:, None]
        return mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)


@functools.lru_cache(maxsize=None)
def head_scale(scale: float, heads: int, kv_heads: int, dtype: mx.Dtype) -> mx.array:
    """(heads + kv_heads, 1, 1) in ``dtype``: the softmax ``scale`` for the
    query heads, 1 for the key heads (what :func:`apply_rope` multiplies a
    joined q/k rotation by). One array per setting, shared by every layer, in
    the dtype the rotation computes in, so no layer casts it."""
    return mx.array([scale] * heads + [1.0] * kv_heads, mx.float32).reshape(-1, 1, 1).astype(dtype)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, head_scale: mx.array) -> mx.array:
    """Rotate (B, H, T, D) by per-token angles (halves convention, as HF Qwen3),
    then multiply each head by ``head_scale`` (H, 1, 1).

    GPU paths: :func:`rotate_shapeless`, one trace for every pass length.
    CPU paths: :func:`rotate_halves`, traced per shape (measured a little
    faster there). Both do the same arithmetic in the same order, so they
    agree bit for bit.
    """
    if backend.gpu_paths():
        return rotate_shapeless(x, cos, sin, head_scale)
    return rotate_halves(x, cos, sin, head_scale)


@mx.compile
def rotate_halves(x: mx.array, cos: mx.array, sin: mx.array, head_scale: mx.array) -> mx.array:
    """:func:`apply_rope` of the CPU paths.

    Compiled per shape (the slices cannot be shapeless), so each new pass
    length traces it again; the rotation and the scaling are two fused
    kernels instead of ten passes.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    head_scale = head_scale.astype(x.dtype)
    return mx.concatenate([(x1 * cos - x2 * sin) * head_scale, (x2 * cos + x1 * sin) * head_scale], axis=-1)


def _rotate(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array,
            head_scale: mx.array) -> Tuple[mx.array, mx.array]:
    """The two rotated halves, times ``head_scale``: rotate_halves' arithmetic."""
    cos, sin = cos.astype(x1.dtype), sin.astype(x1.dtype)
    head_scale = head_scale.astype(x1.dtype)
    return (x1 * cos - x2 * sin) * head_scale, (x2 * cos + x1 * sin) * head_scale


# Only element-wise ops, so shapeless compiling is valid: one trace serves
# every pass length and batch size (a new one only for another rank or dtype).
# Slice and Concatenate cannot infer their shapes in a shapeless trace, so they
# stay outside it -- they were never fused in rotate_halves either.
_rotate_shapeless = mx.compile(_rotate, shapeless=True)


def rotate_shapeless(x: mx.array, cos: mx.array, sin: mx.array, head_scale: mx.array) -> mx.array:
    """:func:`apply_rope` of the GPU paths: split the halves, rotate them in
    the shapeless compiled kernel, join them."""
    half = x.shape[-1] // 2
    return mx.concatenate(_rotate_shapeless(x[..., :half], x[..., half:], cos, sin, head_scale), axis=-1)
