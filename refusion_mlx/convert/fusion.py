"""Fold fine-tuned adapters into the base weights and write a standalone model
folder (``python -m refusion_mlx.fuse`` is its command line).

    python -m refusion_mlx.fuse --model M --adapter-path adapters --save-path fused
    python -m refusion_mlx.fuse --model refusion-4bit --adapter-path adapters --save-path fused-bf16 --dequantize

The folder has Hugging Face parameter names, ``config.json`` with
``mask_token_id`` (and the ``quantization`` block while the weights stay
quantized), the tokenizer files: ``refusion_mlx.load`` and ``mlx_lm.load``
both read it. ``models.adapters.fuse_adapter_folder`` applies the adapters
and folds them in: LoRA/DoRA deltas are added in float32, then cast to the
checkpoint's dtype; a quantized base is quantized again with its own
settings unless ``--dequantize``. The folder is built as a hidden sibling and
renamed into place when complete (as the converter does).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import RefusionError
from ..models.adapters import dequantized, fuse_adapter_folder, read_adapter_config
from ..models.projections import hf_parameters
from .converter import COPIED_FILES, declared_dtype, output_config
from .shards import shard_names
from .staging import check_destination, check_overlap, copy_side_files, staging_folder, write_index
from ..models.loading import DTYPES, load_model, load_tokenizer, read_config, resolve_model_path
from ..models.tokenizer_checks import resolve_mask_id

MAX_SHARD_GB = 5


def stored_dtype(config: dict, model_path: Path) -> str:
    """The dtype the checkpoint's floating tensors are stored in."""
    declared = declared_dtype(config)
    if declared:
        return declared
    for f in sorted(model_path.glob("model*.safetensors"))[:1]:
        for value in mx.load(str(f)).values():
            if mx.issubdtype(value.dtype, mx.floating):
                return {v: k for k, v in DTYPES.items()}.get(value.dtype, "float32")
    return "float32"


def quantized_layers(model) -> list:
    """The model's quantized layers, as ``(name, module)`` pairs."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def dequantize(model) -> int:
    """Quantized layers back to plain ones, in float32 (mlx-lm's ``dequantize_model`` gives bfloat16 for
    mxfp4, nvfp4 and mxfp8, whatever ``--dtype``); how many there were."""
    from mlx.utils import tree_unflatten

    plain = [(name, dequantized(m)) for name, m in quantized_layers(model)]
    if plain:
        model.update_modules(tree_unflatten(plain))
    return len(plain)


def write_fused(folder: Path, weights: dict) -> None:
    """Shards of at most 5 GB and their index, mlx-lm's names and sharding."""
    from mlx_lm.utils import make_shards

    shards = make_shards(weights, MAX_SHARD_GB)
    weight_map = {}
    for name, shard in zip(shard_names(len(shards)), shards):
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
    write_index(folder, weight_map, {"total_size": sum(v.nbytes for v in weights.values())})


def fuse(model: Union[str, Path, None], adapter_path: Union[str, Path], save_path: Union[str, Path],
         dequantize_weights: bool = False, force: bool = False, dtype: Optional[str] = None) -> Path:
    """Fuse ``adapter_path`` into ``model`` and write the folder ``save_path``; returns it.

    ``dtype``: of the written floating tensors (default: the checkpoint's).
    """
    if dtype is not None and dtype not in DTYPES:
        raise RefusionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src = resolve_model_path(model)
    read_adapter_config(adapter_path)
    dst = check_destination(save_path, force)
    for other, flag in ((src, "--model"), (Path(adapter_path).expanduser(), "--adapter-path")):
        check_overlap(other, dst, "--save-path {dst} overlaps " + flag + " {src}", nested=True)
    # mlx-lm (and the transformers it imports: ~2 s of CPU) after the checks: a refusal does not wait for it
    from mlx_lm.utils import save_config

    dtype = dtype or stored_dtype(read_config(src), src)
    model_obj, config = load_model(src, dtype=dtype)
    tokenizer = load_tokenizer(src)
    mask_id = resolve_mask_id(src, config, tokenizer, model_obj.args.vocab_size)
    quantized = len(quantized_layers(model_obj))  # counted first: fusing dequantizes the adapted ones
    fused = fuse_adapter_folder(model_obj, adapter_path, dequantize=dequantize_weights)
    config = dict(config)
    quant = config.get("quantization")
    if dequantize_weights:
        dequantize(model_obj)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        quant = None
        print(f"[INFO] dequantized {quantized} layers", file=sys.stderr)
    out = output_config(config, model_obj.args, mask_id, dtype, quant)
    weights = hf_parameters(model_obj)
    mx.eval(list(weights.values()))
    try:
        with staging_folder(dst, force) as tmp:
            write_fused(tmp, weights)
            copy_side_files(src, tmp, COPIED_FILES)
            (tmp / "README.md").write_text(
                f"# {dst.name}\n\n`{src.name}` with the adapters of `{Path(adapter_path).name}` fused in "
                f"(`python -m refusion_mlx.fuse`, {fused} layers"
                f"{', dequantized' if dequantize_weights else ''}). Loads with `refusion_mlx.load` "
                "and `mlx_lm.load`.\n")
            save_config(out, tmp / "config.json")  # last: it makes the folder loadable
    except (RuntimeError, OSError) as e:  # a full disk (MLX's writer raises RuntimeError), a read-only one
        reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise RefusionError(f"cannot write --save-path {dst}: {reason}; it is left as it was") from None
    return dst
