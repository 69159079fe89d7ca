"""What every model family gives the rest of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class CacheSpec:
    """One sequence's KV cache for a model in this process: ``layers`` in all,
    of which ``held`` are computed here (a pipeline rank's range), each with
    ``kv_heads`` heads of ``head_dim`` in ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    held: range

    def row_bytes(self) -> int:
        """Bytes of keys and values one committed token costs, over the held layers."""
        return 2 * len(self.held) * self.kv_heads * self.head_dim * self.dtype.size
