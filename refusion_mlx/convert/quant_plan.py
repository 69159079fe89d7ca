"""Which layer gets which quantization, and the shape and dtype of every output tensor.

Decided on a lazy copy of the model that is never evaluated, with mlx-lm's own
``quantize_model`` (group-size divisibility, mixed recipes, the config block
``mlx_lm.load`` reads back), so no weight is allocated to plan a conversion.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import RefusionError
from ..models import registry
from ..models.config_checks import QUANT_BITS
from .shards import Spec

Q_BITS = list(QUANT_BITS)  # what the loader reads back
Q_GROUP_SIZES = [32, 64, 128]
Q_MODES = ["affine", "mxfp4", "nvfp4", "mxfp8"]
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
MLX_LM_RECIPES = ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"]
RECIPES = {
    "mixed_2_6": "mlx-lm: 2-bit, 6-bit for lm_head and some v_proj/down_proj",
    "mixed_3_4": "mlx-lm: 3-bit, 4-bit for lm_head and some v_proj/down_proj",
    "mixed_3_6": "mlx-lm: 3-bit, 6-bit for lm_head and some v_proj/down_proj",
    "mixed_4_6": "mlx-lm: 4-bit, 6-bit for lm_head and some v_proj/down_proj",
    "embed_8": "--q-bits everywhere, 8-bit embeddings and lm_head",
    "embed_fp": "--q-bits everywhere, embeddings and lm_head left unquantized (--dtype)",
}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass
class QuantSettings:
    group_size: int
    bits: int
    mode: str = "affine"
    recipe: Optional[str] = None


def quant_settings(quantize: bool = False, q_bits: Optional[int] = None,
                   q_group_size: Optional[int] = None, q_mode: str = "affine",
                   quant_predicate: Optional[str] = None) -> Optional[QuantSettings]:
    """Validated quantization settings; None when not quantizing.

    Any quantization setting implies ``quantize``: nobody passes --q-bits 4 to get bf16.
    Errors name the Python parameters (``q_bits``); the command line shows its flags
    (``__main__.flag_names``).
    """
    check_choice("q_mode", q_mode, Q_MODES, str)
    check_choice("quant_predicate", quant_predicate, list(RECIPES), str)
    affine = q_mode == "affine"  # the other modes fix both (checked below)
    check_choice("q_bits", q_bits, Q_BITS if affine else None, int)
    check_choice("q_group_size", q_group_size, Q_GROUP_SIZES if affine else None, int)
    if not (quantize or q_bits is not None or q_group_size is not None or quant_predicate or q_mode != "affine"):
        return None
    group, bits = MODE_DEFAULTS[q_mode]
    group = group if q_group_size is None else q_group_size
    bits = bits if q_bits is None else q_bits
    if q_mode != "affine" and (group, bits) != MODE_DEFAULTS[q_mode]:
        need = MODE_DEFAULTS[q_mode]
        raise RefusionError(f"q_mode {q_mode} needs group size {need[0]} and {need[1]} bits, "
                            f"got group size {group} and {bits} bits")
    if quant_predicate is not None:
        if q_mode != "affine" and quant_predicate != "embed_fp":
            raise RefusionError(f"recipe {quant_predicate} needs q_mode affine")
        if quant_predicate in MLX_LM_RECIPES and q_bits is not None:  # the recipe sets every layer's bits
            raise RefusionError(f"q_bits does not go with quant_predicate {quant_predicate}, which sets the "
                                "bits of every layer (" + RECIPES[quant_predicate].split(": ", 1)[1] + ")")
    return QuantSettings(group, bits, q_mode, quant_predicate)


def check_choice(name: str, value, choices: Optional[list], kind: type) -> None:
    """``value`` None or one of ``choices`` (any of type ``kind`` without them), of type
    ``kind``: an int is never a bool, nor 4.0 or "4"."""
    if value is None:
        return
    if not isinstance(value, kind) or isinstance(value, bool):
        what = f"one of {', '.join(map(str, choices))}" if choices else "an integer"
        raise RefusionError(f"{name} must be {what}, got {value!r}")
    if choices is not None and value not in choices:
        raise RefusionError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def recipe_predicate(qs: QuantSettings, model: nn.Module) -> Optional[Callable]:
    """The per-layer choice of a recipe (mlx-lm's builder for its own recipes)."""
    if qs.recipe is None:
        return None
    if qs.recipe in MLX_LM_RECIPES:
        from mlx_lm.convert import mixed_quant_predicate_builder

        return mixed_quant_predicate_builder(qs.recipe, model, qs.group_size)
    edge = {"group_size": qs.group_size, "bits": 8, "mode": qs.mode} if qs.recipe == "embed_8" else False

    def predicate(path: str, module: nn.Module):
        return edge if path == "lm_head" or path.endswith("embed_tokens") else True

    return predicate


@dataclass
class QuantPlan:
    leaves: List[Tuple[str, nn.Module]]          # unquantized modules, in model order
    quant: Dict[str, dict]                       # leaf path -> to_quantized kwargs
    specs: Dict[str, Spec]                       # output tensor -> (shape, dtype)
    config_quant: Optional[dict]                 # the config's quantization block
    parameters: int
    notes: List[str]


def make_plan(args, dtype: str, qs: Optional[QuantSettings]) -> QuantPlan:
    """Quantize a lazy, never-evaluated copy of the model to learn the output tensors.

    mlx-lm's ``quantize_model`` decides per layer exactly as it would for
    ``mlx_lm.convert`` (group-size divisibility, recipes) and writes the
    config block ``mlx_lm.load`` reads back; nothing here allocates weights.
    """
    from mlx_lm.utils import get_total_parameters, quantize_model

    plain = registry.build(args)
    plain.set_dtype(DTYPES[dtype])
    leaves = tree_flatten(plain.leaf_modules(), is_leaf=nn.Module.is_module)
    shaped = registry.build(args)
    shaped.set_dtype(DTYPES[dtype])
    config_quant, notes = None, []
    if qs is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a bits-per-weight line of its own
            shaped, qconfig = quantize_model(shaped, {}, qs.group_size, qs.bits, mode=qs.mode,
                                             quant_predicate=recipe_predicate(qs, shaped))
        config_quant = qconfig["quantization"]
        notes += unquantized_notes(leaves, qs.group_size)
    quant = {}
    for path, module in tree_flatten(shaped.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            quant[path] = {"group_size": module.group_size, "bits": module.bits, "mode": module.mode}
    specs = {k: Spec(tuple(v.shape), v.dtype) for k, v in tree_flatten(shaped.parameters())}
    return QuantPlan(leaves, quant, specs, config_quant, get_total_parameters(shaped), notes)


def unquantized_notes(leaves, group_size: int) -> List[str]:
    odd = [(p, m.weight.shape[-1]) for p, m in leaves
           if hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size]
    if not odd:
        return []
    shown = ", ".join(f"{p} ({n})" for p, n in odd[:3]) + (f" (+{len(odd) - 3} more)" if len(odd) > 3 else "")
    return [f"left unquantized, input size not a multiple of group size {group_size}: {shown}"]
