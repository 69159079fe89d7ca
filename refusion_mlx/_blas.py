"""An optimized BLAS under MLX's Linux CPU wheel.

The ``mlx-cpu`` wheel links the *reference* BLAS, which is ~50x slower than
OpenBLAS on matmuls. When the system has OpenBLAS (Debian/Ubuntu:
``apt-get install libopenblas0-pthread``), loading it with global symbol
visibility *before* ``mlx.core`` binds MLX's BLAS calls to it, as
``LD_PRELOAD`` would. Nothing happens on macOS (Accelerate, Metal).

Opt out with ``REFUSION_MLX_BLAS=bundled``; point ``REFUSION_MLX_BLAS`` at a
library file to use that one instead.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

ENV = "REFUSION_MLX_BLAS"
OPT_OUT = {"bundled", "reference", "off", "0", "none"}
CANDIDATES = [
    f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0"
    for arch in ("x86_64", "aarch64")
] + [
    f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0" for arch in ("x86_64", "aarch64")
] + ["/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0"]

preloaded: Optional[str] = None
_library: Optional[ctypes.CDLL] = None

# Below this hidden size the matmuls are so small that waking (and spinning)
# a second BLAS thread costs more than it saves: measured on the demo model
# (hidden 256: +20% tokens/s with one thread) and the 0.6B shape (hidden 1024:
# a 16-token forward takes 448 ms with two threads, 702 ms with one).
SMALL_HIDDEN = 512


def preload() -> Optional[str]:
    """Load an optimized BLAS ahead of mlx.core; return its path, or None."""
    global preloaded, _library
    choice = os.environ.get(ENV, "auto").strip()
    if sys.platform != "linux" or choice.lower() in OPT_OUT or "mlx.core" in sys.modules:
        return None
    paths = CANDIDATES if choice.lower() in ("", "auto", "1") else [choice]
    for path in paths:
        if os.path.exists(path):
            try:
                library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            preloaded, _library = path, library
            return path
    return None


# A forward carrying at least this many tokens (a batch of requests, a
# prompt chunk) has matmuls big enough for every core even on a small model:
# on the demo model, 96 rows of its MLP take 0.96 ms with one thread and
# 0.51 ms with two.
WIDE_ROWS = 64

_small_model = False
_threads: Optional[int] = None


def fit_threads(hidden_size: int) -> Optional[int]:
    """One BLAS thread for small models, unless the user chose a count.

    Returns the thread count set, or None when nothing was changed.
    """
    global _small_model, _threads
    _small_model = False
    if _library is None or "OPENBLAS_NUM_THREADS" in os.environ or hidden_size > SMALL_HIDDEN:
        return None
    setter = getattr(_library, "openblas_set_num_threads", None)
    if setter is None:
        return None
    setter(1)
    _small_model, _threads = True, 1
    return 1


def fit_rows(rows: int) -> Optional[int]:
    """For a small model (see ``fit_threads``): every core for a forward of
    ``WIDE_ROWS`` tokens or more, one thread below. Returns the count in
    force, or None when the thread count is not ours to set."""
    if not _small_model:
        return None
    return _set_threads((os.cpu_count() or 1) if rows >= WIDE_ROWS else 1)


def _set_threads(n: int) -> int:
    global _threads
    if n != _threads:
        _library.openblas_set_num_threads(n)
        _threads = n
    return n


def blas_in_use() -> str:
    """Which BLAS library this process has mapped (Linux), for benchmark output."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return "unknown"
    for needle, name in (("openblas", "OpenBLAS"), ("mkl", "MKL"), ("blis", "BLIS")):
        hits = sorted(p for p in libs if needle in os.path.basename(p).lower()
                      and "scipy_openblas" not in p)
        if hits:
            return f"{name} ({hits[0]})"
    return "reference BLAS bundled with mlx-cpu (slow: install OpenBLAS, see README)"
