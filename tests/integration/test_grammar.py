"""Structured output end to end on the demo model (SmolLM2-135M-Instruct) through `Runtime`.

Every output is judged by an independent reference: Python's `re.fullmatch` for regexes, the
`jsonschema` package for schemas. All requests of a test go in one batch (they share decode steps).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from grammar_cases import LONG_KEYS_SCHEMA, parse_json, regex_cases, schema_cases

from rxf import Runtime
from rxf.core.frontend.tokenizer_manager import RequestError

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.toml"
PROMPTS = [
    "Write an example value:",
    "The answer is",
    "Give me some data.",
    "Here is a record from the database:",
]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.02}


@pytest.fixture(scope="module")
def rt():
    # One torch thread: on a shared 2-core machine two spinning OpenMP threads slow everything down.
    # float32: the neighbour test compares a request in a batch with itself alone, which bf16 (the
    # demo's dtype) does not round alike across batch shapes.
    # grammar.max_match_ms raised: these tests check what the grammars let through, and a step's
    # matching can pass the 50 ms default on a loaded 2-core machine (the scheduler process compiles
    # its attention kernels in the background meanwhile), which ends a request with "abort"; the
    # bound itself has tests of its own (tests/unit/test_grammar_bounds.py, tests/server/test_hostile_grammars.py).
    overrides = {"scheduler.max_running_requests": 64, "runtime.cpu_threads": 1, "model.dtype": "float32",
                 "grammar.max_match_ms": 2000.0}
    with Runtime.from_config(DEMO, **overrides) as runtime:
        yield runtime


def _generate_all(rt: Runtime, params: list[dict]) -> list[dict]:
    return rt.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)


@pytest.mark.slow
def test_fifty_random_regexes_greedy_and_sampled(rt):
    cases = regex_cases(50, seed=7)
    params = []
    for i, (pattern, longest) in enumerate(cases):
        # ASCII patterns: each token adds >= 1 character, so longest + 1 (the stop token) suffices.
        budget = {"regex": pattern, "max_new_tokens": longest + 2}
        params += [{**budget, **GREEDY}, {**budget, **SAMPLED, "seed": i}]
    outs = _generate_all(rt, params)
    for p, out in zip(params, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (p, out)
        assert re.fullmatch(p["regex"], out["text"]), (p["regex"], out["text"])


@pytest.mark.slow
def test_twenty_random_json_schemas_greedy_and_sampled(rt):
    schemas = schema_cases(20, seed=8)
    params = []
    for i, schema in enumerate(schemas):
        params += [{"json_schema": schema, "max_new_tokens": 256, **GREEDY},
                   {"json_schema": schema, "max_new_tokens": 256, **SAMPLED, "seed": i}]
    outs = _generate_all(rt, params)
    stopped = 0
    for p, out in zip(params, outs, strict=True):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue  # a number's digits may run on past the budget; asserted rare below
        stopped += 1
        jsonschema.validate(parse_json(out["text"]), json.loads(p["json_schema"]))
    assert stopped >= 0.9 * len(params), f"only {stopped} of {len(params)} finished by stop"


@pytest.mark.slow
def test_streaming_agrees_and_unconstrained_neighbour_is_unchanged(rt):
    free = {"max_new_tokens": 24, "temperature": 0.0}
    solo = rt.generate("The capital of France is", free)
    constrained = [
        {"regex": r"(yes|no), because [a-z ]{5,30}\.", "max_new_tokens": 40, **GREEDY},
        {"json_schema": LONG_KEYS_SCHEMA, "max_new_tokens": 80, **GREEDY},
        {"ebnf": 'root ::= "Answer: " ("red" | "green" | "blue") "."', "max_new_tokens": 10, **GREEDY},
    ]
    batch = rt.generate(["The capital of France is"] + PROMPTS[:3], [free] + constrained)
    # Same tokens as alone: the mask touched only the constrained rows.
    assert batch[0]["output_ids"] == solo["output_ids"]
    for p, out in zip(constrained, batch[1:], strict=True):
        chunks = list(rt.generate(PROMPTS[constrained.index(p)], p, stream=True))
        assert "".join(c["text"] for c in chunks) == out["text"]
        assert [t for c in chunks for t in c["output_ids"]] == out["output_ids"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(constrained[0]["regex"], batch[1]["text"])
    jsonschema.validate(json.loads(batch[2]["text"]), json.loads(LONG_KEYS_SCHEMA))
    assert re.fullmatch(r"Answer: (red|green|blue)\.", batch[3]["text"])
    assert rt.get_stats().extra["jump_forward_tokens"] > 0


@pytest.mark.slow
def test_invalid_constraints_are_request_errors(rt):
    for params, field, reason in [
        ({"regex": "a(b"}, "regex", "parenthesis"),
        ({"json_schema": "{not json"}, "json_schema", "JSON"),
        ({"json_schema": '{"type": "objekt"}'}, "json_schema", "objekt"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf", "undefined_rule"),
        ({"regex": "a", "json_schema": "{}"}, "json_schema", "at most one"),
    ]:
        with pytest.raises(RequestError, match=rf"sampling_params\.{field}: .*{reason}"):
            rt.generate("x", params)


@pytest.mark.slow
def test_jump_forward_off_gives_valid_outputs_too():
    schemas = [LONG_KEYS_SCHEMA, *schema_cases(2, seed=9)]
    with Runtime.from_config(DEMO, **{"grammar.jump_forward": False, "runtime.cpu_threads": 1}) as off:
        params = [{"json_schema": s, "max_new_tokens": 160, **GREEDY} for s in schemas]
        outs = off.generate(PROMPTS[:1] * len(schemas), params)
        assert off.get_stats().extra["jump_forward_tokens"] == 0
    for schema, out in zip(schemas, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(parse_json(out["text"]), json.loads(schema))
