"""The chat formats a model writes in - its tool-call format (`tool_call_formats`) and its way of
marking reasoning (`reasoning_parsers`) - looked up by name in the plugin registry, where the
builtins register like any plugin's (`rxf.plugins.chat_templates`); a setting may also name a class
as "package.module:Class"."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from rxf.core.registry import PluginRegistry

# Per kind: the setting that names one, and what its errors call it.
SETTINGS = {"tool_call_formats": "model.tool_call_parser", "reasoning_parsers": "model.reasoning_parser"}
LABELS = {"tool_call_formats": "tool call parser", "reasoning_parsers": "reasoning parser"}


@functools.cache
def default_registry() -> PluginRegistry:
    """The registry of every installed plugin, for callers that were given none (tests, tools)."""
    return PluginRegistry.load()


def format_class(kind: str, name: str, base: type, registry: PluginRegistry | None = None) -> type:
    """The class registered as `name` in `kind`, or the "module:Class" that `name` spells; a
    ValueError naming the setting lists the registered names otherwise."""
    registry = registry or default_registry()
    setting = SETTINGS[kind]
    if name in registry.names(kind):
        cls: Any = registry.get(kind, name)
    else:
        module_name, _, attr = name.partition(":")
        if not attr:
            raise ValueError(
                f"unknown {LABELS[kind]} {name!r}: {setting} takes one of "
                f"{', '.join(registry.names(kind))} or 'package.module:Class'"
            )
        cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{setting} {name!r} is not a {base.__name__} subclass")
    return cls
