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

Admission is memory-aware: a request reserves the KV rows its decoder can
write (prompt + budget, :func:`.memory.kv_rows`) against ``max_kv_bytes``; one that
could never fit is refused when submitted (400, naming the numbers), one that
fits waits until finished requests free enough. A step that raises fails the
requests in it (500) and the engine goes on; ``health()`` reports an engine
that died or whose step runs past ``watchdog_seconds``.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import logging
import threading
import time
from typing import Dict, Optional, Tuple

from ..errors import RefusionError
from ..decode.prefix import prefix_length
from .memory import default_max_kv_bytes, growth_rows, kv_row_bytes, kv_rows
from .metrics import ServerMetrics
from .prompt_cache import PromptCache, prefill
from .schemas import APIError, Request
from .slots import step_commits
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
DEFAULT_WATCHDOG_SECONDS = 120.0  # a step running longer makes /health answer 503


class Job:
    """A request in flight: the engine thread posts events to the HTTP side's
    asyncio queue: ("start", None), ("text", str), ("done", dict), ("error", APIError);
    with ``include_commits``, a step's text comes as ("commits", (text, its commits))."""

    def __init__(self, request: Request, loop):
        self.request, self.loop = request, loop
        self.events: "asyncio.Queue[tuple]" = asyncio.Queue()
        self.cancelled = threading.Event()
        self.uid: Optional[int] = None
        self.cache = None
        self.cached = 0
        self.kv_bytes = 0  # reserved against the engine's max_kv_bytes while it runs
        self.waited = False  # it waited in the queue for KV memory
        self.shaper: Optional[TextShaper] = None

    def post(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass


class Engine:
    """Loads the model and runs every generation, batched, on one thread."""

    def __init__(self, model_path: Optional[str] = None, dtype: Optional[str] = None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_queue: int = DEFAULT_MAX_QUEUE,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, adapter_path: Optional[str] = None,
                 max_kv_bytes: Optional[int] = None, watchdog_seconds: float = DEFAULT_WATCHDOG_SECONDS,
                 prompt_cache_dir: Optional[str] = None, prompt_cache_dir_bytes: Optional[int] = None):
        self.model_path, self.dtype, self.adapter_path = model_path, dtype, adapter_path
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.prompt_cache_dir = prompt_cache_dir
        self.prompt_cache_dir_bytes = prompt_cache_bytes if prompt_cache_dir_bytes is None else prompt_cache_dir_bytes
        self.max_kv_bytes = max_kv_bytes  # None: derived when the model is loaded (default_max_kv_bytes)
        self.kv_row_bytes = 0  # the model's KV bytes per token, known once it is loaded
        self.kv_reserved = 0  # by the requests in the batch
        self.watchdog_seconds = watchdog_seconds
        self.waiting: "collections.deque[Job]" = collections.deque()
        self.running: Dict[int, Job] = {}
        self.starting = 0  # taken from the queue, not yet in the batch (counted as queued)
        self.wake = threading.Condition()  # guards waiting, running, starting, kv_reserved
        self.metrics = ServerMetrics()
        self.busy_since: Optional[float] = None  # when the round in progress (admission, step) began
        self.model = self.tokenizer = self.gen = None
        self.args = None  # the model's config, read by the HTTP side
        self.http_tokenizer = None  # the HTTP side's, behind tokenizer_lock
        self.tokenizer_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._error: Optional[BaseException] = None
        self._failed = False  # the engine thread ended on an error (not a shutdown)
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

    def health(self) -> Tuple[bool, str]:
        """(healthy, status): "ok", "stopping", "dead" (the engine thread ended) or
        "stuck" (the step in progress has run past the watchdog)."""
        if self._failed or (self._thread.ident is not None and not self._thread.is_alive()):
            return False, "dead"
        if self._stopping.is_set():
            return False, "stopping"
        since = self.busy_since
        if since is not None and time.monotonic() - since > self.watchdog_seconds:
            return False, "stuck"
        return True, "ok"

    def kv_need(self, request: Request) -> int:
        """The KV bytes a request reserves while it runs (:func:`kv_rows`)."""
        return kv_rows(len(request.prompt_ids), request.params.layout().gen_length) * self.kv_row_bytes

    def submit(self, job: Job) -> None:
        job.kv_bytes = need = self.kv_need(job.request)
        if need > self.max_kv_bytes:
            self.metrics.add("refused")
            rows = need // max(1, self.kv_row_bytes)
            raise APIError(400, f"the request needs {need} bytes of KV cache ({rows} rows of "
                                f"{self.kv_row_bytes} bytes: prompt + max_tokens in whole slots, in steps of "
                                f"{growth_rows()}); the server's --max-kv-bytes is {self.max_kv_bytes}",
                           "max_tokens", "kv_memory_exceeded")
        with self.wake:
            if self._failed:
                raise APIError(503, "the model engine has stopped (see the server's log); restart the server",
                               code="engine_dead")
            if self._stopping.is_set():
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self.waiting) >= self.max_queue:
                raise APIError(503, f"the server is busy ({self.max_queue} requests waiting); retry later",
                               code="server_busy")
            self.waiting.append(job)
            self.wake.notify()

    def snapshot(self) -> dict:
        names = ("completed", "cancelled", "failed", "refused", "kv_waits", "steps", "step_rows",
                 "prefill_tokens", "cached_tokens", "generated_tokens")
        with self.wake:  # one consistent view: a request leaving the batch is counted as it leaves
            state = {"active": len(self.running), "queued": len(self.waiting) + self.starting,
                     "max_batch": self.max_batch, **self.metrics.read(names),
                     "kv": {"reserved_bytes": self.kv_reserved, "max_bytes": self.max_kv_bytes,
                            "bytes_per_token": self.kv_row_bytes}}
        return {**state, "prompt_cache": {"entries": len(self.prompt_cache), "bytes": self.prompt_cache.nbytes,
                                          "max_bytes": self.prompt_cache.max_bytes}}

    # -- the thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            from ..decode.batch import BatchGenerator
            from ..models.loading import load, load_tokenizer

            self.model, self.tokenizer = load(self.model_path, dtype=self.dtype, adapter_path=self.adapter_path)
            self.args = self.model.args
            self.http_tokenizer = load_tokenizer(self.model.model_path)
            self.gen = BatchGenerator(self.model, self.tokenizer, max_batch=self.max_batch)
            self._plan_memory()
            self._open_cache_dir()
        except BaseException as e:  # reported by start() on the caller's thread
            self._error = e if isinstance(e, RefusionError) else RefusionError(
                f"cannot load the model: {type(e).__name__}: {e}")
            self._ready.set()
            self._release()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException:  # a bug: requests get a 500 rather than hang
            log.exception("the engine failed")
            self._failed = True
            self._end_all(APIError(500, "the model engine failed", code="engine_failed"))
        finally:
            self._stopping.set()  # no request is taken from now on
            self._end_all(APIError(503, "the server is shutting down", code="shutting_down"))
            self._release()

    def _plan_memory(self) -> None:
        """The KV bytes per token of the loaded model, and --max-kv-bytes when not given."""
        self.kv_row_bytes = kv_row_bytes(self.model)
        if self.max_kv_bytes is None:
            self.max_kv_bytes = default_max_kv_bytes(self.model, self.prompt_cache.max_bytes, self.kv_row_bytes)

    def _open_cache_dir(self) -> None:
        """With --prompt-cache-dir: the files of this model back the prompt cache, reloaded now."""
        if not self.prompt_cache_dir:
            return
        from ..decode.cache import CommittedCache
        from .cache_files import CacheDir, model_fingerprint

        fingerprint = model_fingerprint(self.model.model_path, str(CommittedCache.for_model(self.model).dtype),
                                        self.adapter_path)
        try:
            store = CacheDir(self.prompt_cache_dir, self.prompt_cache_dir_bytes, fingerprint)
        except OSError as e:
            raise RefusionError(f"cannot use --prompt-cache-dir {self.prompt_cache_dir}: {e.strerror or e}") from None
        n = 0
        self.prompt_cache.store = store
        for tokens, cache in store.load(lambda: CommittedCache.for_model(self.model)):
            self.prompt_cache.restore(tokens, cache)
            n += 1
        log.info("prompt cache: %d entries reloaded from %s (%d kept in memory)", n, self.prompt_cache_dir,
                 len(self.prompt_cache))

    def _serve(self) -> None:
        while not self._stopping.is_set():
            self.busy_since = time.monotonic()  # the watchdog's clock: admission (prefills) and the step
            for job in [j for j in self.running.values() if j.cancelled.is_set()]:
                self._close(job, "cancelled")  # its client left: it leaves the batch, its memory goes
            self._admit()
            if not self.running:
                self.busy_since = None
                with self.wake:
                    if not self.waiting and not self._stopping.is_set():
                        self.wake.wait(0.25)
                continue
            t0 = time.monotonic()
            rows = len(self.running)
            try:
                responses = self.gen.step()
            except Exception as e:  # a bug or out of memory outside one request: the step's requests fail
                log.exception("a step failed")
                self._fail_running(APIError(500, f"the step failed: {_brief(e)}", code="step_failed"))
                continue
            self.metrics.step(time.monotonic() - t0, rows,
                              sum(len(c.tokens) for r in responses for c in r.commits))
            for response in responses:
                self._route(response)

    def _fail_running(self, error: APIError) -> None:
        for job in list(self.running.values()):
            self._close(job, "failed", error)

    def _admit(self) -> None:
        """Queued requests in order, while a batch row and their KV reservation are free."""
        with self.wake:
            batch = []
            while self.waiting and len(self.running) + len(batch) < self.max_batch:
                job = self.waiting[0]
                if job.cancelled.is_set():  # its client left while it waited
                    self.waiting.popleft()
                    self.metrics.add("cancelled")
                    continue
                if self.kv_reserved + job.kv_bytes > self.max_kv_bytes:
                    if not job.waited:
                        job.waited = True
                        self.metrics.add("kv_waits")
                    break  # first in, first served: it waits for memory, those behind it too
                self.waiting.popleft()
                self.kv_reserved += job.kv_bytes
                batch.append(job)
            self.starting = len(batch)
            peers = batch + list(itertools.islice(self.waiting, PEERS))
        for job in batch:
            try:
                self._start(job, peers)
            except Exception as e:  # a bug or out of memory: this request fails, the server stays up
                log.exception("cannot start a request")
                self._close(job, "failed", APIError(500, f"cannot start the request: {_brief(e)}",
                                                    code="start_failed"))

    def _start(self, job: Job, peers) -> None:
        from ..decode.cache import CommittedCache

        ids = job.request.prompt_ids
        n, cache = self.prompt_cache.lookup(ids, [j.cache for j in self.running.values()])
        job.cached = n
        shared = min(len(ids) - 1, max((prefix_length(ids, p.request.prompt_ids) for p in peers if p is not job),
                                       default=0))
        if shared - n >= SHARED_PREFIX and self.prompt_cache.max_bytes > 0:
            cache = cache or CommittedCache.for_model(self.model)
            prefill(self.model, cache, ids[n:shared])  # once; the others find it in the prompt cache
            self.prompt_cache.insert(cache)
            self.metrics.add("prefill_tokens", shared - n)
            n = shared
        job.cache = cache or CommittedCache.for_model(self.model)
        try:
            job.uid = self.gen.insert(ids[n:], job.request.params, cache=job.cache,
                                      max_tokens=job.request.max_tokens)
        except RefusionError as e:
            return self._close(job, "failed", APIError(400, str(e), code="invalid_request"))
        self.metrics.add("prefill_tokens", len(ids) - n)
        self.metrics.add("cached_tokens", job.cached)
        job.shaper = TextShaper(job.request.stop, self.tokenizer.eos_token_id)
        with self.wake:
            self.running[job.uid] = job
            self.starting -= 1
        job.post("start")

    def _route(self, r) -> None:
        job = self.running.get(r.uid)
        if job is None:  # ended earlier in this step
            return
        if r.finish_reason == "error":
            return self._close(job, "failed", APIError(500, f"generation failed: {r.error}",
                                                       code="generation_failed"))
        released = job.shaper.completion_tokens
        text, reason = job.shaper.feed(r.text, r.tokens, final=r.finish_reason is not None)
        self.metrics.add("generated_tokens", job.shaper.completion_tokens - released)
        if job.request.include_commits and r.commits:
            job.post("commits", (text, step_commits(self.tokenizer, job.request, r)))
        elif text:
            job.post("text", text)
        reason = reason or r.finish_reason
        if reason is None:
            return
        prompt, completion = len(job.request.prompt_ids), job.shaper.completion_tokens
        self.prompt_cache.insert(job.cache)  # the conversation so far, for its next turn
        self._close(job, "completed")
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": job.cached}}
        if r.stats is not None:  # ReFusion's own: the block layout used and the forwards it took
            usage.update(layout=dict(r.stats.layout), forwards=r.stats.forwards,
                         tokens_per_forward=round(r.stats.tokens_per_forward, 4))
        job.post("done", {"finish_reason": reason, "stats": r.stats.as_dict() if r.stats else None,
                          "usage": usage})

    def _close(self, job: Job, outcome: str, error: Optional[APIError] = None) -> None:
        """Take a request out of the batch and free its cache now."""
        if job.uid is not None:
            self.gen.remove(job.uid)
        if error is not None:
            job.post("error", error)
        _free(job.cache)
        job.cache = None
        with self.wake:  # leaves the batch and is counted in one view of /health
            if job.uid is None or self.running.pop(job.uid, None) is None:
                self.starting -= 1  # it never reached the batch
            self.kv_reserved -= job.kv_bytes
            job.kv_bytes = 0
            self.metrics.add(outcome)
        if not self.running:  # the batch is empty: hand the allocator's cached buffers back
            import mlx.core as mx

            mx.clear_cache()

    def _end_all(self, error: APIError) -> None:
        self._fail_running(error)
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


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _free(cache) -> None:
    """Drop a cache's buffers. A removed request's decoder loop is suspended
    in a reference cycle that only the garbage collector would break; the
    cache, nearly all of its memory, goes now."""
    if cache is not None:
        cache.free()
