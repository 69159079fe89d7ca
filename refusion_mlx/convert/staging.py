"""Where a conversion (or a fuse) is written: a hidden sibling of the
destination, renamed into place only when complete, so no failure leaves a
half-written model; and the files every written model folder shares (the
shard index, the tokenizer's files)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import RefusionError


def check_destination(dst: Path, force: bool) -> None:
    """Refuse an existing non-empty destination unless forced, and even
    forced anything but a model folder (a file, a folder without
    config.json: data, say); never the home or root folder."""
    if dst.exists() and not dst.is_dir():
        raise RefusionError(f"{dst} exists and is a file" + ("; --force replaces only a model folder" if force
                                                             else "; give a folder's path"))
    if dst.exists() and any(dst.iterdir()):
        if not force:
            raise RefusionError(f"{dst} exists and is not empty; pass --force to replace it")
        if not (dst / "config.json").is_file():
            raise RefusionError(f"{dst} is not a model folder (no config.json): --force replaces only a "
                                "model folder; remove it yourself or give another path")
    resolved = dst.resolve()
    if resolved in (Path.home().resolve(), Path(resolved.anchor)):
        raise RefusionError(f"refusing to write the model into {dst}")


def check_overlap(src: Path, dst: Path, message: str, nested: bool = False) -> None:
    """Refuse a destination that is ``src`` or holds it (publishing would
    replace it); with ``nested``, one inside ``src`` too. ``message`` names
    both, with ``{src}`` and ``{dst}``."""
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents or (nested and s in d.parents):
        raise RefusionError(message.format(src=src, dst=dst))


def copy_side_files(src: Path, folder: Path, names) -> None:
    """Copy the files ``names`` (tokenizer, generation config) and any chat
    templates (``*.jinja``) that ``src`` has into ``folder``."""
    for name in list(names) + [p.name for p in src.glob("*.jinja")]:
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)


def write_index(folder: Path, weight_map: dict, metadata: dict) -> None:
    """``model.safetensors.index.json``: which shard holds each tensor."""
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


@contextmanager
def staging_folder(dst: Path, force: bool) -> Iterator[Path]:
    """A hidden sibling of ``dst`` that becomes ``dst`` only if the body completes."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(dst)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        publish(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_staging(dst: Path) -> None:
    """Folders left by a converter that was killed (SIGKILL cannot be caught)."""
    for p in dst.parent.glob(f".{dst.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish(tmp: Path, dst: Path, force: bool) -> None:
    """Rename into place; a replaced destination is moved aside first, then removed."""
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    if dst.exists() or dst.is_symlink():
        if not force:
            raise RefusionError(f"{dst} appeared during the conversion; pass --force to replace it")
        old = dst.parent / f".{dst.name}.replaced-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
        return
    os.rename(tmp, dst)
