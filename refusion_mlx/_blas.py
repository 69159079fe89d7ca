"""An optimized BLAS under MLX's Linux CPU wheel.

The ``mlx[cpu]`` wheel links the *reference* BLAS, ~30x slower on matmuls.
Loading an optimized library with global symbol visibility *before*
``mlx.core`` binds MLX's ``cblas_*`` calls to it, as ``LD_PRELOAD`` would.
The first that loads, in this order:

1. ``REFUSION_MLX_BLAS``: a library file; or ``bundled`` (also
   ``reference``, ``off``, ``0``, ``none``) to keep the reference BLAS;
2. a system OpenBLAS (Debian/Ubuntu: ``apt-get install
   libopenblas0-pthread``), first as the library the project was measured
   with before MKL;
3. MKL from the Python environment (``libmkl_rt``, which the ``mkl`` wheel,
   a dependency on Linux x86_64, installs into ``<prefix>/lib``).

Python opens ``mlx.core`` with ``RTLD_NOW``: once it is imported, MLX's calls
are bound for good. ``import refusion_mlx`` preloads first thing; where a
program imports ``mlx.core`` (or ``mlx_lm``) first, the start-up hook pip
installs with the package (``_refusion_mlx_blas.py``, run from a ``.pth`` file)
imports ``refusion_mlx`` just before. Without either (``python -S``), the
first model load says so in one line (``warn_once``).

Nothing happens on macOS (Accelerate, Metal).
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from typing import Callable, List, Optional

ENV = "REFUSION_MLX_BLAS"
OPT_OUT = {"bundled", "reference", "off", "0", "none"}
CANDIDATES = [f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0" for arch in ("x86_64", "aarch64")] + [
    f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0" for arch in ("x86_64", "aarch64")
] + ["/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0"]

# MKL's threading layers (MKL_Set_Threading_Layer). INTEL (libiomp5, which
# the intel-openmp wheel installs beside libmkl_rt) and GNU (the system's
# libgomp) are equally fast on an idle machine, but with other jobs on the
# cores GNU's spinning workers collapse (a 2-thread 0.6B-shape forward:
# 1.1 s INTEL, 9.3 s GNU; docs/benchmarks.md). SEQUENTIAL needs no OpenMP.
MKL_LAYERS = {"INTEL": 0, "SEQUENTIAL": 1, "GNU": 3}

# The environment variables each library reads its thread count from: one
# that is set means the user chose, and refusion-mlx leaves the count alone.
USER_THREAD_VARS = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
}

preloaded: Optional[str] = None
_library: Optional[ctypes.CDLL] = None
mlx_first = False  # preload came after mlx.core: too late to bind MLX's calls
mkl_layer: Optional[str] = None  # the threading layer we chose for MKL, if we did

# Below this hidden size the matmuls are so small that waking (and spinning)
# a second BLAS thread costs more than it saves: measured on the demo model
# (hidden 256: +20% tokens/s with one thread) and the 0.6B shape (hidden 1024:
# a 16-token forward takes 448 ms with two threads, 702 ms with one; MKL:
# 388-409 ms and 485-511 ms).
SMALL_HIDDEN = 512


def library_roots() -> List[str]:
    """The ``lib`` folders a pip-installed MKL lands in: this environment's,
    the base interpreter's (a venv over it), the user scheme's (``--user``),
    and the prefix of each ``site-packages`` on ``sys.path`` (a venv's, under
    ``python -S``, which leaves ``sys.prefix`` at the base interpreter)."""
    roots = [sys.prefix, sys.base_prefix]
    try:
        import site

        roots.append(site.getuserbase())
    except Exception:  # site may be disabled (python -S)
        pass
    roots += [os.path.dirname(os.path.dirname(os.path.dirname(p))) for p in sys.path
              if os.path.basename(p) in ("site-packages", "dist-packages")]  # <prefix>/lib/pythonX.Y/...
    seen, out = set(), []
    for root in roots:
        lib = os.path.join(root, "lib")
        if root and lib not in seen:
            seen.add(lib)
            out.append(lib)
    return out


def mkl_candidates(roots: Optional[List[str]] = None) -> List[str]:
    """Every ``libmkl_rt.so*`` under ``roots``, newest soname first per root."""
    found = []
    for root in library_roots() if roots is None else roots:
        found += sorted(glob.glob(os.path.join(root, "libmkl_rt.so*")), reverse=True)
    return found


def candidates() -> List[str]:
    """Where ``preload`` looks, in order: system OpenBLAS, then MKL."""
    return CANDIDATES + mkl_candidates()


def preload() -> Optional[str]:
    """Load an optimized BLAS ahead of mlx.core; return its path, or None."""
    global preloaded, _library, mkl_layer, mlx_first
    choice = os.environ.get(ENV, "auto").strip()
    if sys.platform != "linux" or choice.lower() in OPT_OUT:
        return None
    if "mlx.core" in sys.modules:  # its symbols are bound (Python opens it RTLD_NOW)
        mlx_first = mlx_first or preloaded is None
        return None
    paths = candidates() if choice.lower() in ("", "auto", "1") else [choice]
    for path in paths:
        if os.path.exists(path):
            try:
                library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            preloaded, _library = path, library
            if _kind(library) == "mkl":
                mkl_layer = _choose_mkl_layer(library, path)
            return path
    return None


def _choose_mkl_layer(library, path: str) -> Optional[str]:
    """MKL's threading layer, chosen before its first call. A
    ``MKL_THREADING_LAYER`` the user set wins (a call would override it).

    INTEL needs libiomp5 (intel-openmp installs it beside libmkl_rt; MKL
    exits at its first call without it), loaded here with global visibility
    *before* any libgomp: MKL's threaded kernels resolve their ``omp_*`` calls
    to the first OpenMP runtime in the process, and torch (which transformers
    imports) loads libgomp globally. Left to load libiomp5 at its first call,
    after torch, MKL ran on two runtimes at once: a 2-thread matmul after a
    thread-count change came back wrong (max error 67 on 96x256 @ 256x768,
    tests/test_blas.py). Where libgomp is already loaded, or libiomp5 is
    missing: SEQUENTIAL. (torch's own OpenMP calls then run on libiomp5 too,
    as PyTorch's CPU tuning guide arranges with LD_PRELOAD.)"""
    if "MKL_THREADING_LAYER" in os.environ:
        return None
    setter = getattr(library, "MKL_Set_Threading_Layer", None)
    if setter is None:
        return None
    layer = "SEQUENTIAL"
    iomp = os.path.join(os.path.dirname(path), "libiomp5.so")
    if os.path.exists(iomp) and not any(os.path.basename(p).startswith("libgomp") for p in _mapped_libraries()):
        try:
            ctypes.CDLL(iomp, mode=ctypes.RTLD_GLOBAL)
            layer = "INTEL"
        except OSError:
            pass
    setter(MKL_LAYERS[layer])
    return layer


def _kind(library) -> Optional[str]:
    """'mkl' or 'openblas' by the symbols a library (or a stand-in) exports."""
    if library is None:
        return None
    if getattr(library, "MKL_Set_Num_Threads", None) is not None:
        return "mkl"
    if getattr(library, "openblas_set_num_threads", None) is not None:
        return "openblas"
    return None


def _thread_setter() -> Optional[Callable[[int], None]]:
    """The loaded library's global thread-count setter. (MKL's
    ``mkl_set_num_threads_local`` would not do: it binds the calling thread,
    and MLX calls BLAS from its own worker thread.)"""
    kind = _kind(_library)
    if kind == "mkl":
        return _library.MKL_Set_Num_Threads
    if kind == "openblas":
        return _library.openblas_set_num_threads
    return None


def user_chose_threads() -> bool:
    """Whether the user set the loaded library's thread count themselves."""
    return any(v in os.environ for v in USER_THREAD_VARS.get(_kind(_library), ()))


# A forward carrying at least this many tokens (a batch of requests, a
# prompt chunk) has matmuls big enough for every core even on a small model:
# on the demo model, 96 rows of its MLP take 0.96 ms with one thread and
# 0.51 ms with two.
WIDE_ROWS = 64

_small_model = False
_threads: Optional[int] = None
_before: Optional[int] = None  # the library's own count, read before the first one set here


def fit_threads(hidden_size: int) -> Optional[int]:
    """One BLAS thread for small models, unless the user chose a count; a larger model loaded after one
    gets the library's own count back (it kept the small model's last). Returns the thread count set, or
    None when nothing was changed."""
    global _small_model
    _small_model = False
    if _thread_setter() is None or user_chose_threads():
        return None
    if hidden_size > SMALL_HIDDEN:
        return None if _threads is None else _set_threads(_before or os.cpu_count() or 1)
    _small_model = True
    return _set_threads(1)


def small_model() -> bool:
    """Whether the loaded model runs with one BLAS thread (``fit_threads``)."""
    return _small_model


def fit_rows(rows: int, split: bool = False) -> Optional[int]:
    """For a small model (see ``fit_threads``): every core for a forward of
    ``WIDE_ROWS`` tokens or more, one thread below. Returns the count in
    force, or None when the thread count is not ours to set. ``split``: the
    pass runs as row groups on their own streams (``decode/runner.py: row_groups``),
    each with one thread."""
    if not _small_model:
        return None
    return _set_threads((os.cpu_count() or 1) if rows >= WIDE_ROWS and not split else 1)


def _set_threads(n: int) -> int:
    global _threads, _before
    if _threads is None:
        _before = threads()
    if n != _threads:
        _thread_setter()(n)
        _threads = n
    return n


def _mapped_libraries() -> List[str]:
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if ".so" in line})
    except OSError:
        return []


def _mapped_blas():
    """(kind, path) of the optimized BLAS in this process, or None: the one
    preloaded, else one mapped otherwise (``LD_PRELOAD``)."""
    kind = _kind(_library)
    if kind is not None:
        return kind, preloaded
    libs = _mapped_libraries()
    for needle, kind in (("libopenblas", "openblas"), ("libmkl_rt", "mkl"), ("libmkl_core", "mkl"),
                         ("blis", "blis")):
        hits = [p for p in libs if needle in os.path.basename(p).lower() and "scipy_openblas" not in p]
        if hits:
            return kind, hits[0]
    return None


def _symbol(name: str, path: Optional[str]):
    """A function of the BLAS in use: from our handle, else from the mapped
    library (one preloaded by someone else); None if it has no such symbol."""
    opened = [lambda: _library] if _library is not None else [lambda: ctypes.CDLL(path)]
    for handle in opened + [lambda: ctypes.CDLL(None)]:
        try:
            return getattr(handle(), name)
        except (AttributeError, OSError, TypeError):
            continue
    return None


def threads() -> Optional[int]:
    """The BLAS library's thread count, or None (reference BLAS, macOS)."""
    found = _mapped_blas()
    if found is None:
        return None
    kind, path = found
    name = {"mkl": "MKL_Get_Max_Threads", "openblas": "openblas_get_num_threads"}.get(kind)
    getter = _symbol(name, path) if name else None
    if getter is None:
        return None
    try:
        getter.restype = ctypes.c_int
        return int(getter())
    except Exception:  # a stand-in or an odd build: no count to report
        return None


def mkl_threads() -> Optional[int]:
    """MKL's thread count where the BLAS in use is MKL, else None (``cpu_paths.lay_out_linears``)."""
    found = _mapped_blas()
    return threads() if found is not None and found[0] == "mkl" else None


def _version(kind: str, path: Optional[str]) -> str:
    """'2026.2' for MKL, '0.3.21' for OpenBLAS, '' when the library won't say."""
    try:
        if kind == "mkl":
            get = _symbol("MKL_Get_Version_String", path)
            buf = ctypes.create_string_buffer(256)
            get(buf, len(buf))
            m = re.search(r"Version (\d+(?:\.\d+)*)", buf.value.decode(errors="replace"))
            return m.group(1) if m else ""
        if kind == "openblas":
            get = _symbol("openblas_get_config", path)
            get.restype = ctypes.c_char_p
            m = re.search(r"OpenBLAS (\S+)", get().decode(errors="replace"))
            return m.group(1) if m else ""
    except Exception:  # no such symbol in this build
        pass
    return ""


def _mkl_layer_in_use() -> Optional[str]:
    """The threading layer MKL loaded (known after its first call), else the
    one chosen for it. MKL may pick GNU by itself where libgomp is loaded."""
    for lib in _mapped_libraries():
        m = re.match(r"libmkl_(intel|gnu|tbb)_thread|libmkl_(sequential)", os.path.basename(lib))
        if m:
            return (m.group(1) or m.group(2)).upper()
    layer = mkl_layer or os.environ.get("MKL_THREADING_LAYER")
    return layer.upper() if layer else None


REFERENCE = "reference BLAS bundled with mlx-cpu (slow)"


def describe(full_path: bool = False) -> str:
    """The BLAS this process uses and its thread count, e.g.
    'MKL 2026.2 (libmkl_rt.so.3, INTEL threading, 2 threads)'."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    found = _mapped_blas()
    if found is None:
        return REFERENCE
    kind, path = found
    name = {"mkl": "MKL", "openblas": "OpenBLAS", "blis": "BLIS"}[kind]
    version = _version(kind, path)
    details = [path if full_path or not path else os.path.basename(path)]
    if kind == "mkl":
        layer = _mkl_layer_in_use()
        if layer:
            details.append(f"{layer} threading")
    n = threads()
    if n:
        details.append(f"{n} thread{'s' if n != 1 else ''}")
    return f"{name}{' ' + version if version else ''} ({', '.join(d for d in details if d)})"


def blas_in_use() -> str:
    """Which BLAS library this process has mapped, with its path and thread
    count, for benchmark output."""
    return describe(full_path=True)


def reference_warning() -> Optional[str]:
    """One line with the fix while MLX's CPU work runs on the reference BLAS
    (Linux), else None."""
    if sys.platform != "linux" or _mapped_blas() is not None:
        return None
    if "mlx.core" in sys.modules:
        try:
            import mlx.core as mx

            if mx.default_device() != mx.cpu:
                return None
        except Exception:
            pass
    if os.environ.get(ENV, "").strip().lower() in OPT_OUT:
        return f"slow reference BLAS in use ({ENV}={os.environ[ENV].strip()})"
    fix = "apt-get install libopenblas0-pthread"
    if os.uname().machine == "x86_64":  # the mkl wheel exists for x86_64 only
        fix = f"pip install mkl (or {fix})"
    if mlx_first and any(os.path.exists(p) for p in candidates()):
        fix = ("mlx.core was imported before refusion_mlx and the start-up hook that pip installs with "
               "refusion-mlx did not run (python -S?): import refusion_mlx first")
    return f"slow reference BLAS in use (~30x slower matmuls): {fix}"


_warned = False


def warn_once() -> Optional[str]:
    """Called where a model loads: the first time, one line on stderr while
    MLX's CPU work runs on the reference BLAS (Linux) and the user did not
    choose it (``REFUSION_MLX_BLAS``). Returns the line written, if any."""
    global _warned
    if _warned or os.environ.get(ENV, "").strip().lower() in OPT_OUT:
        return None
    _warned = True
    line = reference_warning()
    if line:
        print(f"WARNING: {line}", file=sys.stderr, flush=True)
    return line
