"""Where a tool call's markup ends, and where the calls are in an answer's
text: one rule for the call splitter (:class:`~.tool_calls.ToolCallSplitter`)
and the stop strings (:class:`~.text.TextShaper`).

A call whose body is JSON (its first character past any whitespace is ``{``
or ``[``, as Qwen3's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``)
ends at the first end marker outside the body's JSON strings: an argument may
hold the marker's text (an agent writing a file about tool calls), and a cut
there would leave a call that does not parse, shown as raw markup. Another
body (XML-like formats, whose values are bare text) ends at the first marker,
and so does a JSON body once it cannot be JSON (a quote the model left
unescaped: a string followed by text, or text by a string; anything past the
value's close), or one still open when the answer ends that is not JSON
whole: the strings were misread, and the first marker is the old, sound
bound (the text and calls after it are read as such, not as the call's).

Both read a text that only grows, from where they stopped: a character is
read about once, whatever the answer's length (they run on the engine's
thread, each step).
"""

from __future__ import annotations

import json
import re
from typing import List, Optional, Tuple

_IN_STRING = re.compile(r'["\\]')  # what ends a JSON string's plain run: its closing quote or an escape
_SOLID = re.compile(r"\S")


class CallEnd:
    """Finds the end marker of a call whose body begins at ``begin`` in a
    text that grows between calls of :meth:`find` (the same text, longer)."""

    def __init__(self, end: str, begin: int = 0):
        self.end, self.begin = end, begin
        self.at = begin  # read up to here (a marker's possible start, a lone backslash: read again)
        self.json: Optional[bool] = None  # whether the body is JSON: known at its first character past whitespace
        self.in_string = False
        self.depth = 0  # the JSON's open brackets, outside strings
        self.last = ""  # the last character outside strings, past whitespace ('"': a string's close)

    def find(self, text: str, final: bool = False) -> int:
        """The end marker's offset in ``text``, or -1 while the call has none yet; ``final``: the text is
        the whole answer (a JSON body still open that does not parse ends at the first marker)."""
        found = self._find(text)
        if found < 0 and final and self.json and not _is_json(text[self.begin:]):
            return self._first_marker(text)
        return found

    def _first_marker(self, text: str) -> int:
        """The body is no JSON after all: the first marker ends it (the body read again, once)."""
        self.json, self.at = False, self.begin
        return self._find(text)

    def _find(self, text: str) -> int:
        end, n = self.end, len(text)
        if not end:  # a format without one (the call runs to the answer's end): as str.find
            return self.begin
        if self.json is None:
            first = len(text) - len(text[self.at:].lstrip()) if self.at < n else n
            if first >= n:
                self.at = n
                return -1
            self.json, self.at = text[first] in "{[", first
        if not self.json:
            found = text.find(end, self.at)
            self.at = max(self.at, n - len(end) + 1)
            return found
        i = self.at
        while i < n:
            if self.in_string:
                m = _IN_STRING.search(text, i)
                if m is None:
                    i = n
                elif m.group() == "\\":
                    if m.start() + 1 >= n:  # the escaped character is yet to come
                        i = m.start()
                        break
                    i = m.start() + 2
                else:
                    self.in_string, i = False, m.start() + 1
                continue
            quote = text.find('"', i)
            found = text.find(end, i, n if quote < 0 else quote + len(end) - 1)  # a marker that starts before it
            if found >= 0:
                if not self._fits(text, i, found):
                    return self._first_marker(text)
                self.at = found
                return found
            if quote < 0:
                read = max(i, n - len(end) + 1)  # a tail that may begin the marker is read again
                if not self._fits(text, i, read):
                    return self._first_marker(text)
                i = read
                break
            if not self._fits(text, i, quote) or self.depth == 0 or self.last not in "{[,:":
                return self._first_marker(text)  # a string where JSON has none
            self.in_string, i = True, quote + 1
            self.last = '"'
        self.at = i
        return -1

    def _fits(self, text: str, start: int, stop: int) -> bool:
        """Whether the JSON, read on over ``text[start:stop]`` (outside strings), may still be valid: no
        text after a string but ``:,]}``, none after the value's close."""
        for m in _SOLID.finditer(text, start, stop):
            c = m.group()
            if self.depth == 0 and self.last or self.last == '"' and c not in ":,]}":
                return False
            self.depth += (c in "{[") - (c in "}]")
            self.last = c
        return True


def _is_json(body: str) -> bool:
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


class CallSpans:
    """Where the calls are in a growing text, their markers included (an open
    one runs to the text's end): :meth:`read` takes the text so far."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.closed: List[Tuple[int, int]] = []
        self.open_at = -1  # the open call's start marker; -1: none open
        self._end: Optional[CallEnd] = None
        self.at = 0  # start markers are looked for from here

    def read(self, text: str, final: bool = False) -> List[Tuple[int, int]]:
        """The spans in ``text``; ``final``: it is the whole answer (:meth:`CallEnd.find`)."""
        while True:
            if self._end is None:
                found = text.find(self.start, self.at)
                if found < 0:
                    self.at = max(self.at, len(text) - len(self.start) + 1)
                    return self.closed
                self.open_at, self._end = found, CallEnd(self.end, found + len(self.start))
            found = self._end.find(text, final)
            if found < 0:
                return self.closed + [(self.open_at, len(text))]
            self.at = found + len(self.end)
            self.closed.append((self.open_at, self.at))
            self._end = None
