"""A command's start: until its flags are parsed (the imports of MLX and the
rest take a second), Ctrl-C ends it with "interrupted" and exit 130, not a
traceback from inside an import; :func:`started` hands Ctrl-C back to the
command (KeyboardInterrupt, which each command turns into the same line)."""

from __future__ import annotations

import signal
import sys


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
