"""The answer's text as the client sees it: cut before the first stop string,
released in order as it becomes final. (The cut at ``max_tokens`` is the
answer's own: :class:`refusion_mlx.decode.answer.AnswerText`.)"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


class TextShaper:
    """Applies stop strings to the in-order answer text.

    Text that could be the start of a stop string is held back until it is
    known not to be one. ``completion_tokens`` counts the answer's ids other
    than EOS (the usage's figure); the ids themselves live in the request's
    committed cache.
    """

    def __init__(self, stop: Sequence[str], eos_id: int):
        self.stop: List[str] = list(stop)
        self.eos_id = eos_id
        self.completion_tokens = 0
        self.text = ""  # all final text received
        self.sent = 0  # characters of self.text already released
        self.hit: Optional[str] = None  # the stop string the text was cut before

    def feed(self, text: str, tokens: Sequence[int], final: bool) -> Tuple[str, Optional[str]]:
        """Take a response's new text and ids; return (text to send, "stop" or None)."""
        self.completion_tokens += sum(1 for t in tokens if t != self.eos_id)
        self.text += text
        hit = self._first_stop()
        if hit is not None:
            self.hit = next(s for s in self.stop if self.text.startswith(s, hit))
            return self._release(hit), "stop"
        if final:
            return self._release(len(self.text)), None
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
