"""The answer's text as the client sees it: cut before the first stop string,
released in order as it becomes final. (The cut at ``max_tokens`` is the
answer's own: :class:`refusion_mlx.decode.answer.AnswerText`.)"""

from __future__ import annotations

import codecs
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .call_bounds import CallSpans


class TextShaper:
    """Applies stop strings to the in-order answer text.

    Text that could be the start of a stop string is held back until it is
    known not to be one. ``completion_tokens`` counts the answer's ids other
    than EOS (the usage's figure); the ids themselves live in the request's
    committed cache.
    """

    def __init__(self, stop: Sequence[str], eos_id: int, calls: Optional[Tuple[str, str]] = None):
        self.stop: List[str] = list(stop)
        # a call's (start, end) markers: the text of a call (:mod:`.call_bounds`) is no stop string's
        self._calls = CallSpans(*calls) if calls is not None else None
        self.eos_id = eos_id
        self.completion_tokens = 0
        self.text = ""  # all final text received
        self.sent = 0  # characters of self.text already released
        self.hit: Optional[str] = None  # the stop string the text was cut before
        self._starts = [_Start(s) for s in self.stop if s]  # how much of each stop string the text ends with
        self._seen = 0  # characters of self.text those have read

    def feed(self, text: str, tokens: Sequence[int], final: bool,
             widths: Optional[Callable[[], List[int]]] = None) -> Tuple[str, Optional[str]]:
        """Take a response's new text and ids; return (text to send, "stop" or None).
        ``widths``: the characters of ``text`` each id spells, asked for when a stop string cuts the
        answer here, so that ``completion_tokens`` counts the ids up to the stop string's end (as an
        autoregressive server's usage does), not the rest of the step the decoder also made."""
        before = self.completion_tokens
        self.completion_tokens += sum(1 for t in tokens if t != self.eos_id)
        self.text += text
        hit = self._first_stop(final)
        if hit is not None:
            self.hit = next(s for s in self.stop if self.text.startswith(s, hit))
            if widths is not None:
                need, used = hit + len(self.hit) - (len(self.text) - len(text)), 0
                for t, w in zip(tokens, widths()):
                    if need <= 0:
                        break
                    need, used = need - w, used + (t != self.eos_id)
                self.completion_tokens = before + used
            return self._release(hit), "stop"
        if final:
            return self._release(len(self.text)), None
        return self._release(len(self.text) - self._held()), None

    def _first_stop(self, final: bool) -> Optional[int]:
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        spans = self._calls.read(self.text, final) if self._calls is not None else []
        hits = []
        for s in self.stop:
            i = self.text.find(s, start)
            while i >= 0 and any(a <= i < b for a, b in spans):  # inside a call: its arguments, not a stop
                i = self.text.find(s, i + 1)
            if i >= 0:
                hits.append(i)
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string:
        each stop string's own, kept as the text grows (:class:`_Start`), so
        a step reads its new text only, never the whole answer again (this
        runs on the engine's thread)."""
        held = max((start.advance(self.text, self._seen) for start in self._starts), default=0)
        self._seen = len(self.text)
        return held

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        return piece


class _Start:
    """How much of a stop string the text read so far ends with: the length
    of its longest start (shorter than the whole) the text ends with, kept
    character by character with Knuth-Morris-Pratt's links (each skips the
    starts that would fail on the same character), so a character costs at
    most O(log len(stop)) steps and O(1) amortized, whatever the answer's
    length; while nothing of it is matched, ``find`` skips to its first
    character."""

    def __init__(self, stop: str):
        self.stop, self.matched = stop, 0
        border = [-1, 0]  # border[k]: the longest proper start of stop[:k] that stop[:k] ends with
        for k in range(1, len(stop)):
            b = border[k]
            while b >= 0 and stop[b] != stop[k]:
                b = border[b]
            border.append(b + 1)
        self.restart = border[len(stop)]  # after the whole stop string (in a call's text, or already cut)
        self.link = [-1] * len(stop)  # where a mismatch at k goes on: a border whose next character differs
        for k in range(1, len(stop)):
            b = border[k]
            self.link[k] = b if stop[b] != stop[k] else self.link[b]

    def advance(self, text: str, at: int) -> int:
        """Read ``text`` from ``at``; the length matched now."""
        stop, link, k, end = self.stop, self.link, self.matched, len(text)
        while at < end:
            if k == 0:
                at = text.find(stop[0], at)
                if at < 0:
                    break
            c = text[at]
            while k >= 0 and stop[k] != c:
                k = link[k]
            k += 1
            if k == len(stop):
                k = self.restart
            at += 1
        self.matched = k
        return k


# --------------------------------------------------------------------------
# A token's bytes, as OpenAI's logprobs show them: a token may hold part of a
# character (byte-level BPE spells "ë" in two tokens), which its decoded
# text alone cannot say ("\ufffd").


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> Dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's scheme): the printable Latin-1 bytes
    stand for themselves, the others take the characters from U+0100 on, in byte order."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_bytes(tokenizer, token: int, text: str) -> bytes:
    """The bytes of ``token`` (``text``: its decoded text): that text's, unless it decoded to a replacement
    character, then the vocabulary entry's (a byte-level spelling, or SentencePiece's ``<0xNN>``)."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    try:
        entry = tokenizer.convert_ids_to_tokens(token)
    except Exception:  # a tokenizer without a vocabulary to read
        return text.encode("utf-8")
    if isinstance(entry, str) and len(entry) == 6 and entry.startswith("<0x") and entry.endswith(">"):
        return bytes([int(entry[3:5], 16)])
    alphabet = _byte_level_alphabet()
    if isinstance(entry, str) and entry and all(c in alphabet for c in entry):
        return bytes(alphabet[c] for c in entry)
    return text.encode("utf-8")


def shown_token(raw: bytes) -> str:
    """A token as OpenAI's logprobs name it: its text, or ``bytes:\\xe2\\x80`` for part of a character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CharCounter:
    """How many characters of the text each token, in order, completes (a character split over tokens counts
    at its last): the steps of OpenAI's ``text_offset``."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, raw: bytes) -> int:
        return len(self._decoder.decode(raw))


def token_piece(tokenizer, token: int) -> Tuple[str, bytes]:
    """A token as logprobs show it: (its name, :func:`shown_token`; its bytes)."""
    raw = token_bytes(tokenizer, token, tokenizer.decode([token]))
    return shown_token(raw), raw
