"""Large buffers kept by the C allocator under MLX's Linux CPU backend.

On Linux, MLX's CPU backend allocates every array with plain ``malloc`` (it
has no buffer cache there, unlike Metal's). glibc serves a request above its
mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it on
``free``, and gives the free top of its heaps back to the system: each op on
a large array then touches new pages, a page fault per 4 KiB. A long prompt's
attention scores are such arrays (a 512-token chunk over 12k keys: 100 MB a
layer): adding 1 to 16M floats took 85 ms, 13 of them arithmetic, and a
6,000-token prefill of the demo model 12.3 s against 6.5 s with the buffers
kept (docs/benchmarks.md).

:func:`keep_buffers` has glibc serve every request from its heaps (no
``mmap`` per buffer) and give back only a free top over 1 GiB, so a freed
buffer is reused as Metal's cache would reuse it. The price: up to 1 GiB of
freed memory a process keeps mapped after a peak (a server's engine gives it
back once idle: ``serve/core/memory.py``'s ``HeapTrim``). Left alone where the user
set glibc's malloc tunables (``GLIBC_TUNABLES`` or ``MALLOC_*_``), outside
Linux, on a C library without ``mallopt`` (musl), or with
``REFUSION_MLX_MALLOC=system``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

ENV = "REFUSION_MLX_MALLOC"
# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_TOP = 1 << 30  # the free top of a heap kept mapped, in bytes

_done: Optional[bool] = None


def user_tuned() -> bool:
    """Whether the environment sets glibc's malloc (its tunables, or the older ``MALLOC_*_`` variables)."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ)


def keep_buffers() -> bool:
    """Tune glibc's malloc as the module says, once per process; whether it is tuned so."""
    global _done
    if _done is None:
        _done = _tune()
    return _done


def _tune() -> bool:
    choice = os.environ.get(ENV, "").strip().lower()
    if choice not in ("", "auto", "system"):  # a typo is said once, and changes nothing
        print(f"warning: {ENV}={os.environ[ENV]!r} is not a setting (system, or unset): glibc's malloc left "
              "as it is", file=sys.stderr)
        return False
    if sys.platform != "linux" or choice == "system" or user_tuned():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_TOP))
