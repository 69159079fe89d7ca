"""What a decoding step gives its caller for one request: :class:`GenerationResponse`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .cache import CommittedCache
from .stats import DecodeStats, SlotCommit


@dataclass
class GenerationResponse:
    """One step of a streamed generation.

    ``text``/``tokens``: what just became final, in answer order (may be
    empty when the step committed slots beyond a gap). ``commits``: the slots
    committed at this step, in commit order. The last response of a request
    has ``finish_reason`` ("stop": EOS; "length": budget spent; "error": it
    failed alone, ``error`` says why), ``stats`` and ``cache`` (its committed
    cache, settled to prompt + answer, for reuse by a later request).

    mlx-lm's fields are properties here, so its loops read the same names:
    ``token`` (the last of ``tokens``), ``generation_tps`` and ``prompt_tps``
    (so far), ``peak_memory`` (GB, so far), from the request's statistics as
    they stand at this step.
    """

    text: str
    tokens: List[int]
    commits: List[SlotCommit]
    phase: str
    step: int
    prompt_tokens: int
    generation_tokens: int
    finish_reason: Optional[str] = None
    stats: Optional[DecodeStats] = None
    uid: int = 0
    cache: Optional[CommittedCache] = None
    error: Optional[str] = None
    error_param: Optional[str] = None  # the request's field the error is about (its fault); None: the runtime's
    exception: Optional[BaseException] = field(default=None, repr=False, compare=False)  # what ``error`` says
    logprobs: Optional[List[tuple]] = None  # per token of ``tokens``: (logprob, top pairs) (``insert(logprobs=)``)
    live: Optional[DecodeStats] = field(default=None, repr=False, compare=False)  # the request's stats, running

    @property
    def token(self) -> Optional[int]:
        return self.tokens[-1] if self.tokens else None

    @property
    def from_draft(self) -> bool:
        """mlx-lm's speculative-decoding flag: no draft model here (ReFusion drafts and verifies its own)."""
        return False

    @property
    def generation_tps(self) -> float:
        if self.stats is not None:
            return self.stats.tokens_per_second
        decode = self.live.total_seconds - self.live.seconds["prefill"] if self.live is not None else 0.0
        return self.generation_tokens / decode if decode > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        stats = self.stats or self.live
        seconds = stats.seconds.get("prefill", 0.0) if stats is not None else 0.0
        return stats.prompt_tokens / seconds if seconds > 0 else 0.0

    @property
    def peak_memory(self) -> float:
        if self.stats is not None:
            return self.stats.peak_memory_gb
        import mlx.core as mx

        return mx.get_peak_memory() / 1e9  # as mlx-lm reads it mid-answer
