"""What a model is, as a hash of each of its files: ranks under ``mlx.launch``
compare them before any weight is read (``distributed.broadcast.same_model``),
and the server's prompt-cache files are named by them
(``serve/caches/cache_files.py: model_fingerprint``).

A model is the files of its folder that decide its tokens -- those
:data:`MODEL_FILES` names (config, generation config, tokenizer, chat
template, the weights' index) and every safetensors file -- and its adapters'
JSON and safetensors files. A small file is hashed whole; a safetensors file
by its size, its header (every tensor's name, dtype, shape and byte range)
and ``TENSOR_SAMPLE`` bytes at the start, the middle and the end of every
tensor: a few small reads per tensor, cheap for an 8B model, and a tensor
scaled or replaced shows where the header alone would not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, Optional, Union

from ..errors import LoadError
from .config_checks import MAX_HEADER

# A model folder's files (what is fetched from the hub): no other weights formats, no docs.
MODEL_FILES = ["config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
               "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "*.jinja"]
TENSOR_SAMPLE = 64  # bytes hashed at each of three places of every tensor


def model_parts(model_path: Union[str, Path], adapter_path: Optional[Union[str, Path]] = None) -> Dict[str, str]:
    """A hash per file of the model (by its name in the folder; an adapter's as ``adapters/NAME``)."""
    folder = Path(model_path)
    names = sorted({f for pattern in MODEL_FILES + ["*.safetensors"] for f in folder.glob(pattern) if f.is_file()})
    parts = {f.name: file_digest(f) for f in names}
    if adapter_path is not None:
        adapters = Path(adapter_path)
        for f in sorted(adapters.glob("*.json")) + sorted(adapters.glob("*.safetensors")):
            parts[f"adapters/{f.name}"] = file_digest(f)
    return parts


def file_digest(path: Path) -> str:
    """One file's hash: a safetensors file's size, header and samples of its tensors; another file whole."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            if path.suffix != ".safetensors":
                h.update(fh.read())
                return h.hexdigest()
            size = path.stat().st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = fh.read(min(n, MAX_HEADER))
            h.update(f"{size}|".encode() + header)
            try:
                tensors = json.loads(header)
                ranges = sorted(tuple(map(int, v["data_offsets"])) for k, v in tensors.items() if k != "__metadata__")
            except (ValueError, TypeError, KeyError, AttributeError):  # the loader's checks say what is wrong
                return h.hexdigest()
            for start, end in ranges:
                for at in (start, (start + end) // 2, end - TENSOR_SAMPLE):
                    fh.seek(8 + n + max(start, at))
                    h.update(fh.read(max(0, min(TENSOR_SAMPLE, end - max(start, at)))))
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e.strerror or e}") from None
    return h.hexdigest()
