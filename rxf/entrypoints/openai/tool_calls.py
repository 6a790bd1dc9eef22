"""OpenAI tool calling over the native engine: what a request's `tools` and `tool_choice` become,
and the calls in the replies.

- "auto" (the default with tools): the tools are shown to the model through the chat template and
  its reply is read by the model's format's parser (`tool_parsers`);
- "required" / a named function: a JSON-schema constraint forces the reply to be calls (a list of
  `{"name", "parameters"}` objects, or the named function's arguments object), so the arguments
  always fit the tool's schema; the reply is read as that JSON, not through the model's format;
- "none": no tools are shown and nothing is parsed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from rxf.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from rxf.entrypoints.openai.sampling import bad_request
from rxf.entrypoints.openai.tool_parsers import NamedCallParser, RequiredCallsParser, ToolCallParser

# A function without parameters takes an empty object (OpenAI's reading of a missing schema).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # the OpenAI tool entries the prompt offers
    parser: ToolCallParser  # how each reply is read
    json_schema: str | None = None  # the constraint that forces calls ("required", named)
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


def plan_tools(req: ChatCompletionRequest, markup_parser: ToolCallParser, constraint: str | None) -> ToolPlan | None:
    """The plan for `req`'s tools (None: no tools offered). `constraint` names the request field
    that already constrains the output, if any: it cannot be combined with forced calls."""
    choice = req.tool_choice
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if not req.tools:
        if forced:
            raise bad_request("tool_choice requires tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
    names = [tool.function.name for tool in req.tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise bad_request(f"tools: function names must be unique; repeated: {', '.join(duplicates)}", "tools")
    max_calls = None if req.parallel_tool_calls else 1
    if not forced:
        return ToolPlan(tools, markup_parser, max_calls=max_calls)
    if constraint is not None:
        raise bad_request(f"tool_choice {_describe(choice)} cannot be combined with {constraint}", "tool_choice")
    parameters = {tool.function.name: tool.function.parameters or _NO_PARAMETERS for tool in req.tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in parameters:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})", "tool_choice"
            )
        return ToolPlan(tools, NamedCallParser(name), json.dumps(parameters[name]), 1)
    return ToolPlan(tools, RequiredCallsParser(), json.dumps(required_calls_schema(parameters, max_calls)), max_calls)


def _describe(choice: Any) -> str:
    return f"{{function: {choice.function.name!r}}}" if isinstance(choice, NamedToolChoice) else repr(choice)


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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reply_message(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A whole reply as the message's content and tool calls (None when it made no call)."""
    scan = plan.parser.parse(text)
    calls = scan.calls[: plan.max_calls]
    if not calls:
        return scan.content, None
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return scan.content or None, tool_calls


@dataclass
class ToolCallStream:
    """One choice's reply as it streams: content deltas, and per call a first delta with its id,
    type, name and the arguments so far, then argument fragments. The deltas add up to
    `reply_message`."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per call started

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        scan = self.plan.parser.scan(self.text, final)
        content, self.content_sent = scan.content[self.content_sent :], max(self.content_sent, len(scan.content))
        out = []
        for index, call in enumerate(scan.calls[: self.plan.max_calls]):
            first = index == len(self.arguments_sent)
            if first:
                self.arguments_sent.append(0)
            fragment = call.arguments[self.arguments_sent[index] :]
            self.arguments_sent[index] += len(fragment)
            if first:
                function = FunctionCallDelta(name=call.name, arguments=fragment)
                out.append(ToolCallDelta(index=index, id=new_call_id(), type="function", function=function))
            elif fragment:
                out.append(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=fragment)))
        return content, out

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)
