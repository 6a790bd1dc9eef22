"""Builtin grammar plugin: the xgrammar backend, registered lazily (imported only when selected)."""

from __future__ import annotations

import importlib.util

from rxf.core.hookspecs import RegisterFactory, hookimpl


@hookimpl
def rxf_register_grammar_backends(register: RegisterFactory) -> None:
    # Registered only when the package is installed, so `grammar.backend = "auto"` can fall back.
    if importlib.util.find_spec("xgrammar") is not None:
        register("xgrammar", "rxf.plugins.grammar.xgrammar_backend:XGrammarBackend")
