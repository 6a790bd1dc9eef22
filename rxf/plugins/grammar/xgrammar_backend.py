"""Structured output with xgrammar: regex, JSON schema and EBNF compiled for the model's tokenizer.

JSON schemas compile to compact JSON (`,` and `:` without optional spaces).
Compiled grammars are cached by (kind, text) in an LRU bounded by `grammar.cache_size` (xgrammar's
own cache is off so that bound is the only one). `compile` may run on several threads at once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from rxf.core.config import GrammarConfig
from rxf.core.grammar import GRAMMAR_KINDS, GrammarBackend, GrammarError, GrammarMatcher

# xgrammar's C++ errors start with a log prefix ("[12:00:00] /project/cpp/x.cc:94: ") and sometimes a
# failed check's condition; neither helps a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward_string(self) -> str:
        return self._m.find_jump_forward_string()


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, config: GrammarConfig) -> None:
        self.vocab_size = vocab_size
        self.cache_size = config.cache_size
        # vocab_size covers the model's padded rows too: padding ids are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=config.compile_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile_uncached(kind, text)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {GRAMMAR_KINDS}")
        try:
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "json_schema":
                # Compact JSON (no optional whitespace): a model cannot pad its output with blanks,
                # and fixed keys become single continuations that jump-forward can append.
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"invalid {kind}: " + _LOG_PREFIX.sub("", str(e)).strip()) from None

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int] | None = None) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None))

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
