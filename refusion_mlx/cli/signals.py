"""The commands' signal handlers: Ctrl-C and SIGTERM while a server runs in process
(:func:`raise_interrupt_once`), SIGHUP left alone under ``nohup`` (:func:`handle_unless_ignored`), and
the caller's handlers back after a command run in process (:func:`handlers_kept`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional


def handle_unless_ignored(sig: int, handler) -> Optional[object]:
    """Install ``handler`` for ``sig`` unless the signal is ignored: ``nohup`` starts a command with SIGHUP
    ignored, and it stays so (as for any Python program, and mlx-lm's). Returns the handler it replaced,
    to put back; None when it left the signal alone."""
    if signal.getsignal(sig) is signal.SIG_IGN:
        return None
    return signal.signal(sig, handler)


def raise_interrupt_once(signum, frame) -> None:
    """A signal handler: the first Ctrl-C (or SIGTERM) raises KeyboardInterrupt, and a second ends the
    process at once, by the signal. The shutdown the first began (a server's ``close``, which joins its
    engine thread) is never cut short by a second KeyboardInterrupt: MLX work left running into
    interpreter exit aborts the process ("terminate called without an active exception", exit 134)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt


@contextlib.contextmanager
def handlers_kept(*signals: int) -> Iterator[None]:
    """The handlers of ``signals`` before the block are back after it, whatever the block (or a handler it
    installed, as :func:`raise_interrupt_once` does) set: a command's ``main`` called in process (a library
    user, a test) leaves the caller's own. A no-op off the main thread, where none can be set."""
    before = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in before.items():
                if handler is not None:  # None: a handler Python did not install, left alone
                    signal.signal(sig, handler)


@contextlib.contextmanager
def interrupt_once() -> Iterator[None]:
    """Ctrl-C is :func:`raise_interrupt_once` inside the block (the commands that run a server in
    process); the handlers before it are back after it (SIGTERM's too, which a Ctrl-C changes). A no-op
    off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with handlers_kept(signal.SIGINT, signal.SIGTERM):
        signal.signal(signal.SIGINT, raise_interrupt_once)
        yield
