"""Where a conversion is written: a hidden sibling of the destination, renamed
into place only when complete, so no failure leaves a half-written model."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import RefusionError


def check_destination(dst: Path, force: bool) -> None:
    """Refuse an existing non-empty destination unless forced; never the home or root folder."""
    if dst.exists() and not force:
        if not dst.is_dir():
            raise RefusionError(f"{dst} exists and is a file; pass --force to replace it")
        if any(dst.iterdir()):
            raise RefusionError(f"{dst} exists and is not empty; pass --force to replace it")
    resolved = dst.resolve()
    if resolved in (Path.home().resolve(), Path(resolved.anchor)):
        raise RefusionError(f"refusing to write the model into {dst}")


def check_overlap(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents:
        raise RefusionError(f"--mlx-path {dst} would replace the source checkpoint {src}")


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
