"""The engine: the one thread that uses MLX.

It loads the model and drives one :class:`BatchGenerator`. Each turn of its
loop takes a :class:`Turn` from the :class:`~.scheduler.Scheduler` --
requests whose client has gone leave, waiting requests are admitted up to
``max_batch`` within ``max_kv_bytes`` -- starts each admitted request from
the longest prefix of its prompt the prompt cache or a running request
holds (its own copy; a request that shares a prefix with one ahead of it
that is still prefilling it waits for those rows: the scheduler's), scores the scoring ones (:mod:`.loglikelihood`), then one
``step()`` runs one batched forward. Each request's :class:`~.job.Job`
shapes its responses into events -- final in-order text, calls, the end
as an :class:`~.outcome.Outcome` -- which go to its asyncio queue; a
finished request's cache joins the prompt cache for its next turn.

Admission is memory-aware: a request reserves the KV rows its decoder can
write (:mod:`.memory`); one that could never fit is refused at once, one
that fits waits for memory. A step that raises fails
its requests and the engine goes on; ``health()`` reports an engine that
died or whose turn runs past ``watchdog_seconds``. The engine knows no HTTP:
it refuses or ends a request with a :class:`~.refusal.Refusal` (a reason and
a message), and the HTTP edge answers it with its API's status and shape.

Its settings are the server's one :class:`~..server_config.ServerConfig`.

Under ``mlx.launch`` every rank runs an engine; rank 0's takes the HTTP
requests, decides each turn's :class:`Turn` and broadcasts it, and every
rank applies it, so all ranks run the same forwards. Idle, rank 0 still
broadcasts an empty plan every ``IDLE_WAIT`` s, so the collectives'
watchdog (``distributed.watchdog``) can tell a quiet server from a dead link.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import List, Optional, Tuple

from ..._threads import free_streams
from ...cli.launch import ready
from ...distributed import watchdog
from ...distributed.broadcast import broadcast
from ...distributed.group import is_link_failure, lost_ranks, say_error
from ...decode.params import PARAM_NAMES
from ...errors import RefusionError, brief
from ..caches.prompt_cache import PromptCache
from ..server_config import ServerConfig
from .engine_request import EngineRequest
from .job import Job, Turn
from .loglikelihood import ScoringTask
from .memory import HeapTrim, KVCost, admission_budget
from .metrics import ServerMetrics
from .refusal import Reason, Refusal, field_of
from .scheduler import Scheduler
from .tool_calls import ToolFormat

log = logging.getLogger("refusion_mlx.server")

IDLE_WAIT = 0.25  # seconds the loop sleeps with nothing to do (then, on several ranks, a heartbeat)


class Engine:
    """Loads the model and runs every generation, batched, on one thread.

    ``dist``: the group under ``mlx.launch`` (``distributed.group.init``);
    rank 0's engine decides each step and the others follow (``Turn``)."""

    def __init__(self, config: Optional[ServerConfig] = None, dist=None):
        self.config = config = config or ServerConfig()
        self.dist = dist
        self.prompt_cache = PromptCache(config.prompt_cache_bytes)
        self.max_kv_bytes = config.max_kv_bytes  # None: derived when the model is loaded (default_max_kv_bytes)
        self.heap = HeapTrim()  # the heap a busy period freed, back to the system when it ends (glibc)
        self.storage = config.storage  # how the caches keep keys and values (--kv-bits)
        self.kv_cost = KVCost.of(None, self.storage)  # KV bytes per token as they are kept, once the model is loaded
        self.eos_id: Optional[int] = None  # the tokenizer's, known once it is loaded
        self.tool_format = None  # the model's ToolFormat (None: it takes no tools), known once it is loaded
        self.metrics = ServerMetrics()
        self.queue = Scheduler(config.max_batch, config.max_queue, self.metrics,  # the queue, the batch, admission
                               self.prompt_cache)
        self.running = self.queue.running  # the batch's jobs by uid (the scheduler's)
        self.busy_since: Optional[float] = None  # when the round in progress (admission, step) began
        self.model = self.tokenizer = self.gen = None
        self.args = None  # the model's config, read by the HTTP side
        self.http_tokenizers = ()  # the HTTP side's two (edge/lanes.py), once the model is loaded
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self.stopping_since: Optional[float] = None  # when stop() was first asked (the HTTP side's clock)
        self._error: Optional[BaseException] = None
        self._failed = False  # the engine thread ended on an error (not a shutdown)
        self._scored = 0  # scoring requests started (their uids: -1, -2, ...)
        self._score_turns = 0  # turns that did a piece of scoring: the clock of whose piece is next
        self._thread = threading.Thread(target=self._run, name="refusion-engine", daemon=True)

    # -- life cycle and the HTTP side's calls ----------------------------------

    def start(self) -> None:
        """Load the model on the engine thread; raise its RefusionError if it fails (once the thread has
        freed its arrays: MLX work left running at interpreter exit aborts the process)."""
        self._thread.start()
        while not self._ready.wait(0.1):
            pass
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self, timeout: float = 0.0) -> None:
        """End every request (shutting down) after the step in progress; wait ``timeout`` s for the thread.
        Under mlx.launch a step that cannot end (a rank died mid-collective) ends the process, in one line."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            watchdog.hurry()
        self._stopping.set()
        with self.queue.wake:
            self.queue.wake.notify()
        if timeout and self._thread.is_alive():
            self._thread.join(timeout)

    def health(self) -> Tuple[bool, str]:
        """(healthy, status): "ok", "stopping", "dead" (the engine thread ended) or
        "stuck" (the step in progress has run past the watchdog)."""
        if self._failed or (self._thread.ident is not None and not self._thread.is_alive()):
            return False, "dead"
        if self._stopping.is_set():
            return False, "stopping"
        since = self.busy_since
        if since is not None and time.monotonic() - since > self.config.watchdog_seconds:
            return False, "stuck"
        return True, "ok"

    def follow(self) -> None:
        """A rank other than 0: load, then run rank 0's plans until it stops."""
        self.start()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def job(self, request: EngineRequest, loop=None) -> Job:
        """The request's Job, as every rank makes it (``loop``: where its events go)."""
        return Job(request, loop, self.kv_cost.need(request), self.eos_id, self.tool_format)

    def submit(self, request: EngineRequest, loop) -> Job:
        """Queue a request; its Job posts the answer's events to ``loop``. A
        :class:`Refusal` when it can never fit in KV memory or cannot wait."""
        return self.submit_all([request], loop)[0]

    def submit_all(self, requests: List[EngineRequest], loop) -> List[Job]:
        """Queue one HTTP request's choices, all or none, as one group (the
        scheduler shares rows between groups): :meth:`submit` for each."""
        jobs = [self.job(request, loop) for request in requests]
        for job in jobs:
            if job.kv_bytes > self.max_kv_bytes:
                self.metrics.outcome(job.request.api, "refused")
                raise self.kv_cost.refusal(job.request, job.kv_bytes, self.max_kv_bytes)
        for job in jobs[1:]:
            job.group = jobs[0]
        with self.queue.wake:
            if self._failed:
                raise Refusal(Reason.ENGINE_DEAD, "the model engine has stopped (see the server's log); "
                                                  "restart the server")
            if self._stopping.is_set():
                raise Refusal(Reason.SHUTTING_DOWN, "the server is shutting down")
            self.queue.put(jobs)
        return jobs

    def snapshot(self) -> dict:
        names = ("completed", "cancelled", "failed", "refused", "kv_waits", "steps", "step_rows",
                 "prefill_tokens", "cached_tokens", "generated_tokens")
        with self.queue.wake:  # one consistent view: a request leaving the batch is counted as it leaves
            batch, numbers = self.queue.counts(self.max_kv_bytes), self.metrics.read(names)
        kv = batch.pop("kv")
        state = {**batch, **numbers, "kv": {**kv, **self.kv_cost.as_dict()}}
        return {**state, "prompt_cache": {"entries": len(self.prompt_cache), "bytes": self.prompt_cache.nbytes,
                                          "max_bytes": self.prompt_cache.max_bytes}}

    # -- the thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            from ...decode.batch import BatchGenerator
            from ...decode.ll_tokenizer import warm as ll_warm
            from ...models.loading import load, load_tokenizer

            if self.dist is not None and self.dist.seed is not None:  # MLX's generator is this thread's own:
                import mlx.core as mx  # every rank's the same, or unseeded drafts part and the collectives hang

                mx.random.seed(self.dist.seed)
            config = self.config
            self.model, self.tokenizer = load(config.model, dtype=config.dtype, adapter_path=config.adapter_path,
                                              dist=self.dist, chat_template=config.chat_template)
            ready(self.dist)
            self.args, self.eos_id = self.model.args, self.tokenizer.eos_token_id
            self.tool_format = ToolFormat.of(self.tokenizer)
            self.http_tokenizers = tuple(load_tokenizer(self.model.model_path, config.chat_template) for _ in range(2))
            ll_warm(self.tokenizer, self.http_tokenizers, self.args.vocab_size, self.eos_id)  # tools' grammars
            self.gen = BatchGenerator(self.model, self.tokenizer, max_batch=config.max_batch,
                                      storage=self.storage)  # checked against the model's head dimension
            open_context = None if config.max_tokens_given else self.args.max_position_embeddings  # Responses'
            self.kv_cost, self.max_kv_bytes = admission_budget(self.model, self.storage, config.max_kv_bytes,
                                                               self.prompt_cache.max_bytes, config.decoding,
                                                               open_context)
            if config.prompt_cache_dir:  # the files of this model back the prompt cache, reloaded now
                from ..caches.cache_files import attach

                attach(self.prompt_cache, self.model, config.prompt_cache_dir, config.prompt_cache_dir_bytes,
                       config.adapter_path, storage=self.storage)
        except BaseException as e:  # reported by start() on the caller's thread
            self._error = e if isinstance(e, RefusionError) else RefusionError(
                f"cannot load the model: {type(e).__name__}: {e}")
            self._ready.set()
            self._release()
            return
        self._ready.set()
        lost = None
        try:
            self._serve()
        except BaseException as e:  # a bug: requests get a 500 rather than hang
            if is_link_failure(e):  # a rank died or the link broke: the server cannot go on
                lost = e
            else:
                log.exception("the engine failed")
                self._failed = True
                self._end_all(Refusal(Reason.ENGINE_FAILED, "the model engine failed"))
        finally:
            self._stopping.set()  # no request is taken from now on
            self._end_all(Refusal(Reason.SHUTTING_DOWN, "the server is shutting down"))
            if lost is not None:  # its line, then the HTTP side delivers those answers and the process ends
                say_error(lost_ranks(lost))
                watchdog.end()
            self._release()

    def _serve(self) -> None:
        leader = self.dist is None or self.dist.leader
        with watchdog.armed():
            while True:
                plan = self._decide() if leader else None
                if self.dist is not None:
                    wire = broadcast(self.dist, plan.wire() if leader else None)
                    plan = plan if leader else Turn.from_wire(wire, self.job)
                if plan.stop:
                    return
                self._apply(plan)

    def _decide(self) -> Turn:
        """Rank 0: this turn's plan (:meth:`.scheduler.Scheduler.next_turn`), from the
        queue and the clients; waits up to ``IDLE_WAIT`` s for a request when nothing runs."""
        if not self.running:
            if self.busy_since is not None:  # a busy period ended
                self.heap.busy()
            self.heap.idle()  # its freed heap back to the system, when it is time (Linux)
            self.busy_since = None
            self.queue.idle_wait(IDLE_WAIT, self._stopping)
        if self._stopping.is_set():
            return Turn(stop=True)
        self.busy_since = time.monotonic()  # the watchdog's clock: admission (prefills) and the step
        return self.queue.next_turn(self.max_kv_bytes, decoding=self.gen is not None and self.gen.has_work)

    def _apply(self, plan: Turn) -> None:
        """One turn, the same on every rank: cancel, admit, a piece of each
        scoring request's work, one decoding step. A step that raises fails
        the requests in it; the engine goes on (a lost rank ends it)."""
        for uid in plan.cancelled:
            if uid in self.running:
                self._close(self.running[uid], "cancelled")
        for job in plan.admitted:
            try:
                self._start(job)
            except Exception as e:  # a bug or out of memory: this request fails, the server stays up
                if is_link_failure(e):
                    raise
                log.exception("cannot start a request")
                self._close(job, "failed", Refusal(Reason.START_FAILED, f"cannot start the request: {brief(e)}"))
        if plan.score:
            self._score()
        if not self.gen.has_work:
            return
        t0 = time.monotonic()
        rows = len(self.running)
        try:
            responses = self.gen.step()
        except Exception as e:  # a bug or out of memory outside one request: the step's requests fail
            if is_link_failure(e):
                raise
            log.exception("a step failed")
            self._fail_running(Refusal(Reason.STEP_FAILED, f"the step failed: {brief(e)}"))
            return
        self.metrics.step(time.monotonic() - t0, rows, sum(len(c.tokens) for r in responses for c in r.commits))
        for response in responses:
            self._route(response)

    def _fail_running(self, error: Refusal) -> None:
        for job in list(self.running.values()):
            self._close(job, "failed", error)

    def _start(self, job: Job) -> None:
        """Start a request from the rows the prompt cache or a running request holds of its prompt.
        A scoring request gets its task, and a uid below 0 (the generator knows it not)."""
        from ...decode.cache import CommittedCache

        if job.request.scoring is not None:
            self._scored += 1
            job.task = ScoringTask(job.request, int(self.model.args.mask_token_id), self.storage)
            job.uid = -self._scored
            # its first piece next, but for those that waited longer than the one just served
            job.served_at = self._score_turns - 0.5
            self.queue.started(job)
            return job.post("start")

        ids = job.request.prompt_ids
        n, cache = self.prompt_cache.lookup(ids, job.request.cache_owner, self.queue.caches())
        job.cached, job.cache = n, cache or CommittedCache.for_model(self.model, storage=self.storage)
        try:
            request = job.request
            constraint = request.compiled if request.compiled is not None else request.constraint
            job.uid = self.gen.insert(ids[n:], request.params, cache=job.cache, constraint=constraint,
                                      logprobs=request.logprobs)
        except RefusionError as e:  # a constraint the engine cannot compile names its field
            constraint = job.request.constraint
            param = (constraint.name if constraint is not None and str(e).startswith(f"{constraint.name}:")
                     else field_of(str(e), PARAM_NAMES))  # logit_bias: a token id past the vocabulary
            return self._close(job, "failed", Refusal(Reason.INVALID_VALUE if param else Reason.INVALID_REQUEST,
                                                      str(e), param))
        self.metrics.add("prefill_tokens", len(ids) - n)
        self.metrics.add("cached_tokens", job.cached)
        self.queue.started(job)
        job.post("start")

    def _score(self) -> None:
        """A piece of one scoring request's work (:meth:`.loglikelihood.ScoringTask.step`), each in turn (a
        request has one job running: the scheduler's), the finished end. A request that comes has the next
        piece, after those waiting longer than the one just served; decoding then has the engine for as long
        as the piece took (``Scheduler.scored``)."""
        t0 = time.monotonic()
        scoring = [j for j in self.running.values() if j.task is not None]
        if not scoring:
            return
        self._score_turns += 1
        job = min(scoring, key=lambda j: (j.served_at, -j.uid))  # the longest unserved
        job.served_at = self._score_turns
        result = job.task.step(self.model, self.tokenizer)
        if isinstance(result, Refusal):
            self._close(job, "failed", result)
        elif result is not None:
            self._finish(job, result)
        self.queue.scored(time.monotonic() - t0)

    def _route(self, r) -> None:
        job = self.running.get(r.uid)
        if job is None:  # ended earlier in this step
            return
        if r.finish_reason == "error" and r.error_param is not None:  # the request's fault (its schema)
            return self._close(job, "failed", Refusal(Reason.INVALID_VALUE, r.error, r.error_param))
        if r.finish_reason == "error":
            return self._close(job, "failed", Refusal(Reason.GENERATION_FAILED, f"generation failed: {r.error}"))
        events, reason, released = job.step(r, self.tokenizer)  # text (with its logprobs), commits, calls
        self.metrics.add("generated_tokens", released)
        for kind, payload in events:
            job.post(kind, payload)
        if reason is not None:  # cut by a stop string before the decoder ended: its figures so far, cache settled
            stats = r.stats if r.stats is not None else self.gen.end(r.uid)
            self._finish(job, job.outcome(reason, stats, self.dist))

    def _finish(self, job: Job, outcome) -> None:
        """The one place a request ends with its answer: counted, its cache kept for its next turn, closed."""
        if job.calls is not None:
            self.metrics.tool_calls(job.calls.calls, job.calls.failed, job.calls.cut)
        if job.cache is not None:
            self.prompt_cache.insert(job.cache, job.request.cache_owner)  # the conversation so far
        self._close(job, "completed")
        job.post("done", outcome)

    def _close(self, job: Job, outcome: str, error: Optional[Refusal] = None) -> None:
        """Take a request out of the batch and free its cache now."""
        if job.uid is not None and job.uid >= 0:  # in the generator (a scoring request's is below 0)
            self.gen.remove(job.uid)
        if error is not None:
            job.post("error", error)
        if job.cache is not None:  # a removed request's decoder loop is held in a reference cycle
            job.cache.free()  # only the garbage collector would break: its cache's memory goes now
        job.cache = None
        if self.queue.left(job, outcome):  # the batch is empty: hand the allocator's cached buffers back
            import mlx.core as mx

            mx.clear_cache()

    def _end_all(self, error: Refusal) -> None:
        self._fail_running(error)
        for job in self.queue.drain():
            job.post("error", error)

    def _release(self) -> None:
        """Free this thread's arrays and MLX streams before it ends (left for
        interpreter exit, they can abort the process)."""
        self.prompt_cache.clear()
        self.model = self.tokenizer = self.gen = None
        gc.collect()
        free_streams()
