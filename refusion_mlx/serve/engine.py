"""The engine: the one thread that uses MLX.

It loads the model and drives one :class:`BatchGenerator`. Between two
steps it drops requests whose client has gone, then admits waiting requests
up to ``max_batch``: each starts from the longest prefix of its prompt that
the prompt cache holds (a copy of those rows, its own), and a prefix that
several admitted or waiting requests share but no entry holds yet (a system
prompt arriving with a burst of requests) is prefilled once, cached and
shared. Then one ``step()`` runs one batched forward over every active
request, and each response goes, as final in-order text, to its request's
asyncio queue. A finished request's cache (prompt + answer) joins the prompt
cache, so the conversation's next turn continues it.

Under ``mlx.launch`` every rank runs an engine; rank 0's also takes the HTTP
requests. Each turn of the loop rank 0 decides a :class:`StepPlan` (which
requests were cancelled, which are admitted with which peers, whether to
stop) and broadcasts it; every rank then applies the same plan to its own
batch, prompt cache and sharded model, so all ranks run the same forwards.
With nothing to do, rank 0 still broadcasts an empty plan every
``IDLE_WAIT`` seconds: the other ranks' collectives never wait long, and the
watchdog (``distributed.watchdog``) can tell a quiet server from a dead link.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..distributed import watchdog
from ..distributed.broadcast import barrier, broadcast
from ..distributed.group import errors, is_link_failure
from ..errors import RefusionError
from ..decode.prefix import prefix_length
from .prompt_cache import PromptCache, prefill
from .schemas import APIError, Request
from .text import TextShaper

log = logging.getLogger("refusion_mlx.server")

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 256
# 2 GiB: about 14,500 cached tokens of ReFusion-8B in bfloat16 (144 KiB a token: 36 layers x 8 KV heads x
# 128 x 2 x 2 bytes; half as many in float32), e.g. eight 1,800-token conversations (one per batch row)
# and a system prompt, for an eighth more memory than the 16 GB of weights.
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
SHARED_PREFIX = 16  # tokens requests must share (beyond the cache) to prefill them once for all
PEERS = 64  # waiting requests compared with one being admitted
IDLE_WAIT = 0.25  # seconds the loop sleeps with nothing to do (then, on several ranks, a heartbeat)


class Job:
    """A request in flight: the engine thread posts events to the HTTP side's
    asyncio queue: ("start", None), ("text", str), ("done", dict), ("error", APIError)."""

    def __init__(self, request: Request, loop):
        self.request, self.loop = request, loop
        self.events: "asyncio.Queue[tuple]" = asyncio.Queue()
        self.cancelled = threading.Event()
        self.uid: Optional[int] = None
        self.cache = None
        self.cached = 0
        self.shaper: Optional[TextShaper] = None

    def post(self, kind: str, payload=None) -> None:
        if self.loop is None:  # a rank other than 0: nobody listens
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass


@dataclass
class StepPlan:
    """What one turn of the engine's loop does, decided by rank 0: close the
    ``cancelled`` running requests (by uid), start the ``admitted`` ones
    (``peers``: the prompts they are compared with for a shared prefix, the
    admitted first, in order), then step the batch; or ``stop``."""

    cancelled: List[int] = field(default_factory=list)
    admitted: List[Job] = field(default_factory=list)
    peers: List[List[int]] = field(default_factory=list)
    stop: bool = False

    def wire(self) -> tuple:
        return self.cancelled, [j.request for j in self.admitted], self.peers, self.stop

    @classmethod
    def from_wire(cls, wire: tuple) -> "StepPlan":
        cancelled, requests, peers, stop = wire
        return cls(cancelled, [Job(r, None) for r in requests], peers, stop)


class Engine:
    """Loads the model and runs every generation, batched, on one thread.

    ``dist``: the group under ``mlx.launch`` (``distributed.group.init``);
    rank 0's engine decides each step and the others follow (``StepPlan``)."""

    def __init__(self, model_path: Optional[str] = None, dtype: Optional[str] = None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_queue: int = DEFAULT_MAX_QUEUE,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, adapter_path: Optional[str] = None,
                 dist=None):
        self.model_path, self.dtype, self.adapter_path = model_path, dtype, adapter_path
        self.dist = dist
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.waiting: "collections.deque[Job]" = collections.deque()
        self.running: Dict[int, Job] = {}
        self.wake = threading.Condition()
        self.counts = collections.Counter()
        self.model = self.tokenizer = self.gen = None
        self.args = None  # the model's config, read by the HTTP side
        self.http_tokenizer = None  # the HTTP side's, behind tokenizer_lock
        self.tokenizer_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="refusion-engine", daemon=True)

    # -- life cycle and the HTTP side's calls ----------------------------------

    def start(self) -> None:
        """Load the model on the engine thread; raise its RefusionError if it fails."""
        self._thread.start()
        while not self._ready.wait(0.1):
            pass
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 0.0) -> None:
        """End every request (503) after the step in progress; wait ``timeout`` s for the thread."""
        self._stopping.set()
        with self.wake:
            self.wake.notify()
        if timeout and self._thread.is_alive():
            self._thread.join(timeout)

    def follow(self) -> None:
        """A rank other than 0: load, then run rank 0's plans until it stops."""
        self.start()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def submit(self, job: Job) -> None:
        with self.wake:
            if self._stopping.is_set():
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self.waiting) >= self.max_queue:
                raise APIError(503, f"the server is busy ({self.max_queue} requests waiting); retry later",
                               code="server_busy")
            self.waiting.append(job)
            self.wake.notify()

    def snapshot(self) -> dict:
        names = ("completed", "cancelled", "failed", "steps", "step_rows", "prefill_tokens", "cached_tokens")
        return {"active": len(self.running), "queued": len(self.waiting), "max_batch": self.max_batch,
                **{k: self.counts[k] for k in names}, "prompt_cache": {
                    "entries": len(self.prompt_cache), "bytes": self.prompt_cache.nbytes,
                    "max_bytes": self.prompt_cache.max_bytes}}

    # -- the thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            from ..decode.batch import BatchGenerator
            from ..models.loading import load, load_tokenizer

            self.model, self.tokenizer = load(self.model_path, dtype=self.dtype, adapter_path=self.adapter_path,
                                              dist=self.dist)
            if self.dist is not None:
                barrier(self.dist)
            self.args = self.model.args
            self.http_tokenizer = load_tokenizer(self.model.model_path)
            self.gen = BatchGenerator(self.model, self.tokenizer, max_batch=self.max_batch)
        except BaseException as e:  # reported by start() on the caller's thread
            self._error = e if isinstance(e, RefusionError) else RefusionError(
                f"cannot load the model: {type(e).__name__}: {e}")
            self._ready.set()
            self._release()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException as e:  # a bug: requests get a 500 rather than hang
            if is_link_failure(e):  # a rank died or the link broke: the server cannot go on
                rank = f"rank {self.dist.rank}: " if self.dist is not None else ""
                errors().write(f"error: {rank}lost the other ranks ({' '.join(str(e).split())}): "
                               "a rank died or the link broke\n")
                errors().flush()
                os._exit(1)
            log.exception("the engine failed")
            self._end_all(APIError(500, "the model engine failed", code="engine_failed"))
        finally:
            self._stopping.set()  # no request is taken from now on
            self._end_all(APIError(503, "the server is shutting down", code="shutting_down"))
            self._release()

    def _serve(self) -> None:
        leader = self.dist is None or self.dist.leader
        with watchdog.armed():
            while True:
                plan = self._plan() if leader else None
                if self.dist is not None:
                    wire = broadcast(self.dist, plan.wire() if leader else None)
                    plan = plan if leader else StepPlan.from_wire(wire)
                if plan.stop:
                    return
                self._apply(plan)

    def _plan(self) -> StepPlan:
        """Rank 0: this turn's plan, from the queue and the clients (waits up
        to ``IDLE_WAIT`` s for a request when nothing runs)."""
        if not self.running:
            with self.wake:
                if not self.waiting and not self._stopping.is_set():
                    self.wake.wait(IDLE_WAIT)
        if self._stopping.is_set():
            return StepPlan(stop=True)
        # a client that left: its request leaves the batch, its memory goes
        plan = StepPlan(cancelled=[uid for uid, j in self.running.items() if j.cancelled.is_set()])
        room = self.max_batch - len(self.running) + len(plan.cancelled)
        if room <= 0:
            return plan
        with self.wake:
            while self.waiting and len(plan.admitted) < room:
                job = self.waiting.popleft()
                if job.cancelled.is_set():  # its client left while it waited
                    self.counts["cancelled"] += 1
                else:
                    plan.admitted.append(job)
            peers = plan.admitted + list(itertools.islice(self.waiting, PEERS))
        plan.peers = [j.request.prompt_ids for j in peers]
        return plan

    def _apply(self, plan: StepPlan) -> None:
        """One turn, the same on every rank: cancel, admit, step."""
        for uid in plan.cancelled:
            if uid in self.running:
                self._close(self.running[uid], "cancelled")
        for i, job in enumerate(plan.admitted):
            try:
                self._start(job, plan.peers[:i] + plan.peers[i + 1:])
            except Exception as e:  # a bug or out of memory: this request fails, the server stays up
                if is_link_failure(e):
                    raise
                log.exception("cannot start a request")
                self._close(job, "failed", APIError(500, f"cannot start the request: {type(e).__name__}: {e}"))
        if not self.running:
            return
        self.counts["steps"] += 1
        self.counts["step_rows"] += len(self.running)
        for response in self.gen.step():
            self._route(response)

    def _start(self, job: Job, peers: List[List[int]]) -> None:
        """Start a request; ``peers``: the prompt ids of the others admitted
        or waiting (a prefix they share is prefilled once)."""
        from ..decode.cache import CommittedCache

        ids = job.request.prompt_ids
        n, cache = self.prompt_cache.lookup(ids, [j.cache for j in self.running.values()])
        job.cached = n
        shared = min(len(ids) - 1, max((prefix_length(ids, p) for p in peers), default=0))
        if shared - n >= SHARED_PREFIX and self.prompt_cache.max_bytes > 0:
            cache = cache or CommittedCache.for_model(self.model)
            prefill(self.model, cache, ids[n:shared])  # once; the others find it in the prompt cache
            self.prompt_cache.insert(cache)
            self.counts["prefill_tokens"] += shared - n
            n = shared
        job.cache = cache or CommittedCache.for_model(self.model)
        try:
            job.uid = self.gen.insert(ids[n:], job.request.params, cache=job.cache)
        except RefusionError as e:
            return self._close(job, "failed", APIError(400, str(e), code="invalid_request"))
        self.counts["prefill_tokens"] += len(ids) - n
        self.counts["cached_tokens"] += job.cached
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        vocab = len(tok)
        job.shaper = TextShaper(lambda t: tok.decode([i for i in t if i < vocab and i != eos],
                                                     skip_special_tokens=True),
                                job.request.max_tokens, job.request.stop, eos)
        self.running[job.uid] = job
        job.post("start")

    def _route(self, r) -> None:
        job = self.running.get(r.uid)
        if job is None:  # ended earlier in this step
            return
        if r.finish_reason == "error":
            return self._close(job, "failed", APIError(500, f"generation failed: {r.error}"))
        text, reason = job.shaper.feed(r.text, r.tokens, final=r.finish_reason is not None)
        if text:
            job.post("text", text)
        reason = reason or r.finish_reason
        if reason is None:
            return
        prompt, completion = len(job.request.prompt_ids), len(job.shaper.tokens)
        self.prompt_cache.insert(job.cache)  # the conversation so far, for its next turn
        self._close(job, "completed")
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": job.cached}}
        if r.stats is not None:  # ReFusion's own: the block layout used and the forwards it took
            usage.update(layout=dict(r.stats.layout), forwards=r.stats.forwards,
                         tokens_per_forward=round(r.stats.tokens_per_forward, 4))
        stats = r.stats.as_dict() if r.stats else None
        if stats is not None and self.dist is not None:
            stats["distributed"] = self.dist.as_dict()
        job.post("done", {"finish_reason": reason, "stats": stats, "usage": usage})

    def _close(self, job: Job, outcome: str, error: Optional[APIError] = None) -> None:
        """Take a request out of the batch and free its cache now."""
        if job.uid is not None:
            self.gen.remove(job.uid)
            self.running.pop(job.uid, None)
        if error is not None:
            job.post("error", error)
        _free(job.cache)
        job.cache = None
        self.counts[outcome] += 1
        if not self.running:  # the batch is empty: hand the allocator's cached buffers back
            import mlx.core as mx

            mx.clear_cache()

    def _end_all(self, error: APIError) -> None:
        for job in list(self.running.values()):
            self._close(job, "failed", error)
        with self.wake:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for job in waiting:
            job.post("error", error)

    def _release(self) -> None:
        """Free this thread's arrays and MLX streams before it ends (left for
        interpreter exit, they can abort the process)."""
        import mlx.core as mx

        self.prompt_cache.entries.clear()
        self.model = self.tokenizer = self.gen = None
        gc.collect()
        try:
            mx.synchronize()
            mx.clear_streams()
        except Exception:  # pragma: no cover - older MLX without clear_streams
            pass


def _free(cache) -> None:
    """Drop a cache's buffers. A removed request's decoder loop is suspended
    in a reference cycle that only the garbage collector would break; the
    cache, nearly all of its memory, goes now."""
    if cache is not None:
        cache.keys = [None] * cache.num_layers
        cache.values = [None] * cache.num_layers
        cache.tokens, cache.positions, cache.capacity = [], [], 0
