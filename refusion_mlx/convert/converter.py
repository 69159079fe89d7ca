"""Convert a ReFusion checkpoint (Hugging Face PyTorch format) to MLX weights.

    python -m refusion_mlx.convert --hf-path GSAI-ML/ReFusion --mlx-path refusion-4bit -q

Everything is checked before anything is written: architecture (the
family ``config.json``'s ``model_type`` names in ``models.registry``), mask id,
tokenizer, and every tensor's presence, shape and dtype. Then one module at a
time is read, cast, quantized with MLX's quantizer and streamed into its
shard, so memory stays near the size of the largest tensor. The output is
built in a hidden sibling folder and renamed into place at the very end: an
interrupted, crashed or refused conversion leaves no destination behind.
The folder loads with ``refusion_mlx.load`` and with ``mlx_lm.load``.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ConfigError, LoadError
from ..models import registry
from ..models.config_checks import Tensor, check_memory, dtype_name, weight_problems
from .checkpoint import FLOAT_TAGS, Checkpoint, open_checkpoint
from .quant_plan import DTYPES, QuantPlan, check_choice, make_plan, quant_settings
from .shards import ShardWriter, shard_names
from .staging import check_destination, check_overlap, copy_side_files, staging_folder, write_index
from ..models.fingerprint import MODEL_FILES
from ..models.loading import load_tokenizer, model_args, read_config, resolve_model_path
from ..models.tokenizer_checks import resolve_mask_id, tokenizer_problems

TAG_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
COPIED_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                "chat_template.json", "generation_config.json"]
# besides the family's own class names (its ``Model.ARCHITECTURES``): a ReFusion class over it
REFUSION_CLASS = re.compile(r"^\w*(ReFusion|Refusion)\w*$")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some exports carry
MAX_SHARD_GB = 5


@dataclass
class Summary:
    """What a conversion produced (also printed at its end)."""

    path: Path
    parameters: int
    bytes_before: int
    bytes_after: int
    bits_per_weight: float
    dtype: str
    quantization: Optional[dict]
    notes: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------
# Source


def resolve_source(hf_path: Union[str, Path]) -> Path:
    """A local folder, or a hub repo: config, tokenizer and weights only (.bin if no safetensors)."""
    path = resolve_model_path(hf_path, allow_patterns=MODEL_FILES + ["tokenizer.model"])
    if Path(hf_path).expanduser().exists() or any(path.glob("model*.safetensors")):
        return path
    return resolve_model_path(hf_path, allow_patterns=MODEL_FILES + ["tokenizer.model"] + BIN_PATTERNS)


# --------------------------------------------------------------------------
# Validation


def check_architecture(config: dict):
    """A family's architecture (``models.registry``: not its MoE or other
    variants), not already quantized: the family's ModelArgs from the config."""
    try:
        known = registry.family(config.get("model_type")).Model.ARCHITECTURES
    except ConfigError as e:
        raise LoadError(str(e)) from None
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(str(a) in known or REFUSION_CLASS.match(str(a)) for a in archs):
        raise LoadError(f"config.json architectures is {archs!r}; {config['model_type']} checkpoints are "
                        f"{' or '.join(known)}")
    if "quantization_config" in config or "quantization" in config:
        raise LoadError("config.json says this checkpoint is already quantized; "
                        "convert the bf16/fp16/fp32 checkpoint")
    return model_args(config)  # which checks the dtype field (config_checks.dtype_field_problems)


def check_tensors(ckpt: Checkpoint, expected: Dict[str, Tuple[int, ...]],
                  tied: bool) -> List[str]:
    """Every expected tensor present, floating-point and shaped as the config implies.

    Returns notes on source tensors that are skipped on purpose.
    """
    names = set(ckpt.tensors)
    skipped = sorted(n for n in names - set(expected)
                     if n.endswith(IGNORED_SUFFIXES) or (tied and n == "lm_head.weight"))
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected) - set(skipped))
    misshaped = [f"{n} is {list(ckpt.tensors[n].shape)}, config implies {list(s)}"
                 for n, s in expected.items() if n in names and tuple(ckpt.tensors[n].shape) != s]
    not_float = [f"{n} is {ckpt.tensors[n].dtype}" for n in expected
                 if n in names and ckpt.tensors[n].dtype not in FLOAT_TAGS]
    problems = []
    for label, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                         ("wrong shapes", misshaped), ("not bf16/fp16/fp32", not_float)):
        if items:
            shown = ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise LoadError("checkpoint does not match config.json: " + "; ".join(problems))
    notes = []
    if tied and "lm_head.weight" in skipped:
        notes.append("tie_word_embeddings: lm_head.weight dropped (the embedding is the head)")
    if any(n.endswith(IGNORED_SUFFIXES) for n in skipped):
        notes.append("rotary_emb.inv_freq buffers dropped (recomputed from rope_theta)")
    return notes


def check_sizes(src: Path, args, ckpt: Checkpoint) -> None:
    """Before the model's skeleton is built: the config's sizes against the
    checkpoint's tensors (one line per contradiction), and the largest tensor,
    read and cast one module at a time, against this machine's memory."""
    if not any(n.startswith("model.") for n in ckpt.tensors) and any(
            n.startswith(("layers.", "embed_tokens.")) for n in ckpt.tensors):
        causal = registry.family(args.model_type).Model.ARCHITECTURES[0]
        raise LoadError(f"{src}: the weights have no 'model.' prefix (embed_tokens.weight, layers.0...): a bare "
                        f"model body, not a {causal} checkpoint; save the {causal} model instead")
    problems = weight_problems(args, {n: Tensor(t.dtype, t.shape) for n, t in ckpt.tensors.items()})
    if problems:
        raise LoadError("\n".join(f"{src}/config.json: {p}" for p in problems))
    largest = max((math.prod(t.shape) for t in ckpt.tensors.values()), default=0)
    check_memory(largest * 8, f"{src}: its largest tensor, read and cast (float32)")


def check_tokenizer(src: Path, config: dict, args) -> int:
    """No token without an embedding row, an EOS token, then the mask id (config or tokenizer,
    the two agreeing: ``tokenizer_checks.resolve_mask_id``)."""
    tokenizer = load_tokenizer(src)
    if len(tokenizer) > args.vocab_size:
        raise LoadError(f"the embedding has {args.vocab_size} rows but the tokenizer has "
                        f"{len(tokenizer)} tokens")
    if tokenizer.eos_token_id is None:
        raise LoadError("the tokenizer defines no eos_token")
    problems = tokenizer_problems(src, config, tokenizer, args.vocab_size)
    if problems:  # as loading refuses them: the converted folder would not load
        raise LoadError("\n".join(problems))
    return resolve_mask_id(src, config, tokenizer, args.vocab_size)


def declared_dtype(config: dict) -> Optional[str]:
    """The config's ``torch_dtype`` (or ``dtype``) when it names one of ``DTYPES`` (``half``: float16)."""
    declared = dtype_name(config.get("torch_dtype") or config.get("dtype"))
    return declared if declared in DTYPES else None


def output_dtype(dtype: Optional[str], config: dict, ckpt: Checkpoint) -> str:
    """``dtype`` (checked), else the config's torch_dtype, else the embedding's stored dtype."""
    if dtype is not None:
        return dtype
    return declared_dtype(config) or TAG_DTYPES[ckpt.tensors["model.embed_tokens.weight"].dtype]


# --------------------------------------------------------------------------
# Conversion proper


def convert_leaf(module: nn.Module, weights: Dict[str, mx.array], dtype: mx.Dtype,
                 qparams: Optional[dict]) -> Dict[str, mx.array]:
    """One module's output tensors (lazy): the source weights cast, then quantized by MLX."""
    leaf = copy.copy(module)  # the skeleton keeps its placeholders; this copy takes the weights
    leaf.update(tree_unflatten(list(weights.items())))
    leaf.set_dtype(dtype)
    if qparams:
        leaf = leaf.to_quantized(**qparams)
    return dict(tree_flatten(leaf.parameters()))


def converted_tensors(ckpt: Checkpoint, plan: QuantPlan, dtype: str,
                      progress: bool) -> Iterator[Tuple[str, mx.array]]:
    """Output tensors one module at a time, each evaluated, then forgotten by the caller."""
    from tqdm import tqdm

    total = sum(len(tree_flatten(m.parameters())) for _, m in plan.leaves)
    with tqdm(total=total, unit="tensor", desc="Converting", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        for path, module in plan.leaves:
            names = [k for k, _ in tree_flatten(module.parameters())]
            weights = {k: ckpt.read(f"{path}.{k}") for k in names}
            outputs = convert_leaf(module, weights, DTYPES[dtype], plan.quant.get(path))
            del weights
            finite = {k: mx.all(mx.isfinite(v)) for k, v in outputs.items() if mx.issubdtype(v.dtype, mx.floating)}
            mx.eval(list(outputs.values()), list(finite.values()))
            bad = [k for k, ok in finite.items() if not ok.item()]
            if bad:  # NaN in the source, or a value past the output dtype's range (float16: 65504)
                raise LoadError(f"{path}.{bad[0]}: holds values that are not finite (NaN or infinity) in {dtype}")
            for k in list(outputs):
                yield f"{path}.{k}", outputs.pop(k)
            bar.update(len(names))
    ckpt.close()


def write_weights(folder: Path, ckpt: Checkpoint, plan: QuantPlan, dtype: str,
                  progress: bool) -> Dict[str, str]:
    """Stream every tensor into shards of at most 5 GB; return the index's weight map."""
    from mlx_lm.utils import make_shards

    groups = make_shards(plan.specs, MAX_SHARD_GB) if plan.specs else [{}]
    names = shard_names(len(groups))
    where = {t: n for n, group in zip(names, groups) for t in group}
    writers = {n: ShardWriter(folder / n, {t: plan.specs[t] for t in group}, {"format": "mlx"})
               for n, group in zip(names, groups)}
    try:
        for name, array in converted_tensors(ckpt, plan, dtype, progress):
            writers[where[name]].write(name, array)
            del array
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return {t: where[t] for t in sorted(where)}


def output_config(config: dict, args, mask_id: int, dtype: str,
                  config_quant: Optional[dict]) -> dict:
    """The source config plus what both runtimes need spelled out."""
    out = dict(config)
    out["mask_token_id"] = mask_id
    for key in ("head_dim", "num_key_value_heads", "rope_theta", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings"):
        if out.get(key) is None:  # mlx-lm's model classes may have no defaults for these
            out[key] = getattr(args, key)
    for key in ("torch_dtype", "dtype"):
        if key in out or key == "torch_dtype":
            out[key] = dtype
    if config_quant is not None:
        out["quantization"] = config_quant
    return out


def model_card(src_name: str, summary: Summary, model_type: str) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(library_name="mlx", pipeline_tag="text-generation",
                         tags=["mlx", "refusion", "diffusion-llm"],
                         base_model=src_name if src_name.count("/") == 1 and not Path(src_name).exists() else None)
    precision = describe_quantization(summary.quantization)
    return (f"---\n{data.to_yaml()}\n---\n\n# {Path(summary.path).name}\n\n"
            f"ReFusion (masked diffusion LLM, {model_type} architecture) converted from `{src_name}` to MLX "
            f"with `python -m refusion_mlx.convert`: {precision}, other tensors {summary.dtype}, "
            f"{summary.bits_per_weight:.2f} bits per weight.\n\n"
            "```bash\npip install refusion-mlx\n"
            f"python -m refusion_mlx.generate --model {Path(summary.path).name} --prompt \"Hello\"\n```\n\n"
            "`mlx_lm.load` reads the same folder (left-to-right decoding).\n")


def write_metadata(folder: Path, src: Path, config: dict, weight_map: Dict[str, str],
                   summary: Summary, src_name: str) -> None:
    """Index, tokenizer and generation files, model card; config.json last (it makes the folder loadable)."""
    from mlx_lm.utils import save_config

    write_index(folder, weight_map, {"total_size": summary.bytes_after, "total_parameters": summary.parameters})
    copy_side_files(src, folder, COPIED_FILES)
    (folder / "README.md").write_text(model_card(src_name, summary, config["model_type"]))
    save_config(config, folder / "config.json")


def convert(hf_path: Union[str, Path], mlx_path: Union[str, Path] = "mlx_model",
            quantize: bool = False, q_group_size: Optional[int] = None,
            q_bits: Optional[int] = None, q_mode: str = "affine",
            quant_predicate: Optional[str] = None, dtype: Optional[str] = None,
            force: bool = False, progress: bool = True) -> Summary:
    """Convert ``hf_path`` (folder or hub id) into an MLX folder at ``mlx_path``.

    Raises ``RefusionError`` (``LoadError`` for bad inputs) before writing
    anything; on any failure or interrupt, ``mlx_path`` is left as it was
    (an interrupt that comes once the new folder is in place leaves it there).
    """
    qs = quant_settings(quantize, q_bits, q_group_size, q_mode, quant_predicate)
    check_choice("dtype", dtype, list(DTYPES), str)
    dst = check_destination(mlx_path, force)
    src = resolve_source(hf_path)
    check_overlap(src, dst, "--mlx-path {dst} would replace the source checkpoint {src}")
    config = read_config(src)
    args = check_architecture(config)
    ckpt = open_checkpoint(src)
    check_sizes(src, args, ckpt)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(registry.build(args).parameters())}
    notes = check_tensors(ckpt, expected, args.tie_word_embeddings)
    mask_id = check_tokenizer(src, config, args)
    out_dtype = output_dtype(dtype, config, ckpt)
    plan = make_plan(args, out_dtype, qs)
    notes += plan.notes
    bytes_after = sum(s.nbytes for s in plan.specs.values())
    quant = plan.config_quant and {k: v for k, v in plan.config_quant.items() if not isinstance(v, dict)}
    if quant:  # the bits the layers have (a recipe's differ from the top-level setting)
        quant["layer_bits"] = sorted({q["bits"] for q in plan.quant.values()})
    summary = Summary(dst, plan.parameters, sum(ckpt.tensors[k].nbytes for k in expected),
                      bytes_after, bytes_after * 8 / plan.parameters, out_dtype, quant, notes)
    for note in notes:
        print(f"[INFO] {note}", file=sys.stderr)
    previous_limit = mx.set_cache_limit(0)  # freed buffers go back to the system at once
    try:
        with staging_folder(dst, force) as tmp:
            weight_map = write_weights(tmp, ckpt, plan, out_dtype, progress)
            config_out = output_config(config, args, mask_id, out_dtype, plan.config_quant)
            write_metadata(tmp, src, config_out, weight_map, summary, str(hf_path))
    finally:
        mx.set_cache_limit(previous_limit)
        ckpt.close()
    return summary


def describe_quantization(q: Optional[dict]) -> str:
    """A summary's quantization in words: a recipe's layers by their bits (``mixed_2_6``: 2/6-bit)."""
    if not q:
        return "not quantized"
    bits = q.get("layer_bits") or [q["bits"]]
    if len(bits) > 1 or bits[0] != q["bits"]:
        return f"{'/'.join(map(str, bits))}-bit {q['mode']} by layer (group size {q['group_size']})"
    return f"{q['bits']}-bit {q['mode']} (group size {q['group_size']})"


def format_summary(s: Summary) -> str:
    what = describe_quantization(s.quantization)
    return (f"[INFO] {s.path}: {_count(s.parameters)} parameters | {_bytes(s.bytes_before)} -> "
            f"{_bytes(s.bytes_after)} | {s.bits_per_weight:.2f} bits per weight | "
            f"{what}, other tensors {s.dtype}")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"
