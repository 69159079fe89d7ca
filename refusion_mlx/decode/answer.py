"""The answer's text, released in answer order as soon as it is final.

Slots commit out of order; a position's text is final once every position
before it is committed. This turns each step's commits into the newly final
ids and text (REFUSION.md §4: the answer in position order, cut after EOS).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from .stats import SlotCommit

class AnswerText:
    """Releases the answer's text in order, only once it can no longer change."""

    def __init__(self, tokenizer, response_start: int, eos_id: int):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.next = response_start
        self.eos_id = eos_id
        self.pending: Dict[int, int] = {}
        self.tokens: List[int] = []
        self.text = ""
        self.done = False

    def add(self, commits: Sequence[SlotCommit]) -> tuple:
        """Take a step's commits; return (newly final ids, newly final text)."""
        for c in commits:
            self.pending.update(zip(c.positions, c.tokens))
        new = []
        while not self.done and self.next in self.pending:
            tok = self.pending.pop(self.next)
            new.append(tok)
            self.next += 1
            self.done = tok == self.eos_id
        if not new:
            return new, ""  # nothing became final: no decode this step
        self.tokens += new
        return new, self._release(final=self.done)

    def _release(self, final: bool) -> str:
        ids = [t for t in self.tokens if t < self.vocab and t != self.eos_id]
        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not final:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still grow
        if not full.startswith(self.text):
            return ""  # a decode that rewrote earlier text: hold until it settles
        segment, self.text = full[len(self.text):], full
        return segment

    def finish(self) -> str:
        return self._release(final=True)

