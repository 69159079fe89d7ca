"""Grammars for constrained decoding: what a request constrains its answer to,
compiled once by llguidance, and one request's matcher.

The engine is llguidance (chosen by measurement: ``benchmarks/grammar_engines.py``,
docs/benchmarks.md "Grammar engines"): it compiles JSON Schema and Lark
grammars (``%json {...}`` embeds a schema) against the model's tokenizer, and
its matcher gives, for the text decided so far in *position order*, the bitmask
of tokens allowed next, the tokens the grammar forces, and rollback -- what the
constrained mode (``constrain.py``) needs to check drafts like speculative
decoding does. No JSON parsing or schema-to-grammar translation is done
here: a schema is narrowed first to what a small model can finish
(:mod:`.json_schema`).

* :class:`Constraint` -- the request's constraint as given: a JSON Schema, any
  JSON object, a grammar in llguidance's Lark format, or tool calls in
  Qwen3's format (forced, or optional for strict tools);
* :func:`compile_constraint` -- checked and compiled against a tokenizer (a
  schema or grammar the engine refuses is one ``DecodeError``);
* one request's matcher (decided tokens in, masks out) is :mod:`.matcher`'s.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from ..errors import DecodeError
from .json_schema import check_schema, for_decoding, size_problem, without_format
from .ll_tokenizer import check_named_tokens, ll_tokenizer, one_token
from .matcher import Matcher, allowed_forced

# compact JSON as json.dumps writes it: ", " between items, ": " after keys
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "lark", "tool_calls")


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match. ``kind``: ``json_schema`` (``source``
    the schema as JSON text), ``json_object`` (any JSON object) or ``lark``
    (``source`` a grammar in llguidance's Lark format)."""

    kind: str
    source: str = ""
    name: str = ""  # for messages: "response_format", "--json-schema", a tool's name ...

    @classmethod
    def json_schema(cls, schema: Union[str, Dict[str, Any]], name: str = "json_schema") -> "Constraint":
        """A JSON Schema given as a dict or as JSON text; checked as JSON Schema here."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise DecodeError(f"{name}: not valid JSON ({e})") from None
            except RecursionError:
                raise DecodeError(f"{name}: nested too deeply to read as JSON") from None
        if isinstance(schema, bool) or not isinstance(schema, dict):
            raise DecodeError(f"{name}: a JSON Schema must be an object, got {type(schema).__name__}")
        check_schema(schema, name)
        for _ in range(16):  # a format the engine does not know is dropped: JSON Schema's formats annotate
            try:
                return cls("json_schema", json.dumps(schema), name).checked()
            except DecodeError as e:
                unknown = UNKNOWN_FORMAT.search(str(e))
                if unknown is None:
                    raise
                schema = without_format(schema, unknown.group(1))
        raise DecodeError(f"{name}: cannot be compiled: too many unknown formats")

    @classmethod
    def json_object(cls, name: str = "json_object") -> "Constraint":
        return cls("json_object", "", name)

    @classmethod
    def lark(cls, grammar: str, name: str = "grammar") -> "Constraint":
        if not isinstance(grammar, str):
            raise DecodeError(f"{name}: a grammar in Lark format, as text, got {type(grammar).__name__}")
        if not grammar.strip():
            raise DecodeError(f"{name}: the grammar is empty")
        return cls("lark", grammar, name).checked()

    @classmethod
    def tool_calls(cls, tools: Sequence[Dict[str, Any]], start: str, end: str, parallel: bool = True,
                   name: str = "tool_choice", optional: bool = False,
                   answer: Optional["Constraint"] = None) -> "Constraint":
        """A forced call: ``start``, a newline, ``{"name": ..., "arguments": ...}``
        with one of ``tools``' names (``{"name", "parameters"}``; the arguments
        valid under that tool's ``parameters`` schema), a newline, ``end`` --
        Qwen3's call format; several, one per line, when ``parallel``.
        ``optional`` (strict tools a model may call): text, then maybe the
        calls; only where the markers are tokens of their own, which text
        cannot spell (elsewhere it compiles to no constraint). ``answer`` (a
        ``json_schema`` or ``json_object`` constraint): that JSON, or the calls
        (no JSON value starts with a marker, spelled or not)."""
        spec = {"tools": [{"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
                          for t in tools], "start": start, "end": end, "parallel": bool(parallel),
                "optional": bool(optional) and answer is None,
                "answer": None if answer is None else answer.schema}
        if not spec["tools"]:
            raise DecodeError(f"{name}: forcing a call needs at least one tool")
        too_large = next((f"{t['name']!r} are {p}" for t in spec["tools"] for p in [size_problem(t["parameters"])] if p),
                         None)
        if too_large is not None:  # before anything recursive reads them
            raise DecodeError(f"{name}: the parameters of tool {too_large} (the limits of constrained decoding)")
        return cls("tool_calls", json.dumps(spec), name).checked()

    @property
    def schema(self) -> Dict[str, Any]:
        """A JSON constraint's schema (``json_object``'s: any object)."""
        if self.kind not in ("json_schema", "json_object"):
            raise DecodeError(f"{self.name}: not a JSON Schema but a {self.kind} constraint")
        return json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}

    @property
    def whole_answer(self) -> bool:
        """Whether the grammar holds the whole answer (not text that may end in calls)."""
        return self.kind != "tool_calls" or not json.loads(self.source).get("optional")

    def checked(self) -> "Constraint":
        """Itself, once the engine has compiled it without a tokenizer: what
        it cannot compile is one ``DecodeError`` naming the constraint."""
        problem = self.problem()
        if problem is not None and self.kind == "tool_calls":  # the tool whose parameters it is, not the calls' grammar
            tools = json.loads(self.source)["tools"]
            problem = next((f"the parameters of tool {t['name']!r} {p}" for t in tools for p in [
                Constraint("json_schema", json.dumps(t["parameters"])).problem()] if p is not None), problem)
        if problem is not None:
            raise DecodeError(f"{self.name}: {problem}")
        return self

    def problem(self) -> Optional[str]:
        """Why the engine cannot compile it without a tokenizer, in one line (None: it can)."""
        from llguidance import LLMatcher

        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(self.grammar(), None)
        except DecodeError:
            raise
        except Exception as e:  # the engine's own refusal of the text
            return f"cannot be compiled: {engine_message(e)}"
        return f"cannot be compiled: {engine_message(messages[0] if messages else '?')}" if is_error else None

    def grammar(self, one_token=lambda text: False) -> str:
        """The grammar in llguidance's form. ``one_token(text)``: whether the
        tokenizer has ``text`` as one token of its own (a call marker such
        as Qwen3's ``<tool_call>`` is then that token, not its spelling)."""
        from llguidance import LLMatcher

        if self.kind == "tool_calls":
            return LLMatcher.grammar_from_lark(tool_call_lark(json.loads(self.source), one_token))
        if self.kind in ("json_schema", "json_object"):
            return LLMatcher.grammar_from_json_schema(for_decoding(self.schema), defaults=dict(JSON_STYLE))
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(json_blocks_for_decoding(self.source))
        raise DecodeError(f"unknown constraint kind {self.kind!r}; known: {', '.join(KINDS)}")


_SPACE = re.compile(r"\s*")


def json_blocks_for_decoding(lark: str) -> str:
    """A Lark grammar with each ``%json {...}`` schema as ``--json-schema``'s
    are decoded (:func:`.json_schema.for_decoding`, compact separators unless
    its ``x-guidance`` says otherwise). The text is walked past its strings,
    regular expressions and comments, where ``%json`` is only text."""
    out, at, i = [], 0, 0
    while i < len(lark):
        c = lark[i]
        if lark.startswith("//", i):  # a comment, to the end of its line
            end = lark.find("\n", i)
            i = len(lark) if end < 0 else end
        elif c in "\"/":  # a string or a regular expression, to its closing quote or slash
            i += 1
            while i < len(lark) and lark[i] != c:
                i += 2 if lark[i] == "\\" else 1
            i += 1
        elif lark.startswith("%json", i):
            start = _SPACE.match(lark, i + len("%json")).end()
            try:
                schema, end = json.JSONDecoder().raw_decode(lark, start)
            except (ValueError, RecursionError):
                return lark  # not a schema: the engine says what is wrong with it
            if not isinstance(schema, dict) or size_problem(schema) is not None:
                return lark
            given = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
            schema = {**for_decoding(schema), "x-guidance": {**JSON_STYLE, **given}}
            out += [lark[at:start], json.dumps(schema)]
            at = i = end
        else:
            i += 1
    return "".join(out) + lark[at:]


def tool_call_lark(spec: Dict[str, Any], one_token) -> str:
    """The Lark grammar of forced calls (``Constraint.tool_calls``)."""
    body = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["name"]},
        "arguments": relocated(for_decoding(t["parameters"]), f"/anyOf/{i}/properties/arguments")},
        "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(spec["tools"])],
            "x-guidance": JSON_STYLE}

    def marker(text: str) -> str:
        return f"<{text[1:-1]}>" if text.startswith("<") and text.endswith(">") and one_token(text) else \
            json.dumps(text)

    calls = 'call ("\\n" call)*' if spec["parallel"] else "call"
    if spec.get("optional"):  # text (which cannot hold a marker token), then maybe the calls
        calls = f"TEXT? ({calls})?\nTEXT: /(?s:.+)/"
    elif spec.get("answer") is not None:  # the answer's JSON under its schema, or the calls
        calls = f"answer | {calls}\n" + json_blocks_for_decoding(f"answer: %json {json.dumps(spec['answer'])}")
    return (f"start: {calls}\ncall: {marker(spec['start'])} \"\\n\" body \"\\n\" {marker(spec['end'])}\n"
            f"body: %json {json.dumps(body)}\n")


_DATA = ("const", "enum", "default", "examples")  # values, not schemas: no reference in them is one
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def relocated(schema: Any, base: str, named: bool = False) -> Any:
    """``schema`` with its references to itself (``#``, ``#/$defs/...``)
    pointing where it now sits, at JSON pointer ``base`` inside a larger
    schema (a tool's parameters inside the calls' grammar). ``named``: a
    mapping of names to schemas (a property may be called "default")."""
    if isinstance(schema, list):
        return [relocated(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if named:
        return {k: relocated(v, base) for k, v in schema.items()}
    out = {k: v if k in _DATA else relocated(v, base, k in _NAMED) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + base + ref[1:]
    return out


UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)$")
def constraint_of(json_schema: Union[str, Dict[str, Any], None] = None, grammar: Optional[str] = None,
                  json_object: bool = False) -> Optional[Constraint]:
    """The Python API's and the CLI's constraint keywords as one Constraint
    (None: unconstrained); at most one of them."""
    given = [n for n, v in (("json_schema", json_schema), ("grammar", grammar), ("json_object", json_object))
             if v is not None and v is not False]  # an empty schema ({}) is given: any JSON
    if len(given) > 1:
        raise DecodeError(f"give one of json_schema, grammar and json_object, not {' and '.join(given)}")
    if json_schema is not None and json_schema is not False:
        return Constraint.json_schema(json_schema)
    if isinstance(grammar, Constraint):  # made already (Constraint.lark, .json_schema, ...)
        return grammar
    if grammar is not None:
        return Constraint.lark(grammar)
    return Constraint.json_object() if json_object else None


def as_constraint(value: Union[Constraint, Dict[str, Any]], name: str = "constraint") -> Constraint:
    """A request's constraint: a :class:`Constraint`, or a dict taken as a JSON Schema."""
    if isinstance(value, (Constraint, dict)):
        return value if isinstance(value, Constraint) else Constraint.json_schema(value, name)
    raise DecodeError(f"{name}: a Constraint (Constraint.json_schema, .lark, .json_object) or a JSON Schema "
                      f"dict, got {type(value).__name__}")


@dataclass
class Compiled:
    """A constraint compiled against one tokenizer: the grammar and its tokenizer."""

    constraint: Constraint
    grammar: str
    tokenizer: Any  # llguidance.LLTokenizer
    vocab: int
    eos_id: int
    pristine: Any = None  # the matcher compile_constraint made to check it, never advanced

    def __post_init__(self):
        self._lock = threading.Lock()

    def matcher(self) -> "Matcher":
        """A fresh matcher: a copy of the pristine one (microseconds; compiling
        the grammar again takes milliseconds to a tenth of a second), so one
        compilation serves every request with this constraint, on any thread."""
        with self._lock:
            made = self.pristine.deep_copy() if self.pristine is not None else None
        return Matcher(self, made)


def compile_constraint(constraint: Constraint, tokenizer, vocab: int, eos_id: int,
                       lock=contextlib.nullcontext(), mask_id: Optional[int] = None) -> Optional[Compiled]:
    """Compile ``constraint`` for ``tokenizer``; a schema or grammar the engine
    refuses is one ``DecodeError`` naming it, and so is a Lark grammar naming a
    token that is not text (``mask_id``: the model's mask token). None: nothing to constrain
    (optional calls whose markers this tokenizer spells as text). ``lock``
    is held while the Hugging Face tokenizer is read (the server's lane
    lock), not while the engine compiles (seconds, for some schemas)."""
    from llguidance import LLMatcher

    with lock:
        if constraint.kind == "tool_calls":
            spec = json.loads(constraint.source)
            if spec.get("optional") and not (one_token(tokenizer, spec["start"])
                                             and one_token(tokenizer, spec["end"])):
                return None  # text could spell a marker and skip the grammar: nothing to guarantee, no constraint
        lltok = ll_tokenizer(tokenizer, vocab, eos_id)
        try:
            grammar = constraint.grammar(lambda text: one_token(tokenizer, text))
        except DecodeError:
            raise
        except Exception as e:  # the engine's own refusal of the text
            raise DecodeError(f"{constraint.name}: cannot be compiled: {engine_message(e)}") from None
        if constraint.kind == "lark":
            check_named_tokens(constraint.source, constraint.name, tokenizer, eos_id, mask_id)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise DecodeError(f"{constraint.name}: cannot be compiled: {engine_message(messages[0])}")
    probe = LLMatcher(lltok, grammar, log_level=0)
    if probe.is_error():
        raise DecodeError(f"{constraint.name}: cannot be compiled: {engine_message(probe.get_error())}")
    ahead = probe.deep_copy()  # what the grammar forces first (a schema's opening brace and key), taken:
    ahead.consume_tokens(allowed_forced(ahead))  # a lexer or parser past its limits fails here, not mid-answer
    if ahead.is_error() and "Too many items" in ahead.get_error():  # forced text that never ends: a: "(" a ")"
        raise DecodeError(f"{constraint.name}: admits no text (what it forces never ends: a rule recurses without "
                          "end)")
    if ahead.is_error():
        raise DecodeError(f"{constraint.name}: cannot be compiled: {engine_message(ahead.get_error())}")
    first = np.zeros((vocab + 31) // 32, dtype=np.int32)  # what may come next: nothing, for a grammar
    ahead.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)  # whose every rule recurses without end
    if ahead.is_error() or not first.any():
        raise DecodeError(f"{constraint.name}: admits no text (no answer can be written under it)")
    return Compiled(constraint, grammar, lltok, vocab, eos_id, probe)


_LISTING = re.compile(r"^\s*(\d+ \||\^+$)")  # the grammar the engine made (a schema's as Lark), line by line


def engine_message(e) -> str:
    """The engine's refusal in one line: without the grammar it lists (the one it made, a schema's as Lark)
    or its parser's state, and JSON Schema's ``oneOf`` said as this runtime has it."""
    text = str(e).split("<state>", 1)[0]
    text = " ".join(line.strip() for line in text.splitlines() if not _LISTING.match(line))
    if "oneOf constraints are not supported" in text:  # the engine's option to read it as anyOf is not offered
        text = "oneOf is not supported (anyOf is: the same alternatives, which may then overlap)"
    return " ".join(text.split())[:300]
