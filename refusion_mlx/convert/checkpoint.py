"""Reading Hugging Face PyTorch-format checkpoints one tensor at a time.

Formats: ``model.safetensors``, sharded safetensors with their index,
``pytorch_model.bin`` and sharded ``.bin`` with their index. Every file is
checked from its header before a single weight is converted, so a truncated
or corrupted checkpoint fails before anything is written. ``.bin`` files are
read with ``torch.load(weights_only=True)``: a pickle that would run code is
refused, never executed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import mmap
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import LoadError

# safetensors dtype tag -> (bytes per element, MLX dtype or None when not a float)
SAFETENSORS_DTYPES = {
    "BF16": (2, mx.bfloat16), "F16": (2, mx.float16), "F32": (4, mx.float32),
    "F64": (8, None), "I64": (8, None), "I32": (4, None), "I16": (2, None), "I8": (1, None),
    "U64": (8, None), "U32": (4, None), "U16": (2, None), "U8": (1, None), "BOOL": (1, None),
    "F8_E4M3": (1, None), "F8_E5M2": (1, None),
}
FLOAT_TAGS = {"BF16", "F16", "F32"}
MAX_HEADER = 100 << 20  # the safetensors reference implementation's limit
SHARD_NAME = re.compile(r"-(\d+)-of-(\d+)\.(safetensors|bin)$")


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says of one tensor, known before reading its data."""

    name: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors tag: BF16, F16, F32, ...
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPES.get(self.dtype, (0, None))[0]


class Checkpoint:
    """Tensor names, shapes and dtypes of a checkpoint, and reads of single tensors."""

    format = ""

    def __init__(self, files: List[Path], tensors: Dict[str, TensorInfo]):
        self.files = files
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def read(self, name: str) -> mx.array:
        raise NotImplementedError

    def close(self) -> None:
        """Drop whatever file is held open or mapped."""


# --------------------------------------------------------------------------
# safetensors


def safetensors_header(file: Path) -> Dict[str, TensorInfo]:
    """Parse and check a safetensors header against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoadError(f"{file.name} is truncated: {size} bytes, not even a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or n > size - 8:
            raise LoadError(f"{file.name} has a corrupted safetensors header "
                            f"(header length {n} does not fit the {size}-byte file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise LoadError(f"{file.name} has a corrupted safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise LoadError(f"{file.name} has a corrupted safetensors header (not a JSON object)")
    data_size = size - 8 - n
    infos, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        infos[name] = _header_entry(file, name, entry, data_size)
        spans.append((int(entry["data_offsets"][0]), int(entry["data_offsets"][1]), name))
    _check_spans(file, sorted(spans), data_size)
    return infos


def _check_spans(file: Path, spans: List[Tuple[int, int, str]], data_size: int) -> None:
    """The tensors' bytes tile the data: no overlap, no gap, nothing after (the format's rule)."""
    end, last = 0, None
    for start, stop, name in spans:
        if start != end:
            problem = (f"{name} overlaps {last}" if start < end
                       else f"{start - end} bytes before {name} belong to no tensor")
            raise LoadError(f"{file.name} has a corrupted safetensors header ({problem})")
        end, last = stop, name
    if end != data_size:
        raise LoadError(f"{file.name} has a corrupted safetensors header ({data_size - end} bytes after the "
                        "last tensor belong to none)")


def _header_entry(file: Path, name: str, entry, data_size: int) -> TensorInfo:
    """One header entry, its offsets checked: a short file is a truncated file."""
    try:
        dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        start, end = int(start), int(end)
    except (KeyError, TypeError, ValueError):
        raise LoadError(f"{file.name} has a corrupted safetensors header (bad entry for {name})") from None
    if dtype not in SAFETENSORS_DTYPES or any(d < 0 for d in shape):
        raise LoadError(f"{file.name} has a corrupted safetensors header "
                        f"({name}: dtype {dtype!r}, shape {list(shape)})")
    info = TensorInfo(name, shape, dtype, file)
    if start < 0 or end - start != info.nbytes:
        raise LoadError(f"{file.name} has a corrupted safetensors header "
                        f"({name}: offsets {start}..{end} do not hold shape {list(shape)} {dtype})")
    if end > data_size:
        raise LoadError(f"{file.name} is truncated: {name} ends at byte {end} of the data "
                        f"but the file holds only {data_size}")
    return info


class SafetensorsCheckpoint(Checkpoint):
    """Lazy reads through ``mx.load``: a tensor's bytes are read when it is evaluated."""

    format = "safetensors"

    def __init__(self, files, tensors):
        super().__init__(files, tensors)
        self._file: Optional[Path] = None
        self._arrays: Dict[str, mx.array] = {}

    def read(self, name: str) -> mx.array:
        file = self.tensors[name].file
        if file != self._file:
            self.close()
            try:
                self._arrays = mx.load(str(file))
            except Exception as e:
                raise LoadError(f"{file.name} is not a readable safetensors file: {_first_line(e)}") from None
            self._file = file
        return self._arrays.pop(name)

    def close(self) -> None:
        self._arrays, self._file = {}, None


# --------------------------------------------------------------------------
# PyTorch .bin


TORCH_EXTRA = "reading PyTorch .bin checkpoints needs torch: pip install 'refusion-mlx[torch]'"


def _torch():
    try:
        import torch
    except ImportError:
        raise LoadError(TORCH_EXTRA) from None
    return torch


def load_bin(file: Path) -> Dict[str, "object"]:
    """A .bin state dict through ``weights_only`` unpickling, memory-mapped when possible."""
    torch = _torch()
    import pickle

    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True,
                           mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as e:
        raise LoadError(_refusal(file, str(e))) from None
    except Exception as e:
        raise LoadError(f"{file.name} is not a readable PyTorch checkpoint: {_first_line(e)}") from None
    if not isinstance(state, dict):
        raise LoadError(f"{file.name} holds a {type(state).__name__}, not a state dict of tensors")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise LoadError(f"{file.name}: entry {key!r} is not a tensor")
    return state


def _refusal(file: Path, message: str) -> str:
    """Why weights-only unpickling refused ``file``: not a pickle at all (a
    byte that is no pickle opcode), an opcode it does not allow, or a global
    (a function or class: what would run code)."""
    import pickletools

    operand = re.search(r"Unsupported operand (\d+)", message)
    if operand:
        code = chr(int(operand.group(1)))
        op = next((o for o in pickletools.opcodes if o.code == code), None)
        if op is None:
            return f"{file.name} is not a PyTorch checkpoint (neither a zip archive nor a valid pickle)"
        return (f"{file.name} refused: its pickle uses {op.name}, which loading weights only does not "
                "allow; only weights are loaded, never code")
    detail = next((line.strip().rstrip(".") for line in message.splitlines() if "GLOBAL" in line
                   or "Unsupported" in line), "unsupported pickle content")
    return (f"{file.name} refused: its pickle would run code or build objects other than tensors "
            f"({detail}); only weights are loaded, never code")


def torch_dtype_tag(tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


TORCH_TAGS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


CHUNK_BYTES = 64 << 20
MADV_DONTNEED = 4  # Linux
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
_MX_OF_NUMPY = {"float16": mx.float16, "float32": mx.float32}


def torch_to_mx(tensor, mapped: bool = False) -> mx.array:
    """Copy a CPU tensor into MLX memory, 64 MB at a time.

    bf16 travels as int16 (numpy has no bf16). When the tensor is memory-mapped
    (``mapped``), each chunk's file pages are released once copied, so a large
    tensor is never resident twice: the copy goes straight into an MLX buffer
    (numpy view of an evaluated array, as in MLX's numpy interop guide).
    """
    torch = _torch()
    t = tensor.detach()
    if not t.is_contiguous():
        t, mapped = t.contiguous(), False
    bf16 = t.dtype == torch.bfloat16
    src = (t.view(torch.int16) if bf16 else t).numpy().reshape(-1)
    out = mx.zeros(src.shape, dtype=mx.int16 if bf16 else _MX_OF_NUMPY[src.dtype.name])
    mx.eval(out)
    dst = np.array(out, copy=False)
    if not (dst.flags.writeable and dst.flags.c_contiguous and src.size):
        out = mx.array(src)
    else:
        per_chunk = max(1, CHUNK_BYTES // src.itemsize)
        for i in range(0, src.size, per_chunk):
            chunk = src[i:i + per_chunk]
            dst[i:i + per_chunk] = chunk
            if mapped:
                release_pages(chunk.ctypes.data, chunk.nbytes)
    out = out.reshape(tuple(t.shape))
    return mx.view(out, mx.bfloat16) if bf16 else out


def release_pages(start: int, nbytes: int) -> None:
    """Drop the resident pages of a memory-mapped range already copied out.

    File-mapped pages count as resident memory until unmapped, so a single-file
    .bin would otherwise end up wholly resident. They are clean copies of the
    file (read again on access): nothing is lost. Only whole pages inside the
    range are released, never a neighbour's.
    """
    if _libc is None:
        return
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


class BinCheckpoint(Checkpoint):
    """One shard's state dict held (memory-mapped) at a time."""

    format = "bin"

    def __init__(self, files, tensors):
        super().__init__(files, tensors)
        self._file: Optional[Path] = None
        self._state: Dict[str, object] = {}
        self._mapped = False

    def read(self, name: str) -> mx.array:
        file = self.tensors[name].file
        if file != self._file:
            self.close()
            self._state, self._file = load_bin(file), file
            self._mapped = zipfile.is_zipfile(file)
        # zip .bin files are memory-mapped; legacy ones were read into memory
        return torch_to_mx(self._state.pop(name), mapped=self._mapped)

    def close(self) -> None:
        self._state, self._file = {}, None  # the last reference: the shard is unmapped


def bin_tensors(file: Path) -> Dict[str, TensorInfo]:
    state = load_bin(file)
    infos = {}
    for name, t in state.items():
        tag = TORCH_TAGS.get(torch_dtype_tag(t), torch_dtype_tag(t))
        infos[name] = TensorInfo(name, tuple(t.shape), tag, file)
    return infos


# --------------------------------------------------------------------------
# Discovery


def _index(path: Path, index_name: str) -> Tuple[List[Path], Dict[str, str]]:
    """Shard files and weight map of an index; every shard it names must exist."""
    index = path / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError) as e:
        raise LoadError(f"{index_name} is malformed: {_first_line(e)}") from None
    for n in names:
        if not isinstance(n, str) or Path(n).name != n:
            raise LoadError(f"{index_name} names an invalid shard file {n!r}")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise LoadError(f"missing shard {missing[0]} (named in {index_name})"
                        + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return [path / n for n in names], weight_map


def _unindexed_shards(path: Path, pattern: str) -> List[Path]:
    """``prefix-XXXXX-of-YYYYY`` files without an index: all YYYYY must be there."""
    files = sorted(path.glob(pattern))
    totals = {int(m.group(2)) for f in files if (m := SHARD_NAME.search(f.name))}
    if len(totals) == 1:
        total = totals.pop()
        present = {int(m.group(1)) for f in files if (m := SHARD_NAME.search(f.name))}
        missing = sorted(set(range(1, total + 1)) - present)
        if missing:
            raise LoadError(f"missing shard {missing[0]} of {total} in {path.name}/ (and no index)")
    return files


def _weight_files(path: Path) -> Tuple[str, List[Path], Optional[Dict[str, str]], str]:
    """(format, files, weight map or None, index name) in HF's order of preference."""
    for fmt, index_name, single, pattern in (
        ("safetensors", "model.safetensors.index.json", "model.safetensors", "model-*-of-*.safetensors"),
        ("bin", "pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model-*-of-*.bin"),
    ):
        if (path / index_name).is_file():
            files, weight_map = _index(path, index_name)
            return fmt, files, weight_map, index_name
        if (path / single).is_file():
            return fmt, [path / single], None, ""
        files = _unindexed_shards(path, pattern)
        if files:
            return fmt, files, None, ""
    raise LoadError(f"{path} has no weights: expected model.safetensors, sharded "
                    "model-XXXXX-of-YYYYY.safetensors with their index, or pytorch_model*.bin")


def open_checkpoint(path: Path) -> Checkpoint:
    """Every weight file's header read and checked; no tensor data read yet."""
    fmt, files, weight_map, index_name = _weight_files(path)
    read_header = safetensors_header if fmt == "safetensors" else bin_tensors
    tensors: Dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in tensors:
                raise LoadError(f"tensor {name} appears in both {tensors[name].file.name} and {f.name}")
            tensors[name] = info
    if weight_map:
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].file.name != shard:
                raise LoadError(f"{index_name} puts {name} in {shard}, which does not hold it")
    cls = SafetensorsCheckpoint if fmt == "safetensors" else BinCheckpoint
    return cls(files, tensors)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(e).__name__
