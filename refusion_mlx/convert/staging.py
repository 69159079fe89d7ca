"""Where a conversion (or a fuse) is written: a hidden sibling of the
destination, renamed into place only when complete, so no failure leaves a
half-written model; and the files every written model folder shares (the
shard index, the tokenizer's files).

Replacing a folder (``--force``) is two renames: the old folder aside
(``.NAME.replaced-PID``), the new one into place. SIGINT, SIGTERM and SIGHUP
wait until both are done and the old folder is removed, so a signal never
leaves the destination missing; a SIGKILL between them is undone by the next
run, which puts the old folder back."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

NAME_MAX = 255  # bytes of a file name (Linux, macOS)
PID_DIGITS = 10  # the most a pid takes in a name
DEFERRED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
_PUBLISHED: Dict[Path, Tuple[int, int]] = {}  # destination -> (device, inode) of the config.json published there

from ..errors import RefusionError


def destination(path: Union[str, Path]) -> Path:
    """Where a conversion to ``path`` writes, decided once: absolute, the folders above it
    resolved (a link among them followed), its own name as given (``.`` and ``..``: the
    folder they name), so the staging folder and the renames all act on the same place."""
    try:
        p = Path(path).expanduser().absolute()
    except RuntimeError as e:  # ~user with no such user
        raise RefusionError(f"{path}: {e}") from None
    return p.resolve() if p.name in ("", "..") else p.parent.resolve() / p.name


def check_destination(path: Union[str, Path], force: bool) -> Path:
    """The ``destination`` of ``path``, checked: an existing non-empty one
    refused unless forced, and even forced anything but a model folder (a
    file, a folder without config.json: data, say); never a symbolic link
    (renamed into place, the model would replace the link, not fill the folder
    it names), the current folder or one holding it, the home or root folder.
    One that cannot be checked (a folder above it that cannot be entered, a
    name too long) is refused in one line too."""
    try:
        dst = destination(path)
        _check_destination(dst, force)
    except OSError as e:
        raise RefusionError(f"cannot check the destination {path}: {e.strerror or e}") from None
    return dst


def _check_destination(dst: Path, force: bool) -> None:
    if dst.is_symlink():
        raise RefusionError(f"{dst} is a symbolic link (to {os.readlink(dst)}); give the folder it points to, "
                            "or a new path")
    cwd = Path.cwd()
    if dst == cwd:
        raise RefusionError(f"{dst} is the current folder, which the model would replace; give a new path, "
                            f"such as {dst / 'model'}")
    if dst in cwd.parents:
        raise RefusionError(f"{dst} holds the current folder, which replacing it would remove; give another path")
    above = next((p for p in dst.parents if p.exists() or p.is_symlink()), None)
    if above is not None and not above.is_dir():
        raise RefusionError(f"{dst}: {above} is a file, not a folder")
    # the folder is built beside dst and renamed into place: refused now, not once the model is written
    if dst.is_dir() and os.path.ismount(dst):
        raise RefusionError(f"{dst} is a mount point, and the model is written beside it then renamed into "
                            f"place; give a folder inside it ({dst / 'model'})")
    if above is not None and not os.access(above, os.W_OK | os.X_OK):
        raise RefusionError(f"{dst}: {above} is not writable (the model is written beside {dst.name}, "
                            "then renamed into place)")
    recover_stale(dst)
    if dst.exists() and not dst.is_dir():
        raise RefusionError(f"{dst} exists and is a file" + ("; --force replaces only a model folder" if force
                                                             else "; give a folder's path"))
    if dst.exists() and any(dst.iterdir()):
        if not force:
            raise RefusionError(f"{dst} exists and is not empty; pass --force (Python: force=True) to replace it")
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
    recover_stale(dst)
    tmp = sibling(dst, "partial", os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _PUBLISHED.pop(dst, None)
    try:
        yield tmp
        publish(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once published
        raise


def recover_stale(dst: Path) -> None:
    """Undo what a converter that was killed (SIGKILL cannot be caught) left
    beside ``dst``: a destination it had moved aside is put back if nothing
    took its place (else removed), a staging folder is removed."""
    for kind in ("replaced", "partial"):
        for p, pid in siblings(dst, kind):
            if pid_alive(pid):
                continue
            if kind == "replaced" and not (dst.exists() or dst.is_symlink()):
                os.rename(p, dst)
                print(f"[INFO] {dst}: put back as it was (a conversion killed while replacing it had "
                      f"moved it to {p.name})", file=sys.stderr)
            else:
                remove_path(p)


def sibling(dst: Path, kind: str, pid: int) -> Path:
    """The hidden folder beside ``dst`` of the conversion ``pid``: its staging folder
    (``partial``) or the old destination it moved aside (``replaced``)."""
    return dst.parent / f"{_sibling_prefix(dst, kind)}{pid}"


def _sibling_prefix(dst: Path, kind: str) -> str:
    """``.NAME.KIND-``; where that and a pid would not fit in a file name
    (:data:`NAME_MAX` bytes), NAME cut short and a hash of the whole of it."""
    prefix = f".{dst.name}.{kind}-"
    if len(os.fsencode(prefix)) + PID_DIGITS <= NAME_MAX:
        return prefix
    digest = hashlib.sha256(os.fsencode(dst.name)).hexdigest()[:16]
    stem = dst.name
    while len(os.fsencode(f".{stem}~{digest}.{kind}-")) + PID_DIGITS > NAME_MAX:
        stem = stem[:-1]
    return f".{stem}~{digest}.{kind}-"


def siblings(dst: Path, kind: str) -> List[Tuple[Path, int]]:
    """Every ``sibling(dst, kind, pid)`` there is, with its pid: names compared exactly
    (a glob would take ``[`` or ``*`` in the name for a pattern)."""
    prefix = _sibling_prefix(dst, kind)
    try:
        names = sorted(os.listdir(dst.parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    pids = [(name, name[len(prefix):]) for name in names if name.startswith(prefix)]
    return [(dst.parent / name, int(pid)) for name, pid in pids if pid.isascii() and pid.isdigit()]


def remove_path(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP are held for the duration and delivered
    (to the handlers they had) at its end. Only the main thread takes Python
    signals; elsewhere none can interrupt the body."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {}
    for sig in DEFERRED_SIGNALS:
        if signal.getsignal(sig) is not None:  # None: a handler Python did not install, left alone
            previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


def publish(tmp: Path, dst: Path, force: bool) -> None:
    """Rename into place; a replaced destination is moved aside first, then
    removed, with signals held until the destination is whole again."""
    with signals_deferred():
        if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
            dst.rmdir()
        if not (dst.exists() or dst.is_symlink()):
            os.rename(tmp, dst)
            _PUBLISHED[dst] = _identity(dst / "config.json")
            return
        if not force:
            raise RefusionError(f"{dst} appeared during the conversion; pass --force (Python: force=True) to "
                                "replace it")
        old = sibling(dst, "replaced", os.getpid())
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(old, dst)
            raise
        _PUBLISHED[dst] = _identity(dst / "config.json")
        remove_path(old)


def outcome(path: Union[str, Path]) -> str:
    """What a conversion to ``path`` that failed or was interrupted left there,
    in words: the new model when it had been published, else the destination as it was."""
    try:
        dst = destination(path)
    except (OSError, RefusionError):  # it could not be checked, so it was never replaced
        return f"{path} left as it was"
    published = _PUBLISHED.get(dst)
    if published is not None and _identity(dst / "config.json") == published:
        return f"{dst} holds the new model (it was complete)"
    aside = sibling(dst, "replaced", os.getpid())
    if not os.path.lexists(dst) and os.path.lexists(aside):  # (lexists: False where they cannot be seen)
        return f"{dst} is missing: its old folder is {aside}, rename it back"
    return f"{dst} left as it was"


def _identity(p: Path) -> Optional[Tuple[int, int]]:
    try:
        st = os.lstat(p)
    except OSError:
        return None
    return st.st_dev, st.st_ino
