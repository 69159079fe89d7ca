"""The answer's text, released in answer order as soon as it is final.

Slots commit out of order; a position's text is final once every position
before it is committed. This turns each step's commits into the newly final
ids and text (REFUSION.md §4: the answer in position order, cut after EOS).

The text is ``tokenizer.decode(ids, skip_special_tokens=True)`` of the final
ids, released piece by piece. ``StreamingText`` gets the same pieces without
decoding the whole answer at every step: it decodes a window of recent ids
(the prefix-offset/read-offset technique), so the work is linear in the answer.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from .stats import SlotCommit

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to, for now


class StreamingText:
    """The text of a growing list of ids, released as it becomes final.

    The pieces joined are what re-decoding all ids at every step would
    release: ``decode(ids, skip_special_tokens=True)`` with a trailing
    ``"\\ufffd"`` (an incomplete UTF-8 sequence that may still grow) held until
    the end, and nothing released while a decode rewrites text already out.

    Only a window is decoded: ``ids[start:]``, where ``ids[start:read]`` is
    context whose text is already released (it carries what a decoder needs
    from the left: a byte sequence, a leading space) and its text,
    ``context``, is cut off the window's. Once the window's new text is
    complete the window moves on: the new ids become the next context. A
    tokenizer whose decode is not a concatenation at token boundaries
    (``clean_up_tokenization_spaces``, or a window that disagrees with its
    context) is decoded whole, as before.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: List[int] = []
        self.start = 0  # window start: ids[start:read] are context only
        self.read = 0  # the text of ids[:read] is all released
        self.context = ""  # decode(ids[start:read])
        self.held = ""  # the window's new text already released (its tail is still held)
        self.pieces: List[str] = []
        self.whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False) is True)
        self.decoded = 0  # ids passed to decode, all told (the work done)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _decode(self, ids: List[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Take more ids; return the text that became final (all of it if ``final``)."""
        self.ids.extend(ids)
        if self.whole:
            return self._release_whole(final)
        window = self._decode(self.ids[self.start:])
        if not window.startswith(self.context):
            self.whole = True  # decode is not local for this tokenizer: decode all from now on
            return self._release_whole(final)
        new = window[len(self.context):]
        text = new if final else new.rstrip(REPLACEMENT)
        if not text.startswith(self.held):
            return ""  # a decode that rewrote earlier text: hold until it settles
        piece, self.held = text[len(self.held):], text
        if piece:
            self.pieces.append(piece)
        if text == new:  # nothing held back: the new ids become the context
            end = len(self.ids)
            context = self._decode(self.ids[self.read:end]) if end > self.read else ""
            if context:
                self.start, self.context = self.read, context
            else:  # ids without text (skipped special tokens) are no context: keep the old one
                self.context = window
            self.read, self.held = end, ""
        return piece

    def _release_whole(self, final: bool) -> str:
        full = self._decode(self.ids)
        if not final:
            full = full.rstrip(REPLACEMENT)
        text = self.text
        if not full.startswith(text):
            return ""
        piece = full[len(text):]
        if piece:
            self.pieces.append(piece)
        return piece


class AnswerText:
    """Releases the answer's text in order, only once it can no longer change."""

    def __init__(self, tokenizer, response_start: int, eos_id: int):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.next = response_start
        self.eos_id = eos_id
        self.pending: Dict[int, int] = {}
        self.tokens: List[int] = []
        self.stream = StreamingText(tokenizer)
        self.done = False

    @property
    def text(self) -> str:
        return self.stream.text

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
        return new, self._release(new, final=self.done)

    def _release(self, new: Sequence[int], final: bool) -> str:
        ids = [t for t in new if t < self.vocab and t != self.eos_id]
        return self.stream.add(ids, final=final)

    def finish(self) -> str:
        return self._release([], final=True)
