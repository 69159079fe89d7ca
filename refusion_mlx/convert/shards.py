"""Writing safetensors shards tensor by tensor.

``mx.save_safetensors`` needs a whole shard in memory, and a shard may be
5 GB. The converter knows every output tensor's shape and dtype before it
computes any of them, so the header can be written first and each tensor
streamed to disk as soon as it is computed, then dropped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from ..errors import RefusionError

TAGS = {
    mx.bfloat16: ("BF16", 2), mx.float16: ("F16", 2), mx.float32: ("F32", 4),
    mx.uint32: ("U32", 4), mx.uint8: ("U8", 1), mx.int32: ("I32", 4), mx.uint16: ("U16", 2),
}


@dataclass(frozen=True)
class Spec:
    """An output tensor before it exists: enough to lay out the file."""

    shape: Tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:  # the name mlx-lm's make_shards reads
        return math.prod(self.shape) * TAGS[self.dtype][1]


def shard_names(count: int) -> List[str]:
    """mlx-lm's names, which ``mlx_lm.load`` globs for (``model*.safetensors``)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardWriter:
    """One safetensors file: the header from the specs up front, then each tensor at its offset.

    It is written as ``NAME.partial`` and takes its name only when complete, so
    no file with a loadable name is ever half-written.
    """

    def __init__(self, path: Path, specs: Dict[str, Spec], metadata: Dict[str, str]):
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        self.specs = specs
        header: Dict[str, object] = {"__metadata__": metadata}
        self.offsets: Dict[str, int] = {}
        offset = 0
        for name, spec in specs.items():
            header[name] = {"dtype": TAGS[spec.dtype][0], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
            self.offsets[name] = offset
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the format recommends
        self.start = 8 + len(raw)
        self.written: set = set()
        self.file = open(self.partial, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, array: mx.array) -> None:
        """Write an evaluated array where the header put it; it must match its spec."""
        spec = self.specs.get(name)
        if spec is None or name in self.written or tuple(array.shape) != spec.shape or array.dtype != spec.dtype:
            raise RefusionError(f"internal error writing {self.path.name}: {name} {array.shape} "
                                f"{array.dtype} does not match the planned {spec}")
        self.file.seek(self.start + self.offsets[name])
        self.file.write(_bytes(array))
        self.written.add(name)

    def close(self) -> None:
        """Flush to disk; a shard with tensors missing is an error, not a file."""
        if len(self.written) != len(self.specs):
            self.file.close()
            raise RefusionError(f"internal error: {self.path.name} closed with "
                                f"{len(self.written)} of {len(self.specs)} tensors")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self.file.close()


def _bytes(array: mx.array) -> memoryview:
    """The array's bytes without a copy (bf16 through a uint16 view: no buffer format for it)."""
    if array.dtype == mx.bfloat16:
        array = mx.view(array, mx.uint16)
    view = memoryview(array)
    if not view.c_contiguous:
        view = memoryview(np.ascontiguousarray(np.asarray(array)))
    return view.cast("B")
