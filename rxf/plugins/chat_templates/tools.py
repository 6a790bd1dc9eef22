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


def _value_text(value: Any) -> str:
    """An argument value as qwen3_coder writes it: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else _json(value)


@dataclass(frozen=True)
class Qwen3CoderSyntax:
    """Qwen3-Coder's XML calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
    </function>\\n</tool_call>`, results in `<tool_response>` tags."""

    result_role: str = "user"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = "\n".join(_json({"type": "function", "function": f}) for f in functions)
        return (
            f"# Tools\n\nYou have access to the following functions:\n\n<tools>\n{listing}\n</tools>\n\n"
            "To call a function, reply in this format, one block per call:\n<tool_call>\n<function=example_function>\n"
            "<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call>"
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = []
        for call in calls:
            arguments = call["arguments"] if isinstance(call["arguments"], dict) else {}
            params = "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n" for k, v in arguments.items())
            blocks.append(f"<tool_call>\n<function={call['name']}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)

    def format_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _python_value(value: Any) -> str:
    """A JSON value as a Python literal (what a pythonic call's keyword takes)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_value(k)}: {_python_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_python_value, value)) + "]"
    return repr(value)


@dataclass(frozen=True)
class PythonicSyntax:
    """Llama 3.2 / Llama 4 pythonic calls: the reply is a Python list of calls with keyword
    arguments, `[get_weather(city="Paris"), ping()]`; results in the `ipython` role."""

    result_role: str = "ipython"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = "\n".join(_json(f) for f in functions)
        return (
            "You can call the functions below. To call them, reply with only a Python list of calls with "
            "keyword arguments and literal values, e.g. [func_name1(param1=value1), func_name2(param2=value2)].\n\n"
            f"{listing}"
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        def one(call: dict[str, Any]) -> str:
            arguments = call["arguments"] if isinstance(call["arguments"], dict) else {}
            return f"{call['name']}(" + ", ".join(f"{k}={_python_value(v)}" for k, v in arguments.items()) + ")"

        return "[" + ", ".join(map(one, calls)) + "]"

    def format_result(self, content: str) -> str:
        return content


# DeepSeek-V3's markers (fullwidth bars and the lower-one-eighth block stand in for spaces).
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_OUTPUT_BEGIN, DS_OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"


@dataclass(frozen=True)
class DeepSeekV3Syntax:
    """DeepSeek-V3: `<｜tool▁calls▁begin｜>` then, per call, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
    and the arguments in a ```json block, `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>`. Results in
    `<｜tool▁output▁begin｜>` blocks."""

    result_role: str = "user"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = "\n".join(_json({"type": "function", "function": f}) for f in functions)
        example = self.format_calls([{"name": "function_name", "arguments": {"parameter": "value"}}])
        return f"## Tools\n\nYou can call these functions:\n{listing}\n\nTo call functions, reply in this format:\n{example}"

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = "".join(
            f"{DS_CALL_BEGIN}function{DS_SEP}{c['name']}\n```json\n{_json(c['arguments'])}\n```{DS_CALL_END}" for c in calls
        )
        return f"{DS_CALLS_BEGIN}{blocks}{DS_CALLS_END}"

    def format_result(self, content: str) -> str:
        return f"{DS_OUTPUT_BEGIN}{content}{DS_OUTPUT_END}"


@dataclass(frozen=True)
class HarmonySyntax:
    """gpt-oss's harmony calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {...}<|call|>`; results as messages from the function (shown to a template without tool
    support as user turns)."""

    result_role: str = "user"

    def describe_tools(self, functions: list[dict[str, Any]]) -> str:
        listing = "\n".join(_json(f) for f in functions)
        return (
            f"# Tools\n\n## functions\n\n{listing}\n\nTo call a function, write a commentary message to it: "
            "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments as JSON}<|call|>"
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "".join(
            f"<|channel|>commentary to=functions.{c['name']} <|constrain|>json<|message|>{_json(c['arguments'])}<|call|>"
            for c in calls
        )

    def format_result(self, content: str) -> str:
        return content
