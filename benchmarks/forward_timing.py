"""The timing under ``benchmarks.forward_cost``: a cache filled to a
length, the forwards of each phase and width timed on it (the whole
forward, its host part, AR's one-token forward beside each), and each op
class timed alone with the same shapes.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.packed import padded
from refusion_mlx.decode.runner import Runner
from refusion_mlx.errors import RefusionError

from .speed_common import median

PHASES = ("plan", "verify", "infill")
SLOT_SIZE = 4


def infill_layout(width: int, slot_size: int = SLOT_SIZE) -> tuple:
    """(slots, cursor) of an infill pass ``width`` tokens wide: whole slots
    from their first token when the width allows, else one slot's last
    ``width`` tokens."""
    if width % slot_size == 0:
        return width // slot_size, 0
    if width < slot_size:
        return 1, slot_size - width
    raise RefusionError(f"an infill pass of {width} tokens is neither whole slots of {slot_size} nor part of one")


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn()`` evaluated, after one untimed call."""
    mx.eval(fn())
    times = []
    for _ in range(repeat):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return median(times)


class AROneToken:
    """mlx-lm's one-token forward after ``kv_len`` cached rows (random keys
    and values), with room for ``room`` more without growing its buffers:
    the AR side of every row at this cache length, timed right after each of
    its forwards at the same cache length (:func:`forward_ms`), so that both
    sides of ``x_ar`` meet the machine in the same state. One untimed call
    first. ``times``, ``builds``: the lists each timed forward's seconds and
    its graph's are appended to (default new)."""

    def __init__(self, ar_model, kv_len: int, room: int = 0, times: Optional[List[float]] = None,
                 builds: Optional[List[float]] = None):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.cache = ar_model, make_prompt_cache(ar_model)
        args = ar_model.args
        self.shape = (1, args.num_key_value_heads, args.head_dim)
        self.dtype = ar_model.model.norm.weight.dtype
        self.cut(kv_len + room + 1)  # the buffers as long as any forward here needs: none grows while timed
        self.token = mx.array([[1]], dtype=mx.int32)
        self.times: List[float] = [] if times is None else times
        self.builds: List[float] = [] if builds is None else builds
        self.once(kv_len, keep=False)

    def cut(self, rows: int) -> None:
        """Exactly ``rows`` cached rows: the rest dropped (its offset moved back, nothing copied), or random
        rows added."""
        B, K, D = self.shape
        for c in self.cache:
            if c.offset > rows:
                c.trim(c.offset - rows)
            elif c.offset < rows:
                kv = mx.random.normal((B, K, rows - c.offset, D)).astype(self.dtype)
                c.update_and_fetch(kv, kv)
        mx.eval([c.state for c in self.cache])

    def once(self, rows: int, keep: bool = True) -> float:
        """Seconds of one forward after ``rows`` cached rows (its graph built, then evaluated)."""
        self.cut(rows)
        mx.synchronize()
        t0 = time.perf_counter()
        best = mx.argmax(self.model(self.token, cache=self.cache)[:, -1, :], axis=-1)
        built = time.perf_counter()
        mx.eval(best)
        took = time.perf_counter() - t0
        if keep:
            self.times.append(took)
            self.builds.append(built - t0)
        return took


class Filled:
    """One sequence's cache holding ``rows`` committed rows of random keys and
    values, with room for ``extra`` more (the passes timed write after them)."""

    def __init__(self, model, rows: int, extra: int, seed: int = 0):
        self.cache = CommittedCache.for_model(model)
        self.cache.reserve(rows + extra)
        key = mx.random.key(seed)
        for store in self.cache.stores:
            if store is not None:
                shape = store.keys.shape
                store.keys = mx.random.normal(shape, key=key).astype(store.keys.dtype)
                store.values = mx.random.normal(shape, key=key).astype(store.values.dtype)
                mx.eval(store.keys, store.values)
        self.cache.commit([0] * rows, list(range(rows)))

    def cut(self, rows: int) -> None:
        """Exactly ``rows`` committed rows: past them the rest dropped (the rows kept are the first ones,
        so nothing is copied: ``CommittedCache.keep``), short of them the next rows the passes wrote
        committed, as a decode commits them."""
        n = len(self.cache)
        if n > rows:
            self.cache.keep(range(rows))
        elif n < rows:
            self.cache.commit([0] * (rows - n), list(range(n, rows)))

    def write(self, phase: str, width: int):
        if phase == "infill":
            slots, cursor = infill_layout(width)
            return self.cache.infill(slots, SLOT_SIZE, cursor)
        return self.cache.extend(width)


def cache_lengths(kv_len: int, phase: int, phases: int, repeat: int, fixed_kv: bool) -> List[int]:
    """The cache length of each forward of a row at ``kv_len`` (the untimed one first), the row's phase
    the ``phase``-th of ``phases``: ``kv_len`` each with ``fixed_kv``; else a new length each time, as a
    decode's cache grows: the timed ones at ``kv_len + phase``, then ``phases`` rows longer each, so that
    no two forwards of a cache length repeat a shape (a plan and a verify pass of one width are the same
    forward) and no phase is measured at longer caches than another; the untimed one past them."""
    if fixed_kv:
        return [kv_len] * (repeat + 1)
    return [kv_len + phase + k * phases for k in (repeat, *range(repeat))]


def forward_ms(model, filled: Filled, phase: str, width: int, lengths: List[int],
               ar: Optional[AROneToken] = None) -> Tuple[List[float], List[float], List[float]]:
    """Seconds of whole forwards of ``width`` tokens (LM head on every row),
    one after each cache length of ``lengths`` (:func:`cache_lengths`; the
    first untimed), of the host's part of each before its evaluation:
    building the graph in Python (with ``REFUSION_MLX_OVERLAP=on``, also
    starting its first layers), and of ``ar``'s one-token forward timed
    right after each at the same cache length (none without ``ar``)."""
    runner = Runner.of(model)
    rng = np.random.default_rng(0)
    times, builds, ar_times = [], [], []
    for r, length in enumerate(lengths):
        filled.cut(length)
        write = filled.write(phase, width)
        start = len(filled.cache)
        tokens = mx.array(rng.integers(0, model.args.vocab_size, width), dtype=mx.int32)
        positions = mx.arange(start, start + width, dtype=mx.int32)
        mx.eval(tokens, positions, *([write.mask] if isinstance(write.mask, mx.array) else []),
                *([write.rows] if write.rows is not None else []))
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model.head(runner.hidden(tokens, positions, write)).astype(mx.float32)
        built = time.perf_counter()
        mx.eval(logits)
        if r:
            times.append(time.perf_counter() - t0)
            builds.append(built - t0)
            if ar is not None:
                ar_times.append(ar.once(length))
    return times, builds, ar_times


def parts_ms(model, filled: Filled, phase: str, width: int, repeat: int, sync_ms: float) -> Dict[str, float]:
    """Each op class of the forward timed alone over every layer (ms)."""
    args = model.args
    dtype = model.layers[0].input_layernorm.weight.dtype
    H, K, D = model.heads, model.kv_heads, args.head_dim
    x = mx.random.normal((width, args.hidden_size)).astype(dtype)
    y = mx.random.normal((width, H * D)).astype(dtype)
    q = mx.random.normal((1, H, width, D)).astype(dtype)
    kv = mx.random.normal((1, K, width, D)).astype(dtype)
    mx.eval(x, y, q, kv)
    layers = model.layers
    write = padded(filled.write(phase, width), width)  # a padded batch of one where shapes are bucketed
    mask = None if write.mask is None else model.attention_mask(write.mask, width, write.visible, dtype)

    def proj():
        return [[*a.qkv(a, x), a.o_proj(y)] for a in (layer.self_attn for layer in layers)]

    def attn():
        return [write.layer(i).attend(q, kv, kv, mask) for i in range(len(layers))]

    fns = {"proj": proj, "mlp": lambda: [layer.mlp(x) for layer in layers],
           "attn": attn, "head": lambda: model.head(x).astype(mx.float32)}
    quantized = [m for layer in layers for _, m in layer.named_modules() if isinstance(m, nn.QuantizedLinear)]
    if quantized:  # every quantized matmul of the layers: in one call, and in calls of at most 7 rows
        inputs = {}
        for m in quantized:
            k = m.scales.shape[-1] * m.group_size
            inputs.setdefault(k, mx.random.normal((width, k)).astype(dtype))
        mx.eval(list(inputs.values()))

        def matmuls(rows: int):
            def run():
                out = []
                for m in quantized:
                    xm = inputs[m.scales.shape[-1] * m.group_size]
                    out += [mx.quantized_matmul(xm[i:i + rows], m.weight, m.scales, m.get("biases"), transpose=True,
                                                group_size=m.group_size, bits=m.bits) for i in range(0, width, rows)]
                return out
            return run

        fns["qmm"] = matmuls(width)
        fns["qmm_rows7"] = matmuls(7)
    return {name: max(0.0, 1000 * timed(fn, repeat) - sync_ms) for name, fn in fns.items()}


def sync_cost_ms(repeat: int = 20) -> float:
    a = mx.zeros((1,))
    return 1000 * timed(lambda: a + 1, repeat)
