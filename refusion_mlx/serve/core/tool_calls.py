"""Tool calls: the model's calls found in its answer text, and the checks on
the tools a request gives, shared by the three APIs.

The calls' format is the tokenizer's, as mlx-lm reads it: its tokenizer
wrapper picks a parser among ``mlx_lm.tool_parsers`` from the chat template
(``tool_parser_type`` in ``tokenizer_config.json`` overrides), e.g.
``json_tools`` for Qwen3's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.
:class:`ToolFormat` is that choice (the markers around a call and the
parser); a model whose template has no call format takes no tools.

:class:`ToolCallSplitter` runs on the engine thread after the stop strings
(:class:`~.text.TextShaper`): it turns the in-order answer text into text
and :class:`ToolCall` items, holding back text that may be the start of a
call, so a stream never shows raw call markup. A call that does not parse
stays text, and is counted.

Tools enter the prompt only through the chat template: each API's adapter
turns its tool definitions into the form templates take (OpenAI's
``{"type": "function", "function": {name, description, parameters}}``) with
:func:`function_tool`, which checks them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ...decode.json_schema import size_problem
from .call_bounds import CallEnd
from .refusal import Reason, Refusal

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
PROBE = "refusion_probe_tool"  # a tool name no template writes by itself


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes a call: between ``start`` and ``end``, read by
    ``parse(text, tools)`` (an mlx-lm tool parser: a dict or a list of dicts
    with ``name`` and ``arguments``)."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]
    parser: str  # the parser's module, for the log

    @classmethod
    def of(cls, tokenizer) -> Optional["ToolFormat"]:
        """The tokenizer's format (mlx-lm's choice), if its chat template also
        renders the tools it is given; else None: the model takes no tools."""
        if not getattr(tokenizer, "has_tool_calling", False) or not renders_tools(tokenizer):
            return None
        parse = tokenizer.tool_parser
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, parse,
                   getattr(parse, "__module__", "?").rsplit(".", 1)[-1])


def renders_tools(tokenizer) -> bool:
    """Whether the chat template writes the tools it is given into the prompt."""
    tool = function_tool({"name": PROBE, "description": "", "parameters": {"type": "object", "properties": {}}},
                         "tools[0]")
    from ...models.template_steps import step_limit

    try:
        with step_limit(tokenizer):
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool],
                                                 add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    return PROBE in text


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: its ``id`` (``call_...``), the function's
    ``name`` and its ``arguments`` as JSON text (an object)."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> Dict[str, Any]:
        return json.loads(self.arguments)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def arguments_object(text: Any, param: str) -> Dict[str, Any]:
    """A replayed call's ``arguments`` (a JSON object as text) read, or a
    Refusal naming ``param``: not such text, or nested past what the parser
    takes (a string's nesting is not the body's, which the edge bounds)."""
    try:
        args = json.loads(text) if isinstance(text, str) else None
    except RecursionError:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: nested too deeply to read as JSON", param) from None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise Refusal(Reason.INVALID_VALUE, f"{param}: must be a JSON object as text", param)
    return args


def as_calls(parsed: Any) -> Optional[List[ToolCall]]:
    """A parser's output as calls; None when it is not one or more {name, arguments (an object)}."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item.get("id") or call_id(), item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


class ToolCallSplitter:
    """Splits the answer's final, in-order text into text and calls.

    ``feed(text, final)`` returns the items now certain, in order: strings
    and :class:`ToolCall`. Text that could begin ``start`` is held back until
    it is known not to; a call is held until its ``end`` (outside its JSON's
    strings: :mod:`.call_bounds`), then parsed; one
    that does not parse (or never ends) goes out as the text it was
    (``failed`` counts them), the whitespace before it too, but for one the
    token budget cut short: it is neither text nor a call (its markup is the
    template's, not an answer; ``cut`` counts them). Whitespace between text
    and a call, or after a call, is dropped. With ``single`` (``parallel_tool_calls`` false) the
    answer ends after the first call: ``done`` turns true. Which of the text
    fed went out as text is kept by offset (:meth:`kept`, up to ``decided``),
    so the tokens of a call's markup can be told from the answer's own.
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[dict] = (), single: bool = False):
        self.fmt, self.tools, self.single = fmt, list(tools), single
        self.pending = ""  # text received, not yet given out
        self.base = 0  # where pending starts in the text fed (all before it is decided)
        self.spans: List[Tuple[int, int]] = []  # the text fed that went out as text, as [start, end) offsets
        self.call_at = 0  # where the open call's start marker is in the text fed
        self.gap = ""  # the whitespace before it: dropped if it is a call, given back with it if not
        self.in_call = False
        self.ends = CallEnd(fmt.end)  # the open call's end marker, looked for as its body grows
        self.after_call = False  # the last item given out was a call
        self.calls = 0
        self.failed = 0
        self.cut = 0
        self.done = False

    def feed(self, text: str, final: bool, cut: bool = False) -> List[Union[str, ToolCall]]:
        """The items now certain; ``final``: the answer ends with ``text``,
        ``cut``: because the token budget ran out."""
        if self.done:
            return []
        self.pending += text
        out: List[Union[str, ToolCall]] = []
        while not self.done:
            if self.in_call:
                end = self.ends.find(self.pending, final)  # pending begins with the call's body
                if end < 0:
                    break
                body = self.pending[:end]
                self._advance(end + len(self.fmt.end))
                self._close(body, out, self.fmt.end)
            else:
                start = self.pending.find(self.fmt.start)
                if start < 0:
                    break
                head = self.pending[:start]
                self._text(head.rstrip(), out, self.base)
                self.gap = head[len(head.rstrip()):]
                self.call_at, self.in_call = self.base + start, True
                self.ends = CallEnd(self.fmt.end)
                self._advance(start + len(self.fmt.start))
        if self.done:
            self._advance(len(self.pending))
        elif final:
            if self.in_call:  # no end marker: a call if it parses as one (an EOS for the end), else text
                body = self.pending
                self._advance(len(body))
                self._close(body, out, "", cut)
            self._text(self.pending, out, self.base)
            self._advance(len(self.pending))
        elif not self.in_call:
            keep = _partial_tail(self.pending, self.fmt.start)
            cut = len(self.pending) - keep
            text = self.pending[:cut]
            ready = text.rstrip()  # trailing whitespace waits: a call may follow it
            self._text(ready, out, self.base)
            self._advance(len(ready))
        return out

    @property
    def decided(self) -> float:
        """The text fed before this offset is decided: given out as text (:meth:`kept`) or not."""
        return float("inf") if self.done else self.base

    def kept(self, start: int, end: int) -> bool:
        """Whether any of the text fed at ``[start, end)`` went out as text (a point: within some)."""
        for s, e in reversed(self.spans):  # in order and apart: the spans before one that ends by start end sooner
            if e <= start:
                return False
            if (s <= start < e) if start == end else (s < end and start < e):
                return True
        return False

    def _advance(self, n: int) -> None:
        self.pending, self.base = self.pending[n:], self.base + n

    def _text(self, text: str, out: list, at: int) -> None:
        """``text``, fed at offset ``at``, goes out (less the whitespace after a call)."""
        if self.after_call:
            stripped = text.lstrip()
            at, text = at + len(text) - len(stripped), stripped
        if text:
            out.append(text)
            self.spans.append((at, at + len(text)))
            self.after_call = False

    def _close(self, body: str, out: list, end: str, cut: bool = False) -> None:
        self.in_call = False
        try:
            calls = as_calls(self.fmt.parse(body, self.tools))
        except Exception:  # whatever the parser raises: the text was not a call
            calls = None
        if calls is None and cut:  # the budget cut it short: left out
            self.cut += 1
            return
        if calls is None:
            self.failed += 1
            self._text(self.gap + self.fmt.start + body + end, out, self.call_at - len(self.gap))
            return
        if self.single:
            calls, self.done = calls[:1], True
        out.extend(calls)
        self.calls += len(calls)
        self.after_call = True


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that begins ``marker`` (shorter than it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# --------------------------------------------------------------------------
# Tools as the chat template takes them


def function_tool(spec: Any, param: str, schema_field: str = "parameters") -> dict:
    """A function tool (``name``, ``description``, ``parameters``: a JSON
    Schema object; one without ``type`` is taken as ``"type": "object"``) in
    the chat template's form; a :class:`Refusal` naming ``param`` when it is
    malformed (the schema as the API calls it: ``schema_field``)."""
    if not isinstance(spec, dict):
        raise Refusal(Reason.INVALID_VALUE, f"{param}: must be an object", param)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise Refusal(Reason.INVALID_VALUE, f"{param}.name: must be 1 to 64 letters, digits, '_', '-', '.' or ':'",
                      f"{param}.name")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise Refusal(Reason.INVALID_VALUE, f"{param}.description: must be a string", f"{param}.description")
    parameters = spec.get("parameters")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    if isinstance(parameters, dict) and "type" not in parameters:  # OpenAI takes it as an object's schema: so
        parameters = {"type": "object", **parameters}  # here, and a call's arguments are one (never null)
    _check_schema(parameters, f"{param}.{schema_field}")
    function = {"name": name, **({"description": description} if description else {}), "parameters": parameters}
    return {"type": "function", "function": function}


def check_schema_size(schema: Any, param: str) -> None:
    """A schema within the limits of :func:`~refusion_mlx.decode.json_schema.size_problem`,
    checked before any library (which would recurse) sees it; else a Refusal naming ``param``."""
    too_large = size_problem(schema)
    if too_large is not None:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: the schema is {too_large} (the limits of this server)", param)


def _check_schema(schema: Any, param: str) -> None:
    """A tool's parameters: a JSON Schema of an object, valid as a schema."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise Refusal(Reason.INVALID_VALUE, f"{param}: must be a JSON Schema of an object "
                                            '({"type": "object", "properties": {...}})', param)
    check_schema_size(schema, param)
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise Refusal(Reason.INVALID_VALUE, f"{param}: not a valid JSON Schema"
                                            f"{f' at {where}' if where else ''}: {e.message}"[:300], param) from None


def template_tools(tools: Sequence[dict], choice: Optional[str], takes_tools: bool, param: str,
                   choice_param: str, named: bool = False) -> Tuple[dict, ...]:
    """The tools (in the template's form) a request gives the chat template
    and whose calls its answer is read for: none with ``tool_choice`` "none".
    Names must differ; a model without a call format takes none (a 400).
    ``named``: ``choice`` is a tool's name (a tool may be named "none")."""
    names = [t["function"]["name"] for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: two tools are named {twice!r}", param)
    check_tool_choice(choice, names, choice_param, named)
    if not tools or choice == "none" and not named:
        return ()
    if not takes_tools:
        raise Refusal(Reason.UNSUPPORTED, f"{param}: this model's chat template has no tool-call format, so it "
                                          "cannot take tools", param)
    return tuple(tools)


def check_tool_choice(choice: Optional[str], names: Sequence[str], param: str, named: bool = False) -> None:
    """``choice``: "auto", "none", "required" or a tool's name (``named``).
    A name the tools do not have is a 400, and so is "required" without
    tools; a forced call is decoded under a grammar (:mod:`.structured`)."""
    if choice in (None, "auto", "none") and not named:
        return
    if choice == "required" and not named and not names:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: forcing a call needs tools to call", param)
    if (named or choice != "required") and choice not in names:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: no tool named {choice!r} among the request's tools "
                                            f"({', '.join(names) or 'none'})", param)


def check_results(messages: Sequence[dict], params: Sequence[str]) -> None:
    """Every tool result (a message of role "tool") answers a call that an
    earlier assistant message made, by id; ``params``: each message's field."""
    made = set()
    for m, param in zip(messages, params):
        made.update(call.get("id") for call in m.get("tool_calls") or ())
        if m.get("role") == "tool" and m.get("tool_call_id") not in made:
            raise Refusal(Reason.INVALID_VALUE, f"{param}: a tool result for call {m.get('tool_call_id')!r}, "
                                                "which no earlier assistant message made", param)



def first_unanswered(messages: Sequence[dict], right_after: bool) -> Optional[Tuple[int, List[str]]]:
    """The first message whose calls are not each answered by a tool result -- among the tool messages right
    after it (``right_after``: OpenAI's chat rule), or anywhere after it -- and the ids left unanswered.
    With ``right_after``, assistant messages that only make calls (no text) after one that makes calls are
    one group, answered by the tool messages right after the group, in any order: clients (Codex's chat
    client) write each of a turn's parallel calls as its own message, then the results."""
    first, later, run = None, set(), set()  # the results after a message; those of the tool run right after its group
    in_run = False  # the message after this one is a tool result
    for i in range(len(messages) - 1, -1, -1):  # from the end: one pass
        m = messages[i]
        calls = [c.get("id") for c in m.get("tool_calls") or ()]
        missing = [c for c in calls if c not in (run if right_after else later)]
        first = (i, missing) if missing else first
        if m.get("role") == "tool":
            run = run if in_run else set()  # a new run of results: those after the group before it
            run.add(m.get("tool_call_id"))
            later.add(m.get("tool_call_id"))
        elif not (calls and m.get("role") == "assistant" and not m.get("content")):
            run = set()  # but for a message that only makes calls: the group goes on before it
        in_run = m.get("role") == "tool"
    return first
