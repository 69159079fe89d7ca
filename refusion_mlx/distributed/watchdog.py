"""A timeout on collectives, which MLX does not offer.

A rank whose peer died usually gets an error from the backend (the ring
closes its sockets); a link that goes silent (a cable pulled, a peer
stopped) leaves every collective waiting for ever. The watchdog is a daemon
thread: while it is armed, the code that runs collectives calls
:func:`pet` whenever it makes progress (each sharded layer as a forward is
built, each broadcast); if no pet comes for ``timeout`` seconds it writes
one line to standard error and ends the process with status 1. Once a stop
is asked (:func:`hurry`: the server closing, a signal from ``mlx.launch``
after another rank died) the limit is ``STOP_GRACE`` s: a collective that
lost its peer mid-evaluation waits for ever, and the stop would hang.

The collectives that wait for the other ranks to load the model
(:func:`loading`: one rank may be downloading it, another reading a slow
disk) have a limit of their own, ``REFUSION_MLX_LOAD_TIMEOUT`` (default an
hour), only there so that a rank that died or hangs while the others wait
ends them at last; a stop still ends them in ``STOP_GRACE`` s.

A rank that cannot go on ends by :func:`end` (the watchdog's timeout, the
server's engine when the backend says a peer is gone): what the command
registered with :func:`before_exit` (the server answering its open
requests) runs first, for at most ``LAST_WORDS`` s.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator, NoReturn, Optional

ENV = "REFUSION_MLX_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
LOAD_ENV = "REFUSION_MLX_LOAD_TIMEOUT"
DEFAULT_LOAD_TIMEOUT = 3600.0  # seconds a rank waits for the others to download and read the model
STOP_GRACE = 5.0  # seconds without progress once a stop is asked (a healthy step ends well within)
LAST_WORDS = 10.0  # seconds what before_exit registered may take before an ending rank exits


def timeout_from_env(name: str = ENV, default: float = DEFAULT_TIMEOUT) -> float:
    """Seconds a collective may wait (``REFUSION_MLX_COLLECTIVE_TIMEOUT``, default 120; or ``name``'s)."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from .group import DistributedError

        raise DistributedError(f"{name}={raw!r} must be a positive number of seconds")
    return value


class Watchdog:
    def __init__(self, timeout: float, rank: int, load_timeout: float = DEFAULT_LOAD_TIMEOUT):
        self.timeout, self.rank, self.load_timeout = timeout, rank, load_timeout
        self._last = time.monotonic()
        self._armed = 0
        self._loading = 0  # blocks waiting on the other ranks' loading: load_timeout
        self.stopping = False  # hurried: a stop was asked
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="refusion-watchdog", daemon=True)
            self._thread.start()

    def pet(self) -> None:
        self._last = time.monotonic()

    def hurry(self, seconds: float) -> None:
        """A stop was asked: ``seconds`` from now without progress end the process."""
        if not self.stopping:
            self.stopping = True
            self.timeout = min(self.timeout, seconds)
            self.pet()

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

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """``load_timeout`` inside the block (until a stop); the clock starts again after it."""
        with self._lock:
            self._loading += 1
        try:
            yield
        finally:
            with self._lock:
                self._loading -= 1
            self.pet()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            loading = bool(self._loading) and not self.stopping
            limit = self.load_timeout if loading else self.timeout
            if self._armed and time.monotonic() - self._last > limit:
                from .group import errors

                waited = (f"{limit:g} s" + (" after the stop" if self.stopping else "")
                          + (" while they load the model" if loading else ""))
                tail = "" if self.stopping else f"; stopping ({LOAD_ENV if loading else ENV} sets the limit)"
                try:
                    errors().write(f"error: rank {self.rank}: no progress from the other ranks for {waited} "
                                   f"(a rank died or the link is down){tail}\n")
                    errors().flush()
                finally:
                    end()


_watchdog: Optional[Watchdog] = None
_before_exit: Optional[Callable[[], object]] = None


def before_exit(fn: Optional[Callable[[], object]]) -> None:
    """``fn`` runs when this rank ends (:func:`end`), before it exits (None: nothing runs)."""
    global _before_exit
    _before_exit = fn


def end() -> NoReturn:
    """End this rank's process with status 1, its one line said. What
    :func:`before_exit` registered runs first, on a thread of its own for at
    most ``LAST_WORDS`` s (it may wait on a lock a collective that never ends
    holds); MLX is not torn down (a collective left waiting would hang that)."""
    fn = _before_exit
    if fn is not None:
        last = threading.Thread(target=fn, name="refusion-last-words", daemon=True)
        last.start()
        last.join(LAST_WORDS)
    os._exit(1)


def install(rank: int, timeout: Optional[float] = None) -> Watchdog:
    """The process's watchdog (started on first call)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(timeout_from_env() if timeout is None else timeout, rank,
                             timeout_from_env(LOAD_ENV, DEFAULT_LOAD_TIMEOUT))
        _watchdog.start()
    return _watchdog


def pet() -> None:
    """Progress: called by the sharded layers and the broadcasts (cheap; a
    no-op when no watchdog runs)."""
    w = _watchdog
    if w is not None:
        w._last = time.monotonic()


def hurry(seconds: float = STOP_GRACE) -> None:
    """A stop was asked: a collective that makes no progress for ``seconds``
    more ends the process with its one line, instead of the stop waiting for
    it for ever (a no-op when no watchdog runs)."""
    w = _watchdog
    if w is not None:
        w.hurry(seconds)


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Arm the watchdog for the block (nothing when none runs)."""
    if _watchdog is None:
        yield
        return
    with _watchdog.armed():
        yield


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Collectives inside the block wait for the other ranks to load the model
    (a download, a slow disk): ``REFUSION_MLX_LOAD_TIMEOUT`` is their limit."""
    if _watchdog is None:
        yield
        return
    with _watchdog.loading():
        yield
