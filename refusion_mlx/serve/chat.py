"""Terminal chat with ReFusion: ``python -m refusion_mlx.chat``.

Multi-turn chat that keeps the conversation's committed KV cache: after a
turn the cache holds exactly the prompt and the answer (the decoder settles
it), so the next turn renders the whole conversation with the chat template,
finds how much of it the cache already holds, and prefills only the new
suffix. ``ChatSession`` is the Python API; the REPL is a thin loop over it.

``--visualize`` redraws the answer's positions as slots fill out of order;
``--trace FILE`` records every step's commits as JSON (see
``examples/render_trace.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import unicodedata
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, TextIO

from ..errors import RefusionError
from .prompt_cache import common_prefix


# --------------------------------------------------------------------------
# The conversation


@dataclass
class TurnRecord:
    """What one turn cost: ``prompt_tokens`` is what a fresh start would prefill
    (the whole rendered conversation), ``prefill_tokens`` what was prefilled."""

    turn: int
    prompt_tokens: int
    prefill_tokens: int
    reused_tokens: int
    answer_tokens: int
    finish_reason: str
    seconds: float
    stats: object  # DecodeStats

    def as_dict(self) -> dict:
        return {"turn": self.turn, "prompt_tokens": self.prompt_tokens,
                "prefill_tokens": self.prefill_tokens, "reused_tokens": self.reused_tokens,
                "answer_tokens": self.answer_tokens, "finish_reason": self.finish_reason,
                "seconds": round(self.seconds, 4), "decode": self.stats.as_dict()}


class ChatSession:
    """A conversation over one CommittedCache, reused from turn to turn.

    ``stream(text)`` yields the GenerationResponses of the answer (text in
    order, as it becomes final); the answer joins the history when the turn
    completes. A turn that fails or is interrupted leaves no trace: the user
    message is dropped and the cache cut back to what it held before.
    """

    def __init__(self, model, tokenizer, params=None, system: Optional[str] = None, reuse: bool = True):
        from ..decode.params import RefusionParams

        self.model = model
        self.tokenizer = tokenizer
        self.params = params or RefusionParams()
        self.params.layout()
        self.system = system
        self.reuse = reuse
        self.messages: List[Dict[str, str]] = []
        self.turns: List[TurnRecord] = []
        self.cache = self._new_cache()
        self.response_start = 0  # the answer's first position in the current turn

    def _new_cache(self):
        from ..decode.cache import CommittedCache

        return CommittedCache.for_model(self.model)

    def reset(self) -> None:
        """Forget the conversation and its cache."""
        self.messages.clear()
        self.turns.clear()
        self.cache = self._new_cache()

    def prompt_ids(self) -> List[int]:
        from ..decode.generate import chat_prompt

        return chat_prompt(self.tokenizer, self.messages, system=self.system)

    def _reusable(self, ids: List[int]) -> int:
        """Cut the cache to the longest prefix of ``ids`` it holds; return its length."""
        if not self.reuse:
            self.cache = self._new_cache()
            return 0
        n, rows = common_prefix(self.cache, ids)
        if n == len(ids):  # all cached (cannot happen after a new user message); prefill one
            n, rows = n - 1, rows[:-1]
        if len(rows) != len(self.cache):
            self.cache.keep(rows)
        return n

    def _rollback(self, keep: int) -> None:
        """After a failed turn: keep only the cached positions below ``keep``."""
        c = self.cache
        try:
            if len(c.tokens) != len(c.positions):
                raise ValueError("inconsistent cache")
            rows = sorted((r for r in range(len(c.tokens)) if c.positions[r] < keep),
                          key=lambda r: c.positions[r])
            c.keep(rows)
        except Exception:  # interrupted mid-update: start the cache afresh
            self.cache = self._new_cache()

    def stream(self, text: str) -> Iterator:
        """Answer ``text`` in the conversation; yields GenerationResponses."""
        from ..decode.generate import stream_generate

        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
        except Exception:
            self.messages.pop()
            raise
        reused = self._reusable(ids)
        self.response_start = len(ids)
        t0 = time.perf_counter()
        pieces, last, done = [], None, False
        try:
            for last in stream_generate(self.model, self.tokenizer, ids[reused:], cache=self.cache,
                                        params=self.params):
                pieces.append(last.text)
                yield last
            done = True
        finally:
            if not done:
                self.messages.pop()
                self._rollback(reused)
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.turns.append(TurnRecord(len(self.turns) + 1, len(ids), len(ids) - reused, reused,
                                     last.generation_tokens, last.finish_reason,
                                     time.perf_counter() - t0, last.stats))

    def send(self, text: str) -> str:
        """The whole answer to ``text`` (no streaming)."""
        return "".join(r.text for r in self.stream(text))

    def totals(self) -> dict:
        """Prefill over the conversation so far, with reuse and as a fresh start per turn would be."""
        return {"turns": len(self.turns),
                "prefill_tokens": sum(t.prefill_tokens for t in self.turns),
                "prefill_tokens_without_reuse": sum(t.prompt_tokens for t in self.turns)}


# --------------------------------------------------------------------------
# The live view of slot decoding

MASK = "░"
EOS_MARK = "⏎"


def display_width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


class SlotView:
    """Redraws the answer's positions in place as slots are committed, out of order.

    Masked positions show as ``░``; committed tokens as their text, the ones
    committed at this step highlighted. Only the blocks reached so far are
    drawn. Like llama.cpp's ``--diffusion-visual``; ANSI cursor movement.
    """

    def __init__(self, tokenizer, out: TextIO, response_start: int, block_lengths: Sequence[int],
                 eos_id: int, width: Optional[int] = None, height: Optional[int] = None,
                 color: bool = True, frame_time: float = 0.0):
        import shutil

        size = shutil.get_terminal_size((100, 30))
        self.tokenizer = tokenizer
        self.out = out
        self.start = response_start
        self.block_ends = [sum(block_lengths[: i + 1]) for i in range(len(block_lengths))]
        self.eos_id = eos_id
        self.width = max(20, width or size.columns)
        self.height = max(4, height or size.lines)
        self.color = color
        self.filled: Dict[int, str] = {}
        self.eos_at: Optional[int] = None
        self.lines = 0
        self.frames = 0
        self.frame_time = frame_time  # minimum seconds a frame stays (fast models would just flash)
        self.shown_at = 0.0

    def piece(self, token: int) -> str:
        if token == self.eos_id:
            return EOS_MARK
        text = self.tokenizer.decode([token])
        return text.replace("\n", "↵").replace("\t", "→").replace("\x1b", "") or "·"

    def update(self, response) -> None:
        """Take a step's commits and redraw."""
        fresh = set()
        for commit in response.commits:
            for p, t in zip(commit.positions, commit.tokens):
                offset = p - self.start
                self.filled[offset] = self.piece(t)
                fresh.add(offset)
                if t == self.eos_id and (self.eos_at is None or offset < self.eos_at):
                    self.eos_at = offset
        header = (f"step {response.step + 1} · {response.phase} · "
                  f"{len(self.filled)} committed ({len(fresh)} now)")
        self._draw(header, self._cells(fresh))

    def _visible_end(self) -> int:
        reach = max(self.filled, default=0)
        end = next((e for e in self.block_ends if e > reach), self.block_ends[-1])
        if self.eos_at is not None:
            end = min(end, self.eos_at + 1)
        return end

    def _cells(self, fresh: set) -> List[tuple]:
        cells = []
        for offset in range(self._visible_end()):
            text = self.filled.get(offset)
            if text is None:
                cells.append((MASK, "2"))  # dim
            else:
                cells.append((text, "1;32" if offset in fresh else ""))
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
        self.out.write("\n".join(frame) + "\n")
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
        if self.lines:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")  # up to the frame's first line, erase below

    def finish(self) -> None:
        """Erase the last frame (the answer is printed as plain text after it)."""
        wait = self.shown_at + self.frame_time - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self._clear()
        self.lines = 0
        self.out.flush()


# --------------------------------------------------------------------------
# The trace: every step's commits, as JSON


class Trace:
    """Records each step (turn, step, phase, positions, tokens) and rewrites FILE after each turn."""

    def __init__(self, path: str, tokenizer):
        self.path = path
        self.tokenizer = tokenizer
        self.steps: List[dict] = []
        self.turn = 0  # counts every turn of the run, /reset or not
        self.write()  # fail now (bad path) rather than after the first answer

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
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.steps, f)
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------
# The REPL

HELP = "commands: /reset clears the conversation, /stats shows the last turn, /help, /quit (or Ctrl-D)"


class Terminal:
    """Where the REPL reads and writes; dim styling only on a terminal."""

    def __init__(self, read: Callable[[str], str] = input, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, interactive: Optional[bool] = None):
        self.read = read
        self.out = out
        self.err = err
        self.interactive = sys.stdin.isatty() if interactive is None else interactive
        self.color = hasattr(err, "isatty") and err.isatty() and "NO_COLOR" not in os.environ

    def note(self, text: str) -> None:
        self.err.write((f"\x1b[2m{text}\x1b[0m" if self.color else text) + "\n")
        self.err.flush()


def turn_summary(t: TurnRecord) -> str:
    s = t.stats
    return (f"  {t.answer_tokens} tokens · {s.steps} steps · {s.tokens_per_forward:.2f} tokens/forward · "
            f"{s.tokens_per_second:.1f} tok/s · prefill {t.prefill_tokens} of {t.prompt_tokens} prompt "
            f"tokens ({t.reused_tokens} reused from the cache)")


def run_turn(session: ChatSession, text: str, term: Terminal, visualize: bool = False,
             trace: Optional[Trace] = None, frame_time: float = 0.0) -> bool:
    """One user message: stream (or draw) the answer. False when it failed."""
    view = None
    answer = []
    stream = session.stream(text)
    if trace is not None:
        trace.begin_turn()
    try:
        for r in stream:
            if visualize:
                if view is None:
                    view = SlotView(session.tokenizer, term.out, session.response_start,
                                    session.params.layout().block_lengths, session.tokenizer.eos_token_id,
                                    frame_time=frame_time)
                view.update(r)
                answer.append(r.text)
            else:
                term.out.write(r.text)
                term.out.flush()
            if trace is not None:
                trace.add(session.response_start, r)
    except KeyboardInterrupt:
        stream.close()
        if view is not None:
            view.finish()
        term.out.write("\n")
        term.note("[interrupted: the turn is dropped]")
        return False
    except RefusionError as e:
        stream.close()
        if answer:
            term.out.write("\n")
        term.note(f"error: {e}" + (" (/reset starts over)" if "context" in str(e) else ""))
        return False
    if view is not None:
        view.finish()
        term.out.write("".join(answer))
    term.out.write("\n")
    term.out.flush()
    if trace is not None:
        trace.write()
    term.note(turn_summary(session.turns[-1]))
    return True


def stats_text(session: ChatSession) -> str:
    if not session.turns:
        return "no turn yet"
    return json.dumps({**session.turns[-1].as_dict(), "conversation": session.totals()}, indent=2)


def repl(session: ChatSession, term: Terminal, visualize: bool = False, trace: Optional[Trace] = None,
         frame_time: float = 0.0) -> int:
    """Read lines until /quit or end of input; each line is a user turn or a command."""
    prompt = ">> " if term.interactive else ""
    while True:
        try:
            line = term.read(prompt)
        except (EOFError, KeyboardInterrupt):
            if term.interactive:
                term.out.write("\n")
            break
        command = line.strip()
        if not command:
            continue
        if command in ("/quit", "/exit", "q"):
            break
        if command in ("/reset", "r"):
            session.reset()
            term.note("  reset: conversation and cache cleared")
        elif command == "/stats":
            term.out.write(stats_text(session) + "\n")
        elif command in ("/help", "h"):
            term.note(HELP)
        elif command.startswith("/"):
            term.note(f"unknown command {command.split()[0]}; {HELP}")
        else:
            run_turn(session, line, term, visualize=visualize, trace=trace, frame_time=frame_time)
    term.note("bye")
    return 0


def build_parser():
    from ..cli import OneLineParser, add_adapter_arg, add_decoding_args

    parser = OneLineParser(prog="python -m refusion_mlx.chat",
                           description="Chat with a ReFusion model in the terminal (multi-turn, KV cache kept "
                                       "across turns).")
    parser.add_argument("--model", help="model folder or hub repo id (default: the bundled demo model)")
    add_adapter_arg(parser)
    parser.add_argument("--system", "--system-prompt", dest="system", help="system message")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="compute dtype")
    add_decoding_args(parser)
    parser.add_argument("--no-reuse", action="store_true",
                        help="prefill the whole conversation every turn (to measure what reuse saves)")
    parser.add_argument("--visualize", action="store_true",
                        help="draw the answer's slots filling out of order (ANSI terminal)")
    parser.add_argument("--frame-time", type=float, default=0.08, metavar="SECONDS",
                        help="with --visualize, the least time a step stays on screen (default 0.08; 0: as fast "
                             "as it decodes)")
    parser.add_argument("--trace", metavar="FILE", help="write each step's commits as JSON to FILE")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from ..cli import params_from_args

    term = Terminal()
    try:
        if not 0 <= args.frame_time <= 10:
            raise RefusionError(f"--frame-time must be within 0..10 seconds, got {args.frame_time}")
        params = params_from_args(args)
        trace = None
        if args.trace:
            try:
                trace = Trace(args.trace, None)
            except OSError as e:
                raise RefusionError(f"cannot write the trace to {args.trace}: {e.strerror or e}") from None
        from ..models.loading import load

        model, tokenizer = load(args.model, dtype=args.dtype, adapter_path=args.adapter_path)
        if trace is not None:
            trace.tokenizer = tokenizer
        session = ChatSession(model, tokenizer, params, system=args.system, reuse=not args.no_reuse)
    except RefusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if term.interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    name = args.model or "tiny-refusion (demo)"
    term.note(f"refusion_mlx.chat · {name} · max tokens {params.gen_length} · slot {params.slot_size}"
              + (" · no cache reuse" if args.no_reuse else ""))
    term.note(HELP)
    return repl(session, term, visualize=args.visualize, trace=trace, frame_time=args.frame_time)


if __name__ == "__main__":
    sys.exit(main())
