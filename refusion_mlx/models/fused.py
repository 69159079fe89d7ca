"""Linear layers as the model runs them: a transposed weight view made once
(``Linear``), and the projections that read one input fused into one matmul
(``FUSED``, ``fuse_linears``), with the row counts that map a fused weight
back to Hugging Face's parameter names (``fused_rows``)."""

from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .backend import gpu_paths


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


class Linear(nn.Linear):
    """``nn.Linear``; on the CPU paths (``backend``) it multiplies by a
    transposed view of its weight made once (no copy), instead of a transpose
    op dispatched in every call."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True):
        super().__init__(input_dims, output_dims, bias=bias)
        self._weight_t = Derived()

    def __call__(self, x: mx.array) -> mx.array:
        if gpu_paths():
            return super().__call__(x)
        weight_t = self._weight_t.get((self["weight"],), lambda w: w.T)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight_t)
        return x @ weight_t


# Projections that read the same input, fused into one matmul at load time.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_linears(layers) -> Optional[nn.Module]:
    """One layer computing several layers' outputs side by side, or None.

    Plain layers fuse; quantized ones only with identical group size, bits
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
    fused = copy.copy(layers[0])
    if isinstance(fused, Linear):
        fused._weight_t = Derived()  # its own, not the copied layer's
    for key in layers[0].keys():
        fused[key] = mx.concatenate([layer[key] for layer in layers], axis=0)
    return fused


def fused_rows(args) -> Dict[str, int]:
    """Rows of each fused part's weight, from the model's ModelArgs."""
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    return {"q_proj": q, "k_proj": kv, "v_proj": kv,
            "gate_proj": args.intermediate_size, "up_proj": args.intermediate_size}
