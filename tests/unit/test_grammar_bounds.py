"""Bounded grammar work: the forced continuation (jump-forward) and compiles in limited workers.

Reference for the forced text: xgrammar's own `find_jump_forward_string`, on grammars whose forced
continuations are short (the only ones it may be called on); the same text is expected at every
position of a valid output. On endless ones it never returns, so there the expectation is the
grammar's own text, cut at the bound.
"""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from rxf.core.config import GrammarConfig
from rxf.core.grammar import GrammarError
from rxf.plugins.grammar.forced import forced_string
from rxf.plugins.grammar.xgrammar_backend import XGrammarBackend
from rxf.testing.checkpoints import make_tiny_tokenizer

VOCAB = 512
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def backend(tokenizer):
    config = GrammarConfig(compile_timeout_s=2.0, compile_memory_mb=256, max_match_ms=10_000)  # time: not the bound here
    backend = XGrammarBackend(tokenizer, VOCAB, config)
    yield backend
    backend.close()


FINITE = [  # (kind, constraint, a valid output)
    ("regex", r"hello (world|there)", "hello there"),
    ("regex", r"caf(é|è) (au lait|noir)!", "café noir!"),  # é and è share their first byte only
    ("ebnf", 'root ::= "abc" ("x" | "yz") "def" [0-9]+', "abcyzdef42"),
    ("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                                 "age": {"type": "integer"}},
                                "required": ["name", "age"]}), '{"name": "Bo", "age": 7}'),
    ("json_schema", json.dumps({"enum": ["Main Street", "Main Road"]}), '"Main Road"'),
    ("json_schema", json.dumps({"const": {"key": [1, 2, "three"]}}), '{"key":[1,2,"three"]}'),  # a const is compact
    ("json_schema", json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}),
     "[true, false, true]"),
]


@pytest.mark.parametrize(("kind", "text", "output"), FINITE, ids=[c[0] + str(i) for i, c in enumerate(FINITE)])
def test_forced_text_equals_xgrammars_at_every_position(backend, tokenizer, kind, text, output):
    m = backend.matcher(backend.compile(kind, text), stop_token_ids=[EOS])
    ids = tokenizer.encode(output, add_special_tokens=False)
    forced_seen = []
    for i, token in enumerate([*ids, EOS]):
        expected = m._m.find_jump_forward_string()  # safe here: these grammars force little
        assert m.jump_forward_string(10_000) == expected, (i, tokenizer.decode(ids[:i]))
        assert m.jump_forward_string(3) == expected.encode()[:3].decode("utf-8", "ignore")
        forced_seen.append(expected)
        assert m.accept_token(token), (i, token)  # the matcher is where it was
    assert m.is_terminated() and any(forced_seen)


ENDLESS = [  # (kind, constraint, what its forced text repeats)
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}), '{"a": '),
    ("json_schema", json.dumps({"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}},
                                                "required": ["b"]},
                                          "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
                                                "required": ["a"]}},
                                "$ref": "#/$defs/A"}), '{"b": {"a": '),
    ("json_schema", json.dumps({"type": "array", "items": {"const": 1}, "minItems": 100_000_000}), "1, "),
    ("regex", "a{100000000}", "a"),
    ("ebnf", 'root ::= "ab" root', "ab"),
]


@pytest.mark.parametrize(("kind", "text", "unit"), ENDLESS, ids=[c[0] + str(i) for i, c in enumerate(ENDLESS)])
def test_forced_text_of_an_endless_grammar_stops_at_the_bound(backend, kind, text, unit):
    m = backend.matcher(backend.compile(kind, text), stop_token_ids=[EOS])
    before = backend.allocate_bitmask(1)
    m.fill_bitmask(before, 0)
    start = time.perf_counter()
    forced = m.jump_forward_string(4096)
    elapsed = time.perf_counter() - start
    assert len(forced.encode()) == 4096
    body = forced.removeprefix("[")  # the array's opening bracket comes once
    assert (unit * (len(body) // len(unit) + 1)).startswith(body), forced[:80]
    assert elapsed < 1.0, elapsed  # measured: ~30 ms for 4 KiB on the 512-token vocabulary
    after = backend.allocate_bitmask(1)
    m.fill_bitmask(after, 0)
    assert after.equal(before)  # rolled back


def test_forced_text_stops_at_the_time_budget(backend):
    m = backend.matcher(backend.compile("ebnf", 'root ::= "ab" root'), stop_token_ids=[EOS])
    start = time.perf_counter()
    forced = forced_string(m._m, m._first_bytes, m._scratch, [EOS], 10**9, budget_s=0.02)
    assert time.perf_counter() - start < 0.5 and 0 < len(forced) < 10**6


def _workers(sandbox) -> list[psutil.Process]:
    return [psutil.Process(w.proc.pid) for w in sandbox._workers]


def test_compiles_past_the_limits_fail_alone_and_the_workers_recover(backend):
    literal = "x" * 2_000_000  # measured: > 60 s and > 400 MB to compile
    start = time.monotonic()
    with pytest.raises(GrammarError, match=r"^regex is too complex: compiling it (takes over 2 s|needs over 256 MiB)"):
        backend.validate("regex", literal)
    assert time.monotonic() - start < 30  # the limit, plus starting a worker on a loaded machine
    start = time.monotonic()
    with pytest.raises(GrammarError, match="too complex"):  # the verdict is kept: no second attempt
        backend.validate("regex", literal)
    assert time.monotonic() - start < 0.1
    with pytest.raises(GrammarError, match=r"^invalid regex: .*parenthesis"):  # the compiler's own reason
        backend.validate("regex", "(")
    assert backend.matcher(backend.compile("regex", "ok+"), [EOS]).jump_forward_string(8) == "ok"

    # A worker that dies mid-compile (a native crash, the kernel's OOM killer) fails that constraint only.
    killer = threading.Timer(1.0, lambda: [p.kill() for p in _workers(backend._sandbox)])
    killer.start()
    with pytest.raises(GrammarError, match="the compiler process died on it"):
        backend.validate("json_schema", json.dumps({"enum": ["x" * 1_000_000, "y"]}))
    killer.join()
    backend.validate("regex", "fine")


def test_workers_end_with_the_backend(tokenizer):
    backend = XGrammarBackend(tokenizer, VOCAB, GrammarConfig())
    backend.validate("regex", "a+")
    workers = _workers(backend._sandbox)
    assert len(workers) == 1  # started on demand: one compile at a time needed one worker
    backend.close()
    psutil.wait_procs(workers, timeout=5)
    assert not any(p.is_running() for p in workers)


def test_a_worker_that_cannot_start_fails_the_request_but_not_the_constraint(tokenizer, monkeypatch):
    import sys

    backend = XGrammarBackend(tokenizer, VOCAB, GrammarConfig())
    with monkeypatch.context() as patch:
        patch.setattr(sys, "executable", "/bin/false")  # a worker that exits at once
        with pytest.raises(GrammarError, match="the grammar compile worker failed to start"):
            backend.validate("regex", "a+")
    backend.validate("regex", "a+")  # no verdict was kept: a real worker now accepts it
    with pytest.raises(GrammarError, match="^invalid regex"):
        backend.validate("regex", "a(")
    backend.close()
