"""Linear layers as the model runs them: a transposed weight view made once
(``Linear``), and the projections that read one input joined into one
matmul after loading (``Projections``, ``join_projections``), with the row
counts that map a joined weight back to Hugging Face's names
(``hf_parameters``).

A module declares such a group as a class attribute and calls it with
itself and the input, getting one array per *output group*::

    class Attention(nn.Module):
        qkv = Projections("qkv_proj", (("q_proj", "k_proj"), ("v_proj",)))

        def __call__(self, x, ...):
            qk, v = self.qkv(self, x)  # q and k side by side, then v

As loaded the layers are separate (Hugging Face's names; adapters wrap
them), and a group of several outputs is concatenated. ``join_projections``
replaces the layers by one (``qkv_proj``: their rows stacked) and puts a
:class:`Joined` in the module's attribute: the same call, now one matmul
whose output is split at the groups' edges. Either way the module runs the
same code, and each output is computed exactly as before.
"""

from __future__ import annotations

import copy
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .backend import gpu_paths, pads_quantized, quantized_rows


class Derived:
    """An array made from parameters and remade whenever one is replaced
    (``load_weights``, ``update``, quantisation). It lives outside the
    module's parameters: never saved, never counted twice."""

    __slots__ = ("sources", "value")

    def __init__(self):
        self.sources: Tuple[mx.array, ...] = ()
        self.value: Optional[mx.array] = None

    def get(self, sources: Tuple[mx.array, ...], make) -> mx.array:
        if self.value is None or len(sources) != len(self.sources) or \
                any(a is not b for a, b in zip(sources, self.sources)):
            self.value, self.sources = make(*sources), sources
        return self.value


def weight_major_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` computed as ``(weight @ x.T).T``: the BLAS walks the weight's rows as the outer
    dimension (``cpu_paths.lay_out_linears``)."""
    rows = x.size // x.shape[-1]
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear``; on the CPU paths (``backend``) it multiplies by a
    transposed view of its weight made once (no copy), instead of a transpose
    op dispatched in every call, or, laid out ``weight_major``
    (``cpu_paths.lay_out_linears``), passes of two or more rows weight-major."""

    weight_major = False

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True):
        super().__init__(input_dims, output_dims, bias=bias)
        self._weight_t = Derived()

    def __call__(self, x: mx.array) -> mx.array:
        if gpu_paths():
            return super().__call__(x)
        if self.weight_major and x.size > x.shape[-1]:
            out = weight_major_matmul(x, self["weight"])
            return out + self["bias"] if "bias" in self else out
        weight_t = self._weight_t.get((self["weight"],), lambda w: w.T)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight_t)
        return x @ weight_t


def tied_head(embedding: nn.Module, h: mx.array) -> mx.array:
    """The LM head of a model whose embedding is its head: ``embedding.as_linear(h)``, or on the CPU paths,
    laid out ``weight_major`` (``cpu_paths.lay_out_linears``), weight-major for two or more rows."""
    if getattr(embedding, "weight_major", False) and not gpu_paths() and h.size > h.shape[-1]:
        return weight_major_matmul(h, embedding.weight)
    return embedding.as_linear(h)


class PaddedQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose input rows are padded with zeros to the
    count the backend's kernels read the weights once for
    (:func:`.backend.quantized_rows`), the padding's outputs sliced off: each
    real row is computed as before, by a kernel that streams the weights once
    for the whole pass instead of once per row."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        padded = quantized_rows(rows)
        if padded == rows:
            return super().__call__(x)
        out = super().__call__(mx.pad(x.reshape(rows, x.shape[-1]), [(0, padded - rows), (0, 0)]))
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def pad_quantized(model: nn.Module) -> int:
    """Where the backend pads narrow quantized matmuls (CUDA: :func:`.backend.pads_quantized`),
    every ``nn.QuantizedLinear`` of ``model`` made a :class:`PaddedQuantizedLinear`
    in place (the same arrays); how many (elsewhere none: the layers stay as they are)."""
    if not pads_quantized():
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = PaddedQuantizedLinear
            count += 1
    return count


class Projections:
    """Linear layers of one module that read the same input, kept apart:
    ``groups`` names the layers of each output group (a group of several is
    concatenated). ``name``: the one layer ``join_projections`` makes of them."""

    __slots__ = ("name", "groups")

    def __init__(self, name: str, groups: Sequence[Sequence[str]]):
        self.name = name
        self.groups = tuple(tuple(g) for g in groups)

    @property
    def parts(self) -> Tuple[str, ...]:
        return tuple(p for g in self.groups for p in g)

    def __call__(self, module: nn.Module, x: mx.array) -> Tuple[mx.array, ...]:
        return tuple(module[g[0]](x) if len(g) == 1 else mx.concatenate([module[p](x) for p in g], axis=-1)
                     for g in self.groups)


class Joined:
    """Projections after ``join_projections``: one layer ``name`` computes every
    part (``rows`` output rows each, in order); its output is split at the
    groups' edges (``cuts``)."""

    __slots__ = ("name", "rows", "cuts")

    def __init__(self, declared: Projections, rows: Sequence[int]):
        self.name = declared.name
        self.rows = dict(zip(declared.parts, rows))
        ends, at = [], 0
        for group in declared.groups:
            at += sum(self.rows[p] for p in group)
            ends.append(at)
        self.cuts = ends[:-1]

    def __call__(self, module: nn.Module, x: mx.array) -> List[mx.array]:
        return mx.split(module[self.name](x), self.cuts, axis=-1)


@functools.lru_cache(maxsize=None)
def _declared(cls: type) -> Tuple[Tuple[str, Projections], ...]:
    """The Projections a module class declares, by attribute name."""
    found = {}
    for klass in reversed(cls.__mro__):
        found.update({k: v for k, v in vars(klass).items() if isinstance(v, Projections)})
    return tuple(found.items())


def join_linears(layers) -> Optional[nn.Module]:
    """One layer computing several layers' outputs side by side, or None.

    Plain layers join; quantized ones only with identical group size, bits
    and mode (mixed recipes quantize v_proj differently: those stay apart).
    Rows are concatenated, so each output is computed exactly as before.
    """
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1 or kinds.pop() not in (Linear, nn.QuantizedLinear):
        return None
    if len({getattr(layer, "group_size", 0) for layer in layers}) > 1 or \
            len({getattr(layer, "bits", 0) for layer in layers}) > 1 or \
            len({getattr(layer, "mode", "") for layer in layers}) > 1 or \
            len({tuple(sorted(layer.keys())) for layer in layers}) > 1:
        return None
    one = copy.copy(layers[0])
    if isinstance(one, Linear):
        one._weight_t = Derived()  # its own, not the copied layer's
    for key in layers[0].keys():
        one[key] = mx.concatenate([layer[key] for layer in layers], axis=0)
    return one


def join_projections(model: nn.Module) -> int:
    """Join every declared group of projections into one matmul, module by
    module (after sharding, and after adapters: a group with an adapted or
    differently quantized layer stays apart). Fewer, larger matmuls per
    layer: +6% tokens/s on the demo model (CPU), where dispatch dominates.
    Returns how many groups were joined."""
    count = 0
    for module in model.modules():
        for attr, declared in _declared(type(module)):
            if not isinstance(getattr(module, attr), Projections) or not all(p in module for p in declared.parts):
                continue
            one = join_linears([module[p] for p in declared.parts])
            if one is None:
                continue
            rows = [module[p]["weight"].shape[0] for p in declared.parts]
            for p in declared.parts:
                del module[p]
            module[declared.name] = one
            setattr(module, attr, Joined(declared, rows))
            mx.eval(one.parameters())  # frees the separate weights now
            count += 1
    return count


def joined(model: nn.Module) -> Dict[str, Joined]:
    """Every joined group by its layer's path (``model.layers.0.self_attn.qkv_proj``)."""
    out = {}
    for path, module in model.named_modules():
        for attr, _ in _declared(type(module)):
            value = getattr(module, attr)
            if isinstance(value, Joined):
                out[f"{path}.{value.name}" if path else value.name] = value
    return out


def hf_parameters(model: nn.Module) -> Dict[str, mx.array]:
    """The model's parameters under Hugging Face's names (joined ones as row
    slices, no copies)."""
    groups = joined(model)
    out = {}
    for name, value in tree_flatten(model.parameters()):
        layer, _, leaf = name.rpartition(".")
        group = groups.get(layer)
        if group is None:
            out[name] = value
            continue
        prefix = layer.rpartition(".")[0]
        start = 0
        for part, rows in group.rows.items():
            out[f"{prefix}.{part}.{leaf}"] = value[start:start + rows]
            start += rows
    return out
