"""Splitting a model over the ranks of an ``mx.distributed`` group.

**Tensor parallel** (:func:`shard`, as mlx-lm's ``Model.shard``): every
layer is split by heads and MLP columns, as the family's
``Model.tensor_parallel`` (``base.TensorParallel``) says. q/k/v and gate/up
keep a slice of their output rows ("all-to-sharded": no communication, each
rank computes its own heads and columns); o_proj and down_proj keep the
matching slice of their input columns and sum their partial outputs over
the group ("sharded-to-all": one all-reduce each, two per layer per
forward). The embedding, the norms and the LM head stay whole, so every
rank computes the same logits from the same all-reduced hidden states and
the decoder's host decisions agree on every rank without further messages.

The sharded q/k/v and gate/up stay the model's own ``Linear`` (or
``QuantizedLinear``) with fewer rows, so ``projections.join_projections`` joins
them after sharding exactly as alone, and the CPU paths keep their
transposed weight views; only o_proj/down_proj become MLX's sharded-to-all
layers (plus a watchdog pet).

**Pipeline parallel** (:func:`pipeline`): rank r keeps a contiguous range of
layers; the hidden states travel rank 0 -> 1 -> ... by send/recv, and the
last rank's result is summed back to every rank (the others add zeros) so
the LM head and the decisions are again the same everywhere. One transfer
of T x hidden per rank boundary per forward instead of two all-reduces per
layer: see docs/distributed.md for when that wins.

Both run before any weight is read (``loading._load_split``): the layers
hold lazy initial values, never evaluated, and the loader then reads from
the files only the parameters this rank has, in its shapes (``slices``).
"""

from __future__ import annotations

import functools
from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (QuantizedShardedToAllLinear, ShardedToAllLinear,
                                       shard_inplace)

from ..distributed import watchdog
from ..errors import ConfigError
from . import registry
from .projections import joined


class _SumLinear(ShardedToAllLinear):
    """o_proj / down_proj under tensor parallelism: a partial product summed over the group."""

    def __call__(self, x: mx.array) -> mx.array:
        watchdog.pet()
        return super().__call__(x)


class _SumQuantizedLinear(QuantizedShardedToAllLinear):
    def __call__(self, x: mx.array) -> mx.array:
        watchdog.pet()
        return super().__call__(x)


def check_tensor_parallel(args, size: int) -> None:
    """mlx-lm's checks, one line each: the sizes the family splits (heads, KV
    heads, MLP columns) divide evenly."""
    for name in registry.family(args.model_type).Model.tensor_parallel.sizes:
        value = getattr(args, name)
        if value % size:
            raise ConfigError(f"tensor parallel over {size} ranks needs {name} ({value}) divisible by {size}; "
                              "use another number of ranks or --pipeline")


def _sum_layer(layer: nn.Module, group) -> nn.Module:
    if isinstance(layer, nn.QuantizedLinear):
        groups, N = layer["scales"].shape[-1], group.size()
        if groups % N:
            raise ConfigError(f"tensor parallel over {N} ranks needs the quantization groups of each row "
                              f"({groups} of {layer.group_size}) divisible by {N}; use --pipeline")
        return _SumQuantizedLinear.from_quantized_linear(layer, group=group)
    if isinstance(layer, nn.Linear):
        return _SumLinear.from_linear(layer, group=group)
    raise ConfigError(f"cannot shard a {type(layer).__name__} (fuse adapters into the weights first)")


def _at(block: nn.Module, path: str) -> Tuple[object, str]:
    """(the object holding it, its name) of a block-relative path."""
    parent, _, name = path.rpartition(".")
    for part in parent.split(".") if parent else ():
        block = block[part]
    return block, name


def shard(model, group) -> None:
    """Tensor parallel: split every layer's heads and MLP columns over ``group``.
    Call before the projections are joined (and, to read only this rank's
    share, before the weights are read: ``loading._load_split``)."""
    N = group.size()
    check_tensor_parallel(model.args, N)
    if joined(model):
        raise ConfigError("shard the model before joining its projections")
    plan = model.tensor_parallel
    for layer in model.layers:
        for path in plan.split:
            parent, name = _at(layer, path)
            if not isinstance(parent[name], (nn.Linear, nn.QuantizedLinear)):
                raise ConfigError(f"cannot shard a {type(parent[name]).__name__} "
                                  "(fuse adapters into the weights first)")
            shard_inplace(parent[name], "all-to-sharded", group=group)
        for path in plan.summed:
            parent, name = _at(layer, path)
            parent[name] = _sum_layer(parent[name], group)
        for path in plan.counts:
            owner, name = _at(layer, path)
            setattr(owner, name, getattr(owner, name) // N)
    model.heads //= N
    model.kv_heads //= N


class _Absent(nn.Module):
    """A layer another pipeline rank holds: the hidden states pass through."""

    def __call__(self, x, *args, **kwargs):
        return x


class _Hops:
    """What a pipeline rank does around one layer: receive the hidden states
    from the previous rank before it, send them to the next after it, and at
    the model's last layer sum the last rank's result back to every rank."""

    def __init__(self, group, receive: bool, send: bool, gather: bool):
        self.group, self.receive, self.send, self.gather = group, receive, send, gather

    def before(self, x: mx.array) -> mx.array:
        watchdog.pet()
        if self.receive:
            x = mx.distributed.recv_like(x, self.group.rank() - 1, group=self.group)
        return x

    def after(self, x: mx.array) -> mx.array:
        g = self.group
        if self.send:
            x = mx.distributed.send(x, g.rank() + 1, group=g)
        if self.gather:
            last = mx.array(g.rank() == g.size() - 1)
            x = mx.distributed.all_sum(mx.where(last, x, mx.zeros_like(x)), group=g)
        return x


class _Boundary:
    """A rank's own layer at a pipeline boundary: the block itself (same
    class behind this one, same parameter names, so the weights load and
    fuse as they do alone) between its hops."""

    def __call__(self, x, *args, **kwargs):
        return self._hops.after(super().__call__(self._hops.before(x), *args, **kwargs))


@functools.lru_cache(maxsize=None)
def _boundary_class(block_class: type) -> type:
    return type(f"Boundary{block_class.__name__}", (_Boundary, block_class), {})


def _boundary(block: nn.Module, hops: _Hops) -> nn.Module:
    block.__class__ = _boundary_class(type(block))
    block._hops = hops
    return block


class _Relay(nn.Module):
    """Another rank's layer at a pipeline boundary: the hops only."""

    def __init__(self, hops: _Hops):
        super().__init__()
        self._hops = hops

    def __call__(self, x, *args, **kwargs):
        return self._hops.after(self._hops.before(x))


def layer_range(layers: int, rank: int, size: int):
    """The contiguous layers ``[start, end)`` rank ``rank`` holds (earlier ranks get the extra ones)."""
    base, extra = divmod(layers, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def pipeline(model, group) -> None:
    """Pipeline parallel: keep this rank's contiguous layers, drop the others'."""
    L, N, r = len(model.layers), group.size(), group.rank()
    if L < N:
        raise ConfigError(f"pipeline over {N} ranks needs at least {N} layers, the model has {L}")
    start, end = layer_range(L, r, N)
    layers = model.layers
    for i in range(L):
        own = start <= i < end
        receive, send, gather = r > 0 and i == start, r < N - 1 and i == end - 1, i == L - 1
        if receive or send or gather:
            hops = _Hops(group, receive, send, gather)
            layers[i] = _boundary(layers[i], hops) if own else _Relay(hops)
        elif not own:
            layers[i] = _Absent()
    model.layer_range = (start, end)
