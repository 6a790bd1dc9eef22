"""Structured output in the scheduler, in-process on a tiny random Llama (KV ledger checked every step).

References: Python's `re` and the `jsonschema` package judge every output; transformers gives the
unconstrained requests' greedy tokens.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
from grammar_cases import LONG_KEYS_SCHEMA, parse_json, regex_cases, schema_cases
from test_scheduler import drain, make_scheduler, prompts, request


def _text(sched, ids: list[int]) -> str:
    return sched.stop.tokenizer.decode(ids, skip_special_tokens=True)


def test_regex_and_schema_outputs_match_beside_unconstrained_greedy(tiny_llama, hf_reference):
    # grammar.max_match_ms far above its 50 ms: a loaded 2-core machine (a full test session) once
    # took longer than that for a step of these schemas' matching, which ends a request by design
    sched = make_scheduler(tiny_llama, **{"scheduler.max_running_requests": 32, "grammar.max_match_ms": 5000})
    ps = prompts(14, seed=11)
    regexes = regex_cases(6, seed=3)
    schemas = schema_cases(4, seed=4)
    for i, (pattern, longest) in enumerate(regexes):
        sched.add_request(request(f"re{i}", ps[i], longest + 2, regex=pattern))
    for i, schema in enumerate(schemas):
        sched.add_request(request(f"js{i}", ps[6 + i], 200, json_schema=schema))
    for i in range(4):  # unconstrained rows share every batch with the constrained ones
        sched.add_request(request(f"free{i}", ps[10 + i], 24))
    got = drain(sched)
    for i, (pattern, _) in enumerate(regexes):
        r = got[f"re{i}"]
        # ignore_eos is set: the matcher's termination ends the request.
        assert r["finished"].type == "stop", (pattern, r)
        assert re.fullmatch(pattern, _text(sched, r["ids"])), (pattern, _text(sched, r["ids"]))
    for i, schema in enumerate(schemas):
        r = got[f"js{i}"]
        assert r["finished"].type == "stop", (schema, _text(sched, r["ids"]), r["finished"])
        jsonschema.validate(parse_json(_text(sched, r["ids"])), json.loads(schema))
    for i in range(4):
        assert got[f"free{i}"]["ids"] == hf_reference(ps[10 + i], 24)


def test_jump_forward_on_and_off_both_valid_and_on_saves_decode_steps(tiny_llama):
    steps = {}
    for jump in (True, False):
        sched = make_scheduler(tiny_llama, **{"grammar.jump_forward": jump})
        for i, p in enumerate(prompts(3, seed=12)):
            sched.add_request(request(f"j{i}", p, 200, json_schema=LONG_KEYS_SCHEMA))
        got = drain(sched)
        for r in got.values():
            assert r["finished"].type == "stop"
            value = parse_json(_text(sched, r["ids"]))
            jsonschema.validate(value, json.loads(LONG_KEYS_SCHEMA))
        jumped = sched.stats().extra["jump_forward_tokens"]
        assert (jumped > 0) == jump
        steps[jump] = sched.counters.decode_steps
    # Each key costs ~10 tokens: jump-forward extends them in one step instead of decoding each.
    assert steps[True] < steps[False] / 2, steps


def test_retraction_keeps_constrained_requests_valid(tiny_llama):
    sched = make_scheduler(
        tiny_llama, **{"cache.max_total_tokens": 260, "scheduler.max_running_requests": 8,
                       "scheduler.init_new_token_ratio": 0.05, "scheduler.min_new_token_ratio": 0.05,
                       "grammar.jump_forward": False}
    )
    pattern = r"[a-z]{20,30}-\d{10,20}"
    for i, p in enumerate(prompts(8, seed=13, lo=10, hi=20)):
        sched.add_request(request(f"r{i}", p, 60, regex=pattern))
    got = drain(sched)
    assert sched.stats().extra["retractions"] > 0
    for r in got.values():
        assert r["finished"].type == "stop"
        assert re.fullmatch(pattern, _text(sched, r["ids"]))


def test_invalid_grammar_aborts_without_holding_kv(tiny_llama):
    sched = make_scheduler(tiny_llama)
    sched.add_request(request("bad", prompts(1, seed=14)[0], 8, regex="a(b"))
    sched.add_request(request("good", prompts(1, seed=15)[0], 8, regex="ok"))
    got = drain(sched)
    assert got["bad"]["finished"].type == "abort"
    assert "regex" in got["bad"]["finished"].message and "parenthesis" in got["bad"]["finished"].message
    assert _text(sched, got["good"]["ids"]) == "ok"
    assert sched.runner.token_to_kv_pool.available_size() + sched.tree.total_size() == sched.runner.max_total_tokens


def test_compiling_request_waits_while_others_decode(tiny_llama, hf_reference):
    sched = make_scheduler(tiny_llama)
    gate = threading.Event()
    compile_now = sched.grammar.backend.compile

    def slow_compile(kind: str, text: str):
        assert gate.wait(30), "the test never opened the gate"
        return compile_now(kind, text)

    sched.grammar.backend.compile = slow_compile
    p_free, p_json = prompts(2, seed=16)
    sched.add_request(request("json", p_json, 200, json_schema=LONG_KEYS_SCHEMA))
    sched.add_request(request("free", p_free, 40))
    for _ in range(10):  # the loop runs on: the unconstrained request decodes, the other waits
        assert sched.step() == []
    assert [r.rid for r in sched.waiting] == ["json"] and sched.waiting[0].kv_len == 0
    assert [(r.rid, len(r.output_ids)) for r in sched.running] == [("free", 10)]
    gate.set()
    got = drain(sched)
    assert got["free"]["ids"] == hf_reference(p_free, 40)
    jsonschema.validate(parse_json(_text(sched, got["json"]["ids"])), json.loads(LONG_KEYS_SCHEMA))


def test_min_new_tokens_yields_to_a_complete_grammar(tiny_llama):
    sched = make_scheduler(tiny_llama)
    sched.add_request(request("m", prompts(1, seed=17)[0], 20, regex="ok", min_new_tokens=10, ignore_eos=False))
    got = drain(sched)
    assert got["m"]["finished"].type == "stop" and _text(sched, got["m"]["ids"]) == "ok"


def test_tokenizer_info_is_built_by_the_first_constrained_request_on_a_compile_thread(
    tiny_llama, hf_reference, monkeypatch
):
    import xgrammar as xgr

    builds: list[str] = []  # the thread of each tokenizer-info build
    build = xgr.TokenizerInfo.from_huggingface

    def spy(*args, **kwargs):
        builds.append(threading.current_thread().name)
        return build(*args, **kwargs)

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", staticmethod(spy))
    sched = make_scheduler(tiny_llama)
    p_free, p_regex = prompts(2, seed=18)
    sched.add_request(request("free", p_free, 12))
    assert drain(sched)["free"]["ids"] == hf_reference(p_free, 12)
    assert builds == []  # free requests only: the backend was never set up
    sched.add_request(request("re", p_regex, 8, regex="ok"))
    sched.add_request(request("re2", p_free, 8, regex="ok"))
    got = drain(sched)
    assert [_text(sched, got[r]["ids"]) for r in ("re", "re2")] == ["ok", "ok"]
    assert len(builds) == 1 and builds[0].startswith("rxf-grammar"), builds  # once, off the loop


def _first_end(ids: list[int], after: list[int]) -> int:
    """The length of the shortest prefix of `ids` that ends with `after`."""
    return next(k for k in range(len(after), len(ids) + 1) if ids[k - len(after) : k] == after)


def test_grammar_after_sleeps_until_the_output_ends_with_it(tiny_llama, hf_reference):
    """A thinking model's constraint starts after its reasoning: the output is the unconstrained
    greedy one up to and including the `grammar_after` tokens, then the grammar's; a request whose
    tokens never come stays unconstrained."""
    sched = make_scheduler(tiny_llama)
    ps = prompts(2, seed=21)
    free = [hf_reference(p, 12) for p in ps]
    after = free[0][3:5]
    never = [next(t for t in range(5, 500) if t not in free[1])]
    sched.add_request(request("after", ps[0], 40, regex="(yes|no)!", grammar_after=after))
    sched.add_request(request("never", ps[1], 12, regex="(yes|no)!", grammar_after=never))
    got = drain(sched)
    ids = got["after"]["ids"]
    k = _first_end(free[0], after)
    assert ids[:k] == free[0][:k]
    assert re.fullmatch("(yes|no)!", _text(sched, ids[k:])) and got["after"]["finished"].type == "stop"
    assert got["never"]["ids"] == free[1]
