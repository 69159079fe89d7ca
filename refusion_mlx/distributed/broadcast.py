"""Host values rank 0 decides and every rank must follow (the server's step:
which requests joined, left or were cancelled), and every rank's values on
every rank (:func:`gather`: the ranks meeting on their way to ready,
``meeting.py``)."""

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
        _check(dist, n > 0 and (n == len(data) or not dist.leader))
        watchdog.pet()
        buf = np.frombuffer(data, np.uint8) if dist.leader else np.zeros(n, np.uint8)
        out = mx.distributed.all_sum(mx.array(buf), group=dist.group, stream=mx.cpu)
        raw = np.array(out, copy=False).tobytes()
        watchdog.pet()
    return value if dist.leader else _unpickle(dist, raw)


def gather(dist: Distributed, value: Any) -> list:
    """Every rank's ``value``, in rank order, on every rank: two all-sums (the
    sizes, then the bytes, each rank's at its own place) under the watchdog."""
    data = pickle.dumps(value)
    with watchdog.armed():
        sizes = np.zeros(dist.size, np.int32)
        sizes[dist.rank] = len(data)
        sizes = np.array(mx.distributed.all_sum(mx.array(sizes), group=dist.group, stream=mx.cpu))
        _check(dist, sizes.min() > 0 and sizes[dist.rank] == len(data))
        watchdog.pet()
        ends = np.cumsum(sizes)
        buf = np.zeros(int(ends[-1]), np.uint8)
        buf[ends[dist.rank] - len(data):ends[dist.rank]] = np.frombuffer(data, np.uint8)
        raw = np.array(mx.distributed.all_sum(mx.array(buf), group=dist.group, stream=mx.cpu)).tobytes()
        watchdog.pet()
    return [_unpickle(dist, raw[end - size:end]) for size, end in zip(sizes, ends)]


def _check(dist: Distributed, whole: bool) -> None:
    """A collective whose peer is gone does not always raise: MLX's ring can fail its pending work and
    return what the buffers hold. What came back is not what was sent: raised as the backend's failure
    (``group.is_link_failure``), before a second collective waits on the dead peer for ever."""
    if not whole:
        raise RuntimeError(f"[{dist.backend}] a collective came back incomplete")


def _unpickle(dist: Distributed, raw: bytes) -> Any:
    try:
        return pickle.loads(raw)
    except Exception:  # bytes no rank sent (:func:`_check`)
        _check(dist, False)
