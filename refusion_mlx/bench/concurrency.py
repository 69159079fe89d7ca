"""Many requests at once: aggregate tokens/s and latency per request for 1, 2,
4, 8 ... concurrent clients, decoded in-process by continuous batching.

Every level decodes the same workload -- the suite's prompts, ``rounds``
times over -- so the tokens are the same and the aggregate tokens/s compare
like for like, against one request at a time (N = 1). N clients take the
next request of the workload as soon as their previous one ends; it joins
the batch at the next step boundary, so the batch mixes prompts and phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..decode.batch import BatchGenerator
from ..decode.params import RefusionParams
from .runs import storage_of
from .suite import BenchError


@dataclass
class LevelResult:
    """One concurrency level: what was decoded and how fast."""

    clients: int
    requests: int
    tokens: int
    wall_seconds: float
    steps: int
    latencies: List[float] = field(default_factory=list)  # seconds, per request
    first_text: List[float] = field(default_factory=list)  # seconds to the first released text
    peak_memory_gb: float = 0.0
    prefill_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        lat = np.array(self.latencies or [0.0])
        ttft = np.array(self.first_text or [0.0])
        return {"clients": self.clients, "requests": self.requests, "tokens": self.tokens,
                "wall_seconds": round(self.wall_seconds, 4), "steps": self.steps,
                "tokens_per_second": round(self.tokens_per_second, 2),
                "latency_mean_s": round(float(lat.mean()), 4),
                "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
                "latency_p90_s": round(float(np.percentile(lat, 90)), 4),
                "first_text_p50_s": round(float(np.percentile(ttft, 50)), 4),
                "peak_memory_gb": round(self.peak_memory_gb, 4)}


def run_level(model, tokenizer, prompts: Sequence[List[int]], params: Sequence[RefusionParams],
              clients: int, rounds: int, kv: Optional[dict] = None) -> LevelResult:
    """The workload (``prompts`` x ``rounds``) through ``clients`` concurrent
    clients (``kv``: ``kv_bits`` and ``kv_group_size`` of their caches)."""
    gen = BatchGenerator(model, tokenizer, max_batch=clients, storage=storage_of(kv, model))
    work = [i for _ in range(rounds) for i in range(len(prompts))]
    owner: Dict[int, list] = {}  # uid -> [start time, first text time]

    def submit() -> None:
        i = work[len(result.latencies) + len(owner)]
        owner[gen.insert(prompts[i], params[i])] = [time.perf_counter(), None]

    result = LevelResult(clients, len(work), 0, 0.0, 0)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in range(min(clients, len(work))):
        submit()
    while gen.has_work:
        for r in gen.step():
            entry = owner[r.uid]
            result.tokens += len(r.tokens)
            if r.text and entry[1] is None:
                entry[1] = time.perf_counter()
            if r.finish_reason is not None:
                if r.error is not None:
                    raise BenchError(f"a benchmark request failed: {r.error}")
                start, first = owner.pop(r.uid)
                now = time.perf_counter()
                result.latencies.append(now - start)
                result.first_text.append((first or now) - start)
                result.prefill_tokens += r.stats.prompt_tokens
                if len(result.latencies) + len(owner) < len(work):
                    submit()
        result.steps += 1
    result.wall_seconds = time.perf_counter() - t0
    result.peak_memory_gb = mx.get_peak_memory() / 1e9
    return result


def run_levels(model, tokenizer, prompts, params, levels: Sequence[int], rounds: int,
               warmup: bool = True, log: Optional[Callable[[str], None]] = None,
               kv: Optional[dict] = None) -> List[LevelResult]:
    """Every level in turn (after one untimed warm-up pass at the widest)."""
    say = log or (lambda _m: None)
    if warmup:
        run_level(model, tokenizer, prompts[:max(levels)], params, max(levels), 1, kv)
    out = []
    for n in levels:
        r = run_level(model, tokenizer, prompts, params, n, rounds, kv)
        say(f"{n} clients: {r.tokens} tokens in {r.wall_seconds:.2f} s, {r.tokens_per_second:.0f} tokens/s")
        out.append(r)
    return out


def baseline(levels: Sequence[dict]) -> Tuple[int, float]:
    """The level the others are compared with: one client when it was measured (in any place of the
    list), else the fewest; (its clients, its tokens/s)."""
    if not levels:
        return 1, 0.0
    base = min(levels, key=lambda d: d["clients"])
    return base["clients"], base["tokens_per_second"]


def format_levels(results: Sequence[LevelResult], format_table) -> str:
    clients, base = baseline([r.as_dict() for r in results])
    rows = []
    for r in results:
        d = r.as_dict()
        rows.append([r.clients, r.requests, r.tokens, d["wall_seconds"], d["tokens_per_second"],
                     f"{d['tokens_per_second'] / base:.2f}x" if base else "-", d["latency_p50_s"],
                     d["latency_p90_s"], d["first_text_p50_s"], r.steps, round(r.peak_memory_gb * 1000)])
    return format_table(["clients", "requests", "tokens", "wall s", "tok/s", f"vs {clients}", "latency p50 s",
                         "p90 s", "first text p50 s", "steps", "peak MB"], rows)
