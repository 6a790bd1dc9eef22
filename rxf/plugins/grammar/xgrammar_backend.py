"""Structured output with xgrammar: regex, JSON schema and EBNF compiled for the model's tokenizer.

JSON schemas compile to compact JSON (`,` and `:` without optional spaces).
`validate` (the front door) refuses a JSON schema keyword xgrammar would not enforce
(`schema_support.py`), then compiles in a limited worker process (`sandbox.py`: time, memory,
crashes); `compile` (the scheduler) compiles here, only constraints `validate` accepted. Compiled
grammars are cached by (kind, text) in an LRU bounded by `grammar.cache_size` entries and
`grammar.cache_memory_mb` (xgrammar's own cache is off so these are the only bounds). `compile` and
`validate` may run on several threads at once.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from rxf.core.config import GrammarConfig
from rxf.core.grammar import GRAMMAR_KINDS, GrammarBackend, GrammarError, GrammarMatcher
from rxf.plugins.grammar.forced import FirstByteTable, forced_string
from rxf.plugins.grammar.sandbox import CompileSandbox
from rxf.plugins.grammar.schema_support import unenforced_keyword

# xgrammar's C++ errors start with a log prefix ("[12:00:00] /project/cpp/x.cc:94: ") and sometimes a
# failed check's condition; neither helps a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def compile_constraint(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """`text` compiled as a `kind` constraint; GrammarError with the compiler's reason if invalid."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    try:
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "json_schema":
            # Compact JSON (no optional whitespace): a model cannot pad its output with blanks,
            # and fixed keys become single continuations that jump-forward can append.
            return compiler.compile_json_schema(text, any_whitespace=False)
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError) as e:
        raise GrammarError(f"invalid {kind}: " + _LOG_PREFIX.sub("", str(e)).strip()) from None


def _check_enforced(text: str) -> None:
    """GrammarError naming the first keyword of the schema `text` that xgrammar would compile without
    enforcing (`schema_support.py`); invalid JSON is left to xgrammar's own error."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return
    keyword = unenforced_keyword(schema)
    if keyword is not None:
        raise GrammarError(
            f"invalid json_schema: {keyword} is not supported (the grammar backend would not enforce it, "
            "so output could break the schema)"
        )


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, first_bytes: FirstByteTable, vocab_size: int, budget_s: float) -> None:
        self._m = matcher
        self._first_bytes = first_bytes
        self._budget_s = budget_s  # the most one jump_forward_string may take
        self._stop_ids = list(matcher.stop_token_ids)
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward_string(self, max_bytes: int) -> str:
        # Never xgrammar's find_jump_forward_string: it has no bound (see forced.py).
        return forced_string(self._m, self._first_bytes, self._scratch, self._stop_ids, max_bytes, self._budget_s)


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, config: GrammarConfig) -> None:
        self.vocab_size = vocab_size
        self.cache_size = config.cache_size
        self.cache_bytes = config.cache_memory_mb << 20
        self.match_budget_s = config.max_match_ms / 1e3
        # vocab_size covers the model's padded rows too: padding ids are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=config.compile_threads, cache_enabled=False)
        # Only matchers need it (the scheduler): built by the first compile, on a compile thread
        # (0.1-0.4 s for the demo model's 49k tokens), never in a process that only validates.
        self._first_bytes: FirstByteTable | None = None
        self._sandbox = CompileSandbox(info, config.compile_threads, config.compile_timeout_s,
                                       config.compile_memory_mb, config.cache_size)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def validate(self, kind: str, text: str) -> None:
        with self._lock:
            if (kind, text) in self._cache:
                return
        if kind == "json_schema":  # before the sandbox's compile; `compile` takes only what passed here
            _check_enforced(text)
        self._sandbox.check(kind, text)

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = compile_constraint(self._compiler, kind, text)
        with self._lock:
            if self._first_bytes is None:
                self._first_bytes = FirstByteTable(self._info, self.vocab_size)
            if key not in self._cache:
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
            while self._cache and (len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes):
                self._cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int] | None = None) -> XGrammarMatcher:
        assert self._first_bytes is not None, "a matcher needs a compile first"
        m = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        return XGrammarMatcher(m, self._first_bytes, self.vocab_size, self.match_budget_s)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def close(self) -> None:
        self._sandbox.close()
