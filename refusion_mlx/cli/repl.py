"""The terminal chat's loop: each line a user turn or a command, the answer
streamed (or drawn with :class:`.slot_view.SlotView`) and its cost noted."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Optional, TextIO

from ..decode.conversation import ChatSession, TurnRecord
from ..distributed import group as distributed_group
from ..distributed.group import is_link_failure
from ..errors import RefusionError
from .flags import without_line_end
from .launch import agreed_steps
from .slot_view import SlotView
from .trace import Trace

HELP = ("commands: /reset clears the conversation (or r), /stats shows the last turn, /help (or h), /quit (or "
        "/exit, q, Ctrl-D); any other line is a message")
# each command's names: a line whose first word is one of the /names is that command; a line that is only a
# letter is mlx_lm.chat's (q, r, h)
COMMANDS = {"quit": ("/quit", "/exit"), "reset": ("/reset",), "stats": ("/stats",), "help": ("/help",)}
LETTERS = {"q": "quit", "r": "reset", "h": "help"}


def command_of(line: str) -> Optional[str]:
    """The command a line gives (``quit``, ``reset``, ``stats``, ``help``), ``"unknown"`` for a lone
    ``/word`` that is none, or None: the line is a message ("/usr/bin is a path" too)."""
    words = line.split()
    if not words:
        return None
    if len(words) == 1 and words[0] in LETTERS:
        return LETTERS[words[0]]
    for command, names in COMMANDS.items():
        if words[0] in names:
            return command
    return "unknown" if len(words) == 1 and words[0].startswith("/") else None


class Terminal:
    """Where the REPL reads and writes; dim styling only on a terminal."""

    def __init__(self, read: Callable[[str], str] = input, out: Optional[TextIO] = None,
                 err: Optional[TextIO] = None, interactive: Optional[bool] = None):
        self.read = read
        self.out = out or sys.stdout  # the streams of the moment it is made, not of the import
        self.err = err = err or sys.stderr
        self.interactive = (sys.stdin is not None and sys.stdin.isatty()) if interactive is None else interactive
        self.color = hasattr(err, "isatty") and err.isatty() and "NO_COLOR" not in os.environ

    def note(self, text: str) -> None:
        self.err.write((f"\x1b[2m{text}\x1b[0m" if self.color else text) + "\n")
        self.err.flush()


def turn_summary(t: TurnRecord, max_tokens: Optional[int] = None, history: bool = True) -> str:
    """The turn's cost in one line; ``max_tokens``: the session's budget, said when the turn had less
    (``history``: earlier turns took some of the context, which /reset frees)."""
    s = t.stats
    cut = (f" · max tokens {max_tokens} cut to {t.max_tokens} to fit the context"
           + (" (/reset starts over)" if history else "") if max_tokens is not None and t.max_tokens < max_tokens
           else "")
    return (f"  {t.answer_tokens} tokens · {s.steps} steps · {s.tokens_per_forward:.2f} tokens/forward · "
            f"{s.tokens_per_second:.1f} tok/s · prefill {t.prefill_tokens} of {t.prompt_tokens} prompt "
            f"tokens ({t.reused_tokens} reused from the cache){cut}")


def run_turn(session: ChatSession, text: str, term: Terminal, visualize: bool = False,
             trace: Optional[Trace] = None, frame_time: float = 0.0) -> bool:
    """One user message (a piped line's carriage return, of Windows' line ending, dropped): stream (or draw)
    the answer. False when it failed."""
    text = without_line_end(text)
    view = None
    answer = []
    stream = agreed_steps(distributed_group.current(), session.stream(text))  # under mlx.launch: one stop
    if trace is not None:
        trace.begin_turn()
    try:
        for r in stream:
            if visualize:
                if view is None:  # on a terminal: redrawn in place; in a pipe or a file: frame after frame
                    tty = hasattr(term.out, "isatty") and term.out.isatty()
                    view = SlotView(session.tokenizer, term.out, session.cache, session.response_start,
                                    session.turn_params.layout().block_lengths, session.tokenizer.eos_token_id,
                                    frame_time=frame_time if tty else 0.0, redraw=tty,
                                    color="NO_COLOR" not in os.environ)
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
    except (RefusionError, RuntimeError) as e:  # this turn failed (MLX's own failure: out of memory); a lost
        if isinstance(e, RuntimeError) and is_link_failure(e):  # rank ends the chat (cli.run says so)
            raise
        stream.close()
        if answer:
            term.out.write("\n")
        # an earlier turn's history may be what fills the context: then /reset helps
        term.note(f"error: {e}" + (" (/reset starts over)" if "context" in str(e) and session.messages else ""))
        return False
    if view is not None:
        view.finish()
        term.out.write("".join(answer))
    term.out.write("\n")
    term.out.flush()
    if trace is not None:
        trace.write()
    earlier = sum(m.get("role") == "user" for m in session.messages) > 1
    term.note(turn_summary(session.turns[-1], session.params.gen_length, history=earlier))
    return True


def stats_text(session: ChatSession) -> str:
    if not session.turns:
        return "no turn yet"
    dist = distributed_group.current()  # under mlx.launch: how the model is split
    extra = {} if dist is None else {"distributed": dist.as_dict()}
    return json.dumps({**session.turns[-1].as_dict(), "conversation": session.totals(), **extra}, indent=2)


def repl(session: ChatSession, term: Terminal, visualize: bool = False, trace: Optional[Trace] = None,
         frame_time: float = 0.0) -> int:
    """Read lines until /quit or end of input; each line is a user turn or a command (:func:`command_of`).

    Returns the exit status: 0, or 1 when turns were piped in and one of them failed (a script must see it;
    at a terminal the user has read the error already). Ctrl-C at the prompt is raised (KeyboardInterrupt:
    the command's "interrupted" and exit 130); during an answer it drops that turn (:func:`run_turn`)."""
    prompt = ">> " if term.interactive else ""
    failed = 0
    while True:
        try:
            line = term.read(prompt)
        except (EOFError, KeyboardInterrupt) as e:
            if term.interactive:  # the prompt's line ended
                term.out.write("\n")
            if isinstance(e, KeyboardInterrupt):  # as at any other time: "interrupted", exit 130 (cli.run)
                raise
            break
        if not line.strip():
            continue
        command = command_of(line)
        if command == "quit":
            break
        if command == "reset":
            session.reset()
            term.note("  reset: conversation and cache cleared")
        elif command == "stats":
            term.out.write(stats_text(session) + "\n")
        elif command == "help":
            term.note(HELP)
        elif command == "unknown":
            term.note(f"unknown command {line.strip()}; {HELP}")
        elif not run_turn(session, line, term, visualize=visualize, trace=trace, frame_time=frame_time):
            failed += 1
    if failed and not term.interactive:
        term.note(f"bye ({failed} turn{'s' if failed > 1 else ''} failed)")
        return 1
    term.note("bye")
    return 0
