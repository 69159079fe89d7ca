"""Who runs next: the engine's queue and batch, and each turn's admission.

The :class:`Scheduler` holds the requests waiting (in arrival order) and
those in the batch, with the KV bytes the batch has reserved, under one
lock the HTTP side also takes (``put``, ``counts``). Rank 0's engine asks it
for each turn's :class:`~.job.Turn` (:meth:`Scheduler.next_turn`): the
running requests whose client left leave; queued requests are admitted in
order while a batch row and their KV reservation (:mod:`.memory`) are free;
the first that does not fit waits for memory, those behind it too. A
request's start and its leaving are recorded here (:meth:`started`,
:meth:`left`), so ``/health`` sees one consistent view.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Dict, List, Optional

from .job import Job, Turn
from .refusal import Reason, Refusal

PEERS = 64  # waiting requests compared with one being admitted


class Scheduler:
    """The queue (``waiting``), the batch (``running``, by uid), the requests
    taken from the queue but not yet in the batch (``starting``, counted as
    queued) and the KV bytes reserved (``kv_reserved``), guarded by ``wake``;
    ``metrics``: where a request that leaves the queue unstarted is counted."""

    def __init__(self, max_batch: int, max_queue: int, metrics):
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self.score_after = 0.0  # when decoding has had its share after the last piece of scoring
        self.waiting: "collections.deque[Job]" = collections.deque()
        self.running: Dict[int, Job] = {}
        self.starting = 0
        self.kv_reserved = 0
        self.wake = threading.Condition()

    def put(self, job: Job) -> None:
        """Queue a job (the caller holds ``wake``); a Refusal when ``max_queue`` already wait."""
        if len(self.waiting) >= self.max_queue:
            raise Refusal(Reason.SERVER_BUSY, f"the server is busy ({self.max_queue} requests waiting); retry later")
        self.waiting.append(job)
        self.wake.notify()

    def idle_wait(self, seconds: float, stopping: threading.Event) -> None:
        """With nothing running or waiting, wait up to ``seconds`` for a request (or a stop)."""
        with self.wake:
            if not self.waiting and not stopping.is_set():
                self.wake.wait(seconds)

    def next_turn(self, max_kv_bytes: int, decoding: bool = False) -> Turn:
        """This turn's plan: the running requests whose client left, then the
        queued ones admitted in order within a batch row and ``max_kv_bytes``
        (their reservations made now), and the peers they are compared with
        for a shared prefix (the admitted first, then up to PEERS waiting);
        whether the scoring requests do a piece of work: while others are
        ``decoding``, scoring gets at most half the engine's time (:meth:`scored`)."""
        plan = Turn(cancelled=[uid for uid, j in self.running.items() if j.cancelled.is_set()],
                    score=not decoding or time.monotonic() >= self.score_after)
        room = self.max_batch - len(self.running) + len(plan.cancelled)
        freed = sum(self.running[uid].kv_bytes for uid in plan.cancelled)
        with self.wake:
            while self.waiting and len(plan.admitted) < room:
                job = self.waiting[0]
                if job.cancelled.is_set():  # its client left while it waited
                    self.waiting.popleft()
                    self.metrics.outcome(job.request.api, "cancelled")
                    continue
                if self.kv_reserved - freed + job.kv_bytes > max_kv_bytes:
                    if not job.waited:
                        job.waited = True
                        self.metrics.add("kv_waits")
                    break
                self.waiting.popleft()
                self.kv_reserved += job.kv_bytes
                plan.admitted.append(job)
            self.starting = len(plan.admitted)
            peers = plan.admitted + list(itertools.islice(self.waiting, PEERS))
        plan.peers = [(j.request.cache_owner, j.request.prompt_ids) for j in peers]
        return plan

    def scored(self, seconds: float) -> None:
        """A piece of scoring took ``seconds``: decoding has the engine as long before the next."""
        self.score_after = time.monotonic() + seconds

    def started(self, job: Job) -> None:
        """An admitted job is in the batch (its ``uid`` set)."""
        with self.wake:
            self.running[job.uid] = job
            self.starting -= 1

    def left(self, job: Job, outcome: str) -> bool:
        """A job left the batch (or never reached it) with ``outcome``: its
        reservation goes, counted in one view of ``/health``. Whether the batch is now empty."""
        with self.wake:
            if job.uid is None or self.running.pop(job.uid, None) is None:
                self.starting -= 1  # it never reached the batch
            self.kv_reserved -= job.kv_bytes
            job.kv_bytes = 0
            self.metrics.outcome(job.request.api, outcome)
        return not self.running

    def drain(self) -> List[Job]:
        """Every waiting job, taken from the queue (the engine is ending)."""
        with self.wake:
            waiting, self.waiting = list(self.waiting), collections.deque()
        return waiting

    def counts(self, max_kv_bytes: Optional[int]) -> dict:
        """The batch and the queue as ``/health`` shows them (the caller holds ``wake``)."""
        return {"active": len(self.running), "queued": len(self.waiting) + self.starting,
                "max_batch": self.max_batch, "kv": {"reserved_bytes": self.kv_reserved, "max_bytes": max_kv_bytes}}
