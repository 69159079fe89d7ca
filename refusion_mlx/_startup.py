"""A command's start: until its flags are parsed (the imports of MLX and the
rest take a second), Ctrl-C ends it with "interrupted" and exit 130, not a
traceback from inside an import; :func:`started` hands Ctrl-C back to the
command (KeyboardInterrupt, which each command turns into the same line).
A command starts as ``python -m refusion_mlx.<command>`` or as its console
script (``refusion-<command>``, pyproject.toml's ``[project.scripts]``)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

# the console scripts pip installs (pyproject.toml's [project.scripts]): refusion-<command>
SCRIPTS = ("refusion-generate", "refusion-convert", "refusion-chat", "refusion-server", "refusion-bench",
           "refusion-train", "refusion-fuse")


def console_script() -> Optional[str]:
    """The name of the console script this process runs (``refusion-chat``), or None: its ``argv[0]`` is
    the script's path (on Windows with ``.exe`` or ``-script.py`` until pip's launcher takes them off)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and isinstance(sys.argv[0], str) else ""
    for suffix in (".exe", "-script.pyw", "-script.py"):
        name = name.removesuffix(suffix)
    return name if name in SCRIPTS else None


def starting() -> bool:
    """Whether the process is a command that is starting: ``python -m`` imports the package (its
    ``argv[0]`` is ``-m`` until the module runs), or a console script does."""
    return sys.argv[:1] == ["-m"] or console_script() is not None


def _interrupted(signum, frame):
    print("interrupted", file=sys.stderr)
    raise SystemExit(130)


def quiet_interrupts() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)


def started() -> None:
    """The command runs: Ctrl-C is KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
