"""Reasoning parsers by name, and the choice of one for a chat template.

`model.reasoning_parser` names a registered parser (`rxf_register_reasoning_parsers`; builtins:
"think", with the aliases "qwen3" and "deepseek_r1", and "harmony") or a class as
"package.module:Class"; "none" turns reasoning off; unset, the template decides: one that declares
a parser, else one whose source shows a marker, else none (the output is all content).
"""

from __future__ import annotations

from typing import Any

from rxf.core.registry import PluginRegistry
from rxf.entrypoints.chat.formats import format_class
from rxf.entrypoints.chat.reasoning.base import ReasoningParser, ReasoningSplit

OFF = "none"
# A marker in a template's source -> the parser of its model's reasoning (checked in this order).
_TEMPLATE_MARKERS = (("<|channel|>", "harmony"), ("<think>", "think"))


def detect_reasoning_name(chat_template: Any) -> str | None:
    declared = getattr(chat_template, "reasoning_parser", None)
    if declared:
        return declared
    source = getattr(chat_template, "source_text", "")
    return next((name for marker, name in _TEMPLATE_MARKERS if marker in source), None)


def make_reasoning_parser(
    name: str | None, chat_template: Any, registry: PluginRegistry | None = None
) -> ReasoningParser | None:
    """The parser for `model.reasoning_parser` (None: detected from the template; "none": off)."""
    name = detect_reasoning_name(chat_template) if name is None else name
    if name is None or name == OFF:
        return None
    return format_class("reasoning_parsers", name, ReasoningParser, registry)()


__all__ = ["ReasoningParser", "ReasoningSplit", "detect_reasoning_name", "make_reasoning_parser"]
