"""The distributed group a command runs in, if ``mlx.launch`` started it.

``mlx.launch`` starts every rank with environment variables that name its
backend (``MLX_HOSTFILE`` for the ring, ``MLX_IBV_DEVICES`` or
``MLX_JACCL_COORDINATOR`` for JACCL, MPI's own); without any of them a
command runs alone, as before, and never touches ``mx.distributed``.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

import mlx.core as mx

from .._json import read_json
from ..errors import RefusionError

MODES = ("tensor", "pipeline")


class DistributedError(RefusionError):
    """The group cannot be formed or cannot go on (a rank died, a link broke)."""


class Agreed(DistributedError):
    """Failures every rank has heard of (the ranks met over them: ``meeting.py``), ``said`` as (rank,
    message): rank 0 says each as that rank's line (:func:`say_error`), the other ranks nothing."""

    def __init__(self, said: List[Tuple[int, str]]):
        super().__init__("\n".join(f"rank {rank}: {message}" for rank, message in said))
        self.said = said


# MLX's messages when a peer is gone (raised from an evaluation)
_LINK_MARKS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")


def is_link_failure(error: BaseException) -> bool:
    """Whether an exception is a lost peer or link: the run cannot go on."""
    if isinstance(error, DistributedError):
        return True
    return isinstance(error, RuntimeError) and str(error).lstrip().startswith(_LINK_MARKS)


def launched_backend() -> Optional[str]:
    """The backend ``mlx.launch`` (or mpirun) started this process for, or None."""
    env = os.environ
    if "MLX_RANK" not in env and "OMPI_COMM_WORLD_SIZE" not in env and "PMI_SIZE" not in env:
        return None
    if env.get("MLX_IBV_DEVICES") or env.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if env.get("NCCL_HOST_IP"):
        return "nccl"
    if "MLX_HOSTFILE" in env:
        return "ring"
    return "mpi"


@dataclass
class Distributed:
    """One rank's view of the run: the group, its backend and the sharding mode."""

    group: "mx.distributed.Group"
    backend: str
    mode: str = "tensor"
    weight_bytes: int = 0  # the whole model's (recorded by the loader)
    weight_bytes_per_rank: int = 0  # this rank's share
    seed: Optional[int] = None  # the random seed every rank got (init): a decoding thread takes it
    meeting: bool = True  # on the way to ready: a rank that fails meets the others (meeting.py)

    def record_weights(self, whole: int, this_rank: int) -> None:
        self.weight_bytes, self.weight_bytes_per_rank = int(whole), int(this_rank)

    def as_dict(self) -> dict:
        """``stats["distributed"]``."""
        return {"backend": self.backend, "size": self.size, "mode": self.mode,
                "weight_bytes": self.weight_bytes, "weight_bytes_per_rank": self.weight_bytes_per_rank}

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that writes output and serves HTTP."""
        return self.rank == 0


_current: Optional[Distributed] = None


class _HostfileError(DistributedError):
    def __init__(self, message: str):
        super().__init__(f"MLX_HOSTFILE: {message}")


def _ring_hosts(path: str) -> int:
    """How many hosts the ring's ``MLX_HOSTFILE`` names (0: an empty file, which
    ``mlx.launch -n 1`` writes), checked before MLX reads it: a missing file, a
    file that is not a JSON list of hosts (each an "ip:port" or a list of
    them, as mlx.launch writes), an empty list (MLX died of it: a floating
    point exception) or an ``MLX_RANK`` outside it is one line."""
    try:
        if not Path(path).read_text().strip():
            return 0
    except (OSError, ValueError):
        pass  # read_json says what is wrong with it
    hosts = read_json(Path(path), _HostfileError)
    if not isinstance(hosts, list):
        raise _HostfileError(f"{path} must hold a JSON list of hosts, one per rank (as mlx.launch writes it), "
                             f"not a {type(hosts).__name__}")
    if not hosts:
        raise _HostfileError(f"{path} lists no hosts")
    for i, host in enumerate(hosts):
        ips = host if isinstance(host, list) else [host]
        if not ips or not all(isinstance(ip, str) and ip for ip in ips):
            raise _HostfileError(f"{path}: host {i} must be an \"ip:port\" or a list of them, got {host!r}")
    rank = os.environ.get("MLX_RANK", "")
    if not (rank.isdigit() and int(rank) < len(hosts)):
        raise DistributedError(f"MLX_RANK={rank!r} is not a rank of the {len(hosts)} hosts MLX_HOSTFILE={path} "
                               f"lists (0 to {len(hosts) - 1})")
    return len(hosts)


def init(pipeline: bool = False) -> Optional[Distributed]:
    """Join the group ``mlx.launch`` started (once per process), or None when
    running alone (no launcher, or a group of one).

    MLX's global random generator gets the same seed on every rank, one rank
    0 drew: unseeded sampling draws from it, and ranks that drew apart would
    decode apart (then wait on each other's collectives). MLX keeps a
    generator per thread: a thread that decodes (the server's engine) seeds
    its own with ``seed``."""
    global _current
    if _current is not None:
        _current.mode = "pipeline" if pipeline else "tensor"
        return _current
    backend = launched_backend()
    if backend is None:
        return None
    if backend == "ring" and _ring_hosts(os.environ["MLX_HOSTFILE"]) < 2:
        return None  # mlx.launch -n 1 writes an empty hostfile: alone (MLX's ring of one host waits for ever)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:
        raise DistributedError(f"cannot join the {backend} group: {' '.join(str(e).split())}") from None
    if group.size() < 2:
        return None
    from .broadcast import broadcast  # (it builds on this module)

    _current = Distributed(group, backend, "pipeline" if pipeline else "tensor")
    _current.seed = broadcast(_current, secrets.randbits(63))
    mx.random.seed(_current.seed)
    return _current


def current() -> Optional[Distributed]:
    """The group this process joined with :func:`init`, or None."""
    return _current


_errors = None  # a follower's real standard error, for its error lines only


def quiet_followers(dist: Optional[Distributed]) -> None:
    """Ranks other than 0 write nothing: their standard output and error go
    nowhere, except error lines (:func:`errors`), which may be theirs alone."""
    global _errors
    if dist is not None and not dist.leader:
        sys.stdout.flush()
        sys.stderr.flush()
        _errors = sys.stderr
        sys.stdout = sys.stderr = open(os.devnull, "w")


def errors():
    """Where this rank writes its one-line errors: standard error, also on a quiet rank."""
    return _errors if _errors is not None else sys.stderr


def say_error(error: Union[str, BaseException]) -> None:
    """This rank's one-line error: ``error: rank N: message`` (``error:
    message`` alone), on :func:`errors`; a message of several lines (one
    per bad value) is that many such lines. ``error``: the message, or the
    exception whose message it is. Under ``mlx.launch``, an exception on the
    way to ready (not a lost link) is first taken to the other ranks
    (``meeting.meet``): rank 0 alone then says every rank's failure, each
    distinct one once; an :class:`Agreed` one is said by rank 0 alone."""
    said = [(None if _current is None else _current.rank, str(error))]
    if isinstance(error, Agreed):
        said = error.said if _current is None or _current.leader else []
    elif isinstance(error, BaseException) and _current is not None and _current.meeting \
            and not (isinstance(error, RuntimeError) and is_link_failure(error)):  # (a lost link: none to meet)
        from .meeting import meet

        said = meet(_current, str(error))
    out = errors()
    for rank, message in said:
        label = "" if rank is None else f"rank {rank}: "
        out.write("".join(f"error: {label}{line}\n" for line in message.splitlines() or [""]))
    out.flush()


def lost_ranks(error: BaseException) -> str:
    """What a lost peer or link (:func:`is_link_failure`) is to the user."""
    return f"lost the other ranks ({' '.join(str(error).split())}): a rank died or the link broke"


def _noise(line: bytes) -> bool:
    """The backend's per-socket complaints once a peer is gone (dozens of
    lines before the one error that says it)."""
    text = line.lstrip().lower()
    return text.startswith((b"[ring]", b"[jaccl]")) and (b"socket" in text or b"too many" in text)


def filter_backend_noise() -> None:
    """Drop the backend's per-socket lines from standard error (C++ writes
    them to file descriptor 2); Python's own ``sys.stderr`` writes straight
    to the terminal, so nothing of ours waits on the filter.
    ``MLX_RING_VERBOSE`` keeps everything."""
    if os.environ.get("MLX_RING_VERBOSE"):
        return
    try:
        sys.stderr.flush()
        terminal = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
    except OSError:
        return
    sys.stderr = os.fdopen(terminal, "w", buffering=1)

    def forward():
        with os.fdopen(read, "rb") as source, os.fdopen(os.dup(terminal), "wb", buffering=0) as sink:
            for line in source:
                if not _noise(line):
                    sink.write(line)

    threading.Thread(target=forward, name="refusion-stderr", daemon=True).start()
