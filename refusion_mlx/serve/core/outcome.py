"""How a request ended, in the server's own terms: what the engine's "done"
event carries, whichever API asked.

:class:`Outcome` holds the finish reason, the stop string that cut the
answer, the token counts (:class:`Usage`), the decoder's stats and, for a
scored prompt, its tokens' scores (:class:`ScoredPrompt`). It is data, not a
body: each protocol's writer formats it its own way (OpenAI's ``usage``,
the Responses API's, Anthropic's ``input_tokens`` without the cached ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

FINISH_REASONS = ("stop", "length", "tool_calls")


@dataclass(frozen=True)
class Usage:
    """An answer's token counts: the prompt's (``cached`` of them from the
    prompt cache), the answer's, and ReFusion's own figures when it was
    decoded -- the block layout, the forwards it took, tokens per forward."""

    prompt: int
    completion: int
    cached: int = 0
    layout: Optional[dict] = None
    forwards: Optional[int] = None
    tokens_per_forward: Optional[float] = None

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def refusion(self) -> dict:
        """ReFusion's figures as every API's usage carries them after its own (none for a scored prompt)."""
        if self.layout is None:
            return {}
        return {"layout": dict(self.layout), "forwards": self.forwards, "tokens_per_forward": self.tokens_per_forward}


@dataclass(frozen=True)
class ScoredPrompt:
    """A prompt scored token by token (``echo`` with logprobs): its ``text``
    (with a drafted token after it, if any), each token's name (``pieces``,
    :func:`.text.token_piece`'s), log-probability (``values``; None for a token
    nothing scored) and most likely alternatives (``top``: (name,
    log-probability) pairs, as many as asked; None where nothing scored the
    token), whether the answer
    shows them (``shown``), and the characters of ``text`` each token
    completes (``chars``: the steps of its offsets)."""

    text: str
    pieces: List[str]
    values: List[Optional[float]]
    top: List[Optional[List[Tuple[str, float]]]]
    shown: bool = True
    chars: Optional[List[int]] = None


@dataclass(frozen=True)
class Outcome:
    """A request's end: ``finish_reason`` (one of FINISH_REASONS), the
    ``stop_sequence`` that cut it (None: none), its ``usage``, the decoder's
    ``stats`` (a dict; under ``mlx.launch`` with the group's; None when it
    was not decoded) and, for a scored prompt, ``scored``."""

    finish_reason: str
    usage: Usage
    stop_sequence: Optional[str] = None
    stats: Optional[dict] = None
    scored: Optional[ScoredPrompt] = None

    def brief(self) -> str:
        """One line for the server's log."""
        u, s = self.usage, self.stats
        return (f"prompt={u.prompt} cached={u.cached} completion={u.completion} finish={self.finish_reason}"
                + (f" steps={s['steps']} tokens/forward={s['tokens_per_forward']:.2f}" if s else ""))
