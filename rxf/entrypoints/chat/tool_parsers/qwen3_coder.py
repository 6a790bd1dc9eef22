"""Qwen3-Coder's XML format (Qwen3-Coder, Qwen3.5): plain text, then per call

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are written untyped, so each is read by the offered tool's schema: a string parameter's
text is the string, any other's is read as JSON (kept as a string if it is none). The arguments
object grows a parameter at a time, once its `</parameter>` arrives, so it only ever extends."""

from __future__ import annotations

import json
import re
from typing import Any

from rxf.entrypoints.chat.tool_parsers.base import Piece, ToolCallParser, tagged_pieces
from rxf.entrypoints.chat.tool_parsers.json_scan import CallScan
from rxf.plugins.chat_templates.tools import Qwen3CoderSyntax

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_END_PARAMETER = "</parameter>"
_END_FUNCTION = re.compile(r"\s*</function>")
_FUNCTION_PREFIX = "<function="


def _is_string_schema(schema: Any) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"
    markers = (OPEN,)
    syntax = Qwen3CoderSyntax()

    def __init__(self, hidden: tuple[str, ...] = (), schemas: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(hidden)
        self.schemas = schemas or {}  # function name -> its parameters' schemas, by parameter

    def for_tools(self, tools: list[dict[str, Any]]) -> Qwen3CoderParser:
        schemas = {}
        for tool in tools:
            function = tool.get("function", tool)
            schemas[function["name"]] = (function.get("parameters") or {}).get("properties") or {}
        return Qwen3CoderParser(self.hidden, schemas)

    def _value(self, function: str, parameter: str, text: str) -> Any:
        # The template writes each value on lines of its own: one newline either side is markup.
        text = text.removeprefix("\n").removesuffix("\n")
        if _is_string_schema(self.schemas.get(function, {}).get(parameter)):
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def _call(self, body: str, block_closed: bool) -> CallScan:
        """The call inside a `<tool_call>` block (`body`: the text after the tag, so far; the
        block's end also ends the arguments when `</function>` is missing)."""
        head = _FUNCTION.match(body)
        if head is None:
            stripped = body.lstrip()
            pending = _FUNCTION_PREFIX.startswith(stripped) or (
                stripped.startswith(_FUNCTION_PREFIX) and ">" not in stripped and "\n" not in stripped
            )
            return CallScan(valid=pending)
        name = head.group(1).strip()
        members, i = [], head.end()
        while (param := _PARAMETER.match(body, i)) is not None:
            end = body.find(_END_PARAMETER, param.end())
            if end == -1:
                break
            key = param.group(1).strip()
            value = self._value(name, key, body[param.end() : end])
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            i = end + len(_END_PARAMETER)
        closed = block_closed or _END_FUNCTION.match(body, i) is not None
        return CallScan(name=name, arguments="{" + ", ".join(members) + ("}" if closed else ""))

    def pieces(self, text: str) -> list[Piece]:
        return tagged_pieces(text, OPEN, CLOSE, self._call)
