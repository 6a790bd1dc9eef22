"""Tool calling over the native engine: what `tools` and `tool_choice` (OpenAI's shapes, validated,
as dicts) become, and the calls in a reply.

- "auto" (the default with tools): the tools are shown to the model through the chat template and
  its reply is read by the model's format's parser (`tool_parsers`);
- "required" / a named function (`{"type": "function", "function": {"name": ...}}`): a JSON-schema
  constraint forces the reply to be calls (a list of `{"name", "parameters"}` objects, or the named
  function's arguments object), so the arguments always fit the tool's schema; the reply is read as
  that JSON, not through the model's format;
- "none": no tools are shown and nothing is parsed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from rxf.core.echo import cut, echo
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.tool_parsers import NamedCallParser, ParsedCall, RequiredCallsParser, ToolCallParser

# A function without parameters takes an empty object (OpenAI's reading of a missing schema).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # the OpenAI tool entries the prompt offers
    parser: ToolCallParser  # how each reply is read
    json_schema: str | None = None  # the constraint that forces calls ("required", named)
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


# How deep a client's JSON schema may nest, counting every object and array, a keyword's value or
# an unknown keyword's as much as a subschema: far deeper than schemas are written (OpenAI's
# strict mode allows 10 levels of objects, 20 of these), and within what is done with one. The
# meta-schema check recurses about 7 frames a level (Python's limit is 1,000), and the Responses
# API echoes `tools` and `text.format` in its response object, which pydantic refuses to write
# when it nests over 255 levels in all.
MAX_SCHEMA_DEPTH = 64


def check_schema_depth(value: Any) -> None:
    """Raises ValueError unless `value` (a JSON value) nests at most MAX_SCHEMA_DEPTH objects and
    arrays. Walks every value, without recursion."""
    pending = [(value, 1)] if isinstance(value, dict | list) else []  # (an object or array, its depth)
    while pending:
        item, depth = pending.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays")
        children = item.values() if isinstance(item, dict) else item
        pending += ((child, depth + 1) for child in children if isinstance(child, dict | list))


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError (the reason, bounded) unless `schema` is a JSON Schema by the 2020-12
    meta-schema, nested at most MAX_SCHEMA_DEPTH deep."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    check_schema_depth(schema)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = ".".join(map(str, exc.path))
        raise ValueError(f"not a valid JSON schema{' at ' + where if where else ''}: {cut(exc.message)}") from None


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    markup_parser: ToolCallParser,
    constraint: str | None,
) -> ToolPlan | None:
    """The plan for the offered `tools` (None: no tools offered). `constraint` names the field that
    already constrains the output, if any: it cannot be combined with forced calls."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    forced = tool_choice == "required" or named is not None
    if not tools:
        if forced:
            raise ChatInputError("tool_choice requires tools", "tool_choice")
        return None
    if tool_choice == "none":
        return None
    names = [tool["function"]["name"] for tool in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ChatInputError(f"tools: function names must be unique; repeated: {cut(', '.join(duplicates))}", "tools")
    max_calls = None if parallel_tool_calls else 1
    if not forced:
        return ToolPlan(tools, markup_parser.for_tools(tools), max_calls=max_calls)
    if constraint is not None:
        described = f"{{function: {echo(named)}}}" if named is not None else repr(tool_choice)
        raise ChatInputError(f"tool_choice {described} cannot be combined with {constraint}", "tool_choice")
    parameters = {tool["function"]["name"]: tool["function"].get("parameters") or _NO_PARAMETERS for tool in tools}
    if named is not None:
        if named not in parameters:
            raise ChatInputError(
                f"tool_choice names the function {echo(named)}, which is not in tools ({cut(', '.join(names))})", "tool_choice"
            )
        return ToolPlan(tools, NamedCallParser(named), json.dumps(parameters[named]), 1)
    return ToolPlan(tools, RequiredCallsParser(), json.dumps(required_calls_schema(parameters, max_calls)), max_calls)


def required_calls_schema(parameters: dict[str, dict[str, Any]], max_calls: int | None) -> dict[str, Any]:
    """A non-empty list of calls, each `{"name": <a tool>, "parameters": <that tool's schema>}`."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in parameters.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def tool_params(plan: ToolPlan | None) -> dict[str, Any]:
    """The native parameters the plan adds: its forcing constraint, or special tokens kept in the
    output for a parser whose markup is one."""
    if plan is None:
        return {}
    if plan.json_schema is not None:
        return {"json_schema": plan.json_schema}
    return {"skip_special_tokens": False} if plan.parser.needs_special_tokens else {}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reply_calls(plan: ToolPlan, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole reply as its content (the text without the call markup) and its calls."""
    scan = plan.parser.parse(text)
    return scan.content, scan.calls[: plan.max_calls]
