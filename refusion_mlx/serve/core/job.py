"""A request in flight (:class:`Job`) and what one turn of the engine's loop
does (:class:`Turn`, decided by rank 0 and broadcast under ``mlx.launch``).

A Job shapes its decoder's responses into the answer's events
(:meth:`Job.step`: final text through the stop strings and the tool-call
splitter, a step's commits, the tokens' log-probabilities) and its end into
an :class:`~.outcome.Outcome`; the engine only posts them. Neither knows
any API: each protocol's writer formats the events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from ...decode.answer import end_ids
from .engine_request import EngineRequest
from .outcome import Outcome, Usage
from .slots import step_commits
from .text import CharCounter, TextShaper, token_piece
from .tool_calls import ToolCallSplitter, ToolFormat


class Job:
    """A request in flight: the engine thread posts events to the HTTP side's
    asyncio queue: ("start", None), ("text", str), ("tool_call", ToolCall),
    ("done", Outcome), ("error", Refusal); with ``include_commits``, a step's
    first text comes as ("commits", (text, its commits)); with ``logprobs``,
    text comes as ("logprobs", (text, its tokens' entries)).

    Made whole by the engine (``Engine.job``: on rank 0 when the request is
    submitted, on the other ranks from the plan): the request, where its
    events go (``loop``; None: nobody listens), the KV bytes it reserves
    while it runs, its text's stop strings (``shaper``) and, when the request
    gives tools and the model has a call format (``tool_format``), the
    splitter that reads its calls (``calls``). Only its decoding's handles
    change after: ``uid``, ``cache`` and ``cached`` are set when the engine
    starts it.
    """

    def __init__(self, request: EngineRequest, loop, kv_bytes: int = 0, eos_id: Optional[int] = None,
                 tool_format: Optional[ToolFormat] = None):
        self.request, self.loop = request, loop
        self.events: "asyncio.Queue[tuple]" = asyncio.Queue()
        self.cancelled = threading.Event()
        self.kv_bytes = kv_bytes  # reserved against the engine's max_kv_bytes while it runs
        self.waited = False  # it waited in the queue for KV memory
        self.calls = (ToolCallSplitter(tool_format, request.tools, single=not request.parallel_tool_calls)
                      if request.tools and tool_format is not None else None)
        # stop strings cut the answer's text, never a call's arguments (which then would not parse)
        self.shaper = TextShaper(request.stop, eos_id,
                                 (tool_format.start, tool_format.end) if self.calls is not None else None)
        self.group: object = self  # the HTTP request it is a choice of (Scheduler.put: queued with its group)
        self.uid: Optional[int] = None  # in the BatchGenerator, once started
        self.cache = None  # its CommittedCache, once started
        self.cached = 0  # prompt tokens the prompt cache held
        self.task = None  # a scoring request's ScoringTask, once started
        self.served_at = 0.0  # scoring: the engine's scoring turn that last did a piece of it (started: that less 0.5)
        # when the HTTP side last found its client there; 0: not looked yet, so it looks at once (a client
        # that closed its side with its request -- gone, or half-closed: one FIN -- is cancelled at once)
        self.client_seen = 0.0
        self.entry_chars = 0  # characters of the tokens whose logprobs went out (or were held, with calls)
        self.held: List[Tuple[int, dict]] = []  # (offset, entry) of tokens the call splitter has not decided
        self.chars = CharCounter()  # the answer's tokens as characters of its text

    def take(self, text: str, tokens, finished: bool, cut: bool = False, tokenizer=None) -> tuple:
        """A response's new final text and ids, through the stop strings and the
        tool-call splitter: (the items now certain -- strings and ToolCalls --,
        "stop" when the answer ends here, else None). With ``parallel_tool_calls``
        false the first call ends the answer; ``cut``: the token budget ended it;
        ``tokenizer``: spells the ids for a stop string's usage (:class:`.text.TextShaper`)."""
        widths = None if tokenizer is None else (lambda: token_widths(tokenizer, tokens))
        text, reason = self.shaper.feed(text, tokens, final=finished, widths=widths)
        if self.calls is None:
            return ([text] if text else []), reason
        items = self.calls.feed(text, final=finished or reason is not None, cut=cut and reason is None)
        return items, reason or ("stop" if self.calls.done else None)

    def step(self, response, tokenizer) -> Tuple[list, Optional[str], int]:
        """One step's response shaped: (the events to post in order, the
        finish reason when the answer ends here else None, the answer tokens
        it released)."""
        released = self.shaper.completion_tokens
        items, reason = self.take(response.text, response.tokens, finished=response.finish_reason is not None,
                                  cut=response.finish_reason == "length", tokenizer=tokenizer)
        events = []
        if self.request.include_commits and response.commits:
            first = items.pop(0) if items and isinstance(items[0], str) else ""
            events.append(("commits", (first, step_commits(tokenizer, self.request, response))))
        if self.request.logprobs is None or response.logprobs is None:
            events += [("text" if isinstance(i, str) else "tool_call", i) for i in items]
        else:  # the step's text with its tokens' entries, then its calls
            text = "".join(i for i in items if isinstance(i, str))
            entries = self._of_content(self._within_answer(token_entries(tokenizer, response.tokens,
                                                                         response.logprobs, self.chars)),
                                       final=response.finish_reason is not None or reason is not None)
            events += [("logprobs", (text, entries))] if text or entries else []
            events += [("tool_call", i) for i in items if not isinstance(i, str)]
        return events, reason or response.finish_reason, self.shaper.completion_tokens - released

    def _within_answer(self, entries: List[dict]) -> List[Tuple[int, dict]]:
        """``entries`` (each with its offset in the answer's text) but those of tokens wholly past a stop
        string that cut the answer: the tokens' texts join into the answer's, as OpenAI's do."""
        kept = []
        for e in entries:
            if self.shaper.hit is not None and self.entry_chars >= self.shaper.sent:
                break
            kept.append((self.entry_chars, e))
            self.entry_chars += e["chars"]
        return kept

    def _of_content(self, entries: List[Tuple[int, dict]], final: bool) -> List[dict]:
        """The entries of the answer's content: with tools, not those of a call's markup (OpenAI's logprobs
        cover the content alone). A token whose text the splitter has not decided waits for it."""
        if self.calls is None:
            return [e for _, e in entries]
        out, waiting = [], []
        for at, e in self.held + entries:
            if not final and at + max(e["chars"], 1) > self.calls.decided:  # a part of a character: its own
                waiting.append((at, e))
            elif self.calls.kept(at, at + e["chars"]):
                out.append(e)
        self.held = waiting
        return out

    def outcome(self, reason: str, stats, dist=None) -> Outcome:
        """The "done" event: finish reason ("tool_calls" for an answer that
        ended after making calls), the stop string that cut it, the token
        counts and the decoder's stats (with the group's under ``mlx.launch``)."""
        if reason == "stop" and self.calls is not None and self.calls.calls:
            reason = "tool_calls"
        usage = Usage(len(self.request.prompt_ids), self.shaper.completion_tokens, self.cached)
        info = None
        if stats is not None:  # the block layout used and the forwards it took
            usage = Usage(usage.prompt, usage.completion, usage.cached, dict(stats.layout), stats.forwards,
                          round(stats.tokens_per_forward, 4))
            info = stats.as_dict()
            if dist is not None:
                info["distributed"] = dist.as_dict()
        return Outcome(reason, usage, self.shaper.hit, info)

    def post(self, kind: str, payload=None) -> None:
        if self.loop is None:  # a rank other than 0: nobody listens
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass


def token_widths(tokenizer, tokens) -> List[int]:
    """The characters each of ``tokens``, in order, spells (a character split over tokens counts at its last)."""
    count = CharCounter()
    return [count(token_piece(tokenizer, t)[1]) for t in tokens]


def token_entries(tokenizer, tokens, scores, chars: CharCounter) -> List[dict]:
    """Per final token with text (EOS, the other end ids, and ids past the tokenizer left out):
    its name and bytes (:func:`.text.token_piece`), the characters of the answer's text it completes
    (``chars``, counting over the answer), its log-probability (the probability the decoder accepted it
    under, :mod:`refusion_mlx.decode.token_scores`, as a natural log) and top tokens ((name, bytes,
    log-probability) of the same row of logits)."""
    ends, vocab = end_ids(tokenizer), len(tokenizer)
    out = []
    for t, score in zip(tokens, scores):
        if t in ends or t >= vocab or score is None:
            continue
        lp, top = score
        name, raw = token_piece(tokenizer, t)
        out.append({"token": name, "bytes": raw, "chars": chars(raw), "logprob": lp,
                    "top": [(*token_piece(tokenizer, i), v) for i, v in top]})
    return out


@dataclass
class Turn:
    """What one turn of the engine's loop does, decided by rank 0: close the
    ``cancelled`` running requests (by uid), start the ``admitted`` ones, in
    order, do a piece of the scoring requests' work when ``score``, then step
    the batch; or ``stop``."""

    cancelled: List[int] = field(default_factory=list)
    admitted: List[Job] = field(default_factory=list)
    stop: bool = False
    score: bool = True

    def wire(self) -> tuple:
        """What rank 0 broadcasts: the admitted requests without their compiled
        constraints (a grammar's matcher stays in its process; the others compile their own)."""
        requests = [dataclasses.replace(j.request, compiled=None) for j in self.admitted]
        return self.cancelled, requests, self.stop, self.score

    @classmethod
    def from_wire(cls, wire: tuple, job: Callable[[EngineRequest], Job]) -> "Turn":
        """The plan rank 0 broadcast; ``job`` makes each admitted request's Job (``Engine.job``)."""
        cancelled, requests, stop, score = wire
        return cls(cancelled, [job(r) for r in requests], stop, score)
