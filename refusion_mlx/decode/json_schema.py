"""JSON Schemas as the constrained mode decodes them: checked as JSON Schema,
then narrowed to what a small model can finish (objects that list their
properties closed to others, integers without bounds held to 16 digits),
and formats the engine does not know dropped. What is decoded under the
narrowed schema is valid under the schema as given."""

from __future__ import annotations

from typing import Any, Dict

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
    if ("properties" in s or "patternProperties" in s) and "additionalProperties" not in s \
            and "unevaluatedProperties" not in s:
        return {**s, "additionalProperties": False}
    return s


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in every object schema
    that lists its properties and says nothing of others (as OpenAI's strict
    schemas must, and as vLLM and xgrammar decode by default): what it
    accepts is valid under ``schema``, and a model cannot run on writing keys
    nobody asked for. A schema that allows other keys says so
    (``"additionalProperties": true`` or a schema)."""
    return map_schemas(schema, _closed)


INTEGER_DIGITS = 16  # an integer with no bound in its schema is written in at most this many digits
_TOP = 10 ** INTEGER_DIGITS - 1


def _bounded(s: dict) -> dict:
    kind = s.get("type")
    if kind != "integer" and not (isinstance(kind, list) and "integer" in kind and "number" not in kind):
        return s
    out = dict(s)
    if "maximum" not in s and "exclusiveMaximum" not in s:
        out["maximum"] = _TOP
    if "minimum" not in s and "exclusiveMinimum" not in s:
        out["minimum"] = -_TOP
    return out


def bounded_integers(schema: Any) -> Any:
    """``schema`` with integers that have no bound on a side held to
    ``INTEGER_DIGITS`` digits there (llama.cpp's JSON grammars cap them so
    too): a small model otherwise writes digits until its budget ends."""
    return map_schemas(schema, _bounded)


def for_decoding(schema: Any) -> Any:
    """The schema a request's answer is decoded under: its objects closed, its integers bounded (one walk)."""
    return map_schemas(schema, lambda s: _bounded(_closed(s)))


def check_schema(schema: Dict[str, Any], name: str) -> None:
    """The schema is valid JSON Schema (its declared draft, else 2020-12)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise DecodeError(f"{name}: not a valid JSON Schema: {e.message}" + (f" (at {where})" if where else "")) \
            from None
