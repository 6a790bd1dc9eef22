"""JSON Schema keywords xgrammar compiles without enforcing are refused (`schema_support.py`), and
the list is checked against the installed xgrammar: each refused keyword's schema still accepts an
instance the keyword forbids (when xgrammar learns one, its case here fails: drop it from the list)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from rxf.core.grammar import GrammarError
from rxf.plugins.grammar.schema_support import unenforced_keyword
from rxf.plugins.grammar.xgrammar_backend import _check_enforced

# (schema, where its unenforced keyword is, an instance that keyword forbids)
UNENFORCED = [
    ({"not": {"type": "string"}}, "/not", '"a"'),
    ({"allOf": [{"type": "string"}, {"maxLength": 1}]}, "/allOf", '"abc"'),
    ({"type": "string", "if": {"minLength": 1}, "then": {"maxLength": 2}}, "/if", '"abc"'),
    ({"$ref": "http://127.0.0.1:1/x.json"}, "/$ref", "1"),
]


@pytest.mark.parametrize(("schema", "where", "forbidden"), UNENFORCED, ids=[w for _, w, _ in UNENFORCED])
def test_xgrammar_still_lets_through_what_the_keyword_forbids(schema, where, forbidden) -> None:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, forbidden)
    assert unenforced_keyword(schema) == where


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}}, "/properties/a/items/not"),
        ({"anyOf": [{"type": "integer"}, {"$defs": {"d": {"allOf": [{}, {}]}}}]}, "/anyOf/1/$defs/d/allOf"),
        ({"prefixItems": [{"type": "string"}, {"if": {}, "else": {}}]}, "/prefixItems/1/if"),
    ],
)
def test_the_keyword_is_found_inside_subschemas(schema, where) -> None:
    assert unenforced_keyword(schema) == where


@pytest.mark.parametrize(
    "schema",
    [
        # keywords as data or names, not as keywords
        {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}, "required": ["not"]},
        {"enum": [{"not": 1}, {"allOf": [1, 2]}]},
        {"const": {"$ref": "http://x"}},
        {"default": {"not": {}}, "type": "object"},
        # forms xgrammar enforces
        {"allOf": [{"type": "string"}]},
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"},
        {"type": "string", "if": {"minLength": 1}},  # `if` alone constrains nothing
    ],
)
def test_what_xgrammar_enforces_passes(schema) -> None:
    assert unenforced_keyword(schema) is None
    _check_enforced(json.dumps(schema))


def test_the_refusal_names_the_keyword() -> None:
    with pytest.raises(GrammarError, match=r"invalid json_schema: /properties/x/not is not supported"):
        _check_enforced(json.dumps({"type": "object", "properties": {"x": {"not": {}}}}))
    _check_enforced("{not json")  # left to xgrammar's own error
