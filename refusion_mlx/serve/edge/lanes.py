"""The HTTP side's tokenizers, in two lanes, so that no request's prompt
holds another's: the templates, tokenizing and constraint compilation a
request needs run on a worker thread, in the lane its body's size picks.

A request body over :data:`LARGE_BODY` bytes goes to the large lane: one
tokenizer and one worker thread at a time, the others waiting on the event
loop (not in a thread of the pool, which a flood of them would empty). Any
smaller body goes to the small lane, with its own tokenizer. A megabyte of
prompt takes about a second to tokenize; thirty of them, sent at once,
used to hold a one-line request behind them for 37 s. What a request renders
besides its body (a Responses follow-up's stored conversation) counts as
body (:func:`weigh`): a 70-byte follow-up of 4 MiB of turns held the small
lane for 10 s.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, TypeVar

import anyio

from ..core.refusal import Reason, Refusal

LARGE_BODY = 64 << 10  # bytes of request body from which a request takes the large lane
BODY_BYTES = "refusion.body_bytes"  # the scope key where RequestGuard leaves a body's size

T = TypeVar("T")
_current = threading.local()  # the lane of the request this worker thread runs


def weigh(scope: dict, nbytes: int) -> None:
    """Count ``nbytes`` more of the request's work toward its lane: what it renders beyond its body."""
    scope[BODY_BYTES] = scope.get(BODY_BYTES, 0) + nbytes


class Lane:
    """A tokenizer, the lock that keeps it to one thread, and how many worker threads the lane may hold."""

    def __init__(self, tokenizer: Any, threads: Optional[int]):
        self.tokenizer, self.lock, self.threads = tokenizer, threading.Lock(), threads
        self._limiter = None

    def limiter(self):
        """anyio's limiter of the lane's threads (made in the event loop: None, the pool's own)."""
        if self.threads is not None and self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        return self._limiter


class Lanes:
    """The two lanes; ``stopping()``: whether the server is shutting down, when
    work that has not begun is refused (503) instead of held up for."""

    def __init__(self, small: Any, large: Any, stopping: Callable[[], bool] = lambda: False):
        self.small, self.large, self.stopping = Lane(small, None), Lane(large, 1), stopping

    def current(self) -> Lane:
        """The lane of the request this thread runs (the small one outside any)."""
        return getattr(_current, "lane", None) or self.small

    async def run(self, scope: dict, work: Callable[[], T]) -> T:
        """``work()`` on a worker thread, in the lane of the request's body size."""
        lane = self.large if scope.get(BODY_BYTES, 0) > LARGE_BODY else self.small

        def in_lane() -> T:
            if self.stopping():  # queued behind others while the server began to stop: no work for nobody
                raise Refusal(Reason.SHUTTING_DOWN, "the server is shutting down")
            _current.lane = lane
            try:
                return work()
            finally:
                _current.lane = None

        return await anyio.to_thread.run_sync(in_lane, limiter=lane.limiter())
