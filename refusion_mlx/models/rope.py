"""RoPE from a per-token position id: ReFusion commits slots out of order, so
each token is rotated by its own position, not its place in the sequence.

Three rotations, one arithmetic: float32 (and the CPU paths) rotate by cos
and sin formed exactly as Hugging Face forms them (:class:`PositionalRoPE`),
in a compiled kernel; half precision on the GPU paths uses MLX's fused
``mx.fast.rope`` (one kernel a layer instead of three), every token its own
batch entry so that each turns by its own position (:class:`TokenPositions`),
which computes the angles and the turn in float32 and rounds once -- closer
to the float32 rotation than rounding cos, sin and each product to half
precision is."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import ConfigError
from . import backend
from .kernels import PerShape


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


@dataclass(frozen=True)
class TokenPositions:
    """What every layer takes as ``rope`` for ``mx.fast.rope``: each token's
    position (``offsets``, (N,) int32 for N tokens) and the rotation's
    periods (``freqs``: 1 / the inverse frequencies)."""

    offsets: mx.array
    freqs: mx.array


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
        self.freqs = mx.array(np.float32(1.0) / inv_freq)

    def for_pass(self, positions: mx.array, dtype: mx.Dtype):
        """What every layer of a pass takes as ``rope``: :class:`TokenPositions`
        where the fused kernel rotates (half precision on the GPU paths),
        else cos and sin (:meth:`angles`)."""
        if backend.gpu_paths() and dtype in (mx.bfloat16, mx.float16):
            return TokenPositions(positions.reshape(-1).astype(mx.int32), self.freqs)
        return self.angles(positions, dtype)

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


def apply_rope(x: mx.array, rope, head_scale: Optional[mx.array]) -> mx.array:
    """Rotate (B, H, T, D) by per-token angles (halves convention, as HF Qwen3),
    then multiply each head by ``head_scale`` (H, 1, 1; None: nothing to
    multiply, the caller folded it in before).

    ``rope`` as :meth:`PositionalRoPE.for_pass` made it: :class:`TokenPositions`,
    MLX's fused kernel (:func:`rotate_fused`); or cos and sin: on the GPU
    paths :func:`rotate_shapeless`, one trace for every pass length, on the
    CPU paths :func:`rotate_halves`, traced per shape (measured a little
    faster there). Those two do the same arithmetic in the same order, so
    they agree bit for bit.
    """
    if isinstance(rope, TokenPositions):
        return rotate_fused(x, rope, head_scale)
    scale = mx.ones((x.shape[1], 1, 1), x.dtype) if head_scale is None else head_scale
    if backend.gpu_paths():
        return rotate_shapeless(x, *rope, scale)
    return rotate_halves(x, *rope, scale)


def rotate_fused(x: mx.array, rope: TokenPositions, head_scale: Optional[mx.array]) -> mx.array:
    """:func:`apply_rope` through ``mx.fast.rope``: (B, H, T, D) laid out as
    B*T batch entries of one token each (views of the (B, T, H, D) rows the
    projections made), each offset by its own position."""
    B, H, T, D = x.shape
    rows = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)
    out = mx.fast.rope(rows, D, traditional=False, base=None, scale=1.0, offset=rope.offsets, freqs=rope.freqs)
    out = out.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    return out if head_scale is None else out * head_scale


@PerShape
def rotate_halves(x: mx.array, cos: mx.array, sin: mx.array, head_scale: mx.array) -> mx.array:
    """:func:`apply_rope` of the CPU paths.

    Compiled per shape (the slices cannot be shapeless; ``kernels.PerShape``), so each new pass
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
