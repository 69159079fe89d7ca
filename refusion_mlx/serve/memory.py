"""How much KV memory the engine's requests may reserve (``--max-kv-bytes``).

A request's decoder reserves every row it can write when it starts: the
prompt plus the budget in whole slots, in multiples of the cache's growth rows
(:func:`kv_rows`), at the model's KV bytes per token (:func:`kv_row_bytes`).
Without ``--max-kv-bytes`` the budget is 90% of the device's memory --
Metal's recommended working set on a Mac, the physical memory otherwise --
less the weights and the prompt cache's budget (:func:`default_max_kv_bytes`);
the rest is left to a step's activations and transient copies.
"""

from __future__ import annotations

import logging
import os
from typing import Tuple

from ..errors import RefusionError

log = logging.getLogger("refusion_mlx.server")

MEMORY_FRACTION = 0.9  # of the device's memory, the rest left to activations and the system


def growth_rows() -> int:
    """CommittedCache's growth: a cache holds a multiple of these rows."""
    from ..decode.cache import GROWTH_ROWS

    return GROWTH_ROWS


def kv_rows(prompt_tokens: int, budget: int) -> int:
    """The KV rows a request's cache can hold: its decoder reserves prompt +
    budget (whole slots) at once, in multiples of the cache's growth rows."""
    growth = growth_rows()
    return -(-(prompt_tokens + budget) // growth) * growth


def kv_row_bytes(model, storage=None) -> int:
    """Bytes of one cached token: keys and values of every layer of the model
    (a pipeline's ranks count the same), as ``storage`` (a
    ``decode.kv_store.Storage``; the float store by default) keeps them."""
    from ..decode.kv_store import Storage

    spec = model.cache_spec()
    return spec.layers * (storage or Storage()).row_bytes(spec)


def device_memory() -> Tuple[int, str]:
    """(bytes, what they are): Metal's recommended working set on a Mac, else the physical memory."""
    import mlx.core as mx

    if mx.metal.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return int(info["max_recommended_working_set_size"]), "Metal's recommended working set"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def default_max_kv_bytes(model, prompt_cache_bytes: int, row_bytes: int) -> int:
    """--max-kv-bytes when not given (logged with its derivation); a RefusionError
    when the weights and the prompt cache leave no room for one request."""
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
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


def kv_need(request, row_bytes: int) -> int:
    """The KV bytes a request reserves while it runs (:func:`kv_rows`)."""
    return kv_rows(len(request.prompt_ids), request.params.layout().gen_length) * row_bytes


def kv_refusal(need: int, row_bytes: int, max_bytes: int):
    """The refusal of a request that can never fit, naming the numbers."""
    from .refusal import Reason, Refusal

    rows = need // max(1, row_bytes)
    return Refusal(Reason.KV_MEMORY_EXCEEDED, f"the request needs {need} bytes of KV cache ({rows} rows of "
                   f"{row_bytes} bytes: prompt + max_tokens in whole slots, in multiples of {growth_rows()}); the "
                   f"server's --max-kv-bytes is {max_bytes}", "max_tokens")
