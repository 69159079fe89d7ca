"""The answer's text as the client sees it: cut at ``max_tokens`` and before
the first stop string, released in order as it becomes final."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple


class TextShaper:
    """Applies ``max_tokens`` and stop strings to the in-order answer.

    The decoder's budget is whole slots, so the answer can run past
    ``max_tokens``: it is cut there (finish "length"). Text that could be the
    start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, decode: Callable[[List[int]], str], max_tokens: int, stop: Sequence[str],
                 eos_id: int):
        self.decode = decode
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.eos_id = eos_id
        self.tokens: List[int] = []
        self.text = ""  # all final text received (after the max_tokens cut)
        self.sent = 0  # characters of self.text already released

    def feed(self, text: str, tokens: Sequence[int], final: bool) -> Tuple[str, Optional[str]]:
        """Take a response's new text and ids; return (text to send, finish reason or None)."""
        reason = None
        content = [t for t in tokens if t != self.eos_id]
        room = self.max_tokens - len(self.tokens)
        if len(content) > room:
            self.tokens += content[:room]
            full = self.decode(self.tokens)
            text = full[len(self.text):] if full.startswith(self.text) else ""
            reason = "length"
        else:
            self.tokens += content
        self.text += text
        hit = self._first_stop()
        if hit is not None:
            return self._release(hit), "stop"
        if reason or final:
            return self._release(len(self.text)), reason
        return self._release(len(self.text) - self._held()), None

    def _first_stop(self) -> Optional[int]:
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        tail = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), tail, -1):
                if self.text.endswith(s[:k]):
                    tail = k
                    break
        return tail

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        return piece
