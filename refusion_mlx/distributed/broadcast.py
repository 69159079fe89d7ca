"""Host values rank 0 decides and every rank must follow (the server's step:
which requests joined, left or were cancelled)."""

from __future__ import annotations

import pickle
from typing import Any

import mlx.core as mx
import numpy as np

from . import watchdog
from .group import Distributed


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
