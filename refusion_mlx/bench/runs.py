"""One timed generation per side: ReFusion (this package) and mlx-lm's
autoregressive (AR) decoding of the same weights.

Both sides are measured the same way, from the user's seat: wall time from
the call until the answer's last token has reached Python, through each
library's public ``stream_generate`` (so detokenization is included on both
sides). Counting rules, the same for both:

* tokens: the answer up to and including EOS (or the whole budget).
* prefill time: ReFusion's first forward (prompt plus the first block's
  masks, ``stats.seconds['prefill']``); AR's time to the first token.
* end-to-end tokens/s = tokens / wall; decode tokens/s = tokens produced
  after the prefill pass / (wall - prefill): AR's first token comes out of
  its prefill, so AR counts tokens - 1 there; ReFusion's first pass only
  plans, so it counts all its tokens. (mlx-lm's ``generation_tps`` counts
  the first token without its time; this does not.)
* forwards: model calls that contributed to the answer. mlx-lm prefills a
  prompt of P > 1 tokens as P-1 tokens then the last one (two calls) and
  dispatches one look-ahead step beyond the last token; that step is not
  counted and not timed (it is drained after the clock stops).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from ..decode.decoder import check_context
from ..decode.params import RefusionParams
from ..decode.stats import PHASES
from ..decode.stream import stream_generate


@dataclass
class RunResult:
    """What one side did on one prompt."""

    side: str  # "refusion" or "ar"
    generated_tokens: int
    forwards: int
    wall_seconds: float
    prefill_seconds: float
    phase_seconds: Dict[str, float]
    peak_memory_gb: float
    host_syncs: int
    steps: int
    finish_reason: str
    output_ids: List[int] = field(default_factory=list)
    text: str = ""
    committed_tokens: Optional[int] = None
    lookahead_forwards: int = 0
    prefill_tokens: int = 0  # answer tokens the prefill pass itself produced

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / max(self.forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> Optional[float]:
        """Tokens after the prefill pass per second after it (None: no such tokens)."""
        decode = self.wall_seconds - self.prefill_seconds
        tokens = self.generated_tokens - self.prefill_tokens
        return tokens / decode if decode > 0 and tokens > 0 else None

    @property
    def other_seconds(self) -> float:
        """Wall time outside the named phases (ReFusion: streaming, detokenizing,
        bookkeeping between phases)."""
        return max(self.wall_seconds - sum(self.phase_seconds.values()), 0.0)

    def as_dict(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            "committed_tokens": self.committed_tokens,
            "forwards": self.forwards,
            "lookahead_forwards": self.lookahead_forwards,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "decode_tokens_per_second": _round(self.decode_tokens_per_second, 3),
            "prefill_tokens": self.prefill_tokens,
            "wall_seconds": round(self.wall_seconds, 6),
            "prefill_seconds": round(self.prefill_seconds, 6),
            "phase_seconds": {k: round(v, 6) for k, v in self.phase_seconds.items()},
            "other_seconds": round(self.other_seconds, 6),
            "peak_memory_gb": round(self.peak_memory_gb, 4),
            "host_syncs": self.host_syncs,
            "steps": self.steps,
            "finish_reason": self.finish_reason,
            "output_ids": list(self.output_ids),
            "text": self.text,
        }


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def storage_of(kv: Optional[dict], model):
    """The caches' KVStorage of ``{"kv_bits", "kv_group_size"}`` (checked against ``model``)."""
    from ..decode.kv_store import KVStorage

    kv = kv or {}
    return KVStorage.of(kv.get("kv_bits"), kv.get("kv_group_size"), model)


def run_refusion(model, tokenizer, prompt_ids: Sequence[int], params: RefusionParams,
                 kv: Optional[dict] = None) -> RunResult:
    """Decode once with ReFusion through the public streaming API (``kv``:
    ``kv_bits`` and ``kv_group_size``, None for the model's dtype); a budget past the model's context
    is refused (``check_context``), as the library would cut it: a measurement runs what it was asked."""
    check_context(model, len(prompt_ids), params)
    mx.synchronize()
    mx.reset_peak_memory()
    tokens: List[int] = []
    text, last = "", None
    t0 = time.perf_counter()
    for last in stream_generate(model, tokenizer, list(prompt_ids), params=params, **(kv or {})):
        tokens += last.tokens
        text += last.text
    wall = time.perf_counter() - t0
    stats = last.stats
    phases = {p: stats.seconds[p] for p in PHASES}
    return RunResult("refusion", stats.generated_tokens, stats.forwards, wall, stats.seconds["prefill"],
                     phases, mx.get_peak_memory() / 1e9, stats.host_syncs, stats.steps,
                     last.finish_reason, tokens, text, committed_tokens=stats.committed_tokens)


class CountingModel:
    """Counts the forward calls mlx-lm makes; everything else passes through."""

    def __init__(self, model):
        self._model = model
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def run_ar(model, tokenizer, prompt_ids: Sequence[int], max_tokens: int, kv: Optional[dict] = None) -> RunResult:
    """Decode once, greedily and left to right, with mlx-lm's stream_generate
    (``kv`` with ``kv_bits``: its quantized cache, from the first token).

    ``max_tokens`` counts answer tokens as ReFusion's budget does, EOS not
    included: mlx-lm's own ``max_tokens`` counts the EOS it generates, so it
    is asked for one more, and a token past the budget that is not EOS is
    dropped (the answer ends at the budget, "length"; the clock stops at the
    budget's last token, and that step is counted as look-ahead)."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.generate import stream_generate as ar_stream_generate

    counter = CountingModel(model)
    mx.synchronize()
    mx.reset_peak_memory()
    tokens: List[int] = []
    text, last, first = "", None, None
    seen: List[tuple] = []  # (time, forward calls) when each token reached Python
    t0 = time.perf_counter()
    quantized = {}
    if kv and kv.get("kv_bits"):
        quantized = dict(kv_bits=kv["kv_bits"], kv_group_size=kv.get("kv_group_size") or 64, quantized_kv_start=0)
    for last in ar_stream_generate(counter, tokenizer, mx.array(list(prompt_ids)), max_tokens=max_tokens + 1,
                                   **quantized):
        seen.append((time.perf_counter(), counter.calls))
        first = seen[0][0]
        tokens.append(int(last.token))
        text += last.text
    finish = last.finish_reason
    if len(tokens) > max_tokens and finish != "stop":  # the budget's answer tokens, and no EOS after them
        del tokens[max_tokens:], seen[max_tokens:]
        text, finish = tokenizer.decode(tokens), "length"
    end, calls = seen[-1]
    mx.synchronize(generation_stream)  # the look-ahead step, outside the clock
    peak = mx.get_peak_memory() / 1e9
    lookahead = 1 if calls > len(tokens) else 0
    phases = {"prefill": first - t0, "steps": end - first}
    return RunResult("ar", len(tokens), calls - lookahead, end - t0, first - t0, phases, peak,
                     host_syncs=len(tokens), steps=len(tokens), finish_reason=finish,
                     output_ids=tokens, text=text, lookahead_forwards=counter.calls - (calls - lookahead),
                     prefill_tokens=min(len(tokens), 1))


def share_weights(ar_model, model) -> None:
    """Point mlx-lm's model at the ReFusion model's arrays: the same weights
    (same dtype, same quantization) in memory once, not a second copy --
    but for a weight mlx-lm's matmul could not read in place: on the CPU
    paths a joined projection's weight may be laid out (in, out)
    (``cpu_paths.lay_out_linears``), so q/k/v and gate/up are column slices of it,
    which MLX would copy at every call. Those get a row-major copy once:
    mlx-lm runs on its weights as ``mlx_lm.load`` stores them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..models.projections import hf_parameters

    ours = {k: mx.contiguous(v, allow_col_major=True) for k, v in hf_parameters(model).items()}
    theirs = {k for k, _ in tree_flatten(ar_model.parameters())}
    if set(ours) != theirs:
        missing = sorted(theirs ^ set(ours))[:3]
        raise ValueError(f"mlx-lm's model has different parameters ({', '.join(missing)} ...)")
    ar_model.load_weights(list(ours.items()), strict=True)
    ar_model.eval()


def median_run(runs: Sequence[RunResult]) -> RunResult:
    """The run with the median wall time (the lower one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.wall_seconds)
    return ordered[(len(ordered) - 1) // 2]
