"""Tool-call parsers by name, and the choice of one for a chat template.

`model.tool_call_parser` names a built-in parser (`PARSERS`) or a third-party class as
"package.module:Class" (a `ToolCallParser` subclass); unset, the chat template's own format is
used, else the one its source text shows, else Hermes (the most common format).
"""

from __future__ import annotations

import importlib
from typing import Any

from rxf.entrypoints.chat.tool_parsers.base import ParsedCall, Scan, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from rxf.entrypoints.chat.tool_parsers.hermes import HermesParser
from rxf.entrypoints.chat.tool_parsers.llama3_json import Llama3JsonParser
from rxf.entrypoints.chat.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)
}
DEFAULT_PARSER = HermesParser.name
# A marker in a template's source -> the format its model writes (checked in this order).
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


def parser_class(name: str) -> type[ToolCallParser]:
    if name in PARSERS:
        return PARSERS[name]
    module_name, _, attr = name.partition(":")
    if not attr:
        raise ValueError(
            f"unknown tool call parser {name!r}: model.tool_call_parser takes one of "
            f"{', '.join(sorted(PARSERS))} or 'package.module:Class'"
        )
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise ValueError(f"tool call parser {name!r} is not a ToolCallParser subclass")
    return cls


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


def make_parser(name: str | None, chat_template: Any, tokenizer: Any) -> ToolCallParser:
    """The parser for `model.tool_call_parser` (None: detected from the chat template)."""
    cls = parser_class(name or detect_parser_name(chat_template))
    if not cls.needs_special_tokens:
        return cls()
    special = getattr(tokenizer, "all_special_tokens", None) or []
    return cls(hidden=tuple(t for t in special if t not in cls.markers))


__all__ = [
    "PARSERS",
    "NamedCallParser",
    "ParsedCall",
    "RequiredCallsParser",
    "Scan",
    "ToolCallParser",
    "detect_parser_name",
    "make_parser",
    "parser_class",
]
