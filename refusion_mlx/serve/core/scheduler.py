"""Who runs next: the engine's queue and batch, and each turn's admission.

The :class:`Scheduler` holds the jobs waiting (in arrival order) and
those in the batch, with the KV bytes the batch has reserved, under one
lock the HTTP side also takes (``put``, ``counts``). An HTTP request's
jobs (its choices: ``n``, a list of prompts) are queued together or not at
all, as one ``group``, and a job whose client left leaves the queue at once
(it holds no place another request could have). Rank 0's engine asks it for
each turn's :class:`~.job.Turn` (:meth:`Scheduler.next_turn`): the running
jobs whose client left leave; queued jobs are admitted while a batch row
and their KV reservation (:mod:`.memory`) are free, each time the first to
arrive of the requests holding the fewest rows (so one request's many
choices never keep a later request's one behind them); the job chosen that
does not fit waits for memory, and the rest with it. A job whose prompt
shares a prefix with one started ahead of it that is still prefilling it
waits (the others go on) until those rows land, then starts from them
(:meth:`.caches.prompt_cache.PromptCache.waits`): a prefix is prefilled
once, a chunk a step in the batch's forwards. Scoring jobs hold at
most all rows but one (:func:`scoring_rows`): an hour of log-likelihood work
in eight prompts leaves a row for the next chat. And a scoring request holds
one of them at a time, its prompts scored one after another: the engine does
one piece of scoring a turn whatever the rows, so more would add nothing but
make the next scoring request wait for one of its prompts to end (a
24-prompt job held every scoring row, and a 4-token score waited for a whole
prompt of it, or the whole job). A job's start and its
leaving are recorded here (:meth:`started`, :meth:`left`), so ``/health``
sees one consistent view.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Dict, List, Optional

from .job import Job, Turn
from .refusal import Reason, Refusal


def scoring_rows(max_batch: int) -> int:
    """Batch rows scoring jobs may hold at once, one per request: all but one (one, in a batch of one)."""
    return max(1, max_batch - 1)


class Scheduler:
    """The queue (``waiting``), the batch (``running``, by uid), the requests
    taken from the queue but not yet in the batch (``starting``, counted as
    queued) and the KV bytes reserved (``kv_reserved``), guarded by ``wake``;
    ``metrics``: where a request that leaves the queue unstarted is counted;
    ``prompt_cache``: the engine's, which says whether a job waits for a
    prefix (None: none does)."""

    def __init__(self, max_batch: int, max_queue: int, metrics, prompt_cache=None):
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self.prompt_cache = prompt_cache
        self.score_after = 0.0  # when decoding has had its share after the last piece of scoring
        self.waiting: "collections.deque[Job]" = collections.deque()
        self.running: Dict[int, Job] = {}
        self.starting = 0
        self.kv_reserved = 0
        self.wake = threading.Condition()

    def put(self, jobs: List[Job]) -> None:
        """Queue one request's jobs, all or none (the caller holds ``wake``): a
        Refusal when they would make more than ``max_queue`` wait beyond the
        batch's free rows (those the next turn admits: a burst into an idle
        batch of 4 with a queue of 2 was refused at its fifth request). A
        request is never refused for its own size while nothing else waits."""
        self._purge()
        free = max(0, self.max_batch - len(self.running) - self.starting)
        beyond = len(self.waiting) - free  # jobs waiting that no free row takes
        if beyond > 0 and beyond + len(jobs) > self.max_queue:
            raise Refusal(Reason.SERVER_BUSY, f"the server is busy ({len(self.waiting)} requests waiting"
                          + (f", and this one brings {len(jobs)}" if len(jobs) > 1 else "") + "); retry later")
        self.waiting.extend(jobs)
        self.wake.notify()

    def _purge(self) -> None:
        """Drop the waiting jobs whose client left (the caller holds ``wake``)."""
        if any(job.cancelled.is_set() for job in self.waiting):
            for job in [j for j in self.waiting if j.cancelled.is_set()]:
                self.metrics.outcome(job.request.api, "cancelled")
            self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())

    def idle_wait(self, seconds: float, stopping: threading.Event) -> None:
        """With nothing running or waiting, wait up to ``seconds`` for a request (or a stop)."""
        with self.wake:
            if not self.waiting and not stopping.is_set():
                self.wake.wait(seconds)

    def next_turn(self, max_kv_bytes: int, decoding: bool = False) -> Turn:
        """This turn's plan: the running requests whose client left, then the
        queued ones admitted in order within a batch row and ``max_kv_bytes``
        (their reservations made now), but those that wait for a prefix a
        request ahead of them is prefilling (:meth:`_waits`); whether the
        scoring requests do a piece of work: while others are ``decoding``,
        scoring gets at most half the engine's time (:meth:`scored`)."""
        plan = Turn(cancelled=[uid for uid, j in self.running.items() if j.cancelled.is_set()])
        room = self.max_batch - len(self.running) + len(plan.cancelled)
        freed = sum(self.running[uid].kv_bytes for uid in plan.cancelled)
        with self.wake:
            self._purge()  # jobs whose client left while they waited
            live = [j for j in self.running.values() if not j.cancelled.is_set()]
            held = collections.Counter(j.group for j in live)
            scoring = {j.group for j in live if j.request.scoring is not None}  # one row each
            prefixed = set()  # jobs waiting this turn for a prefix
            sources = self.caches()
            ahead = [[j.request.cache_owner, j.request.prompt_ids, None] for j in live  # prompts still prefilling
                     if j.cache is not None and len(j.cache) < len(j.request.prompt_ids)]
            while len(plan.admitted) < room:
                takes = [j for j in self.waiting if j not in prefixed and (j.request.scoring is None
                         or (len(scoring) < scoring_rows(self.max_batch) and j.group not in scoring))]
                job = None
                for j in sorted(takes, key=lambda j: held[j.group]):  # the first among the least served
                    if not self._waits(j, ahead, sources):
                        job = j
                        break
                    prefixed.add(j)
                if job is None:
                    break
                if self.kv_reserved - freed + job.kv_bytes > max_kv_bytes:
                    if not job.waited:
                        job.waited = True
                        self.metrics.add("kv_waits")
                    break
                self.waiting.remove(job)
                held[job.group] += 1
                if job.request.scoring is not None:
                    scoring.add(job.group)
                self.kv_reserved += job.kv_bytes
                plan.admitted.append(job)
                if job.request.scoring is None:
                    ahead.append([job.request.cache_owner, job.request.prompt_ids, None])
            self.starting = len(plan.admitted)
        # a decoding request admitted now decodes this turn: it has its share before the next piece
        decoding = decoding or any(j.request.scoring is None for j in plan.admitted)
        plan.score = not decoding or time.monotonic() >= self.score_after
        return plan

    def _waits(self, job: Job, ahead: List[list], sources: List[tuple]) -> bool:
        """Whether a decoding ``job`` waits for a prefix that one ``ahead`` of it -- admitted this turn, or
        in the batch still prefilling its prompt -- is prefilling and the cache and ``sources`` (the batch's
        caches) do not hold (:meth:`.caches.prompt_cache.PromptCache.waits`)."""
        return (self.prompt_cache is not None and job.request.scoring is None and bool(ahead)
                and self.prompt_cache.waits(job.request.prompt_ids, job.request.cache_owner, ahead, sources))

    def caches(self) -> List[tuple]:
        """(cache owner, cache) of the requests in the batch: rows a new prompt may start from."""
        return [(j.request.cache_owner, j.cache) for j in self.running.values() if j.cache is not None]

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
        self._purge()
        return {"active": len(self.running), "queued": len(self.waiting) + self.starting,
                "max_batch": self.max_batch, "kv": {"reserved_bytes": self.kv_reserved, "max_bytes": max_kv_bytes}}
