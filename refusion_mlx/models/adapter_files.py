"""Writing an adapter folder as mlx-lm's trainer does: ``adapters.safetensors``,
its numbered copies and ``adapter_config.json``. Every file goes to a
temporary sibling first and is renamed into place once all of a save's files
are written, so a failed write (a full disk) leaves the folder as it was: its
old weights beside their own config, never new weights beside an old config.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional, Union

import mlx.core as mx

from ..errors import RefusionError
from .adapters import ADAPTER_CONFIG, ADAPTER_FILE


@contextmanager
def _replaced_atomically(path: Path, tmp: Path) -> Iterator[Path]:
    """``tmp`` to write, renamed onto ``path`` when the body completes (a
    reader never sees a half-written file; a crash leaves the old one);
    removed if anything fails."""
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json_atomic(data: dict, path: Union[str, Path]) -> Path:
    """Write a JSON file (indented, as mlx-lm's) via a temporary sibling renamed into place."""
    path = Path(path)
    try:
        with _replaced_atomically(path, path.parent / f".{path.name}.tmp-{os.getpid()}") as tmp:
            tmp.write_text(json.dumps(data, indent=4) + "\n")
    except OSError as e:
        raise RefusionError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def numbered_adapter_file(iteration: int) -> str:
    """The name of the numbered copy saved at ``iteration`` (``0000100_adapters.safetensors``)."""
    return f"{iteration:07d}_{ADAPTER_FILE}"


def save_adapters(weights: Dict[str, mx.array], folder: Union[str, Path], iteration: Optional[int] = None,
                  config: Optional[dict] = None) -> Path:
    """adapters.safetensors; with ``iteration`` its numbered copy, with ``config`` adapter_config.json: all
    written, then all renamed into place (a failed write leaves the folder as it was, in one line)."""
    folder = Path(folder)
    path = target = folder / ADAPTER_FILE
    weight_files = [path] + ([folder / numbered_adapter_file(iteration)] if iteration is not None else [])
    try:
        with ExitStack() as renames:  # each file's rename waits for the others' writes
            for target in weight_files:
                tmp = folder / f".{target.stem}.tmp-{os.getpid()}.safetensors"
                mx.save_safetensors(str(renames.enter_context(_replaced_atomically(target, tmp))), weights,
                                    metadata={"format": "mlx"})
            if config is not None:
                target = folder / ADAPTER_CONFIG
                tmp = renames.enter_context(_replaced_atomically(target, folder / f".{target.name}.tmp-{os.getpid()}"))
                tmp.write_text(json.dumps(config, indent=4) + "\n")
    except (RuntimeError, OSError) as e:
        raise RefusionError(f"cannot write {target}: {' '.join(str(e).split())}") from None
    return path


def make_adapter_folder(folder: Union[str, Path]) -> Path:
    """Create the adapter folder (and its parents) unless it exists."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RefusionError(f"cannot create the adapter folder {folder}: {e.strerror or e}") from None
    return folder


def write_adapter_config(config: dict, folder: Union[str, Path]) -> Path:
    """``adapter_config.json`` of ``folder`` (created if need be), atomically."""
    return write_json_atomic(config, make_adapter_folder(folder) / ADAPTER_CONFIG)
