"""The chat's trace: every step's commits, as JSON (``python -m refusion_mlx.chat
--trace FILE``; ``examples/render_trace.py`` draws it)."""

from __future__ import annotations

import json
from typing import List

from .output import check_writable, write_text


class Trace:
    """Records each step (turn, step, phase, positions, tokens) and rewrites FILE after each turn."""

    def __init__(self, path: str, tokenizer):
        self.path = path
        self.tokenizer = tokenizer
        self.steps: List[dict] = []
        self.turn = 0  # counts every turn of the run, /reset or not
        self.writable()  # fail now (bad path) rather than after the first answer

    def writable(self) -> None:
        """An OSError unless FILE can be written (FILE itself is left as it is until a turn is traced)."""
        check_writable(self.path)

    def begin_turn(self) -> None:
        self.turn += 1

    def add(self, response_start: int, response) -> None:
        positions = [p for c in response.commits for p in c.positions]
        tokens = [t for c in response.commits for t in c.tokens]
        self.steps.append({
            "turn": self.turn, "step": response.step, "phase": response.phase,
            "positions": positions, "tokens": tokens,
            "pieces": [self.tokenizer.decode([t]) for t in tokens],
            "slots": [len(c.positions) for c in response.commits],
            "response_start": response_start,
            "eos_id": self.tokenizer.eos_token_id,
            "finish_reason": response.finish_reason,
        })

    def write(self) -> None:
        write_text(self.path, json.dumps(self.steps))
