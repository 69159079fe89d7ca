"""MLX's CPU kernels built in a fraction of the time, the first time (Linux, the CPU backend).

MLX's CPU backend fuses a compiled function's elementwise ops into one C++
kernel, which it builds with ``g++`` the first time it meets it and keeps in
``<tmp>/mlx/<version>/cpu`` for every later process. Each build parses MLX's
kernel preamble (``mlx/backend/cpu/compiled_preamble.h``): ~1.3 CPU-s a
kernel here, most of it that header. The demo's first ``generate`` on a fresh
machine built 29 kernels: 30 s, against 3.4 s once they were built (and the
test suite ~200 of them).

g++ reads a precompiled header (``.gch``) in place of a header it would find
first beside the file it compiles, which is where MLX's kernel sources look
for the preamble first. :func:`prepare` builds one there, once per machine and
MLX version (~2 CPU-s, ~50 MB), with the compiler flags MLX's library
builds its kernels with (read from it), and a kernel
then builds in ~0.25 s. A precompiled header g++ finds unusable (another
compiler, other flags: a later MLX) is passed over, and the kernels build as
before: nothing else changes. Where g++ fails to build it (a full disk), a
``.failed`` file beside it says so, and later loads do not try again.
``REFUSION_MLX_KERNEL_HEADER=off`` leaves it out.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ENV = "REFUSION_MLX_KERNEL_HEADER"
PREAMBLE = "mlx/backend/cpu/compiled_preamble.h"
# MLX's command for a kernel (JitCompiler::build_command), as its library spells it: a precompiled header
# must be built with its flags; an MLX that spells it otherwise gets none (no guessing)
COMMAND = re.compile(rb'g\+\+ ((?:-[A-Za-z0-9+=_.]+ )+)-shared \{\} "\{\}" -o "\{\}"')
STALE_LOCK = 300.0  # seconds after which another process's unfinished build is taken as dead


def kernel_dir() -> Path:
    """Where MLX writes its CPU kernels: std::filesystem::temp_directory_path()'s choice, then mlx/<version>/cpu."""
    import mlx.core as mx

    tmp = next((os.environ[k] for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(k)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "cpu"


@functools.lru_cache(maxsize=1)
def mlx_flags() -> Optional[tuple]:
    """The flags MLX builds its CPU kernels with, read from its library once (None: not found)."""
    import mlx.core as mx

    for library in sorted(Path(mx.__file__).parent.glob("lib/libmlx*.so*")):
        try:
            found = COMMAND.search(library.read_bytes())
        except OSError:
            continue
        if found:
            return tuple(found.group(1).decode().split())
    return None


def include_dir() -> Path:
    import mlx.core as mx

    return Path(mx.__file__).parent / "include"


def header_path() -> Path:
    return kernel_dir() / (PREAMBLE + ".gch")


def prepare() -> Optional[Path]:
    """The precompiled preamble, built now if this machine has none for this MLX (None: not here: off, not
    Linux, not the CPU, no g++, another process building it, or g++ refused)."""
    import mlx.core as mx

    choice = os.environ.get(ENV, "").strip().lower()
    if choice not in ("", "auto", "off"):  # a typo is said, and changes nothing
        print(f"warning: {ENV}={os.environ[ENV]!r} is not a setting (off, or unset): left out", file=sys.stderr)
        return None
    if sys.platform != "linux" or choice == "off" or mx.default_device() != mx.cpu:
        return None
    target = header_path()
    if target.is_file():
        return target
    failed = target.with_name(target.name + ".failed")  # g++ refused it here once: not again at every load
    if failed.exists():
        return None
    compiler, preamble = shutil.which("g++"), include_dir() / PREAMBLE
    flags = mlx_flags() if compiler is not None and preamble.is_file() else None
    if flags is None:
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(target.with_name(target.name + ".lock"))
    except OSError:
        return None
    if lock is None:
        return None
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        done = subprocess.run([compiler, *flags, "-x", "c++-header", str(preamble), "-I", str(include_dir()),
                               "-o", str(part)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=600)
        if done.returncode != 0:
            failed.touch()
            return None
        os.replace(part, target)  # whole or not there: a reader never sees half of it
        return target
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        for path in (part, lock):
            try:
                path.unlink()
            except OSError:
                pass


def _lock(path: Path) -> Optional[Path]:
    """``path`` made by this process alone (another's build is under way: None), taken over when stale."""
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < STALE_LOCK:
                    return None
                path.unlink()
            except FileNotFoundError:
                pass
    return None
