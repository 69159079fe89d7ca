"""Elementwise numerics, per device (``backend``: GPU or CPU paths).

On the GPU paths these are MLX's own kernels. MLX's CPU backend computes ``exp``
one element at a time (~14 ns each here, ~30x numpy's), and a ReFusion
forward is full of exponentials: the SwiGLU of every layer, the attention
softmax, the LM head's log-sum-exp over the vocabulary. On the CPU paths, in
float32, they use :func:`exp` below instead: one fused, vectorised kernel,
3-4x faster, within 2e-6 relative error (logits move by ~1e-6; the golden
cases stay token-exact).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .backend import cpu_paths


class PerShape:
    """``mx.compile(fun)`` for a function that cannot be compiled shapeless
    (a bit-cast, a slice), with its traces bounded. MLX keeps one trace per
    input shape for as long as the compiled function lives, and looks a call
    up among them one by one; attention scores take a new shape at almost
    every pass, so a server's traces grew without end (~50 KB each: 850 MB
    after 20,000) and each lookup slowed (8 us to 440 us). Past ``limit``
    shapes the compiled function is made afresh, which frees its traces."""

    def __init__(self, fun, limit: int = 256):
        self.fun, self.limit = fun, limit
        self.__doc__, self.__name__ = fun.__doc__, fun.__name__
        self._fresh()

    def _fresh(self) -> None:
        self.compiled, self.shapes = mx.compile(self.fun), set()

    def __call__(self, *args: mx.array) -> mx.array:
        key = tuple((a.shape, a.dtype) for a in args)
        if key not in self.shapes:
            if len(self.shapes) >= self.limit:
                self._fresh()
            self.shapes.add(key)
        return self.compiled(*args)


def _cpu_float32(x: mx.array) -> bool:
    return x.dtype == mx.float32 and cpu_paths()


# Adding and then subtracting 1.5 * 2**23 rounds a float32 of magnitude
# below 2**22 to the nearest integer with two additions, which vectorise;
# ``floor`` is a library call per element in MLX's generated CPU kernels and
# keeps the whole fused loop scalar (the exp below: 2x faster without it).
_ROUND = 12582912.0


@PerShape
def exp(x: mx.array) -> mx.array:
    """exp(x) = 2**n * exp(r), n = x / ln2 rounded to the nearest integer,
    r = x - n ln2 with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact),
    exp(r) by a degree-7 polynomial and 2**n built in the exponent bits.
    Inputs below -87 give exactly 0 (a masked score's -inf too): the
    polynomial's ~1e-38 there would make subnormal probabilities, and
    subnormal arithmetic is many times slower on some CPUs (Intel: a
    training step 8x slower, docs/benchmarks.md). It is differentiable
    (training on the CPU): d/dx = p'(r) * 2**n. Compiled per shape (a bit-cast cannot be
    shapeless; :class:`PerShape`); retracing a new shape costs ~0.2 ms, the kernel is reused."""
    x = mx.clip(x, -87.0, 88.0)
    n = mx.stop_gradient((x * 1.4426950408889634 + _ROUND) - _ROUND)
    r = x - n * 0.693359375 + n * 2.12194440e-4
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720 + r / 5040))))))
    # 2**n has no gradient (n is a floor); its bits are built out of the graph
    scale = mx.stop_gradient(((n.astype(mx.int32) + 127) << 23).view(mx.float32))
    return mx.where(x > -87.0, p * scale, 0.0)


# Training on the CPU paths differentiates through these kernels. Left to MLX, a backward pass keeps every
# intermediate of exp's polynomial (a LoRA run on the demo peaked at 0.211 GB against 0.089 GB on MLX's own
# exp); each kernel below states its own gradient, from its inputs or its output, which the forward keeps.

@mx.custom_function
def _swiglu_cpu(gate: mx.array, up: mx.array) -> mx.array:
    return _swiglu_fused(gate, up)


@PerShape
def _swiglu_fused(gate: mx.array, up: mx.array) -> mx.array:
    return gate / (1.0 + exp(-gate)) * up


@PerShape
def _swiglu_grads(gate: mx.array, up: mx.array, cotangent: mx.array):
    s = 1.0 / (1.0 + exp(-gate))  # sigmoid, recomputed: d silu(g) = s + g s (1 - s)
    return cotangent * up * (s + gate * s * (1.0 - s)), cotangent * gate * s


@_swiglu_cpu.vjp
def _swiglu_vjp(primals, cotangent, output):
    return _swiglu_grads(*primals, cotangent)


@mx.custom_function
def _softmax_cpu(x: mx.array) -> mx.array:
    e = exp(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


@PerShape
def _softmax_grad(probs: mx.array, cotangent: mx.array) -> mx.array:
    return probs * (cotangent - mx.sum(cotangent * probs, axis=-1, keepdims=True))


@_softmax_cpu.vjp
def _softmax_vjp(primals, cotangent, output):
    return _softmax_grad(output, cotangent)


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def silu_gate(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU's ``silu(gate) * up``."""
    if _cpu_float32(gate):
        return _swiglu_cpu(gate, up)
    return _swiglu(gate, up)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis, computed in float32 (``precise``)."""
    if not _cpu_float32(x):
        return mx.softmax(x, axis=-1, precise=True)
    return _softmax_cpu(x)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis (float32 logits)."""
    if not _cpu_float32(x):
        return mx.logsumexp(x, axis=-1)
    top = mx.max(x, axis=-1)
    return top + mx.log(mx.sum(exp(x - top[..., None]), axis=-1))
