"""Seeded random regexes and JSON schemas for the structured-output tests.

Every generated constraint is finite (bounded repetitions, no `*`/`+`, strings with maxLength, arrays
with maxItems), so a constrained generation always completes within a bounded number of characters; with
ASCII-only patterns each token adds at least one character, which bounds the tokens too.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = ["cat", "dog", "red", "blue", "yes", "no", "alpha", "beta", "x", "42", "ok", "zeta"]
CLASSES = ["[a-z]", "[A-Z]", "[a-f0-9]", "[aeiou]", r"\d", "[xyz_]"]
SEPARATORS = ["-", " ", ":", ", ", "_", "/"]
# Long fixed keys: after `{"` the grammar allows one string up to the value, so jump-forward applies.
LONG_KEYS_SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "the_first_very_long_property_name": {"type": "integer", "minimum": 0, "maximum": 9},
        "and_a_second_rather_long_property_name": {"enum": ["alpha", "beta"]},
    },
    "required": ["the_first_very_long_property_name", "and_a_second_rather_long_property_name"],
    "additionalProperties": False,
})
KEYS = ["name", "id", "color", "size", "tags", "score", "active", "owner", "items", "level", "ratio"]


def random_regex(rng: random.Random) -> tuple[str, int]:
    """A pattern of 1-4 parts (literal, alternation, bounded class repetition, optional word) joined
    by separators, and the length of its longest match."""
    parts: list[str] = []
    longest = 0
    for i in range(rng.randint(1, 4)):
        if i:
            sep = rng.choice(SEPARATORS)
            parts.append(sep)  # separators and words have no regex metacharacters
            longest += len(sep)
        kind = rng.choice(["literal", "alternation", "class", "optional"])
        if kind == "literal":
            word = rng.choice(WORDS)
            parts.append(word)
            longest += len(word)
        elif kind == "alternation":
            words = rng.sample(WORDS, rng.randint(2, 4))
            parts.append("(" + "|".join(words) + ")")
            longest += max(map(len, words))
        elif kind == "class":
            lo = rng.randint(1, 3)
            hi = lo + rng.randint(0, 3)
            parts.append(f"{rng.choice(CLASSES)}{{{lo},{hi}}}")
            longest += hi
        else:
            word = rng.choice(WORDS)
            parts.append(f"({word})?")
            longest += len(word)
    return "".join(parts), longest


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "enum", "boolean", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 12)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": rng.sample(WORDS, 3)}])
        return {"type": "array", "items": item, "minItems": 1, "maxItems": rng.randint(1, 3)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object with 1-4 required properties: bounded numbers, enums, short strings, arrays and
    (up to two levels) nested objects."""
    names = rng.sample(KEYS, rng.randint(1, 4))
    props = {name: _value_schema(rng, depth) for name in names}
    return {"type": "object", "properties": props, "required": names, "additionalProperties": False}


def parse_json(text: str) -> Any:
    """json.loads, tolerating raw control characters inside strings: xgrammar 0.2 compiles a string
    with minLength/maxLength to `[^"\\\r\n]{lo,hi}`, which admits them (its unbounded strings do not)."""
    return json.loads(text, strict=False)


def regex_cases(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [random_regex(rng) for _ in range(n)]


def schema_cases(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps(random_object_schema(rng)) for _ in range(n)]
