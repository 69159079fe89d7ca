"""Host values rank 0 decides and every rank must follow (the server's step:
which requests joined, left or were cancelled)."""

from __future__ import annotations

import pickle
from typing import Any

import mlx.core as mx
import numpy as np

from . import watchdog
from .group import Distributed, DistributedError


def broadcast(dist: Distributed, value: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (others pass anything: it is ignored).

    Two all-sums on the CPU stream, the length then the bytes (the other
    ranks add zeros), under the watchdog: a peer that is gone is an error,
    not a hang. The ranks are copies of one program, so pickle is safe here."""
    with watchdog.armed():
        data = pickle.dumps(value) if dist.leader else b""
        size = mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=dist.group, stream=mx.cpu)
        n = int(size.item())
        watchdog.pet()
        buf = np.frombuffer(data, np.uint8) if dist.leader else np.zeros(n, np.uint8)
        out = mx.distributed.all_sum(mx.array(buf), group=dist.group, stream=mx.cpu)
        raw = np.array(out, copy=False).tobytes()
        watchdog.pet()
    return value if dist.leader else pickle.loads(raw)


def barrier(dist: Distributed) -> None:
    """Every rank got here (loading done, say)."""
    with watchdog.armed():
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=dist.group, stream=mx.cpu))


def same_model(dist: Distributed, described: str) -> None:
    """Every rank loads the model rank 0 loads (``described``: its config.json,
    --dtype and device paths, as text), or every rank raises one
    DistributedError naming the ranks that differ. Mismatched ranks failed
    later, at a collective, as a lost rank or a timeout."""
    leader = broadcast(dist, described)
    differs = np.zeros(dist.size, np.int32)
    differs[dist.rank] = int(described != leader)
    with watchdog.armed():
        ranks = np.flatnonzero(np.array(mx.distributed.all_sum(mx.array(differs), group=dist.group,
                                                               stream=mx.cpu)))
    if ranks.size:
        names = ", ".join(map(str, ranks))
        raise DistributedError(f"rank{'s' if ranks.size > 1 else ''} {names} loaded another model than rank 0 "
                               "(its config.json, --dtype or REFUSION_MLX_PATHS differ): give every rank the same")
