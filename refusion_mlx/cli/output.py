"""The files a command writes (``--json``, ``--trace``): checked before the
work, so a bad path fails in a second and not after it; written whole, so a
reader never sees half of one.

A path is the user's: ``~`` is their home, a symbolic link is followed to
the file it names (the link stays a link), and a device, a pipe or a
process substitution (``/dev/stdout``, ``>(jq .)``) is written in place.
Nothing else on disk is touched: the temporary file has a name no one else
holds.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import Optional


def _stat(path: str) -> Optional[os.stat_result]:
    """What ``path`` names, through links; None if nothing (or a dangling link)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def check_writable(path: str) -> None:
    """An OSError (naming ``path``) unless it can be written; nothing on disk changes."""
    path = os.path.expanduser(path)
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if st is not None:
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    try:  # the one way to know a new file can be made there (a read-only file system, an ACL)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".refusion-probe-")
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    os.close(fd)
    os.remove(probe)


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``: a regular file through a temporary
    sibling renamed into place; anything else (a device, a pipe) directly. A
    failed write names ``path`` (a full disk's error names no file)."""
    path = os.path.expanduser(path)
    try:
        _write(path, text)
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, path) from None


def _write(path: str, text: str) -> None:
    st = _stat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    real = os.path.realpath(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real), prefix=f".{os.path.basename(real)}.", suffix=".tmp")
    except PermissionError:  # the file may be written but its folder not: in place, then
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask())
        os.replace(tmp, real)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
