"""A checkpoint's config.json checked before anything is built from it.

Three checks, each reporting every bad value on a line of its own (a
``ConfigError`` or ``LoadError`` whose message has one line per problem),
and none allocating anything:

* :func:`field_problems`: every field's type and range (``DecoderArgs``
  calls it first): an integer is an integer (``true`` is not one), sizes lie
  within :data:`LIMITS` -- far above any real checkpoint, far below what
  would overflow MLX's 32-bit dimensions or take the machine's memory just
  to build a model's skeleton --, ``rope_theta`` and ``rms_norm_eps`` are
  finite and positive, flags are booleans.
* :func:`weight_problems`: the sizes against the weights' own safetensors
  headers (:func:`read_headers`: the JSON header of each file, checked
  against the file's size; no tensor is read): the layer count, the
  vocabulary, the hidden size, the heads and the MLP width.
* :func:`check_memory`: the weights' bytes in the dtype they will be loaded
  in, from the same headers, against this machine's memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from .._json import read_json_object
from ..errors import LoadError

# Sizes a config may give: well above every published checkpoint (Llama 3.1 405B:
# 126 layers, hidden 16,384, intermediate 53,248; vocabularies up to ~260k), well
# below what overflows MLX's int32 dimensions.
LIMITS: Dict[str, Tuple[int, int]] = {
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 4096),
    "vocab_size": (2, 1 << 22),
    "max_position_embeddings": (1, 1 << 24),
}
MAX_HEADER = 100 << 20  # bytes of a safetensors JSON header (a real one: a few hundred KB)
# safetensors dtype tags: bytes per element (floating or not)
TAGS = {"F64": (8, True), "F32": (4, True), "F16": (2, True), "BF16": (2, True), "I64": (8, False),
        "I32": (4, False), "U32": (4, False), "I16": (2, False), "U16": (2, False), "I8": (1, False),
        "U8": (1, False), "BOOL": (1, False), "F8_E4M3": (1, True), "F8_E5M2": (1, True)}
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# PyTorch's other names of floating dtypes, which transformers reads from a config as torch.<name>
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # the bits MLX's affine quantization packs (mx.quantize)
MAX_ROPE_FACTOR = 1024  # a RoPE scaling factor (published ones: up to 64)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Tensor(NamedTuple):
    """What a header says of one tensor: its dtype tag and shape."""

    dtype: str
    shape: Tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _shown(value: Any) -> str:
    """A value as config.json spells it (``true``, ``1e+12``, ``"x"``)."""
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def field_problems(args) -> List[str]:
    """Each bad field of a ``DecoderArgs`` (as read, before defaults are
    derived) as one line: its name, what it must be, what it is."""
    out: List[str] = []
    for name, (lo, hi) in LIMITS.items():
        value = getattr(args, name, None)
        if value is None and name in ("num_key_value_heads", "head_dim"):
            continue  # derived from the others
        if not _is_int(value):
            out.append(f"{name} must be an integer, got {_shown(value)}")
        elif not lo <= value <= hi:
            out.append(f"{name} must be within {lo}..{hi}, got {value}")
    eps = args.rms_norm_eps
    if not (_is_number(eps) and 0 < eps < 1):
        out.append(f"rms_norm_eps must be a number in (0, 1), got {_shown(eps)}")
    theta = args.rope_theta
    if theta is not None and not (_is_number(theta) and 1 < theta <= 1e12):  # a base past 1; real ones 1e4-1e7
        out.append(f"rope_theta must be a number over 1 and at most 1e12, got {_shown(theta)}")
    for name in ("rope_scaling", "rope_parameters"):
        out += _rope_problems(name, getattr(args, name))
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(f.default, bool) and not isinstance(value, bool):
            out.append(f"{f.name} must be true or false, got {_shown(value)}")
    for name in ("model_type", "hidden_act"):
        if not isinstance(getattr(args, name), str):
            out.append(f"{name} must be a string, got {_shown(getattr(args, name))}")
    if not isinstance(args.architectures, list) or not all(isinstance(a, str) for a in args.architectures):
        out.append(f"architectures must be a list of strings, got {_shown(args.architectures)}")
    mask = args.mask_token_id  # within the vocabulary: checked with the tokenizer's (loading.load)
    if mask is not None and (not _is_int(mask) or mask < 0):
        out.append(f"mask_token_id must be a token id (an integer >= 0), got {_shown(mask)}")
    return out


def _rope_problems(name: str, value: Any) -> List[str]:
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"{name} must be an object or null, got {_shown(value)}"]
    out = []
    kind = value.get("rope_type", value.get("type", "default"))
    if not isinstance(kind, str):
        out.append(f"{name}.rope_type must be a string, got {_shown(kind)}")
    factor = value.get("factor", 1.0)
    if not (_is_number(factor) and 0 < factor <= MAX_ROPE_FACTOR):
        out.append(f"{name}.factor must be a number in (0, {MAX_ROPE_FACTOR}], got {_shown(factor)}")
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "original_max_position_embeddings"):
        given = value.get(key)
        if given is not None and not (_is_number(given) and 0 < given <= 1 << 24):
            out.append(f"{name}.{key} must be a positive number up to {1 << 24}, got {_shown(given)}")
    theta = value.get("rope_theta")
    if theta is not None and not (_is_number(theta) and theta > 0):
        out.append(f"{name}.rope_theta must be a positive number, got {_shown(theta)}")
    return out


def dtype_name(value: Any) -> Any:
    """A config's dtype string by its own name: PyTorch's aliases (``half``, ``float``, ``double``) as
    transformers reads them; anything else as given."""
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


def dtype_field_problems(config: Dict[str, Any]) -> List[str]:
    """A ``dtype`` (else ``torch_dtype``) string that names no floating dtype: transformers reads it as
    ``torch.<value>`` where PyTorch is installed (``"auto"``, from_pretrained's argument, then failed as
    the tokenizer's load) and leaves it alone where not, so it is refused here whatever is installed:
    a folder loads or not alike from a command (which keeps PyTorch out) and from Python."""
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"
    value = config.get(key)
    if not isinstance(value, str) or dtype_name(value) in FLOAT_BYTES or dtype_name(value) == "float64":
        return []
    return [f"config.json: {key} is {value!r}, which is not a dtype (float16, bfloat16 or float32)"
            + ("; 'auto' is an argument of from_pretrained, not a value for config.json" if value == "auto" else "")]


def quantization_problems(config: Dict[str, Any]) -> List[str]:
    """config.json's ``quantization`` (mlx-lm's): group size, bits, mode; per-layer overrides."""
    quant = config.get("quantization")
    if quant is None or "quantization" not in config:
        return []
    if not isinstance(quant, dict):
        return [f"quantization must be an object, got {_shown(quant)}"]
    out = []
    group, bits, mode = quant.get("group_size", 64), quant.get("bits", 4), quant.get("mode", "affine")
    if not _is_int(group) or group not in (16, 32, 64, 128):
        out.append(f"quantization.group_size must be 16, 32, 64 or 128, got {_shown(group)}")
    if not _is_int(bits) or bits not in QUANT_BITS:
        out.append(f"quantization.bits must be {', '.join(map(str, QUANT_BITS[:-1]))} or {QUANT_BITS[-1]}, "
                   f"got {_shown(bits)}")
    if not isinstance(mode, str):
        out.append(f"quantization.mode must be a string, got {_shown(mode)}")
    for key, value in quant.items():
        if key not in ("group_size", "bits", "mode") and not isinstance(value, (dict, bool)):
            out.append(f"quantization.{key} must be an object or true/false, got {_shown(value)}")
    return out


# --------------------------------------------------------------------------
# The weights' headers


def read_headers(files: Iterable[Path]) -> Dict[str, Tensor]:
    """Every tensor's dtype and shape, from the safetensors headers only (a
    LoadError when a header is malformed or does not fit its file)."""
    out: Dict[str, Tensor] = {}
    for f in files:
        out.update(_read_header(Path(f)))
    return out


def _read_header(file: Path) -> Dict[str, Tensor]:
    def bad(why: str) -> LoadError:
        return LoadError(f"{file.name} is not a valid safetensors file: {why}")

    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise bad(f"its header length does not fit its {size} bytes")
            raw = fh.read(n)
    except OSError as e:
        raise LoadError(f"cannot read {file}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    out = {}
    data = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = tag in TAGS and isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise bad(f"a malformed entry for {name}")
        tensor = Tensor(tag, tuple(shape))
        if not (_is_int(start) and _is_int(end) and 0 <= start and end - start == tensor.size * TAGS[tag][0]):
            raise bad(f"the offsets of {name} do not hold its shape {list(shape)} of {tag}")
        if end > data:
            raise bad(f"{name} ends at byte {end} of its data, but the file holds {data} (truncated?)")
        out[name] = tensor
    return out


FLOAT_TAGS = ("F32", "F16", "BF16")
PACKED_TAGS = ("U32", "U8")  # a quantized layer's packed weights; a float mode's scales


def dtype_problems(tensors: Dict[str, Tensor], quantized: bool) -> List[str]:
    """A weight that is no floating tensor (nor, in a quantized model, a
    packed one): ints or booleans in a float's place decode garbage."""
    allowed = FLOAT_TAGS + (PACKED_TAGS if quantized else ())
    bad = sorted(n for n, t in tensors.items() if t.dtype not in allowed)
    if not bad:
        return []
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return [f"{bad[0]}{more} is {tensors[bad[0]].dtype}: weights are float32, float16 or bfloat16"
            + (" (or packed, in a quantized model)" if quantized else "")]


def weight_problems(args, tensors: Dict[str, Tensor]) -> List[str]:
    """The config's sizes that the tensors contradict, one line each. Rows
    only where a quantized layer packs its columns; Hugging Face's names."""
    out: List[str] = []
    layers = {int(m.group(1)) for name in tensors for m in [LAYER.match(name)] if m}
    held = max(layers) + 1 if layers else 0
    if held != args.num_hidden_layers:
        out.append(f"num_hidden_layers is {args.num_hidden_layers}, but the weights hold {held} layers")

    def dim(name: str, axis: int) -> Optional[int]:
        t = tensors.get(name)
        return t.shape[axis] if t is not None and len(t.shape) > axis else None

    checks = [("vocab_size", args.vocab_size, "model.embed_tokens.weight", 0),
              ("hidden_size", args.hidden_size, "model.norm.weight", 0),
              ("num_attention_heads x head_dim", args.num_attention_heads * args.head_dim,
               "model.layers.0.self_attn.q_proj.weight", 0),
              ("num_key_value_heads x head_dim", args.num_key_value_heads * args.head_dim,
               "model.layers.0.self_attn.k_proj.weight", 0),
              ("intermediate_size", args.intermediate_size, "model.layers.0.mlp.gate_proj.weight", 0)]
    if not args.tie_word_embeddings:
        checks.append(("vocab_size", args.vocab_size, "lm_head.weight", 0))
    for what, want, name, axis in checks:
        got = dim(name, axis)
        if got is not None and got != want:
            out.append(f"{what} is {want}, but {name} has {got} rows" if axis == 0 else
                       f"{what} is {want}, but {name} has {got} columns")
    return out


# --------------------------------------------------------------------------
# Memory


def physical_memory() -> int:
    """This machine's memory in bytes (0 when it cannot be told)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):  # pragma: no cover - not a POSIX system
        return 0


def weight_bytes(tensors: Dict[str, Tensor], dtype: Optional[str]) -> int:
    """The tensors' bytes once loaded: floating ones in ``dtype`` (None: as stored), packed ones as stored."""
    total = 0
    for t in tensors.values():
        size, floating = TAGS[t.dtype]
        total += t.size * (FLOAT_BYTES[dtype] if floating and dtype in FLOAT_BYTES else size)
    return total


def check_memory(need: int, what: str, hint: str = "") -> None:
    """A LoadError when ``need`` bytes (``what`` they are for) exceed this machine's memory."""
    have = physical_memory()
    if have and need > have:
        raise LoadError(f"{what} need {need / (1 << 30):.1f} GiB, more than this machine's "
                        f"{have / (1 << 30):.1f} GiB of memory{hint}")


def folder_problems(folder: Path) -> List[str]:
    """A model folder's entries that must not be opened, one line each:
    anything but regular files and folders (a FIFO would block the first
    read for ever, a device read without end), and links that lead out of
    the folder (in the hub's cache, ``REPO/snapshots/REV``, out of ``REPO``:
    its files are links to ``REPO/blobs``). Nothing is opened: the entries
    are only looked at."""
    out = []
    root = folder.resolve()
    if root.parent.name == "snapshots":
        root = root.parent.parent
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        return [f"{folder}: cannot list the folder: {e.strerror or e}"]
    for entry in entries:
        try:
            if entry.is_symlink() and not Path(entry.path).resolve().is_relative_to(root):
                out.append(f"{entry.name}: a link to {os.readlink(entry.path)}, outside the model folder (copy "
                           "the file in, or link the whole folder)")
                continue
            if entry.is_symlink() and not os.path.exists(entry.path):
                out.append(f"{entry.name}: a link to {os.readlink(entry.path)}, which does not exist; remove it")
            elif not (entry.is_file() or entry.is_dir()) and os.path.lexists(entry.path):
                out.append(f"{entry.name}: not a regular file (a pipe, socket or device); remove it")
        except RuntimeError:  # pathlib's "Symlink loop" (Python 3.11 and 3.12)
            out.append(f"{entry.name}: a link that leads back to itself; remove it")
        except OSError as e:
            out.append(f"{entry.name}: {e.strerror or e}")
    return out


def shard_problems(folder: Path, names: Iterable[Any]) -> List[str]:
    """Shard names from ``model.safetensors.index.json`` that would leave the
    folder: not a plain string, absolute, with ``..``, or resolving outside;
    one line a name (the index names a shard once per tensor)."""
    out = []
    root = folder.resolve()
    for name in names:
        if not isinstance(name, str) or not name:
            out.append(f"model.safetensors.index.json names a shard {_shown(name)}: not a file name")
        elif Path(name).is_absolute() or ".." in Path(name).parts or not (folder / name).resolve().is_relative_to(root):
            out.append(f"model.safetensors.index.json names the shard {name!r}, outside the model folder")
    return list(dict.fromkeys(out))


TOKEN_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


def token_id_problems(configs: Iterable[Dict[str, Any]], ids: Iterable[Any], vocab_size: int) -> List[str]:
    """Token ids outside ``[0, vocab_size)``: those of :data:`TOKEN_FIELDS` in
    ``configs`` (config.json, generation_config.json; an id or a list of ids)
    and the tokenizer's own ``ids``, one line each."""
    out = []
    named = [(f, c.get(f)) for c in configs for f in TOKEN_FIELDS if c.get(f) is not None]
    for name, value in named + [("the tokenizer's eos token id", i) for i in ids]:
        for t in value if isinstance(value, list) else [value]:
            if not (_is_int(t) and 0 <= t < vocab_size):
                what = name.replace("_token_id", " token id").replace("_", " ")
                out.append(f"{what} {_shown(t)} is outside the vocabulary of {vocab_size}")
    return out



def end_ids(configs: Sequence[Dict[str, Any]]) -> List[int]:
    """The end ids a checkpoint names: the last of ``configs`` (config.json,
    then generation_config.json) with an ``eos_token_id`` (an id or a list),
    as mlx-lm's ``load`` gives them to its tokenizer (checked in the
    vocabulary by :func:`token_id_problems`)."""
    for c in reversed(list(configs)):
        value = c.get("eos_token_id")
        if value is not None:
            return [t for t in (value if isinstance(value, list) else [value]) if _is_int(t)]
    return []


def folder_configs(folder: Path, config: Dict[str, Any]) -> List[Dict[str, Any]]:
    """config.json's settings, and generation_config.json's where the folder has one."""
    extra = folder / "generation_config.json"
    return [config] + ([read_json_object(extra)] if extra.is_file() else [])
