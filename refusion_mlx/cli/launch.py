"""Commands under ``mlx.launch``: join the group, silence the other ranks,
start the collectives' watchdog. Alone (no launcher) all of it is a no-op."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from typing import Callable, Iterator, Optional, TypeVar

from ..distributed import group as dgroup
from ..distributed import watchdog
from .._threads import free_streams_at_thread_end
from ..distributed.broadcast import broadcast
from ..distributed.meeting import checkpoint

T = TypeVar("T")


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """--pipeline: how the model is split when mlx.launch starts several ranks."""
    parser.add_argument("--pipeline", action="store_true",
                        help="under mlx.launch: give each rank a contiguous range of layers (pipeline "
                             "parallel) instead of a share of every layer's heads (tensor parallel, the default)")


def join(args) -> Optional[dgroup.Distributed]:
    """The group this command runs in (None alone; ``distributed.group.init``,
    which seeds MLX's random generator alike on every rank). Ranks other than
    0 print nothing to standard output from here on; a collective that stops
    making progress ends the process (``distributed.watchdog``)."""
    dist = dgroup.init(pipeline=getattr(args, "pipeline", False))
    if dist is None:
        return None
    dgroup.filter_backend_noise()
    dgroup.quiet_followers(dist)
    watchdog.install(dist.rank)
    return dist


def ready(dist: Optional[dgroup.Distributed]) -> None:
    """Every rank has loaded its share: the ranks' last meeting on their way (``distributed.meeting``:
    under the loading's limit, not the collectives'; a rank that failed on the way says so there). From
    here a rank's error is its own line."""
    if dist is not None:
        checkpoint(dist)
        dist.meeting = False


class _LeaderCtrlC:
    """Rank 0's Ctrl-C in a chat (:func:`leader_interrupts`): raised while it reads the user's line,
    noted (``pending``) anywhere else."""
    reading = False
    pending = False


_LEADER = _LeaderCtrlC()


def _note_ctrl_c(signum, frame) -> None:
    if _LEADER.reading:
        _LEADER.reading = False  # one KeyboardInterrupt: a second Ctrl-C is noted
        raise KeyboardInterrupt
    _LEADER.pending = True


@contextlib.contextmanager
def leader_interrupts(dist: Optional[dgroup.Distributed]) -> Iterator[None]:
    """Rank 0's Ctrl-C for the duration of a chat under mlx.launch. The other ranks follow rank 0 only at
    its broadcasts: at the prompt (:func:`shared_input`) and after each step of a turn
    (:func:`agreed_steps`). A KeyboardInterrupt raised anywhere else on rank 0 (between a turn's end
    and the next read, say) ended rank 0 alone, the others lost it. So Ctrl-C is noted there and
    acted on at the next broadcast: the next read ends the chat on every rank, a turn that had begun
    stops after its first step. Alone, or on another rank, a no-op."""
    if dist is None or not dist.leader or threading.current_thread() is not threading.main_thread():
        yield
        return
    _LEADER.reading = _LEADER.pending = False
    previous = signal.signal(signal.SIGINT, _note_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _LEADER.reading = _LEADER.pending = False


def agreed_steps(dist: Optional[dgroup.Distributed], steps: Iterator[T]) -> Iterator[T]:
    """``steps`` (a turn's responses), ending at the same step on every rank.

    Alone: ``steps`` as they are. Under mlx.launch, Ctrl-C reaches every rank
    of a terminal's process group at a different step; each rank stopping
    where it was left the others waiting on collectives it never joined.
    So rank 0 notes its SIGINT instead of raising it, the others ignore
    theirs, and after each step rank 0 says whether to go on: every rank
    raises KeyboardInterrupt after the same step."""
    if dist is None:
        yield from steps
        return
    stop: list = []
    previous = signal.signal(signal.SIGINT, (lambda signum, frame: stop.append(signum)) if dist.leader
                             else signal.SIG_IGN)
    if dist.leader and _LEADER.pending:  # a Ctrl-C since the line was read is this turn's
        stop.append(signal.SIGINT)
    _LEADER.pending = False
    try:
        for response in steps:
            yield response
            if broadcast(dist, bool(stop)):
                raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, previous)
        close = getattr(steps, "close", None)
        if close is not None:
            close()


def with_distributed(stats: Optional[dict], dist: Optional[dgroup.Distributed]) -> Optional[dict]:
    """A statistics dict with ``distributed`` added when running on several ranks."""
    if stats is not None and dist is not None:
        stats["distributed"] = dist.as_dict()
    return stats


def shared_input(dist: dgroup.Distributed, read: Callable[[str], str]) -> Callable[[str], str]:
    """``read`` on rank 0, its lines on every rank: the chat's turns are the
    same everywhere. While rank 0 waits for the user it broadcasts a
    heartbeat each second, so no rank's collective waits long enough for
    the watchdog. End of input is EOFError on every rank, Ctrl-C at the
    prompt KeyboardInterrupt."""
    if not dist.leader:
        def follow(prompt: str) -> str:
            while True:
                kind, line = broadcast(dist)
                if kind == "line":
                    return line
                if kind == "eof":
                    raise EOFError
                if kind == "interrupt":
                    raise KeyboardInterrupt
        return follow

    def lead(prompt: str) -> str:
        # the user is read here, in the main thread (where Ctrl-C lands): a reader thread left blocked in
        # stdin aborted the interpreter at exit; the heartbeat is the thread's, until the line is in
        done = threading.Event()

        def beat():
            free_streams_at_thread_end()
            while not done.wait(1.0):
                broadcast(dist, ("wait", None))

        beater = threading.Thread(target=beat, name="refusion-heartbeat", daemon=True)
        beater.start()
        line, ended = None, EOFError
        try:
            _LEADER.reading = True
            if _LEADER.pending:  # Ctrl-C since the last turn ended: at the prompt
                raise KeyboardInterrupt
            line = read(prompt)
        except (EOFError, KeyboardInterrupt) as e:
            ended = type(e)
        finally:
            _LEADER.reading = _LEADER.pending = False
            done.set()
            beater.join()  # its last broadcast done: the ranks' collectives stay in one order
        if line is None:
            broadcast(dist, ("interrupt" if ended is KeyboardInterrupt else "eof", None))
            raise ended
        broadcast(dist, ("line", line))
        return line

    return lead
