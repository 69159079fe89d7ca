"""How much KV memory the engine's requests may reserve (``--max-kv-bytes``).

A request's decoder reserves every row it can write when it starts: the
prompt plus the budget in whole slots, in multiples of the cache's growth rows
(:func:`kv_rows`), at the model's KV bytes per token as its caches keep
them (:func:`kv_row_bytes`; ``--kv-bits`` quantizes them), and with a
quantized cache the rows its widest pass holds in float until they are
committed (:func:`kv_scratch_row_bytes`, :func:`widest_pass`).
Without ``--max-kv-bytes`` the budget is 90% of the device's memory
(``models.backend.device_memory``: Metal's recommended working set on a Mac,
a CUDA device's memory, the physical memory on the CPU) less the weights and the prompt cache's budget (:func:`default_max_kv_bytes`);
the rest is left to a step's activations and transient copies.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from ...errors import RefusionError

log = logging.getLogger("refusion_mlx.server")

MEMORY_FRACTION = 0.9  # of the device's memory, the rest left to activations and the system


def growth_rows() -> int:
    """CommittedCache's growth: a cache holds a multiple of these rows."""
    from ...decode.cache import GROWTH_ROWS

    return GROWTH_ROWS


def kv_rows(prompt_tokens: int, budget: int) -> int:
    """The KV rows a request's cache can hold: its decoder reserves prompt +
    budget (whole slots) at once, in multiples of the cache's growth rows."""
    growth = growth_rows()
    return -(-(prompt_tokens + budget) // growth) * growth


def kv_row_bytes(model, storage=None) -> int:
    """Bytes of one cached token: keys and values of every layer of the model
    (a pipeline's ranks count the same), as ``storage`` (a
    ``decode.kv_store.KVStorage``; the float store by default) keeps them."""
    from ...decode.kv_store import KVStorage

    spec = model.cache_spec()
    return spec.layers * (storage or KVStorage()).row_bytes(spec)


def default_max_kv_bytes(model, prompt_cache_bytes: int, row_bytes: int) -> int:
    """--max-kv-bytes when not given (logged with its derivation); a RefusionError
    when the weights and the prompt cache leave no room for one request."""
    from ...models.backend import device_memory, model_bytes

    weights = model_bytes(model)
    total, what = device_memory()
    value = int(total * MEMORY_FRACTION) - weights - prompt_cache_bytes
    how = (f"{MEMORY_FRACTION:.0%} of {what} ({gib(total)}) - weights ({gib(weights)}) - "
           f"prompt cache ({gib(prompt_cache_bytes)}) = {gib(value)}")
    if value < growth_rows() * row_bytes:
        raise RefusionError(f"no memory left for requests: {how}; lower --prompt-cache-bytes or set --max-kv-bytes")
    log.info("KV memory for requests: %s (--max-kv-bytes)", how)
    return value


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def kv_scratch_row_bytes(model, storage=None) -> int:
    """Bytes one row a pass writes costs besides :func:`kv_row_bytes`, over
    every layer: 0 for the float store (its passes write into the rows
    reserved), the model's dtype for a quantized one (``--kv-bits``: a pass's
    rows stay in float until committed)."""
    from ...decode.kv_store import KVStorage

    spec = model.cache_spec()
    return spec.layers * (storage or KVStorage()).scratch_row_bytes(spec)


def widest_pass(request) -> int:
    """The most rows one of the request's decoding passes keeps in float
    until they are committed, with a quantized cache: a block's (plan,
    verify and infill passes stay within one; its prompt's rows are kept as
    codes as they are written)."""
    return max(request.params.layout().block_lengths)


def kv_span(request) -> Tuple[int, int]:
    """The rows a request's cache can hold while it runs (:func:`kv_rows`)
    and how many of them its widest pass keeps in float besides, with a
    quantized cache (:func:`widest_pass`); a scoring request's are its
    scorer's (``loglikelihood.scoring_rows``: no cache kept after it)."""
    if getattr(request, "scoring", None) is not None:
        from .loglikelihood import scoring_rows

        rows, widest = scoring_rows(request)
        return kv_rows(rows, 0), widest
    return kv_rows(len(request.prompt_ids), request.params.layout().gen_length), widest_pass(request)


def kv_need(request, row_bytes: int, scratch_row_bytes: int = 0) -> int:
    """The KV bytes a request reserves while it runs: its rows (:func:`kv_span`) at
    ``row_bytes``, and with a quantized cache its widest pass's rows at
    ``scratch_row_bytes`` (:func:`kv_scratch_row_bytes`)."""
    rows, widest = kv_span(request)
    return rows * row_bytes + widest * scratch_row_bytes


@dataclass(frozen=True)
class KVCost:
    """What one cached token costs (``row_bytes``, every layer), and one row
    a pass holds besides until committed (``scratch_row_bytes``), as the
    engine's caches keep them (``bits`` and ``group_size``: --kv-bits'; None:
    the model's dtype); the bytes are known once the model is loaded (:meth:`of`)."""

    row_bytes: int = 0
    scratch_row_bytes: int = 0
    bits: Optional[int] = None
    group_size: Optional[int] = None

    @classmethod
    def of(cls, model, storage) -> "KVCost":
        """Of ``model`` (None: not loaded yet, no bytes known) with ``storage`` (a ``decode.kv_store.KVStorage``)."""
        settings = {"bits": storage.bits, "group_size": storage.group_size} if storage is not None else {}
        if model is None:
            return cls(**settings)
        return cls(kv_row_bytes(model, storage), kv_scratch_row_bytes(model, storage), **settings)

    def as_dict(self) -> dict:
        """As /health shows it."""
        return {"bytes_per_token": self.row_bytes, "scratch_bytes_per_token": self.scratch_row_bytes,
                "bits": self.bits, "group_size": self.group_size}

    def need(self, request) -> int:
        """The KV bytes ``request`` reserves (:func:`kv_need`)."""
        return kv_need(request, self.row_bytes, self.scratch_row_bytes)

    def rows_within(self, max_bytes: int, widest: int) -> Optional[int]:
        """The most rows (prompt + budget, :func:`kv_rows`) one request whose
        widest pass is ``widest`` rows (:func:`widest_pass`) may reserve within
        ``max_bytes``; None before the model is loaded (no bytes known)."""
        if not self.row_bytes:
            return None
        rows = (max_bytes - widest * self.scratch_row_bytes) // self.row_bytes
        return rows // growth_rows() * growth_rows()

    def refusal(self, request, need: int, max_bytes: int):
        """The refusal of a request that can never fit, naming the numbers."""
        from .refusal import Reason, Refusal

        rows, widest = kv_span(request)
        scratch = (f", and {widest} rows of {self.scratch_row_bytes} bytes its widest pass holds "
                   "until they are committed (--kv-bits)" if self.scratch_row_bytes and widest else "")
        if getattr(request, "scoring", None) is not None:  # scored: its scorer's rows, no cache kept
            return Refusal(Reason.KV_MEMORY_EXCEEDED, f"scoring the prompt needs {need} bytes of KV cache ({rows} "
                           f"rows of {self.row_bytes} bytes: the prompt and its widest forward, in multiples of "
                           f"{growth_rows()}{scratch}); the server's --max-kv-bytes is {max_bytes}", "prompt")
        param = "max_output_tokens" if getattr(request, "api", "") == "responses" else "max_tokens"  # as its API names it
        return Refusal(Reason.KV_MEMORY_EXCEEDED, f"the request needs {need} bytes of KV cache ({rows} rows of "
                       f"{self.row_bytes} bytes: prompt + {param} in whole slots, in multiples of "
                       f"{growth_rows()}{scratch}); the server's --max-kv-bytes is {max_bytes}", param)


def check_kv_budget(max_bytes: int, cost: KVCost, decoding, context: Optional[int] = None) -> None:
    """At start-up: a RefusionError when ``max_bytes`` is less than the smallest
    request reserves (a one-token prompt and one slot: one growth step of rows,
    and with --kv-bits one slot's rows in float), which would refuse every
    request; a warning when it is less than a one-token prompt with the
    server's default budget (``decoding``) reserves, which refuses every
    request that does not set a smaller max_tokens; a note when it holds
    less than the model's whole ``context`` (the Responses API's open budget
    is then cut to what it holds)."""
    from types import SimpleNamespace

    rows = growth_rows() * cost.row_bytes
    smallest = rows + decoding.slot_size * cost.scratch_row_bytes
    if max_bytes < smallest:
        scratch = (f" + {decoding.slot_size} rows of {cost.scratch_row_bytes} bytes a pass holds in float"
                   if cost.scratch_row_bytes else "")
        raise RefusionError(f"--max-kv-bytes {max_bytes} is less than the smallest request reserves "
                            f"({growth_rows()} rows of {cost.row_bytes} bytes{scratch} = {smallest}): every "
                            f"request would be refused; give at least {smallest}")
    default = cost.need(SimpleNamespace(prompt_ids=[0], params=decoding))
    if max_bytes < default:
        log.warning("--max-kv-bytes %d is less than a request with the default max_tokens (%d) reserves (%d): "
                    "such requests will be refused; lower --max-tokens or raise --max-kv-bytes",
                    max_bytes, decoding.gen_length, default)
    if context is not None and max_bytes < cost.need(SimpleNamespace(prompt_ids=[], params=dataclasses.replace(
            decoding, gen_length=context, serial_num_blocks=None))):
        log.warning("--max-kv-bytes %d holds less than the model's context of %d tokens: a Responses request "
                    "without max_output_tokens gets the most its prompt leaves within it, not the whole "
                    "context; raise --max-kv-bytes for longer answers", max_bytes, context)


def admission_budget(model, storage, given: Optional[int], prompt_cache_bytes: int, decoding,
                     context: Optional[int] = None) -> Tuple["KVCost", int]:
    """(the loaded ``model``'s :class:`KVCost` as ``storage`` keeps its rows,
    ``--max-kv-bytes``: ``given``, else :func:`default_max_kv_bytes`), once
    :func:`check_kv_budget` found it takes the server's own default request
    (and, given the open budget's ``context``, whether it holds that)."""
    cost = KVCost.of(model, storage)
    budget = given if given is not None else default_max_kv_bytes(model, prompt_cache_bytes, cost.row_bytes)
    check_kv_budget(budget, cost, decoding, context)  # refuses what refuses all
    return cost, budget


TRIM_EVERY = 30.0  # seconds between two returns of the freed heap to the system, at most


class HeapTrim:
    """glibc keeps the heap a busy period freed in its per-thread arenas: a server's resident memory
    climbed 1-1.5 GB past what MLX and the prompt cache hold (a soak of mixed requests on the demo) and
    stayed there. While the engine is idle after work (at most every ``every`` seconds), ``malloc_trim(0)``
    gives it back (2.8 -> 2.3 GB, 1.5 -> 0.9 GB in that soak). Elsewhere (macOS, musl) nothing is called."""

    def __init__(self, every: float = TRIM_EVERY):
        self.every, self.after, self.dirty = every, 0.0, False
        self.trim = _malloc_trim()

    def busy(self) -> None:
        """The engine worked: there may be heap to give back once it is idle."""
        self.dirty = True

    def idle(self) -> bool:
        """The engine has nothing to do: trim if it worked since the last trim and it is time; whether it did."""
        now = time.monotonic()
        if self.trim is None or not self.dirty or now < self.after:
            return False
        self.after, self.dirty = now + self.every, False
        self.trim(0)
        return True


def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None

