"""A timeout on collectives, which MLX does not offer.

A rank whose peer died usually gets an error from the backend (the ring
closes its sockets); a link that goes silent (a cable pulled, a peer
stopped) leaves every collective waiting for ever. The watchdog is a daemon
thread: while it is armed, the code that runs collectives calls
:func:`pet` whenever it makes progress (each sharded layer as a forward is
built, each broadcast); if no pet comes for ``timeout`` seconds it writes
one line to standard error and ends the process with status 1.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator, Optional

ENV = "REFUSION_MLX_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0


def timeout_from_env() -> float:
    """Seconds a collective may wait (``REFUSION_MLX_COLLECTIVE_TIMEOUT``, default 120)."""
    raw = os.environ.get(ENV)
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from .group import DistributedError

        raise DistributedError(f"{ENV}={raw!r} must be a positive number of seconds")
    return value


class Watchdog:
    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        self._last = time.monotonic()
        self._armed = 0
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="refusion-watchdog", daemon=True)
            self._thread.start()

    def pet(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Collectives inside the block must make progress every ``timeout`` s."""
        with self._lock:
            self._armed += 1
        self.pet()
        try:
            yield
        finally:
            with self._lock:
                self._armed -= 1

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if self._armed and time.monotonic() - self._last > self.timeout:
                from .group import errors

                try:
                    errors().write(
                        f"error: rank {self.rank}: no progress from the other ranks for {self.timeout:g} s "
                        f"(a rank died or the link is down); stopping ({ENV} sets the limit)\n")
                    errors().flush()
                finally:
                    os._exit(1)


_watchdog: Optional[Watchdog] = None


def install(rank: int, timeout: Optional[float] = None) -> Watchdog:
    """The process's watchdog (started on first call)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(timeout_from_env() if timeout is None else timeout, rank)
        _watchdog.start()
    return _watchdog


def pet() -> None:
    """Progress: called by the sharded layers and the broadcasts (cheap; a
    no-op when no watchdog runs)."""
    w = _watchdog
    if w is not None:
        w._last = time.monotonic()


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Arm the watchdog for the block (nothing when none runs)."""
    if _watchdog is None:
        yield
        return
    with _watchdog.armed():
        yield
