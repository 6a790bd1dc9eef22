"""Tool-call parsers by name, and the choice of one for a chat template.

`model.tool_call_parser` names a registered tool-call format (`rxf_register_tool_call_formats`: a
`ToolCallParser` subclass, which carries the format's `syntax` for templates without tool support;
the builtins are registered by `rxf.plugins.chat_templates`) or a class as "package.module:Class"; unset, the chat
template's own format is used, else the one its source text shows, else Hermes (the most common).
"""

from __future__ import annotations

from typing import Any

from rxf.core.registry import PluginRegistry
from rxf.entrypoints.chat.formats import format_class
from rxf.entrypoints.chat.tool_parsers.base import ParsedCall, Scan, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.forced import NamedCallParser, RequiredCallsParser

DEFAULT_PARSER = "hermes"
# A marker in a template's source -> the format its model writes (checked in this order).
_TEMPLATE_MARKERS = (
    ("<|channel|>", "harmony"),
    ("<function=", "qwen3_coder"),  # before hermes: its calls sit in <tool_call> blocks too
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<|python_tag|>", "llama3_json"),
)


def parser_class(name: str, registry: PluginRegistry | None = None) -> type[ToolCallParser]:
    return format_class("tool_call_formats", name, ToolCallParser, registry)


def detect_parser_name(chat_template: Any) -> str:
    """The format of the template's model: declared by the template, or shown by its source."""
    declared = getattr(chat_template, "tool_parser", None)
    if declared:
        return declared
    source = getattr(chat_template, "source_text", "")
    for marker, name in _TEMPLATE_MARKERS:
        if marker in source:
            return name
    return DEFAULT_PARSER


def make_parser(
    name: str | None, chat_template: Any, tokenizer: Any, registry: PluginRegistry | None = None
) -> ToolCallParser:
    """The parser for `model.tool_call_parser` (None: detected from the chat template)."""
    cls = parser_class(name or detect_parser_name(chat_template), registry)
    if not cls.needs_special_tokens:
        return cls()
    special = getattr(tokenizer, "all_special_tokens", None) or []
    return cls(hidden=tuple(t for t in special if t not in cls.markers))


__all__ = [
    "NamedCallParser",
    "ParsedCall",
    "RequiredCallsParser",
    "Scan",
    "ToolCallParser",
    "detect_parser_name",
    "make_parser",
    "parser_class",
]
