"""The builtin tool-call formats as text (`rxf.core.tool_syntax.ToolSyntax`s): what a template
writes into a prompt for a model that answers in that format, and what the tool-call parser of the
same format reads back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class HermesSyntax:
    """Hermes / Qwen 2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call,
    results in `<tool_response>` tags."""

    result_role: str = "user"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = "\n".join(_json({"type": "function", "function": f}) for f in functions)
        return (
            "# Tools\n\nYou can call the functions listed between <tools> and </tools> when they help.\n"
            f"<tools>\n{listing}\n</tools>\n\nTo call a function, write a JSON object with its name and its "
            "arguments between <tool_call> and </tool_call>, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{_json(call)}\n</tool_call>" for call in calls)

    def format_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


@dataclass(frozen=True)
class Llama3JsonSyntax:
    """Llama 3.1+ JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (several
    joined by "; "); results come back in the `ipython` role."""

    result_role: str = "ipython"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = "\n\n".join(_json({"type": "function", "function": f}) for f in functions)
        return (
            "You have access to the functions below. To call one, reply with only a JSON object of the "
            'form {"name": <function name>, "parameters": <object of argument values>}; for several calls, '
            f"join the objects with \"; \". Use literal values, not variables.\n\n{listing}"
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(_json({"name": c["name"], "parameters": c["arguments"]}) for c in calls)

    def format_result(self, content: str) -> str:
        return content


@dataclass(frozen=True)
class MistralSyntax:
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, results in
    `[TOOL_RESULTS]` blocks."""

    result_role: str = "user"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = _json([{"type": "function", "function": f} for f in functions])
        return (
            f"[AVAILABLE_TOOLS] {listing} [/AVAILABLE_TOOLS]\nTo call functions, reply with [TOOL_CALLS] "
            'followed by a JSON list of calls: [{"name": <function name>, "arguments": <object>}, ...]'
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "[TOOL_CALLS] " + _json(calls)

    def format_result(self, content: str) -> str:
        return f"[TOOL_RESULTS] {content} [/TOOL_RESULTS]"
