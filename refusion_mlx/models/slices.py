"""Reading only a rank's share of safetensors weights.

``mx.load`` maps a file lazily but reads a tensor whole when it is
evaluated. A safetensors file is a JSON header (name, dtype, shape, byte
range) and raw row-major data, so a slice can be read on its own: rows of
the first axis are one contiguous byte range; a slice of the last axis is a
strided view of a memory map, which touches only the pages that hold it.

:func:`read` is given the parameter's shape on this rank (the model is
sharded before its weights are read): the one axis where it is smaller than
the stored tensor says which slice, the rank's.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import LoadError

# safetensors dtype -> (numpy dtype of the bytes, the MLX dtype they are)
DTYPES = {
    "F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32), "U16": (np.uint16, mx.uint16),
    "I16": (np.int16, mx.int16), "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8),
    "I64": (np.int64, mx.int64), "U64": (np.uint64, mx.uint64), "BOOL": (np.bool_, mx.bool_),
}


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes are."""

    file: Path
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # from the start of the file

    @property
    def mx_dtype(self) -> mx.Dtype:
        return DTYPES[self.dtype][1]


def index(files: Sequence[Path]) -> Dict[str, Stored]:
    """Every tensor of the files, by name (the headers only are read)."""
    out: Dict[str, Stored] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise LoadError(f"{f.name}: {name} has dtype {info['dtype']}, which cannot be split")
                start, _ = info["data_offsets"]
                out[name] = Stored(Path(f), info["dtype"], tuple(info["shape"]), 8 + n + int(start))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise LoadError(f"{f.name} is not a readable safetensors file: {e}") from None
    return out


def _slices(stored: Tuple[int, ...], shape: Tuple[int, ...], rank: int, name: str) -> List[slice]:
    if len(stored) != len(shape):
        raise LoadError(f"{name}: stored with shape {stored}, the model has {shape}")
    cut = [slice(None)] * len(shape)
    differ = [a for a, (s, m) in enumerate(zip(stored, shape)) if s != m]
    if len(differ) > 1 or any(stored[a] % shape[a] for a in differ):
        raise LoadError(f"{name}: stored with shape {stored}, the model has {shape}")
    for a in differ:
        cut[a] = slice(rank * shape[a], (rank + 1) * shape[a])
    return cut


def read(stored: Stored, shape: Sequence[int], rank: int, name: str = "") -> mx.array:
    """The tensor, or rank ``rank``'s slice of it when ``shape`` is smaller on one axis."""
    np_dtype, mx_dtype = DTYPES[stored.dtype]
    shape = tuple(shape)
    cut = _slices(stored.shape, shape, rank, name)
    if 0 in stored.shape:
        data = np.zeros(shape, np_dtype)
    else:
        mapped = np.memmap(stored.file, dtype=np_dtype, mode="r", offset=stored.offset, shape=stored.shape)
        data = np.ascontiguousarray(mapped[tuple(cut)])
        del mapped
    out = mx.array(data)
    return out.view(mx_dtype) if out.dtype != mx_dtype else out
