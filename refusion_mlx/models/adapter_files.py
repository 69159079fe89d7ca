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
    written, then all renamed into place (a failed write leaves the folder as it was, in one line). The
    folder is made here, at the first save: a run that fails before it leaves none."""
    folder = make_adapter_folder(folder)
    path = folder / ADAPTER_FILE
    # renamed in the reverse of this order (ExitStack): the weights, their numbered copy, then the config,
    # as the trainer always wrote them (a rename failing midway, rare in one folder, is named below)
    files = ([(folder / ADAPTER_CONFIG, None)] if config is not None else []) + \
        ([(folder / numbered_adapter_file(iteration), weights)] if iteration is not None else []) + [(path, weights)]
    target = path
    try:
        with ExitStack() as renames:  # each file's rename waits for every write
            for target, arrays in files:
                if arrays is None:
                    tmp = folder / f".{target.name}.tmp-{os.getpid()}"
                    renames.enter_context(_replaced_atomically(target, tmp)).write_text(
                        json.dumps(config, indent=4) + "\n")
                else:
                    tmp = folder / f".{target.stem}.tmp-{os.getpid()}.safetensors"
                    mx.save_safetensors(str(renames.enter_context(_replaced_atomically(target, tmp))), arrays,
                                        metadata={"format": "mlx"})
    except (RuntimeError, OSError) as e:  # a rename's error names its file; a write's is the last begun
        failed = getattr(e, "filename2", None) or target
        raise RefusionError(f"cannot write {failed}: {getattr(e, 'strerror', None) or ' '.join(str(e).split())}") \
            from None
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
