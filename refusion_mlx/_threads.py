"""MLX streams of the threads that decode, freed when each thread ends.

MLX keeps streams (and the random generator's state) per thread. A thread
that ran MLX and ended without ``mx.clear_streams()`` leaves them to
interpreter exit, where destroying them aborts the process ("terminate
called without an active exception", exit status 134): a library user's
worker thread that called ``generate`` would take the process down at its
exit. ``clear_streams`` cannot be called while the thread goes on (its
default stream would be gone), so each thread that decodes holds a marker
in a ``threading.local``; CPython drops a thread's locals in that thread as
it ends, and the marker's ``__del__`` frees its streams there.
"""

from __future__ import annotations

import threading

_local = threading.local()


class _ThreadEnd:
    """Held by one thread only; collected as that thread ends, in it."""

    def __del__(self):
        free_streams()


def free_streams() -> None:
    """Free the calling thread's MLX streams, its work done (the thread must not use MLX after)."""
    try:
        import mlx.core as mx

        mx.synchronize()
        mx.clear_streams()
    except Exception:  # interpreter shutdown, or an MLX without clear_streams: nothing to free then
        pass


def free_streams_at_thread_end() -> None:
    """Call from code about to run MLX: a thread other than the main one frees its MLX streams as it ends."""
    if threading.current_thread() is not threading.main_thread() and getattr(_local, "end", None) is None:
        _local.end = _ThreadEnd()
