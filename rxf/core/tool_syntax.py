"""Tool use in chat prompts: how a tool-call format looks as text (`ToolSyntax`), and OpenAI's tool
structure turned into what a template takes.

OpenAI messages carry tool use as structure: `tools` (function definitions), assistant messages
with `tool_calls` (and often null content), and `tool` messages with the results. Templates that
know tools (most Hugging Face templates of tool-calling models) take that structure as it is, with
each call's `arguments` as an object rather than JSON text (`tool_messages`). For the others,
`inline_tools` writes it into plain messages in the text form of a `ToolSyntax` - the form the
model is expected to answer in, so the tool-call parser of the same format reads its reply. The
formats themselves (Hermes, Llama 3 JSON, Mistral) are in `rxf.plugins.chat_templates.tools`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol


class ToolSyntax(Protocol):
    """How a tool-call format looks as text."""

    # The role a tool result is given to the template as (one of chat_template.ROLES).
    result_role: str

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        """Instructions (for the system message) listing `functions` and how to call them."""

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        """Past calls (`{"name", "arguments": object}`) as the model writes them."""

    def format_result(self, content: str) -> str:
        """A tool's result as the text of a `result_role` message."""


def functions_of(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function definitions of OpenAI `tools` entries."""
    return [tool["function"] if "function" in tool else tool for tool in tools]


def _arguments_object(arguments: Any) -> Any:
    """OpenAI sends arguments as JSON text; templates want the object (kept as text if it is none)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _call_dicts(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{index}].tool_calls[{j}] needs a function with a name")
        calls.append({"name": function["name"], "arguments": _arguments_object(function.get("arguments", "{}"))})
    return calls


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that takes tool calls: each call's arguments as an object (in
    OpenAI's nesting, `{"type", "id", "function": {"name", "arguments"}}`, which the published
    templates read)."""
    out = []
    for i, msg in enumerate(messages):
        if msg.get("tool_calls"):
            calls = _call_dicts(msg["tool_calls"], i)
            msg = {
                **msg,
                "tool_calls": [
                    {**original, "type": "function", "function": call}
                    for original, call in zip(msg["tool_calls"], calls, strict=True)
                ],
            }
        out.append(msg)
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def inline_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], syntax: ToolSyntax
) -> list[dict[str, Any]]:
    """Plain messages showing `tools` (in the system message), past calls (in the assistant's
    content) and tool results (as `syntax.result_role` messages)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        msg = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id", "name")}
        if messages[i].get("tool_calls"):
            calls = syntax.format_calls(_call_dicts(messages[i]["tool_calls"], i))
            text = _text_of(msg.get("content"))
            msg["content"] = f"{text}\n{calls}" if text else calls
        elif msg.get("role") == "tool":
            result = syntax.format_result(_text_of(msg.get("content")))
            # Results shown as user turns merge, so that formats needing alternating turns take them.
            if syntax.result_role == "user" and out and messages[i - 1].get("role") == "tool":
                out[-1]["content"] += "\n" + result
                continue
            msg = {"role": syntax.result_role, "content": result}
        out.append(msg)
    if tools:
        block = syntax.describe_tools(functions_of(tools))
        first = out[0] if out else None
        if first is not None and first.get("role") == "system":
            content = first.get("content")
            if isinstance(content, list):
                first["content"] = [*content, {"type": "text", "text": block}]
            else:
                first["content"] = f"{_text_of(content)}\n\n{block}" if content else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
