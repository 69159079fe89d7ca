"""The answer's text, released in answer order as soon as it is final.

Slots commit out of order; a position's text is final once every position
before it is committed. ``AnswerText`` reads the committed cache after each
step and gives the newly final ids and text (REFUSION.md §4: the answer in
position order, cut after EOS).

The text is ``tokenizer.decode(ids, skip_special_tokens=True)`` of the final
ids, released piece by piece. ``StreamingText`` gets the same pieces without
decoding the whole answer at every step: it decodes a window of recent ids
(the prefix-offset/read-offset technique), so the work is linear in the answer.
"""

from __future__ import annotations

import json
import sys
import weakref
from typing import Callable, Iterable, List, Optional, Sequence


REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to, for now
# tokenizers' decoders whose text of ids is the texts of runs of ids joined:
# per-token maps, byte runs, one leading space stripped off the whole text
LOCAL_DECODERS = {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}


def _local_decoder(state: dict) -> bool:
    if state.get("type") == "Sequence":
        return all(_local_decoder(d) for d in state.get("decoders", []))
    return state.get("type") in LOCAL_DECODERS


def decodes_locally(tokenizer) -> bool:
    """Whether a window of ids decodes to the text those ids have in the whole
    decode: a Hugging Face fast tokenizer with transformers' own ``decode``,
    no ``clean_up_tokenization_spaces``, and a decoder of ``LOCAL_DECODERS``.
    Anything else (a subclass's own decode, mlx-lm's NewlineTokenizer, a stub)
    is decoded whole."""
    base = getattr(sys.modules.get("transformers"), "PreTrainedTokenizerBase", None)
    if base is None:  # not loaded: no Hugging Face tokenizer here
        return False
    hf = tokenizer if isinstance(tokenizer, base) else getattr(tokenizer, "__dict__", {}).get("_tokenizer")
    if not isinstance(hf, base):  # (mlx-lm's TokenizerWrapper holds the Hugging Face one)
        return False
    if getattr(hf, "clean_up_tokenization_spaces", True) is not False:
        return False
    for name in ("decode", "_decode"):
        method = getattr(type(hf), name, None)
        if not getattr(method, "__module__", "").startswith("transformers.tokenization_utils"):
            return False
    try:
        decoder = hf.backend_tokenizer.decoder
        return decoder is not None and _local_decoder(json.loads(decoder.__getstate__()))
    except Exception:
        return False


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
    tokenizer whose decode is not known to be a concatenation at token
    boundaries (``decodes_locally``), or a window that disagrees with its
    context, is decoded whole, as before.

    ``history``: where all the ids added so far can be read again (the
    answer's holder, :class:`AnswerText`). With it the detokenizer keeps only
    its window -- ids before ``start`` are dropped as the window moves -- and
    reads the whole list from ``history`` when it must decode whole; without
    it, it keeps every id.
    """

    def __init__(self, tokenizer, window: Optional[bool] = None,
                 history: Optional[Callable[[], List[int]]] = None):
        self.tokenizer = tokenizer
        self.history = history
        self.ids: List[int] = []  # the window (from ``start``), or every id without ``history``
        self.start = 0  # window start: ids[start:read] are context only
        self.read = 0  # the text of ids[:read] is all released
        self.context = ""  # decode(ids[start:read])
        self.held = ""  # the window's new text already released (its tail is still held)
        self.pieces: List[str] = []
        self.whole = not (decodes_locally(tokenizer) if window is None else window)
        self.decoded = 0  # ids passed to decode, all told (the work done)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _decode(self, ids: List[int]) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Take more ids; return the text that became final (all of it if ``final``)."""
        if self.whole:
            return self._release_whole(ids, final)
        self.ids.extend(ids)
        window = self._decode(self.ids[self.start:])
        if not window.startswith(self.context):
            self.whole = True  # decode is not local for this tokenizer: decode all from now on
            return self._release_whole([], final)
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
            if self.history is not None and self.start:  # the ids before the window: the holder has them
                del self.ids[:self.start]
                self.read -= self.start
                self.start = 0
        return piece

    def _release_whole(self, ids: Sequence[int], final: bool) -> str:
        if self.history is not None:
            all_ids = self.history()  # the holder already has ``ids``
        else:
            self.ids.extend(ids)
            all_ids = self.ids
        full = self._decode(all_ids)
        if not final:
            full = full.rstrip(REPLACEMENT)
        text = self.text
        if not full.startswith(text):
            return ""
        piece = full[len(text):]
        if piece:
            self.pieces.append(piece)
        return piece


def end_ids(tokenizer) -> frozenset:
    """The ids that end an answer: EOS, and the tokenizer's other end ids
    (mlx-lm's ``eos_token_ids``: a checkpoint's ``generation_config.json``
    list, ``add_eos_token``)."""
    return frozenset({int(tokenizer.eos_token_id), *(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ())})


class AnswerText:
    """The answer's final ids and text: a view over the committed cache.

    The committed tokens are held once, by the request's
    :class:`~refusion_mlx.decode.cache.CommittedCache`; this view keeps only
    a cursor (the first position not yet final) and the streaming
    detokenizer's window. ``update`` reads what the last step made final.
    ``max_tokens``: cut the answer after that many ids other than EOS (the
    request's ``gen_length``; the decoder's budget is whole slots, so its
    cache can hold more until it settles), and ``cut`` says it was.
    ``stops``: ids besides EOS that end the answer as EOS does (the
    tokenizer's other end ids, mlx-lm's ``eos_token_ids``): ``done`` there,
    the decoder's loop ended by its caller.
    """

    def __init__(self, tokenizer, cache, response_start: int, eos_id: int,
                 max_tokens: Optional[int] = None, stops: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.cache = cache
        self.start = self.next = response_start
        self.eos_id = eos_id
        self.ends = frozenset({eos_id, *stops})  # EOS and the tokenizer's other end ids: no text, the answer ends
        self.max_tokens = max_tokens
        self.content = 0  # final ids other than EOS
        text_ids = weakref.WeakMethod(self._text_ids)  # no cycle: a removed request's cache goes at once
        self.stream = StreamingText(tokenizer, history=lambda: text_ids()())
        self.done = False  # EOS is final
        self.cut = False  # cut at max_tokens
        self.last: Optional[int] = None  # the last final id (EOS or a stop id, once done)

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def length(self) -> int:
        """Final ids, EOS included."""
        return self.next - self.start

    @property
    def tokens(self) -> List[int]:
        """The final ids in answer order, read from the cache."""
        return [self.cache.token_at(p) for p in range(self.start, self.next)]

    def _text_ids(self) -> List[int]:
        """The final ids that have text (the detokenizer's history)."""
        return [t for t in self.tokens if t < self.vocab and t not in self.ends]

    def update(self) -> tuple:
        """Read the cache after a step's commits; return (newly final ids, newly final text)."""
        new = []
        while not (self.done or self.cut):
            tok = self.cache.token_at(self.next)
            if tok is None:
                break
            if tok not in self.ends:
                if self.max_tokens is not None and self.content >= self.max_tokens:
                    self.cut = True
                    break
                self.content += 1
            new.append(tok)
            self.next += 1
            self.done, self.last = tok in self.ends, tok
        if not new:
            return new, ""  # nothing became final: no decode this step
        return new, self._release(new, final=self.done or self.cut)

    def _release(self, new: Sequence[int], final: bool) -> str:
        ids = [t for t in new if t < self.vocab and t not in self.ends]
        return self.stream.add(ids, final=final)

    def finish(self) -> str:
        return self._release([], final=True)
