"""The live view of slot decoding: the answer's positions redrawn in place as
slots are committed out of order (``python -m refusion_mlx.chat --visualize``)."""

from __future__ import annotations

import time
import unicodedata
from typing import Dict, List, Optional, Sequence, TextIO

MASK = "░"
EOS_MARK = "⏎"


def display_width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


class SlotView:
    """Redraws the answer's positions in place as slots are committed, out of order.

    Masked positions show as ``░``; committed tokens as their text, the ones
    committed at this step highlighted. Only the blocks reached so far are
    drawn. Like llama.cpp's ``--diffusion-visual``; ANSI cursor movement.
    ``redraw=False`` (not a terminal: a pipe, a file) writes the frames one
    after another, a blank line between them, with no escape sequences.

    A view over the turn's committed cache (``cache.token_at``): it keeps no
    tokens of its own, only how far the commits reach and each token id's
    text, decoded once.
    """

    def __init__(self, tokenizer, out: TextIO, cache, response_start: int, block_lengths: Sequence[int],
                 eos_id: int, width: Optional[int] = None, height: Optional[int] = None,
                 color: bool = True, frame_time: float = 0.0, redraw: bool = True):
        import shutil

        size = shutil.get_terminal_size((100, 30))
        self.tokenizer = tokenizer
        self.out = out
        self.cache = cache
        self.start = response_start
        self.block_ends = [sum(block_lengths[: i + 1]) for i in range(len(block_lengths))]
        self.eos_id = eos_id
        self.width = max(20, width or size.columns)
        self.height = max(4, height or size.lines)
        self.color = color and redraw
        self.redraw = redraw
        self.committed = 0  # answer positions committed so far
        self.reach = 0  # the furthest committed answer offset
        self.eos_at: Optional[int] = None
        self._pieces: Dict[int, str] = {}  # token id -> its cell text
        self.lines = 0
        self.frames = 0
        self.frame_time = frame_time  # minimum seconds a frame stays (fast models would just flash)
        self.shown_at = 0.0

    def piece(self, token: int) -> str:
        if token == self.eos_id:
            return EOS_MARK
        if token not in self._pieces:
            text = self.tokenizer.decode([token])
            self._pieces[token] = text.replace("\n", "↵").replace("\t", "→").replace("\x1b", "") or "·"
        return self._pieces[token]

    def update(self, response) -> None:
        """Take a step's commits (already in the cache) and redraw."""
        fresh = {p - self.start for commit in response.commits for p in commit.positions}
        self.committed += len(fresh)
        self.reach = max([self.reach, *fresh])
        for commit in response.commits:
            for p, t in zip(commit.positions, commit.tokens):
                if t == self.eos_id and (self.eos_at is None or p - self.start < self.eos_at):
                    self.eos_at = p - self.start
        header = (f"step {response.step + 1} · {response.phase} · "
                  f"{self.committed} committed ({len(fresh)} now)")
        self._draw(header, self._cells(fresh))

    def _visible_end(self) -> int:
        reach = self.reach
        end = next((e for e in self.block_ends if e > reach), self.block_ends[-1])
        if self.eos_at is not None:
            end = min(end, self.eos_at + 1)
        return end

    def _cells(self, fresh: set) -> List[tuple]:
        cells = []
        for offset in range(self._visible_end()):
            token = self.cache.token_at(self.start + offset)
            if token is None:
                cells.append((MASK, "2"))  # dim
            else:
                cells.append((self.piece(token), "1;32" if offset in fresh else ""))
        return cells

    def _draw(self, header: str, cells: List[tuple]) -> None:
        rows, line, used = [], [], 0
        for text, style in cells:
            w = display_width(text)
            if used + w > self.width - 1 and line:
                rows.append(line)
                line, used = [], 0
            line.append((text, style))
            used += w
        if line:
            rows.append(line)
        rows = rows[-(self.height - 2):]  # a frame taller than the terminal cannot be redrawn
        frame = [self._style(header, "2")] + [self._row(row) for row in rows]
        wait = self.shown_at + self.frame_time - time.perf_counter()
        if self.frames and wait > 0:
            time.sleep(wait)
        self._clear()
        self.out.write("\n".join(frame) + ("\n" if self.redraw else "\n\n"))
        self.out.flush()
        self.lines = len(frame)
        self.frames += 1
        self.shown_at = time.perf_counter()

    def _row(self, cells: List[tuple]) -> str:
        """One line, with one escape sequence per run of equally styled cells."""
        out, run, style = [], "", None
        for text, s in cells:
            if s != style and run:
                out.append(self._style(run, style))
                run = ""
            run, style = run + text, s
        if run:
            out.append(self._style(run, style))
        return "".join(out)

    def _style(self, text: str, style: str) -> str:
        return f"\x1b[{style}m{text}\x1b[0m" if style and self.color else text

    def _clear(self) -> None:
        if self.lines and self.redraw:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")  # up to the frame's first line, erase below

    def finish(self) -> None:
        """Erase the last frame (the answer is printed as plain text after it)."""
        wait = self.shown_at + self.frame_time - time.perf_counter()
        if wait > 0 and self.redraw:
            time.sleep(wait)
        self._clear()
        self.lines = 0
        self.out.flush()
