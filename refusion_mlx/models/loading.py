"""Loading ReFusion checkpoints (Hugging Face or converted MLX folders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .. import _blas, _cpu_jit, _hf_index
from .._json import read_json_object
from ..distributed.meeting import same_model
from ..errors import ConfigError, LoadError
from . import backend, config_checks, cpu_paths, projections, registry, sharding
from .config_checks import (check_memory, dtype_problems, quantization_problems, read_headers, weight_bytes,
                            weight_problems)
from .fingerprint import MODEL_FILES, model_parts
from .tokenizer_checks import resolve_mask_id, tokenizer_problems, use_template

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo" / "tiny-refusion"

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def resolve_model_path(path_or_repo: Union[str, Path, None],
                       allow_patterns: Optional[List[str]] = None) -> Path:
    """A local folder as is; a hub id through huggingface-hub (cache first)."""
    if path_or_repo is None:
        return DEMO_MODEL
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoadError(f"{path} is a file; give the model folder")
        return path
    text = str(path_or_repo)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise LoadError(f"no model folder at {text}")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise LoadError(f"huggingface-hub is needed to fetch {text}: {e}") from e
    try:
        return Path(snapshot_download(text, allow_patterns=allow_patterns or MODEL_FILES))
    except HFValidationError:
        raise LoadError(f"no model folder at {text}, and it is not a valid hub repo id") from None
    except Exception as e:  # offline, not cached, unknown repo, network error
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"{text} is not a local folder and could not be fetched from the hub "
            f"(offline and not cached?): {detail}") from None


def read_config(model_path: Path) -> Dict[str, Any]:
    config_file = model_path / "config.json"
    if not config_file.is_file():
        raise LoadError(f"{model_path} has no config.json")
    return read_json_object(config_file)


def model_args(config: Dict[str, Any]):
    """The ``ModelArgs`` of the config's family (``registry``), with missing
    keys and an unknown ``model_type`` reported in one line."""
    missing = [k for k in ("model_type", "hidden_size", "num_hidden_layers",
                           "intermediate_size", "num_attention_heads", "vocab_size")
               if k not in config]
    if missing:
        raise LoadError(f"config.json lacks {', '.join(missing)}")
    if problems := config_checks.dtype_field_problems(config):
        raise LoadError("\n".join(problems))
    try:
        return registry.family_args(config)
    except ConfigError as e:
        raise LoadError(str(e)) from None


def weight_files(model_path: Path) -> List[Path]:
    """Safetensors files named by the index (all must exist), else model*.safetensors."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            outside = config_checks.shard_problems(model_path, weight_map.values())
            names = [] if outside else sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise LoadError(f"{index} is malformed: {e}") from None
        if outside:  # raised here, not in the try: a LoadError is a ValueError, and would be wrapped again
            raise LoadError("\n".join(outside))
        missing = [n for n in names if not (model_path / n).is_file()]
        if missing:
            raise LoadError(f"{model_path}: shard {missing[0]} named in the index is missing")
        return [model_path / n for n in names]
    files = sorted(model_path.glob("model*.safetensors"))
    if files:
        return files
    if list(model_path.glob("pytorch_model*.bin")):
        raise LoadError(
            f"{model_path} holds a PyTorch .bin checkpoint; convert it first with "
            "python -m refusion_mlx.convert")
    raise LoadError(f"{model_path} has no model*.safetensors weights")


def load_weights(files: List[Path]) -> Dict[str, mx.array]:
    weights: Dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise LoadError(f"{f.name} is not a readable safetensors file: {e}") from None
    return weights


def _quantize(model, config: Dict[str, Any], weights: Dict[str, mx.array]) -> None:
    """Swap in quantized layers where the checkpoint has scales (mlx-lm's format)."""
    quant = config["quantization"]
    overrides = {k: v for k, v in quant.items() if isinstance(v, (dict, bool))}

    def predicate(path: str, module: nn.Module):
        if path in overrides:
            return overrides[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    try:
        nn.quantize(model, group_size=quant.get("group_size", 64), bits=quant.get("bits", 4),
                    mode=quant.get("mode", "affine"), class_predicate=predicate)
    except (ValueError, TypeError) as e:  # MLX's refusal of a mode, bits or group size
        detail = " ".join(str(e).split())
        raise LoadError(f"config.json: quantization {quant!r} cannot be applied: {detail}") from None


def default_dtype(stored: mx.Dtype) -> mx.Dtype:
    """float32 on the CPU paths (half-precision matmuls are slower there, and
    exact parity with the reference is a float32 property); the stored dtype
    on the GPU paths (``backend``)."""
    if backend.cpu_paths():
        return mx.float32
    return stored


def load_model(model_path: Path, dtype: Optional[str] = None, lazy: bool = False,
               dist=None) -> Tuple[Any, Dict[str, Any]]:
    """The MLX model of a folder, cast to ``dtype`` (None: see ``default_dtype``).

    ``dist`` (a ``distributed.group.Distributed`` of two or more ranks): the
    model is split over its group (tensor or pipeline, its ``mode``) before
    any weight is read, then only this rank's share is read (``_load_split``).
    Nothing of a folder holding a pipe, a device or a link out of it is opened."""
    problems = config_checks.folder_problems(model_path)
    if problems:
        raise LoadError(f"{model_path}: " + "\n".join(problems))
    config = read_config(model_path)
    args = model_args(config)
    if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):  # mlx-lm's 2nd: tokenizer_config
        raise LoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    files = weight_files(model_path)
    if dist is not None:  # the same files, --dtype and device paths on every rank, before any weight is read
        same_model(dist, {**model_parts(model_path), "--dtype": str(dtype), "REFUSION_MLX_PATHS": backend.mode()})
    check_weights(model_path, config, args, files, dtype, dist)
    _cpu_jit.prepare()  # once per machine: MLX's CPU kernels then build in a fifth of the time
    model = registry.build(args)
    if dist is not None:
        return _load_split(model, model_path, config, dtype, lazy, dist), config
    weights = model.sanitize(load_weights(files))
    if "quantization" in config:
        _quantize(model, config, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        message = " ".join(str(e).split())
        raise LoadError(f"{model_path}: weights do not match config.json: {message}") from None
    stored = model.model.norm.weight.dtype
    target = DTYPES[dtype] if dtype else default_dtype(stored)
    model.set_dtype(target)  # floating parameters only; packed weights keep their dtype
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return model, config


STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def check_weights(model_path: Path, config: Dict[str, Any], args, files: List[Path], dtype: Optional[str],
                  dist=None) -> None:
    """Before anything is built: the config's quantization and sizes against the
    weights' safetensors headers (one line per contradiction), and the weights'
    bytes in the dtype they will be loaded in against this machine's memory
    (a rank's share under ``dist``)."""
    tensors = read_headers(files)
    problems = (quantization_problems(config) + weight_problems(args, tensors)
                + dtype_problems(tensors, "quantization" in config))
    if problems:
        raise LoadError("\n".join(f"{model_path}/config.json: {p}" for p in problems))
    stored = STORED_DTYPES.get(getattr(tensors.get("model.norm.weight"), "dtype", ""))
    target = dtype or ("float32" if backend.cpu_paths() else stored)
    need = weight_bytes(tensors, target) // (dist.size if dist is not None else 1)
    hint = ""
    if target == "float32" and stored != "float32":
        hint = " (in float32, the CPU paths' default: try --dtype bfloat16, or a quantized model)"
    check_memory(need, f"{model_path}: the weights", hint)


def _load_split(model, model_path: Path, config: Dict[str, Any], dtype: Optional[str], lazy: bool,
                dist):
    """A rank's share of the model: split first (its layers still hold lazy,
    never evaluated initial values), then only the bytes of its share read
    from the safetensors files (``slices``), cast, evaluated a layer at a time."""
    from mlx.utils import tree_flatten

    from . import slices

    stored = model.sanitize(slices.index(weight_files(model_path)))
    if "quantization" in config:
        _quantize(model, config, stored)
    expected = {name for name, _ in tree_flatten(model.parameters())}
    if expected != set(stored):
        missing, extra = sorted(expected - set(stored)), sorted(set(stored) - expected)
        detail = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise LoadError(f"{model_path}: weights do not match config.json: {detail}")
    target = DTYPES[dtype] if dtype else default_dtype(stored["model.norm.weight"].mx_dtype)
    _split(model, dist, target)
    weights = [(name, slices.read(stored[name], value.shape, dist.rank, name))
               for name, value in tree_flatten(model.parameters())]
    model.load_weights(weights, strict=True)
    del weights
    model.set_dtype(target)
    model.eval()
    if not lazy:
        for layer in model.layers:  # cast one layer at a time: never two copies of the whole share
            mx.eval(layer.parameters())
        mx.eval(model.parameters())
    return model


FINITE_CHECK_ELEMENTS = 1 << 28  # floating elements checked per evaluation (bounds the check's temporaries)


def check_finite(model, where: str, skip: Set[str] = frozenset()) -> Set[str]:
    """The names of the model's floating parameters (but those in ``skip``),
    once each is found finite; a LoadError naming the first that holds NaN or
    infinity (a broken checkpoint or adapter decodes garbage, "!!!!", with no
    error). Quantized weights are checked through their scales and biases."""
    from mlx.utils import tree_flatten

    names, flags, pending = [], [], 0
    for name, w in tree_flatten(model.parameters()):
        if name in skip or not mx.issubdtype(w.dtype, mx.floating):
            continue
        names.append(name)
        flags.append(mx.all(mx.isfinite(w)))
        pending += w.size
        if pending > FINITE_CHECK_ELEMENTS:
            mx.eval(flags)
            pending = 0
    found = [n for n, ok in zip(names, mx.stack(flags).tolist() if flags else []) if not ok]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise LoadError(f"{where}: {found[0]}{more} holds values that are not finite (NaN or infinity)")
    return set(names)


def _cast_bytes(model, target: mx.Dtype) -> int:
    """Bytes of the model's parameters once floating ones are cast to ``target``."""
    from mlx.utils import tree_flatten

    return sum(v.size * target.size if mx.issubdtype(v.dtype, mx.floating) else v.nbytes
               for _, v in tree_flatten(model.parameters()))


def _split(model, dist, target: mx.Dtype) -> None:
    """Shard (or pipeline) a lazily loaded model over ``dist``'s group and
    record the whole model's and this rank's weight bytes."""
    whole = _cast_bytes(model, target)
    try:
        (sharding.pipeline if dist.mode == "pipeline" else sharding.shard)(model, dist.group)
    except ConfigError as e:
        raise LoadError(str(e)) from None
    dist.record_weights(whole, _cast_bytes(model, target))


def load_tokenizer(model_path: Path, chat_template: Optional[str] = None):
    """mlx-lm's tokenizer wrapper (HF tokenizer plus streaming detokenizer);
    ``chat_template``: a template in place of the folder's (``tokenizer_checks.use_template``).
    transformers' own warnings about the folder's config.json (a pad id
    outside a vocabulary, say) are kept quiet: this project's checks of that
    file say what is wrong in one line, and transformers warns once a process,
    so whether one was printed would depend on what ran before."""
    _hf_index.install()  # before transformers' first import: its model table from the cache
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = mlx_lm_load_tokenizer(model_path)
    except Exception as e:
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise LoadError(f"{model_path}: cannot load the tokenizer: {detail}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # a prompt over the context is this project's to say, in one line:
    if isinstance(getattr(hf, "deprecation_warnings", None), dict):  # not transformers' "Token indices ..." warning
        hf.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    if chat_template is not None:
        use_template(tokenizer, chat_template)
    return tokenizer


def load(path_or_repo: Union[str, Path, None] = None, dtype: Optional[str] = None,
         lazy: bool = False, join_projections: bool = True, adapter_path: Optional[Union[str, Path]] = None,
         dist=None, fuse: Optional[bool] = None, chat_template: Optional[str] = None):
    """Load a ReFusion checkpoint: ``(model, tokenizer)``.

    ``path_or_repo`` is a local folder (Hugging Face format or converted by
    ``refusion_mlx.convert``) or a hub repo id; None loads the bundled demo.
    The mask id ends up in ``model.args.mask_token_id``. ``join_projections`` joins the
    projections each module declares (q/k/v, gate/up) into one matmul each
    (``projections.hf_parameters(model)`` still gives the weights under Hugging
    Face's names). ``adapter_path``: a
    local folder of fine-tuned adapters in mlx-lm's format (``refusion_mlx.train``
    writes them), applied as trained (LoRA/DoRA layers kept, a quantized base
    stays quantized); only the projection groups they leave plain are joined.
    ``dist``: a ``distributed.group.Distributed`` of two or more ranks (from
    ``distributed.group.init``): this rank loads its share only
    (``models/sharding.py``); the projections are joined after sharding.
    ``lazy``: the weights are read when first used, as mlx-lm's ``lazy``, so
    they (and the adapters) are not checked for NaN or infinity here, and
    the projections are not joined.
    ``fuse``: the old spelling of ``join_projections`` ("fuse" now means
    folding adapters in: ``python -m refusion_mlx.fuse``).
    ``chat_template``: a chat template in place of the folder's (mlx-lm's
    server's ``--chat-template``), checked as it is set (one-line ``LoadError``).
    """
    backend.mode()  # a bad REFUSION_MLX_PATHS fails here, in one line
    _blas.warn_once()  # MLX on the reference BLAS (Linux): one line, with the fix, at the first load
    model_path = resolve_model_path(path_or_repo)
    if dist is not None and adapter_path is not None:
        raise LoadError("adapters cannot be split over ranks: fold them into the weights first "
                        "(python -m refusion_mlx.fuse)")
    model, config = load_model(model_path, dtype=dtype, lazy=lazy, dist=dist)
    checked = set() if lazy else check_finite(model, str(model_path))
    if adapter_path is not None:
        from .adapters import load_adapters

        load_adapters(model, adapter_path)
        model.eval()
        if not lazy:
            mx.eval(model.parameters())
            check_finite(model, str(adapter_path), skip=checked)
    if fuse is not None:
        join_projections = fuse
    if join_projections and not lazy:
        projections.join_projections(model)
    projections.pad_quantized(model)  # narrow passes of a quantized model: one read of each weight on CUDA
    tokenizer = load_tokenizer(model_path, chat_template)
    if tokenizer.eos_token_id is None:
        raise LoadError(f"{model_path}: the tokenizer defines no eos_token")
    problems = tokenizer_problems(model_path, config, tokenizer, model.args.vocab_size)
    if problems:
        raise LoadError(f"{model_path}: " + "\n".join(problems))
    model.args.mask_token_id = resolve_mask_id(model_path, config, tokenizer, model.args.vocab_size)
    # the checkpoint's other end ids end an answer too, as mlx-lm's load has its tokenizer stop at them
    named = config_checks.end_ids(config_checks.folder_configs(model_path, config))
    tokenizer.eos_token_ids = {tokenizer.eos_token_id, *named}
    model.model_path = model_path
    if backend.cpu_paths():
        _blas.fit_threads(model.args.hidden_size)
        if not lazy:
            cpu_paths.lay_out_linears(model)
    return model, tokenizer
