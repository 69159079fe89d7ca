"""The server's numbers for Prometheus (``GET /metrics``).

The engine thread records into a :class:`ServerMetrics` (counters by
outcome and API, token counts, two histograms), which ``/health`` also
reads as one consistent snapshot; :func:`exposition` hands them, with the
gauges of the moment (:func:`gauges`: queue, batch, prompt cache, KV
reservations, MLX memory), to ``prometheus_client``, the format's reference
implementation, which writes Prometheus' text format or OpenMetrics, as the
scraper's ``Accept`` asks. Every name starts with ``refusion_``.

The counts are kept here, under one lock, rather than in the library's
metric objects: ``/health`` needs them read together, and the library's
values are read back only through private fields.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Dict, Optional, Sequence, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families

from .apis import APIS

CONTENT_TYPE = choose_encoder("")[1]  # Prometheus' text format, 0.0.4 (OpenMetrics when the scraper asks for it)
OUTCOMES = ("completed", "cancelled", "failed", "refused")
STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKENS_PER_FORWARD = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Histogram:
    """Cumulative buckets (upper bounds), a sum and a count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def family(self, name: str, text: str) -> HistogramMetricFamily:
        running, buckets = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            running += n
            buckets.append((_bound(bound), running))
        return HistogramMetricFamily(name, text, buckets=buckets, sum_value=self.sum)


class ServerMetrics:
    """What the engine counts while it runs, read by ``/health`` and ``/metrics``.

    ``counts``: requests by outcome (``OUTCOMES``), ``kv_waits``, ``steps``, ``step_rows``
    (requests summed over steps), ``generated_tokens``, ``prefill_tokens``,
    ``cached_tokens``, ``tool_calls``, ``tool_call_failures``, ``tool_calls_cut``; ``apis``:
    requests by (API, outcome); ``http_errors``: error responses by status.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: "collections.Counter[str]" = collections.Counter()
        self.apis: "collections.Counter[Tuple[str, str]]" = collections.Counter()
        self.http_errors: "collections.Counter[int]" = collections.Counter()
        self.step_seconds = Histogram(STEP_SECONDS)
        self.tokens_per_forward = Histogram(TOKENS_PER_FORWARD)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def outcome(self, api: str, outcome: str) -> None:
        """A request of ``api`` ended with ``outcome`` (one of OUTCOMES)."""
        with self.lock:
            self.counts[outcome] += 1
            self.apis[api, outcome] += 1

    def tool_calls(self, parsed: int, failed: int, cut: int = 0) -> None:
        """An answer's calls: those read as calls, those that did not parse
        (left as text), and the one max_tokens cut short (left out)."""
        with self.lock:
            self.counts["tool_calls"] += parsed
            self.counts["tool_call_failures"] += failed
            self.counts["tool_calls_cut"] += cut

    def read(self, names: Sequence[str]) -> Dict[str, int]:
        with self.lock:
            return {k: self.counts[k] for k in names}

    def http_error(self, status: int) -> None:
        with self.lock:
            self.http_errors[status] += 1

    def step(self, seconds: float, rows: int, tokens: int) -> None:
        """One engine step over ``rows`` requests: its wall time and the tokens it committed (one forward)."""
        with self.lock:
            self.counts["steps"] += 1
            self.counts["step_rows"] += rows
            self.step_seconds.observe(seconds)
            self.tokens_per_forward.observe(tokens)


# the plain counters: name -> ServerMetrics' count
COUNTS = {"refusion_kv_waits_total": "kv_waits", "refusion_steps_total": "steps",
          "refusion_generated_tokens_total": "generated_tokens", "refusion_prefilled_tokens_total": "prefill_tokens",
          "refusion_cached_prompt_tokens_total": "cached_tokens"}
# (name, type, help) of each metric, in the order written
METRICS: Tuple[Tuple[str, str, str], ...] = (
    ("refusion_requests_total", "counter", "Requests that ended, by outcome (refused: over --max-kv-bytes)."),
    ("refusion_api_requests_total", "counter", "Requests that ended, by API (chat.completions, completions, "
                                               "responses, messages) and outcome."),
    ("refusion_tool_calls_total", "counter", "Tool calls in answers: parsed into calls, unparsed (left as text), "
                                         "or cut short by max_tokens (left out)."),
    ("refusion_http_errors_total", "counter", "Error responses sent, by HTTP status."),
    ("refusion_requests_active", "gauge", "Requests in the batch."),
    ("refusion_requests_queued", "gauge", "Requests waiting for a batch row or KV memory."),
    ("refusion_kv_waits_total", "counter", "Requests that waited in the queue for KV memory (--max-kv-bytes)."),
    ("refusion_steps_total", "counter", "Engine steps (batched forwards)."),
    ("refusion_generated_tokens_total", "counter", "Answer tokens released to clients."),
    ("refusion_prefilled_tokens_total", "counter", "Prompt tokens prefilled (not found in the prompt cache)."),
    ("refusion_cached_prompt_tokens_total", "counter", "Prompt tokens taken from the prompt cache."),
    ("refusion_prompt_cache_entries", "gauge", "Entries in the prompt cache."),
    ("refusion_prompt_cache_bytes", "gauge", "Bytes held by the prompt cache."),
    ("refusion_prompt_cache_max_bytes", "gauge", "The prompt cache's budget (--prompt-cache-bytes)."),
    ("refusion_kv_reserved_bytes", "gauge", "KV memory reserved by the requests in the batch."),
    ("refusion_kv_max_bytes", "gauge", "The KV budget of admission (--max-kv-bytes)."),
    ("refusion_kv_bits", "gauge", "Bits per cached key and value (--kv-bits); 0: the model's dtype."),
    ("refusion_kv_bytes_per_token", "gauge", "KV bytes one cached token costs, every layer, as it is kept."),
    ("refusion_memory_active_bytes", "gauge", "MLX memory in use (mx.get_active_memory)."),
    ("refusion_memory_cache_bytes", "gauge", "MLX allocator cache (mx.get_cache_memory)."),
    ("refusion_memory_peak_bytes", "gauge", "MLX peak memory (mx.get_peak_memory)."),
    ("refusion_step_seconds", "histogram", "Wall time of one engine step (one batched forward)."),
    ("refusion_tokens_per_forward", "histogram", "Tokens committed by one step over the whole batch."),
    ("refusion_engine_up", "gauge", "1 while the engine thread serves and no step is stuck past the watchdog."),
)


def families(metrics: ServerMetrics, gauges: Dict[str, float]) -> list:
    """``metrics``' counters and histograms and the ``gauges`` given (by name,
    as in METRICS; those not given are left out), in METRICS' order."""
    def counter(name, text, label, rows):
        family = CounterMetricFamily(name, text, labels=[label] if label else None)
        for value, n in rows:
            family.add_metric([value] if label else [], n)
        return family

    with metrics.lock:
        c = metrics.counts
        made = {
            "refusion_requests_total": lambda t: counter("refusion_requests", t, "outcome", [(o, c[o]) for o in OUTCOMES]),
            "refusion_api_requests_total": lambda t: _api_family(metrics, t),
            "refusion_tool_calls_total": lambda t: counter("refusion_tool_calls", t, "result", [
                ("parsed", c["tool_calls"]), ("unparsed", c["tool_call_failures"]), ("cut", c["tool_calls_cut"])]),
            "refusion_http_errors_total": lambda t: counter("refusion_http_errors", t, "status", [
                (str(s), n) for s, n in sorted(metrics.http_errors.items())]),
            "refusion_step_seconds": lambda t: metrics.step_seconds.family("refusion_step_seconds", t),
            "refusion_tokens_per_forward": lambda t: metrics.tokens_per_forward.family("refusion_tokens_per_forward", t),
        }
        for name, key in COUNTS.items():
            made[name] = lambda t, name=name, key=key: counter(name, t, None, [(None, c[key])])
        out = []
        for name, kind, text in METRICS:
            if name in made:
                out.append(made[name](text))
            elif name in gauges:
                out.append(GaugeMetricFamily(name, text, value=gauges[name]))
    return out


def _api_family(metrics: ServerMetrics, text: str) -> CounterMetricFamily:
    family = CounterMetricFamily("refusion_api_requests", text, labels=["api", "outcome"])
    for api in APIS:
        for outcome in OUTCOMES:
            family.add_metric([api, outcome], metrics.apis[api, outcome])
    return family


class _Families:
    """The families of one scrape, as prometheus_client's collector interface."""

    def __init__(self, made: list):
        self.made = made

    def collect(self):
        return iter(self.made)


def exposition(metrics: ServerMetrics, gauges: Dict[str, float], accept: Optional[str] = None) -> Tuple[bytes, str]:
    """What ``/metrics`` answers -- (body, content type) -- in the format the
    scraper's ``accept`` header asks for (Prometheus' text format by default)."""
    encode, content_type = choose_encoder(accept or "")
    return encode(_Families(families(metrics, gauges))), content_type


def gauges(state: dict, up: bool) -> dict:
    """The gauges of METRICS from the engine's ``snapshot()``, MLX's memory counters and ``up``."""
    import mlx.core as mx

    cache, kv = state["prompt_cache"], state["kv"]
    return {"refusion_requests_active": state["active"], "refusion_requests_queued": state["queued"],
            "refusion_prompt_cache_entries": cache["entries"], "refusion_prompt_cache_bytes": cache["bytes"],
            "refusion_prompt_cache_max_bytes": cache["max_bytes"],
            "refusion_kv_reserved_bytes": kv["reserved_bytes"], "refusion_kv_max_bytes": kv["max_bytes"] or 0,
            "refusion_kv_bits": kv["bits"] or 0, "refusion_kv_bytes_per_token": kv["bytes_per_token"],
            "refusion_memory_active_bytes": mx.get_active_memory(),
            "refusion_memory_cache_bytes": mx.get_cache_memory(),
            "refusion_memory_peak_bytes": mx.get_peak_memory(), "refusion_engine_up": int(up)}


def parse(text: str) -> Dict[str, float]:
    """The samples of an exposition, ``name{labels}`` -> value (for tests and the soak)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def _bound(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return str(int(x)) if float(x).is_integer() else repr(float(x))
