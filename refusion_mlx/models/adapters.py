"""Fine-tuned adapters in mlx-lm's format, their whole life: add (training),
save (weights atomically, numbered copies; adapter_config.json), read and
apply (loading), fuse (``convert.fusion`` writes the fused folder).

An adapter folder holds ``adapter_config.json`` (``fine_tune_type`` lora,
dora or full; ``num_layers``; ``lora_parameters`` with rank, scale, dropout
and the adapted ``keys``) and ``adapters.safetensors`` (the trained
parameters under the model's own names). The layers are mlx-lm's
(``mlx_lm.tuner``): ``LoRALinear`` / ``DoRALinear`` wrapped around the
model's ``Linear`` or ``nn.QuantizedLinear`` (QLoRA: the base stays
quantized). The same folder therefore loads with ``mlx_lm.load(...,
adapter_path=...)``, except one trained with ``train_embeddings`` (it also
holds the embedding, final norm and head, which mlx-lm's loader refuses in
a LoRA folder; fuse it, and both load the result).

Adapters need the separate projections (q_proj, k_proj, v_proj, gate_proj,
up_proj): load the model with ``join_projections=False``, apply, and only then join the
projection groups that were left plain (``projections.join_projections`` skips
adapted ones).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .._json import read_json_object
from ..errors import LoadError, RefusionError
from .projections import Linear, joined

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora", "full")
# every projection of a block, as mlx-lm names them (relative to the block)
LORA_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LORA_DEFAULTS = {"rank": 8, "scale": 20.0, "dropout": 0.0}
# what ``train_embeddings`` adds to the trained set: the token embedding, the
# final norm and the LM head (model-level names' prefixes)
EMBEDDING_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")


def lora_parameters(rank: int = 8, scale: float = 20.0, dropout: float = 0.0,
                    keys: Optional[Sequence[str]] = None) -> dict:
    """A checked ``lora_parameters`` block (keys: every projection when None)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise RefusionError(f"lora_parameters.rank must be a positive integer, got {rank!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise RefusionError(f"lora_parameters.scale must be a finite number, got {scale!r}")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise RefusionError(f"lora_parameters.dropout must be in [0, 1), got {dropout!r}")
    if keys is not None and not isinstance(keys, (list, tuple)):  # a string was read a letter a key
        raise RefusionError(f"lora_parameters.keys must be a list of module names such as [{LORA_KEYS[0]}], "
                            f"got {keys!r}")
    keys = list(LORA_KEYS if keys is None else keys)
    unknown = [k for k in keys if k not in LORA_KEYS]
    if not keys or unknown:
        raise RefusionError(f"lora_parameters.keys must be a non-empty subset of {', '.join(LORA_KEYS)}"
                            + (f"; unknown: {', '.join(map(str, unknown))}" if unknown else ""))
    return {"rank": rank, "scale": float(scale), "dropout": float(dropout), "keys": keys}


def _check_projections_apart(model) -> None:
    if joined(model):
        raise RefusionError("adapters need the separate q/k/v and gate/up projections: "
                            "load the model with join_projections=False")


def check_num_layers(model, num_layers: int) -> None:
    n = len(model.layers)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or \
            not (num_layers == -1 or 1 <= num_layers <= n):
        raise RefusionError(f"num_layers must be -1 (all) or 1..{n} for this {n}-layer model, got {num_layers!r}")


def add_adapters(model, fine_tune_type: str, num_layers: int, params: Optional[dict] = None,
                 train_embeddings: bool = False) -> None:
    """Make the last ``num_layers`` blocks trainable (-1: all), the rest frozen.

    lora / dora: mlx-lm's layers wrap the projections named by ``params['keys']``
    (the base, quantized or not, stays frozen). full: the blocks' own weights
    train; a quantized block cannot. ``train_embeddings`` also trains the
    token embedding, the final norm and the head (unquantized only): a task
    whose tokens the model rarely produced needs their rows to move, which
    a small model's blocks alone learn several times slower.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    if fine_tune_type not in FINE_TUNE_TYPES:
        raise RefusionError(f"fine-tune type must be one of {', '.join(FINE_TUNE_TYPES)}, got {fine_tune_type!r}")
    check_num_layers(model, num_layers)
    _check_projections_apart(model)
    model.freeze()
    blocks = model.layers[-num_layers:] if num_layers > 0 else model.layers
    if fine_tune_type == "full":
        quantized = [n for n, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
        if quantized:
            raise RefusionError("full fine-tuning needs an unquantized model (its weights train); "
                                "use --fine-tune-type lora or dora on a quantized model (QLoRA)")
        for block in blocks:
            block.unfreeze()
    else:
        params = dict(params or lora_parameters())
        _check_rank(blocks, params)
        try:
            linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
        except (KeyError, ValueError) as e:
            raise RefusionError(f"cannot add {fine_tune_type} layers: {e}") from None
    if train_embeddings:
        for module in embedding_modules(model):
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                raise RefusionError("train_embeddings needs an unquantized embedding and head "
                                    "(this model is quantized)")
            module.unfreeze()


def _check_rank(blocks, params: dict) -> None:
    """A rank past the smallest side of a layer it adapts is refused: it adds
    no capacity, only memory (rank 100000 on the demo asked 1.9 G parameters)."""
    from mlx.utils import tree_flatten

    keys = params.get("keys")
    sides = []
    for block in blocks:
        for name, m in tree_flatten(block.leaf_modules(), is_leaf=nn.Module.is_module):
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and (keys is None or name in keys):
                out_dims, in_dims = m.weight.shape
                sides.append(min(out_dims, in_dims * (32 // m.bits if isinstance(m, nn.QuantizedLinear) else 1)))
    if sides and params.get("rank", 0) > min(sides):
        raise RefusionError(f"--rank {params['rank']} is over the smallest side of a layer it adapts "
                            f"({min(sides)}): at most {min(sides)}")


def embedding_modules(model) -> list:
    """The modules ``train_embeddings`` trains (a tied head is the embedding itself)."""
    modules = dict(model.named_modules())
    return [modules[name] for name in EMBEDDING_MODULES if name in modules]


def read_adapter_config(folder: Union[str, Path]) -> dict:
    """The checked ``adapter_config.json`` of an adapter folder."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LoadError(f"no adapter folder at {folder} (adapters are read from a local folder)")
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise LoadError(f"{folder} has no {ADAPTER_CONFIG}")
    if not (folder / ADAPTER_FILE).is_file():
        raise LoadError(f"{folder} has no {ADAPTER_FILE}")
    config = read_json_object(path)
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise LoadError(f"{path}: fine_tune_type must be one of {', '.join(FINE_TUNE_TYPES)}, got {kind!r}")
    if "num_layers" not in config:
        raise LoadError(f"{path} lacks num_layers")
    if kind != "full":
        lp = config.get("lora_parameters")
        if not isinstance(lp, dict) or "rank" not in lp or "scale" not in lp:
            raise LoadError(f"{path}: lora_parameters needs rank and scale")
        lp.setdefault("dropout", 0.0)
        try:
            lora_parameters(lp["rank"], lp["scale"], lp["dropout"], lp.get("keys"))
        except RefusionError as e:
            raise LoadError(f"{path}: {e}") from None
    if not isinstance(config.get("train_embeddings", False), bool):
        raise LoadError(f"{path}: train_embeddings must be true or false, got {config['train_embeddings']!r}")
    return config


def read_weights(path: Union[str, Path], label: Optional[str] = None,
                 error: type = LoadError) -> Dict[str, mx.array]:
    """The tensors of a safetensors file; ``error`` (naming ``label``, else the
    path) when it cannot be read."""
    try:
        return mx.load(str(path))
    except Exception as e:
        raise error(f"{label or path} is not a readable safetensors file: {e}") from None


def load_adapters(model, adapter_path: Union[str, Path]):
    """Apply the adapters of a folder to a model with separate projections (in place) and return it.

    The LoRA/DoRA layers are mlx-lm's, built from the config; every tensor
    of ``adapters.safetensors`` must be an adapter parameter of that shape
    (or, with ``train_embeddings``, an embedding, final-norm or head
    weight). Errors are one-line ``LoadError``s.
    """
    folder = Path(adapter_path).expanduser()
    config = read_adapter_config(folder)
    try:
        check_num_layers(model, config["num_layers"])
        _check_projections_apart(model)
    except RefusionError as e:
        raise LoadError(f"{folder}: {e}") from None
    if config.get("fine_tune_type") == "full" and any(
            isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        raise LoadError(f"{folder} holds fully fine-tuned weights; they cannot go into a quantized model")
    weights = read_weights(folder / ADAPTER_FILE)
    kind = config.get("fine_tune_type", "lora")
    if kind != "full":
        from mlx_lm.tuner.utils import linear_to_lora_layers

        try:
            linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"], use_dora=kind == "dora")
        except (KeyError, ValueError, TypeError) as e:
            raise LoadError(f"{folder}: cannot add {kind} layers: {e}") from None
    params = dict(tree_flatten(model.parameters()))
    problem = adapter_mismatch(expected_tensors(model, config), weights, config)
    if problem:
        raise LoadError(f"{folder / ADAPTER_FILE}: {problem}")
    model.load_weights([(name, _as_model_dtype(name, w, params)) for name, w in weights.items()], strict=False)
    return model


def expected_tensors(model, config: dict) -> Dict[str, tuple]:
    """Every tensor an adapter file must hold for ``config`` on ``model``
    (its adapter layers already added), with its shape: the LoRA/DoRA layers'
    ``lora_a``, ``lora_b`` (and DoRA's ``m``), or a full fine-tune's blocks;
    with ``train_embeddings`` also the embedding, final norm and head."""
    params = tree_flatten(model.parameters())
    kind, n = config.get("fine_tune_type", "lora"), config["num_layers"]
    if kind == "full":
        first = len(model.layers) - n if n > 0 else 0
        blocks = tuple(f"model.layers.{i}." for i in range(first, len(model.layers)))
        out = {k: tuple(v.shape) for k, v in params if k.startswith(blocks)}
    else:
        out = {k: tuple(v.shape) for k, v in params if k.rsplit(".", 1)[-1] in ADAPTER_LEAVES}
    if config.get("train_embeddings"):
        out.update({k: tuple(v.shape) for k, v in params if k.startswith(tuple(m + "." for m in EMBEDDING_MODULES))})
    return out


def adapter_mismatch(expected: Dict[str, tuple], weights: Dict[str, mx.array], config: dict) -> Optional[str]:
    """Why an adapter file's tensors do not match what its config describes
    (one line, the likeliest cause first), or None: they match exactly."""
    kind, n = config.get("fine_tune_type", "lora"), config["num_layers"]
    lp = config.get("lora_parameters") or {}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    shaped = sorted(k for k in set(weights) & set(expected) if tuple(weights[k].shape) != expected[k])
    described = f"{kind}, num_layers {n}" + (f", rank {lp.get('rank')}" if kind != "full" else "")
    if lp.get("keys") and set(lp["keys"]) != set(LORA_KEYS):
        described += f", keys {', '.join(lp['keys'])}"
    if kind == "dora" and missing and all(k.endswith(".m") for k in missing) and not any(
            k.endswith(".m") for k in weights):
        return ("adapter_config.json says fine_tune_type dora, but the file holds no DoRA magnitudes (m): "
                "LoRA weights? (set fine_tune_type to lora)")
    if kind == "lora" and extra and all(k.endswith(".m") for k in extra):
        return ("the file holds DoRA magnitudes (m), but adapter_config.json says fine_tune_type lora "
                "(set it to dora)")
    embeddings = tuple(m + "." for m in EMBEDDING_MODULES)
    if shaped:
        k = shaped[0]
        got, want = tuple(weights[k].shape), expected[k]
        if k.endswith((".lora_a", ".lora_b")):
            rank = got[-1] if k.endswith(".lora_a") else got[0]
            if rank != lp.get("rank"):
                return (f"{k} has shape {got}, adapter_config.json ({described}) implies {want}: the file's rank "
                        f"is {rank}, lora_parameters.rank says {lp.get('rank')}")
            return (f"{k} has shape {got}, this model's layer implies {want}: adapters trained for another model "
                    "(its layer sizes differ)")
        if k.startswith(embeddings):
            return (f"{k} has shape {got}, the model's is {want}: adapters trained for another model, or trained "
                    "embeddings onto a quantized one (they go into an unquantized embedding and head only)")
        return f"{k} has shape {got}, the model's is {want}" + (
            f" (and {len(shaped) - 1} more mis-shaped)" if len(shaped) > 1 else "")
    if extra and all(k.startswith(embeddings) for k in extra) and not config.get("train_embeddings"):
        return (f"the file holds {extra[0]} (the embedding, final norm or head), but adapter_config.json does "
                "not say train_embeddings: true")
    if extra:
        return (f"{extra[0]} is not among the tensors adapter_config.json describes ({described})"
                + (f", nor are {len(extra) - 1} more" if len(extra) > 1 else "")
                + ": another model, or another num_layers or keys?")
    if missing:
        return (f"lacks {len(missing)} of the {len(expected)} tensors adapter_config.json describes ({described}), "
                f"e.g. {missing[0]}: a truncated or partial file, or another config?")
    return None


def _as_model_dtype(name: str, w: mx.array, params: Dict[str, mx.array]) -> mx.array:
    """A base weight (full fine-tune, embeddings) in the dtype the model was loaded in.

    The trainer saves float32 weights; put into a bfloat16 model as they are,
    they would make its matmuls mixed-precision and a fused folder float32
    behind a config that says bfloat16. LoRA/DoRA tensors keep their own
    dtype, as mlx-lm's layers do."""
    if name.rsplit(".", 1)[-1] in ADAPTER_LEAVES or not mx.issubdtype(params[name].dtype, mx.floating):
        return w
    return w.astype(params[name].dtype)


def has_adapters(model) -> bool:
    return any(hasattr(m, "fuse") and hasattr(m, "lora_a") for _, m in model.named_modules())


def trainable_weights(model) -> Dict[str, mx.array]:
    """What an adapter file holds: the model's trainable parameters, flat."""
    return dict(tree_flatten(model.trainable_parameters()))


def fuse_adapters(model, dequantize: bool = False) -> int:
    """Fold every LoRA/DoRA layer into a plain layer (mlx-lm's ``fuse``), in place.

    The sum is formed in float32 and cast back to the layer's floating dtype (a quantized base's scales',
    else its bias', else the model's: mxfp4, nvfp4 and mxfp8 keep uint8 scales); a quantized base is
    quantized again with its own settings unless ``dequantize``. Returns how many layers were fused.
    """
    fused, floats = [], [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    for name, module in model.named_modules():
        if not (hasattr(module, "fuse") and hasattr(module, "lora_a")):
            continue
        base = module.linear
        dtype = next((a.dtype for a in (getattr(base, "scales", None), getattr(base, "bias", None), base.weight)
                      if a is not None and mx.issubdtype(a.dtype, mx.floating)), floats[0] if floats else mx.float32)
        quantized = isinstance(base, nn.QuantizedLinear)
        if quantized:  # dequantized in float32 here: MLX's default for uint8 scales (mxfp4, ...) is bfloat16
            module.linear = dequantized(base)
        module.set_dtype(mx.float32)
        layer = module.fuse(dequantize=True)
        if quantized and not dequantize:
            layer = nn.QuantizedLinear.from_linear(layer, base.group_size, base.bits, mode=base.mode)
        layer.set_dtype(dtype)
        if type(layer) is nn.Linear:  # the model's own Linear (no transpose per call)
            plain = Linear(layer.weight.shape[1], layer.weight.shape[0], bias="bias" in layer)
            plain.update(layer.parameters())
            layer = plain
        mx.eval(layer.parameters())
        fused.append((name, layer))
    if fused:
        model.update_modules(tree_unflatten(fused))
    return len(fused)


def dequantized(base) -> nn.Module:
    """A quantized layer as a float32 ``nn.Linear`` (its bias kept) or ``nn.Embedding``:
    ``mx.dequantize`` gives bfloat16 by default for uint8 scales (mxfp4, nvfp4, mxfp8)."""
    weight = mx.dequantize(base.weight, base.scales, base.get("biases"), group_size=base.group_size,
                           bits=base.bits, mode=base.mode, dtype=mx.float32)
    if isinstance(base, nn.QuantizedEmbedding):
        table = nn.Embedding(*weight.shape)
        table.weight = weight
        return table
    plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in base)
    plain.weight = weight
    if "bias" in base:
        plain.bias = base.bias.astype(mx.float32)
    return plain


def fuse_adapter_folder(model, adapter_path: Union[str, Path], dequantize: bool = False) -> int:
    """Apply the adapters of a folder to a model with separate projections and fold them in
    (``load_adapters``, then ``fuse_adapters``); returns how many layers were fused."""
    load_adapters(model, adapter_path)
    fused = fuse_adapters(model, dequantize=dequantize)
    if has_adapters(model):
        raise RefusionError("some adapter layers could not be fused")
    return fused
