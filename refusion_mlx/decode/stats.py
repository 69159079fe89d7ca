"""What every run reports (docs/design.md, Statistics), and what one decoding step committed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

PHASES = ("prefill", "plan", "verify", "infill_draft", "infill_verify")


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0  # the answer: response ids up to the first EOS
    committed_tokens: int = 0  # all committed, slots later dropped after EOS included
    forwards: int = 0
    # forwards that ended in a blocking evaluation (the host waited for the
    # device): prefill chunks, plan, verify, infill verify. A forward whose
    # passes keep every value on the device (infill drafts; in a batch, only
    # when every request's pass in it does) is evaluated asynchronously and
    # not counted, so host_syncs <= forwards. Its device time then shows in
    # the next blocking forward's phase seconds, not its own.
    host_syncs: int = 0
    steps: int = 0
    seconds: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    peak_memory_gb: float = 0.0
    # constrained decoding: host seconds spent computing grammar masks (while
    # the device ran the layers) and how many rows were masked
    mask_seconds: float = 0.0
    masks: int = 0
    # the response's block layout: block_length (tokens), blocks, slots_per_block
    layout: Dict[str, int] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / max(self.forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        decode = self.total_seconds - self.seconds["prefill"]
        return self.generated_tokens / decode if decode > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "committed_tokens": self.committed_tokens,
            "forwards": self.forwards,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "host_syncs": self.host_syncs,
            "steps": self.steps,
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "total_seconds": round(self.total_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "peak_memory_gb": round(self.peak_memory_gb, 4),
            "mask_seconds": round(self.mask_seconds, 6),
            "masks": self.masks,
            "layout": dict(self.layout),
        }


# --------------------------------------------------------------------------
# Steps yielded to the caller


@dataclass
class SlotCommit:
    """Tokens committed for one slot (a whole slot, or one cut after EOS)."""

    positions: List[int]
    tokens: List[int]


@dataclass
class Step:
    """One decoding step: which phase committed what."""

    phase: str  # "verify" or "infill"
    commits: List[SlotCommit]
    stats: DecodeStats
