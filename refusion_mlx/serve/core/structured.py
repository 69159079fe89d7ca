"""Structured output at the edge: each API's way of asking for it, as one
:class:`~refusion_mlx.decode.grammar.Constraint` on the engine's request
(constrained decoding: docs/constrained.md).

* :func:`response_format` -- chat completions' ``response_format`` and the
  Responses API's ``text.format`` (the same types, the schema's fields nested
  under ``json_schema`` in one and flat in the other);
* :func:`forced_calls` -- a forced tool call: OpenAI's ``tool_choice``
  "required" or a named function, Anthropic's ``{"type": "any"}`` or
  ``{"type": "tool", "name"}``: the answer is one call (several, one per
  line, when parallel calls are allowed) in Qwen3's format,
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, the
  arguments valid under the tool's ``parameters``; with ``strict`` tools
  under "auto", text and then maybe such calls;
* :func:`request_constraint` -- which one a request gets: a forced call, else
  its format, else strict tools' calls;
* :func:`with_call_grammar` -- the server's ``--call-grammar all`` (the
  default): under "auto", every tool's calls as strict tools' are, so a call
  the model opens always parses; with a format and tools under "auto", the
  format's JSON or the calls (one place, for the three APIs).

A schema the engine cannot compile is a :class:`~.refusal.Refusal` naming
the field: a 400 in the API's own error shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from ...decode.grammar import Constraint
from ...errors import DecodeError
from .refusal import Reason, Refusal
from .tool_calls import check_schema_size

# Qwen3's call markers (mlx-lm's json_tools parser reads them); forced calls are written in this format
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def response_format(value: Any, param: str, nested: bool = True, named: bool = True) -> Optional[Constraint]:
    """``{"type": "text"}`` (None), ``{"type": "json_object"}`` or ``{"type":
    "json_schema", ...}`` with ``name``, ``schema``, ``strict`` (a boolean or null; under
    ``json_schema`` when ``nested``, as chat completions; flat as the
    Responses API's ``text.format``); ``named``: ``name`` is required (OpenAI's rule, on both APIs;
    Anthropic's format has none)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(param)
    if kind != "json_schema":
        raise Refusal(Reason.INVALID_VALUE, f'{param}: must be {{"type": "text"}}, {{"type": "json_object"}} or '
                                            f'{{"type": "json_schema", ...}}', param)
    spec, where = (value.get("json_schema"), f"{param}.json_schema") if nested else (value, param)
    if not nested and "json_schema" in value:  # chat completions' shape: its schema would go unread
        raise Refusal(Reason.INVALID_VALUE, f"{param}.json_schema: not a field here: {param} holds name and "
                                            "schema itself (chat completions nests them under json_schema)",
                      f"{param}.json_schema")
    if not isinstance(spec, dict):
        raise Refusal(Reason.INVALID_VALUE, f"{where}: must be an object with name and schema", where)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise Refusal(Reason.INVALID_VALUE, f"{where}.name: must be a string", f"{where}.name")
    if name is None and named:
        raise Refusal(Reason.INVALID_VALUE, f"{where}.name: is required (the schema's name)", f"{where}.name")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise Refusal(Reason.INVALID_VALUE, f"{where}.strict: must be a boolean, got {spec['strict']!r}",
                      f"{where}.strict")
    if "schema" not in spec and not nested:  # chat completions may leave it out; the Responses API may not
        raise Refusal(Reason.INVALID_VALUE, f"{where}.schema: is required (a JSON Schema)", f"{where}.schema")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):  # a string would be read as JSON text by the Python API
        raise Refusal(Reason.INVALID_VALUE, f"{where}.schema: must be a JSON Schema (an object), got "
                                            f"{type(schema).__name__}", f"{where}.schema")
    check_schema_size(schema, f"{where}.schema")
    return _checked(lambda: Constraint.json_schema(schema, f"{where}.schema"), f"{where}.schema")


def forced_calls(tools: Sequence[dict], choice: Any, parallel: bool, param: str = "tool_choice",
                 strict: bool = False, answer: Optional[Constraint] = None) -> Optional[Constraint]:
    """The constraint of a forced call, or None when ``choice`` forces none
    (unless ``strict``: OpenAI's ``strict: true`` on a tool, with "auto", makes
    the answer text and maybe calls whose arguments follow their schemas --
    or, with an ``answer`` format, that format's JSON or such calls).

    ``tools``: the request's tools in the template's form (checked, named);
    ``choice``: the API's raw tool_choice -- "required", ``{"type":
    "function", "function": {"name"}}``, ``{"type": "function", "name"}``,
    ``{"type": "any"}``, ``{"type": "tool", "name"}`` force; "auto", ``{"type":
    "auto"}`` or none do not."""
    name, auto = None, choice in (None, "auto")
    if isinstance(choice, dict):
        kind = choice.get("type")
        auto = kind == "auto"
        if kind == "any":
            choice = "required"
        elif kind in ("function", "tool"):
            name = choice.get("name") or (choice.get("function") or {}).get("name")
    optional = choice != "required" and name is None
    if optional and not (auto and strict and tools):
        return None
    functions = [t["function"] for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
    if not functions:
        raise Refusal(Reason.INVALID_VALUE, f"{param}: forcing a call needs the request's tools", param)
    spec = [{"name": f["name"], "parameters": f.get("parameters")} for f in functions]
    named = "tools" if optional else param  # strict tools' calls, or the call tool_choice forces
    return _checked(lambda: Constraint.tool_calls(spec, CALL_START, CALL_END, parallel and name is None, named,
                                                  optional, answer if optional else None), "tools")


def request_constraint(tools: Sequence[dict], choice: Any, parallel: bool, strict: bool,
                       shape: Optional[Constraint]) -> Optional[Constraint]:
    """What a request's answer is decoded under: a forced call, else the
    answer's format (``shape``: ``response_format``, ``text.format``; with
    tools under "auto", :func:`with_call_grammar` makes it that format or the
    calls), else strict tools' optional calls, else nothing. A strict tool
    the engine cannot take is a 400 with a format too."""
    forced = forced_calls(tools, choice, parallel)
    if forced is None and shape is not None and strict:
        forced_calls(tools, choice, parallel, strict=strict, answer=shape)  # checked: the constraint is made later
    return forced or shape or forced_calls(tools, choice, parallel, strict=strict)


def any_strict(tools: Any, nested: bool = True) -> bool:
    """Whether a request's raw tools (OpenAI's, ``function`` nested or flat) mark any ``strict``."""
    found = False
    for t in tools or ():
        spec = t.get("function") if nested and isinstance(t, dict) else t
        found |= isinstance(spec, dict) and spec.get("strict") is True
    return found


def _checked(make, param: str) -> Constraint:
    try:
        return make()
    except DecodeError as e:
        raise Refusal(Reason.INVALID_VALUE, str(e), param) from None


def with_call_grammar(request, setting: str):
    """``request`` (an EngineRequest), its possible calls constrained: with
    tools under tool_choice "auto" ("none" leaves no tools, a forced call has
    its own constraint), a request with no constraint of its own is decoded
    as text, then maybe calls valid under their tools' schemas, when the
    server's ``call_grammar`` is "all"; one with a format (``response_format``,
    ``text.format``, ``output_format``) is decoded as that format's JSON or
    such calls, whatever ``call_grammar`` says (its answer is decoded under a
    grammar either way, and a call the grammar lacks could not be written at
    all). A request scored or asking for logprobs is left as it is (the
    constrained mode decodes without slots' scores), and so is one whose
    tools' schemas the engine cannot compile (a look-around in a ``pattern``),
    its format alone then: nobody asked for this constraint, so it is no
    reason to refuse the request (a strict tool's is, in the adapters)."""
    shape = request.constraint
    if shape is None and setting != "all" or shape is not None and shape.kind not in ("json_schema", "json_object") \
            or not request.tools or request.scoring is not None or request.logprobs is not None:
        return request
    try:
        constraint = forced_calls(request.tools, "auto", request.parallel_tool_calls, strict=True, answer=shape)
    except Refusal:
        return request
    return dataclasses.replace(request, constraint=constraint)
