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
* :class:`Matcher` -- one request's matcher: decided tokens in, masks out.
* :func:`allowed_rows` -- a bitmask as booleans on the device (vocabulary wide).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..errors import DecodeError
from .json_schema import check_schema, for_decoding, without_format

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
                   name: str = "tool_choice", optional: bool = False) -> "Constraint":
        """A forced call: ``start``, a newline, ``{"name": ..., "arguments": ...}``
        with one of ``tools``' names (``{"name", "parameters"}``; the arguments
        valid under that tool's ``parameters`` schema), a newline, ``end`` --
        Qwen3's call format; several, one per line, when ``parallel``.
        ``optional`` (strict tools a model may call): text, then maybe the
        calls; only where the markers are tokens of their own, which text
        cannot spell (elsewhere it compiles to no constraint)."""
        spec = {"tools": [{"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
                          for t in tools], "start": start, "end": end, "parallel": bool(parallel),
                "optional": bool(optional)}
        if not spec["tools"]:
            raise DecodeError(f"{name}: forcing a call needs at least one tool")
        return cls("tool_calls", json.dumps(spec), name).checked()

    @property
    def whole_answer(self) -> bool:
        """Whether the grammar holds the whole answer (not text that may end in calls)."""
        return self.kind != "tool_calls" or not json.loads(self.source).get("optional")

    def checked(self) -> "Constraint":
        """Itself, once the engine has compiled it without a tokenizer: what
        it cannot compile is one ``DecodeError`` naming the constraint."""
        from llguidance import LLMatcher

        try:
            text = self.grammar()
            is_error, messages = LLMatcher.validate_grammar_with_warnings(text, None)
        except DecodeError:
            raise
        except Exception as e:  # the engine's own refusal of the text
            raise DecodeError(f"{self.name}: cannot be compiled: {_one_line(e)}") from None
        if is_error:
            raise DecodeError(f"{self.name}: cannot be compiled: {_one_line(messages[0] if messages else '?')}")
        return self

    def grammar(self, one_token=lambda text: False) -> str:
        """The grammar in llguidance's form. ``one_token(text)``: whether the
        tokenizer has ``text`` as one token of its own (a call marker such
        as Qwen3's ``<tool_call>`` is then that token, not its spelling)."""
        from llguidance import LLMatcher

        if self.kind == "tool_calls":
            return LLMatcher.grammar_from_lark(tool_call_lark(json.loads(self.source), one_token))
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(for_decoding(json.loads(self.source)),
                                                      defaults=dict(JSON_STYLE))
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=dict(JSON_STYLE))
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        raise DecodeError(f"unknown constraint kind {self.kind!r}; known: {', '.join(KINDS)}")


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


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer: mlx-lm's wrapper holds it, or it is one."""
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if hasattr(inner, "convert_tokens_to_ids") else tokenizer


def ll_tokenizer(tokenizer, vocab: int, eos_id: int):
    """llguidance's view of a Hugging Face fast tokenizer (mlx-lm's wrapper or the
    tokenizer itself) over the model's ``vocab`` rows; built once per tokenizer
    (about a second at 151,671 tokens)."""
    import llguidance.hf

    hf = hf_tokenizer(tokenizer)
    key = (vocab, eos_id)
    try:
        cached = _TOKENIZERS.setdefault(hf, {})
    except TypeError:  # not weakly referable: not cached
        cached = {}
    if key not in cached:
        try:
            cached[key] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos_id)
        except Exception as e:
            raise DecodeError(f"constrained decoding needs a Hugging Face fast tokenizer ({e})") from None
    return cached[key]


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


def compile_constraint(constraint: Constraint, tokenizer, vocab: int, eos_id: int) -> Optional[Compiled]:
    """Compile ``constraint`` for ``tokenizer``; a schema or grammar the engine
    refuses is one ``DecodeError`` naming it. None: nothing to constrain
    (optional calls whose markers this tokenizer spells as text)."""
    from llguidance import LLMatcher

    if constraint.kind == "tool_calls":
        spec = json.loads(constraint.source)
        if spec.get("optional") and not (one_token(tokenizer, spec["start"]) and one_token(tokenizer, spec["end"])):
            return None  # text could spell a marker and skip the grammar: nothing to guarantee, no constraint
    lltok = ll_tokenizer(tokenizer, vocab, eos_id)
    try:
        grammar = constraint.grammar(lambda text: one_token(tokenizer, text))
    except DecodeError:
        raise
    except Exception as e:  # the engine's own refusal of the text
        raise DecodeError(f"{constraint.name}: cannot be compiled: {_one_line(e)}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise DecodeError(f"{constraint.name}: cannot be compiled: {_one_line(messages[0])}")
    probe = LLMatcher(lltok, grammar, log_level=0)
    if probe.is_error():
        raise DecodeError(f"{constraint.name}: cannot be compiled: {_one_line(probe.get_error())}")
    ahead = probe.deep_copy()  # what the grammar forces first (a schema's opening brace and key), taken:
    ahead.consume_tokens(ahead.compute_ff_tokens())  # a lexer or parser past its limits fails here, not mid-answer
    if ahead.is_error():
        raise DecodeError(f"{constraint.name}: cannot be compiled: {_one_line(ahead.get_error())}")
    first = np.zeros((vocab + 31) // 32, dtype=np.int32)  # what may come next: nothing, for a grammar
    ahead.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)  # whose every rule recurses without end
    if ahead.is_error() or not first.any():
        raise DecodeError(f"{constraint.name}: admits no text (no answer can be written under it)")
    return Compiled(constraint, grammar, lltok, vocab, eos_id, probe)


def one_token(tokenizer, text: str) -> bool:
    """Whether ``text`` is one token of the tokenizer's own vocabulary."""
    hf = hf_tokenizer(tokenizer)
    try:
        i = hf.convert_tokens_to_ids(text)
        return isinstance(i, int) and i != getattr(hf, "unk_token_id", None) and hf.convert_ids_to_tokens(i) == text
    except Exception:
        return False


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]


class Matcher:
    """One request's grammar state: the tokens decided so far, in position order.

    ``consume`` takes decided tokens (each must be allowed: the constrained mode
    only decides tokens that are). ``masks(drafts)`` reads without changing it:
    the bitmask allowed now and after each of the drafts in turn, as long as
    they are allowed (rollback restores the state). ``forced`` is what the
    grammar forces next (a schema's fixed keys, braces, quotes).
    """

    def __init__(self, compiled: Compiled, made=None):
        from llguidance import LLMatcher

        self.compiled = compiled
        self.words = (compiled.vocab + 31) // 32
        self.m = made if made is not None else LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        self.eos_id = compiled.eos_id

    def consume(self, tokens: Sequence[int]) -> int:
        """Decide ``tokens``; returns how many the grammar took (all, when they
        were checked first). EOS after a complete answer counts as taken: a
        stopped matcher takes nothing more, EOS included."""
        tokens = [int(t) for t in tokens]
        body = tokens[:-1] if tokens and tokens[-1] == self.eos_id else tokens
        n = int(self.m.try_consume_tokens(body)) if body else 0
        if n < len(body) or len(body) == len(tokens):
            return n
        if self.m.is_stopped() or self.m.try_consume_tokens([self.eos_id]) == 1:
            return n + 1
        return n

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (unchanged)."""
        return int(self.m.validate_tokens([int(t) for t in tokens])) if len(tokens) else 0

    def masks(self, drafts: Sequence[int]) -> np.ndarray:
        """Bitmasks (len(drafts) + 1, words): allowed now, then after drafts[0],
        after drafts[0:2], ... while the drafts are allowed; rows after the
        first refused draft allow everything (nothing there is decided)."""
        out = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        self._fill(out, 0)
        taken = self.valid_prefix(drafts)
        walked = 0
        for i in range(taken):
            if int(drafts[i]) == self.eos_id or not self.m.consume_token(int(drafts[i])):
                break  # nothing after an EOS is decided
            walked += 1
            self._fill(out, i + 1)
        if walked:
            self.m.rollback(walked)
        return out

    def _fill(self, out: np.ndarray, row: int) -> None:
        self.m.unsafe_compute_mask_ptr(out.ctypes.data + row * out.strides[0], out.strides[0])

    def forced(self) -> List[int]:
        """The tokens the grammar forces next (may be empty): llguidance's
        forced tokens, then the rest of the text it forces (a key and its
        ``": "``, which several tokenizations could spell, so none is forced
        as a token) in the tokenizer's own tokenization, as far as the
        grammar takes it -- text a model does not choose costs no forward."""
        if self.m.is_stopped():
            return []
        tokens = [int(t) for t in self.m.compute_ff_tokens()]
        text = bytes(self.m.compute_ff_bytes())
        lltok = self.compiled.tokenizer
        head = lltok.decode_bytes(tokens) if tokens else b""
        if len(text) > len(head) and text.startswith(head):
            more = tokens + [int(t) for t in lltok.tokenize_bytes(text[len(head):])]
            tokens = more[:int(self.m.validate_tokens(more))]
        return tokens

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow."""
        return self.m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()

    def error(self) -> Optional[str]:
        return self.m.get_error() if self.m.is_error() else None


def allowed_rows(bitmask: np.ndarray, vocab: int) -> mx.array:
    """Bitmask rows (n, words) int32 -> allowed (n, vocab) booleans on the
    device (bit j % 32 of word j // 32 says whether token j is allowed)."""
    words = mx.array(bitmask.view(np.uint32))
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(mx.bool_)
