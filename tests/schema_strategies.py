"""Hypothesis strategies from JSON Schema (the subset FastAPI's OpenAPI
documents use: type, const, enum, anyOf/oneOf/allOf, properties, required,
additionalProperties, items, the numeric and size bounds), for the fuzzer of
tests/test_security.py. ``$ref``s must be resolved first. Values stay small:
strings of at most 12 characters, arrays of at most 3 items."""

from __future__ import annotations

from hypothesis import strategies as st

# any JSON value: what a schema without a type admits
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def _bound(schema, name, exclusive, step):
    if exclusive in schema and not isinstance(schema[exclusive], bool):
        return schema[exclusive] + step
    return schema.get(name)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values the schema admits (a strategy)."""
    if schema is True or schema == {}:
        return JSON
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s) for s in schema[key]])
    if "allOf" in schema:
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged.update(part)
        return from_schema(merged)
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(_bound(schema, "minimum", "exclusiveMinimum", 1),
                           _bound(schema, "maximum", "exclusiveMaximum", -1))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum", schema.get("exclusiveMaximum")), allow_nan=False,
                         allow_infinity=False, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema)
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 12), 12)))
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {})), min_size=low,
                        max_size=max(low, min(schema.get("maxItems", 3), 3)))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                      optional={k: from_schema(v) for k, v in props.items() if k not in required})
        extra = schema.get("additionalProperties")
        if props or extra is False or extra is None:
            return fixed
        return st.dictionaries(st.text(max_size=6), from_schema(extra if isinstance(extra, dict) else {}),
                               max_size=2)
    return JSON
