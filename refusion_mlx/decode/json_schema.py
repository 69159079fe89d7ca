"""JSON Schemas as the constrained mode decodes them: checked as JSON Schema,
then narrowed to what a small model can finish (objects that list their
properties closed to others, integers without bounds held to 16 digits
unless a const or enum gives their values), and formats the engine does not
know dropped; a constant it cannot write exactly, or a bound it cannot hold
exactly, is refused. What is decoded under the narrowed schema is valid under
the schema as given."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ..errors import DecodeError

# where a schema holds schemas (the rest -- const, enum, default, examples, ... -- is data)
NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # names -> schemas
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
ONE_SCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
              "contains", "not", "if", "then", "else", "propertyNames")


def map_schemas(schema: Any, fn) -> Any:
    """``schema`` with ``fn`` applied to it and to each schema inside it, innermost first (a copy)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in NAME_MAPS and isinstance(value, dict):
            out[key] = {k: map_schemas(v, fn) for k, v in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [map_schemas(v, fn) for v in value]
        elif key in ONE_SCHEMA:  # items may be a list (draft 7's tuples)
            out[key] = [map_schemas(v, fn) for v in value] if isinstance(value, list) else map_schemas(value, fn)
    return fn(out)


def without_format(schema: Any, fmt: str) -> Any:
    """``schema`` without ``"format": fmt`` anywhere (a format only annotates
    unless a validator is told to assert it: the instances stay valid)."""
    return map_schemas(schema, lambda s: {k: v for k, v in s.items() if not (k == "format" and v == fmt)})


def _closed(s: dict) -> dict:
    """``s`` with ``"additionalProperties": false`` when it lists its properties and says nothing of
    others (as OpenAI's strict schemas must, and as vLLM and xgrammar decode by default): what it accepts
    is valid under ``s``, and a model cannot run on writing keys nobody asked for. A schema that allows
    other keys says so (``"additionalProperties": true`` or a schema). Left as it is: an object that
    requires a key it does not list (and, in :func:`for_decoding`, a schema :func:`_composed`)."""
    listed = set(s.get("properties") or ()) if isinstance(s.get("properties", {}), dict) else set()
    required = s.get("required") if isinstance(s.get("required"), list) else []
    if ("properties" in s or "patternProperties" in s) and "additionalProperties" not in s \
            and "unevaluatedProperties" not in s and ("patternProperties" in s or set(required) <= listed):
        return {**s, "additionalProperties": False}
    return s


def _composed(schema: Any) -> bool:
    """Whether an object's properties may come from several schemas together (``allOf``; a ``$ref``, an
    ``anyOf`` or a ``oneOf`` beside properties): each closed alone would refuse what they allow together."""
    found = []

    def look(s: dict) -> dict:
        if "allOf" in s or any(k in s for k in ("$ref", "anyOf", "oneOf")) and ("properties" in s or "required" in s):
            found.append(s)
        return s

    map_schemas(schema, look)
    return bool(found)


INTEGER_DIGITS = 16  # an integer with no bound in its schema is written in at most this many digits
_TOP = 10 ** INTEGER_DIGITS - 1


def _bounded(s: dict) -> dict:
    """``s``, an integer with no bound on a side, held to ``INTEGER_DIGITS`` digits there (llama.cpp's JSON
    grammars cap them so too): a small model otherwise writes digits until its budget ends."""
    kind = s.get("type")
    if kind != "integer" and not (isinstance(kind, list) and "integer" in kind and "number" not in kind) \
            or "const" in s or "enum" in s:  # the values are given: no bound to add
        return s
    out = dict(s)
    low, high = _bound(s, "minimum", "exclusiveMinimum"), _bound(s, "maximum", "exclusiveMaximum")
    if "maximum" not in s and "exclusiveMaximum" not in s:  # 16 digits, or as many past a larger minimum
        out["maximum"] = _TOP if low is None or low <= 0 else max(_TOP, int(low) + _TOP)
    if "minimum" not in s and "exclusiveMinimum" not in s:
        out["minimum"] = -_TOP if high is None or high >= 0 else min(-_TOP, int(high) - _TOP)
    return out


def _bound(s: dict, *keys: str):
    values = [s[k] for k in keys if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)]
    return values[0] if values else None


EXACT = 2 ** 53  # the engine holds a JSON number as a 64-bit float: integers are exact up to this size


_BOUNDS = ("minimum", "maximum", "multipleOf")  # past EXACT in size: held rounded (2**53 + 1 let 2**53 pass)
_EXCLUSIVE = ("exclusiveMinimum", "exclusiveMaximum")  # at EXACT too: the engine steps an integer's past it


def _exact_values(s: dict) -> dict:
    """``s``, once each number its ``const`` and ``enum`` give is one the engine writes as given (a larger
    integer was written rounded: 9999999999999999 as 10000000000000000) and each bound one it holds as given;
    else a ValueError naming it."""
    for key in _BOUNDS + _EXCLUSIVE:
        value = s.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and (abs(value) > EXACT or key in _EXCLUSIVE and abs(value) >= EXACT):
            raise ValueError(f"the {key} {value} is past what the grammar engine holds exactly (bounds within "
                             f"2**53 = {EXACT} in size, exclusive ones under it)")
    stack = [s[k] for k in ("const", "enum") if k in s]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, dict)):
            stack.extend(value.values() if isinstance(value, dict) else value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} in a const or enum is not a JSON number")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > EXACT:
            raise ValueError(f"the integer {value} in a const or enum is past what the grammar engine writes "
                             f"exactly (integers up to 2**53 = {EXACT} in size)")
    return s


def for_decoding(schema: Any) -> Any:
    """The schema a request's answer is decoded under, in one walk: its objects closed (:func:`_closed`)
    unless they take their properties from several schemas together (:func:`_composed`: ``allOf``, a
    ``$ref`` beside properties), its integers bounded (:func:`_bounded`), its constants and bounds checked
    (:func:`_exact_values`: a ValueError naming one the engine cannot hold exactly)."""
    close = not _composed(schema)
    return map_schemas(schema, lambda s: _bounded(_closed(_exact_values(s)) if close else _exact_values(s)))


MAX_SCHEMA_DEPTH = 32  # levels of objects and lists in a JSON Schema (real ones: under 10)
MAX_SCHEMA_NODES = 10_000  # objects and lists in one


def size_problem(schema: Any) -> Optional[str]:
    """What is past :data:`MAX_SCHEMA_DEPTH` levels of objects and lists or
    :data:`MAX_SCHEMA_NODES` of them in ``schema`` (None: nothing), walked
    without recursion before any library (which would recurse) sees it."""
    nodes, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            return f"nested over {MAX_SCHEMA_DEPTH} levels"
        if nodes > MAX_SCHEMA_NODES:
            return f"over {MAX_SCHEMA_NODES} objects and lists"
        stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return None


def check_schema(schema: Dict[str, Any], name: str) -> None:
    """The schema is within the size limits (:func:`size_problem`) and valid
    JSON Schema (its declared draft, else 2020-12)."""
    import jsonschema

    too_large = size_problem(schema)
    if too_large is not None:
        raise DecodeError(f"{name}: the schema is {too_large} (the limits of constrained decoding)")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise DecodeError(f"{name}: not a valid JSON Schema: {e.message}" + (f" (at {where})" if where else "")) \
            from None
