"""JSON Schema keywords that xgrammar (0.2.x) compiles without enforcing, refused instead.

xgrammar builds a grammar from the keywords it knows and passes over the rest in silence, so a schema
using one of these produced output that breaks it (`{"not": {}}` wrote `false`; `{"allOf": [{"type":
"string"}, {"type": "integer"}]}` wrote `null`), under a 200. The request is refused instead, naming
the keyword's place; `tests/unit/test_schema_support.py` checks against the installed xgrammar that
each one is still unenforced (so the list shrinks when xgrammar learns one). Annotations that assert
nothing of an instance (`format` values it does not know, `contentEncoding`) are not refused.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of names to them: where a walk over
# the schema finds more keywords (never in `enum`, `const`, `default`, `examples`: data).
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "additionalItems", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _unenforced(node: dict[str, Any]) -> str | None:
    """The keyword of this subschema that xgrammar would not enforce, if any."""
    if "not" in node:
        return "not"
    if "if" in node and ("then" in node or "else" in node):
        return "if"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:  # xgrammar: "allOf with multiple options" unsupported
        return "allOf"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):  # no document but this one is read
        return "$ref"
    return None


def unenforced_keyword(schema: Any) -> str | None:
    """The JSON pointer of the first keyword in `schema` that xgrammar would not enforce, or None.
    Iterative: a schema's depth is bounded elsewhere, not by this walk."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        keyword = _unenforced(node)
        if keyword is not None:
            return f"{path}/{keyword}"
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}/{key}"))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack += [(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()]
    return None
