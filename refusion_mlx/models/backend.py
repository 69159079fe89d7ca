"""The one switch between the GPU paths and the CPU paths.

MLX runs the same graph on a Metal (or CUDA) GPU and on the CPU, but what is fast differs. Every choice of
the runtime between the paths asks this module, and nothing else, which side it is on, and so does every
question of the device's memory (:func:`device_memory`, :func:`memory_size`). Two choices follow MLX's
default device itself, as the paths do not change its kernels: training's dequantizing matmuls on the CPU
(``train.trainer``) and the slow-BLAS warning (``_blas``).

========================  ==================================  =====================================
choice                    GPU paths                           CPU paths
========================  ==================================  =====================================
RMSNorm                   ``mx.fast.rms_norm``                compiled ops (cpu_paths)
attention                 ``mx.fast`` fused kernel, or the    grouped-query matmuls, one softmax
                          unfused one where the backend       (cpu_paths.attend)
                          plans per shape
                          (:func:`fused_attention`), or fused
                          at a few padded shapes
                          (:func:`bucketed_attention`)
exp in SwiGLU, softmax,   MLX's own kernels                   one vectorised, compiled exp (float32;
LM-head log-sum-exp                                           kernels.exp)
Linear layers             ``nn.Linear`` (``x @ w.T``)         MKL on 2+ threads: ``(w @ x.T).T`` for
                                                              2+ rows; else w stored (in, out) at load,
                                                              multiplied through a transposed view
                                                              (cpu_paths.lay_out_linears)
layers of a decode pass   one graph, evaluated at the end     ``async_eval`` every L/8 layers
                          (``REFUSION_MLX_OVERLAP=on``: as     (decode/runner.py: overlap)
                          the CPU paths; :func:`overlaps`)
wide decode passes        one group of rows                   two row groups on two CPU streams
                                                              (small models; runner.row_groups)
LM head                   all head rows in one matmul while   chunks of ``probs.LOGITS_BUDGET_BYTES``
                          the logits fit 1/16 of the device's (32 MB of float32 logits)
                          memory (:func:`logits_budget`)
BLAS threads              untouched                           fitted to the model and the pass
                                                              (``_blas.fit_threads``; per step:
                                                              ``Runner.fit_threads``, a training
                                                              batch: ``trainer.to_mx``)
default dtype             the checkpoint's                    float32
wired memory              :func:`wired_limit` on Metal        nothing
========================  ==================================  =====================================

The mode is ``auto`` (the default: the GPU paths when ``mx.default_device()`` is the GPU, else the CPU
paths), ``gpu`` or ``cpu``, from the environment variable ``REFUSION_MLX_PATHS``, read on first use and
again whenever a model loads (:func:`mode`). Forcing ``gpu`` on a CPU runs the GPU paths on MLX's CPU
kernels -- slower, but how the tests check on a machine without a GPU that both sides decode the golden
cases token for token.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Hashable, Iterator, Optional, Tuple

import mlx.core as mx

from ..errors import RefusionError

ENV = "REFUSION_MLX_PATHS"
MODES = ("auto", "gpu", "cpu")
# How the GPU paths attend: MLX's fused kernel, the unfused matmuls, or as measured for the backend (fused_attention)
ATTENTION_ENV = "REFUSION_MLX_ATTENTION"
ATTENTION_MODES = ("auto", "fused", "unfused", "bucketed")

# Without a memory size from the device: the logits budget of the GPU paths.
FALLBACK_LOGITS_BUDGET_BYTES = 1 << 30
# The share of the device's memory the LM head's float32 logits may take.
LOGITS_MEMORY_FRACTION = 16


class PathsError(RefusionError):
    """REFUSION_MLX_PATHS names no mode."""


_UNREAD = object()
# the mode as last read: None (auto), True (gpu), False (cpu); _UNREAD: read it
_forced = _UNREAD


def _setting(env: str, modes) -> str:
    """The value of ``env``, one of ``modes`` (unset or empty: ``auto``); a
    one-line :class:`PathsError` for any other."""
    raw = os.environ.get(env)
    value = (raw or "auto").strip().lower()
    if value not in modes:
        raise PathsError(f"{env}={raw!r} is not a mode: use one of {', '.join(modes)}")
    return value


@contextlib.contextmanager
def setting(env: str, value: str) -> Iterator[None]:
    """``env`` (this module's ``ENV``, ``ATTENTION_ENV``, ``OVERLAP_ENV``, ``PAD_ENV``) set
    to ``value`` while the block runs, read at once and read again after it
    is restored (benchmarks that run under several settings)."""
    before = os.environ.get(env)
    os.environ[env] = value
    try:
        mode()
        yield
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
        mode()


def mode() -> str:
    """The mode asked for: ``auto``, ``gpu`` or ``cpu`` (unset or empty: ``auto``).

    Reads the environment again (loading a model does), and the hot paths
    follow what it read. Raises :class:`PathsError` (one line) for any
    other value."""
    global _forced
    value = _setting(ENV, MODES)
    _forced = None if value == "auto" else value == "gpu"
    attention_mode()
    overlap_mode()
    qmm_pad_mode()
    return value


def gpu_paths() -> bool:
    """True: take the GPU paths; False: the CPU paths. Cheap (the model asks
    it in every layer): the mode as last read by :func:`mode`."""
    forced = _forced
    if forced is _UNREAD:
        mode()
        forced = _forced
    if forced is None:
        return mx.default_device() == mx.gpu
    return forced


def cpu_paths() -> bool:
    """True: take the CPU paths (see the table above)."""
    return not gpu_paths()


class _Switch:
    """A setting from the environment, one of ``modes``: read again by
    :meth:`read` (and whenever :func:`mode` is, as a model load does;
    :class:`PathsError`, one line, for any other value), else as last read
    (:meth:`get`: cheap enough for the hot paths)."""

    def __init__(self, env: str, modes):
        self.env, self.modes, self.value = env, modes, _UNREAD

    def read(self) -> str:
        self.value = _setting(self.env, self.modes)
        return self.value

    def get(self) -> str:
        return self.value if self.value is not _UNREAD else self.read()


_ATTENTION = _Switch(ATTENTION_ENV, ATTENTION_MODES)


def attention_mode() -> str:
    """``REFUSION_MLX_ATTENTION``, read again (:class:`_Switch`)."""
    return _ATTENTION.read()


# Whether a decode pass starts computing its first layers while Python builds
# the rest: "auto" (the CPU paths only, as measured), "on" (the GPU paths too:
# a candidate for backends whose forward is bound by host work, measured by
# benchmarks/gpu_record.sh), "off"
OVERLAP_ENV = "REFUSION_MLX_OVERLAP"
OVERLAP_MODES = ("auto", "on", "off")


_OVERLAP = _Switch(OVERLAP_ENV, OVERLAP_MODES)


def overlap_mode() -> str:
    """``REFUSION_MLX_OVERLAP``, read again (:class:`_Switch`)."""
    return _OVERLAP.read()


def overlaps() -> bool:
    """Whether a decode pass is evaluated asynchronously every few layers
    while the rest is built (``decode/runner.py: overlap``): the CPU paths
    by default, the GPU paths with ``REFUSION_MLX_OVERLAP=on``, neither with
    ``off``. Cheap: the mode as last read."""
    value = _OVERLAP.get()
    return value == "on" or (value == "auto" and not gpu_paths())


# Rows from which MLX's CUDA quantized matmul reads each weight once (qmm_sm80, mlx/backend/cuda/quantized):
# under them its qmv streams the weights once per row. Measured on an H200 (benchmarks/records/
# nvidia-h200-2026-11-28.json, the 8B shape, 4-bit): 1 row 5.4 ms, 4 rows 17.2 ms, 8 rows 5.3 ms.
CUDA_QMM_ROWS = 8
PAD_ENV = "REFUSION_MLX_QMM_PAD"  # "auto" (default), "on" (pad wherever quantized), "off"
_PAD = _Switch(PAD_ENV, ("auto", "on", "off"))


def quantized_rows(rows: int) -> int:
    """The rows a quantized matmul of ``rows`` input rows runs with: on CUDA,
    2 to 7 rows are padded to :data:`CUDA_QMM_ROWS` (one read of the weights
    instead of one a row; the padding rows are zeros, sliced off); elsewhere
    (Metal's kernels: unmeasured here; the CPU) as given. ``REFUSION_MLX_QMM_PAD``:
    ``off`` never pads, ``on`` pads on every device (tests)."""
    return CUDA_QMM_ROWS if 2 <= rows < CUDA_QMM_ROWS and pads_quantized() else rows


def qmm_pad_mode() -> str:
    """``REFUSION_MLX_QMM_PAD``, read again (:class:`_Switch`)."""
    return _PAD.read()


def pads_quantized() -> bool:
    """Whether narrow quantized matmuls are padded here (:func:`quantized_rows`):
    the setting as last read."""
    value = _PAD.get()
    return value != "off" and (value == "on" or is_cuda())


def is_cuda() -> bool:
    """Whether MLX computes on its CUDA backend here."""
    return _is_cuda(str(mx.default_device()))


@functools.lru_cache(maxsize=None)
def _is_cuda(device: str) -> bool:
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except Exception:
        return False


def fused_attention(queries: int) -> bool:
    """Whether the GPU paths attend through ``mx.fast.scaled_dot_product_attention``
    for ``queries`` query rows (whatever the mask); else
    ``cpu_paths.unfused_attend``. The CPU paths never do
    (``cpu_paths.attend``).

    ``auto``: fused everywhere but on CUDA, where only one query row is.
    There MLX sends a fused call of several query rows to cuDNN, which
    builds a graph for every new shape of queries, keys and mask (and
    raises "Cache thrashing" after 512 of them in a process), and a ReFusion
    pass attends over a new number of keys every time: on the lent H200 a
    forward of 2-32 tokens of ReFusion-8B in bfloat16 took 61-99 ms fused
    against 14-39 ms unfused (a new cache length each pass; 16-19 ms fused
    where the length repeats). One query row takes MLX's vector kernel (or, with an
    array mask, its own unfused ops), which plans nothing and measured
    faster than ours (docs/benchmarks.md, "A wide forward on the H200").
    ``REFUSION_MLX_ATTENTION=fused|unfused`` forces either (benchmarks,
    tests); ``bucketed`` is auto's rule for a pass attended on its own, and
    :func:`bucketed_attention` for the padded passes."""
    if not gpu_paths():
        return False
    mode_ = _ATTENTION.get()
    if mode_ in ("fused", "unfused"):
        return mode_ == "fused"
    if not is_cuda():
        return True
    return queries == 1


def bucketed_attention(queries: int) -> bool:
    """Whether a pass of ``queries`` rows attends as a padded batch at
    bucketed shapes (``decode/packed.py``), fused where
    :func:`plans_shape` allows: ``REFUSION_MLX_ATTENTION=bucketed``, the
    GPU paths, two rows or more (one row takes MLX's vector kernel, which
    plans nothing). A backend that plans per exact shape (cuDNN on CUDA:
    one graph per shape of queries, keys and mask) then sees a few shapes
    over a whole decode instead of a new one every pass."""
    if queries < 2 or not gpu_paths():
        return False
    mode_ = _ATTENTION.get()
    return mode_ == "bucketed"


# Keys are read in lengths of KEY_STEP rows up to 2 * KEY_STEP, then at
# 2**k and 1.5 * 2**k (at most a third more rows than visible): about two
# shapes an octave of cache length.
KEY_STEP = 256


def key_bucket(rows: int) -> int:
    """The key length a bucketed pass that sees ``rows`` keys reads (the rest masked)."""
    if rows <= 2 * KEY_STEP:
        return max(1, -(-rows // KEY_STEP)) * KEY_STEP
    power = 1 << (rows - 1).bit_length()  # the power of two at or above rows
    return power * 3 // 4 if rows <= power * 3 // 4 else power


def row_bucket(rows: int) -> int:
    """The query rows a bucketed pass of ``rows`` rows is padded to: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


# MLX's CUDA backend keeps cuDNN's attention graphs in an LRU cache per thread
# (MLX_CUDA_SDPA_CACHE_SIZE, 256 by default) and raises "Cache thrashing" once
# it has missed twice its capacity in the life of the thread.
SDPA_CACHE_ENV = "MLX_CUDA_SDPA_CACHE_SIZE"
SDPA_CACHE_DEFAULT = 256
_planned = threading.local()


def plans_shape(key: Hashable) -> bool:
    """Whether a fused call of this bucketed shape may be made on this thread:
    a shape made before, or a new one while fewer than half of the SDPA
    cache's capacity have been made here (the other half is left to the
    graphs MLX makes for one-row decoding). So no graph is ever evicted, a
    thread misses at most that many times, and MLX's thrashing error cannot
    be reached; past it, new shapes attend unfused."""
    shapes = getattr(_planned, "shapes", None)
    if shapes is None:
        shapes = _planned.shapes = set()
    if key in shapes:
        return True
    try:
        capacity = int(os.environ.get(SDPA_CACHE_ENV) or SDPA_CACHE_DEFAULT)
    except ValueError:
        capacity = SDPA_CACHE_DEFAULT
    if len(shapes) >= capacity // 2:
        return False
    shapes.add(key)
    return True


def paths() -> str:
    """``"gpu"`` or ``"cpu"``: the paths in force (checks the mode)."""
    return "gpu" if gpu_paths() else "cpu"


# A device's memory as it reports it, the first found: Metal's recommended working set (what its GPU keeps), CUDA's.
_MEMORY_KEYS = (("max_recommended_working_set_size", "Metal's recommended working set"),
                ("memory_size", "the device's memory"), ("total_memory", "the device's memory"))


@functools.lru_cache(maxsize=None)
def _reported_memory(device: str) -> Optional[Tuple[int, str]]:
    try:
        info = mx.device_info()
    except Exception:
        return None
    return next(((info[k], what) for k, what in _MEMORY_KEYS if isinstance(info.get(k), int) and info[k] > 0), None)


def device_memory() -> Tuple[int, str]:
    """(bytes, what they are): the memory the default device's arrays may take, as the device reports
    it (Metal, CUDA: :data:`_MEMORY_KEYS`), else (the CPU) the host's physical memory."""
    return _reported_memory(str(mx.default_device())) or (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory")


def memory_size() -> Optional[int]:
    """The default device's memory in bytes (:func:`device_memory`) when it reports one (Metal, CUDA)."""
    return (_reported_memory(str(mx.default_device())) or (None,))[0]


def logits_budget() -> int:
    """Bytes of float32 logits the GPU paths' LM head may hold at once:
    1/16 of the device's memory, or 1 GiB when it reports none."""
    size = memory_size()
    return FALLBACK_LOGITS_BUDGET_BYTES if size is None else max(1, size // LOGITS_MEMORY_FRACTION)


def _is_metal() -> bool:
    try:
        return mx.default_device() == mx.gpu and mx.metal.is_available()
    except Exception:
        return False


def model_bytes(model) -> int:
    """Bytes of the model's parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array))


@contextlib.contextmanager
def wired_limit(model=None) -> Iterator[None]:
    """Keep the model's memory wired (resident) on Metal while the block runs.

    Sets ``mx.set_wired_limit`` to the device's recommended working-set size and restores the previous
    limit after synchronising (the limit must not change under a running evaluation). Nothing on the CPU
    or CUDA, or when the device recommends no size. ``model`` (optional): warn on stderr when its weights
    come near that size (they cannot all stay resident)."""
    size = memory_size() if _is_metal() else None  # Metal's recommended working set
    if size is None:
        yield
        return
    if model is not None:
        need = model_bytes(model)
        if need > 0.9 * size:
            print(f"warning: the model takes {need >> 20} MB, close to the {size >> 20} MB "
                  "the GPU keeps resident: decoding may be slow", file=sys.stderr)
    old = mx.set_wired_limit(size)
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)
