"""A Responses API request's answer: the response object, its output items, and the conversation
that `previous_response_id` continues, built from the chat plan's result.

A reply is read as chat reads it (the chat plan's `ReplyFormat`): its reasoning, when the model's
reasoning parser finds any, is a `reasoning` item with one `reasoning_text` part, first; its text
without the reasoning and the call markup is one `message` item with one `output_text` part
(present when there is text or no call), each call a `function_call` item (`call_id` is the id a
later `function_call_output` answers). Status:
"completed" (the reply ended), "incomplete" with reason `max_output_tokens` (cut by the budget) or
no reason (aborted on request: `/abort_request`, a drain).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rxf.core.frontend.outputs import GenerateOutput
from rxf.entrypoints.chat.tools import new_call_id
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.logprobs import TokenStr, chat_logprobs
from rxf.entrypoints.openai.protocol import ChatTokenLogprob
from rxf.entrypoints.openai.responses_protocol import (
    FunctionCallOut,
    FunctionToolChoice,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOut,
    ReasoningText,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from rxf.entrypoints.openai.serving_chat import ChatPlan


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsePlan:
    id: str
    request: ResponsesRequest
    chat: ChatPlan  # the one prepared request that serves it
    conversation: list[dict[str, Any]]  # chat messages: the previous response's, then this input's
    model: str
    decode: Callable[[list[int]], str]  # output tokens -> their text, as the engine detokenizes them
    token_str: TokenStr | None = None  # set when the output's logprobs were asked for
    created_at: int = field(default_factory=lambda: int(time.time()))


def token_logprobs(plan: ResponsePlan, out: GenerateOutput) -> list[ChatTokenLogprob]:
    """The logprobs of `out`'s tokens (none unless asked for). With tools they cover every token,
    call markup included, as chat's do."""
    if plan.token_str is None or out.logprobs is None:
        return []
    return chat_logprobs(out.logprobs.output_token_logprobs, out.logprobs.output_top_logprobs, plan.token_str)


def message_item(text: str, status: str, logprobs: list[ChatTokenLogprob] | None = None) -> OutputMessage:
    return OutputMessage(id=new_item_id("msg"), status=status, content=[OutputText(text=text, logprobs=logprobs or [])])


def reasoning_item(text: str, status: str) -> ReasoningOut:
    return ReasoningOut(id=new_item_id("rs"), status=status, content=[ReasoningText(text=text)])


def call_item(call_id: str, name: str, arguments: str, status: str) -> FunctionCallOut:
    return FunctionCallOut(id=new_item_id("fc"), call_id=call_id, name=name, arguments=arguments, status=status)


def finish_status(out: GenerateOutput) -> tuple[str, IncompleteDetails | None]:
    """The response's status and incomplete details for its final output."""
    finish = gen.finish_reason(out)
    if finish == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish == "abort":
        return "incomplete", IncompleteDetails(reason=None)
    return "completed", None


def output_items(plan: ResponsePlan, out: GenerateOutput, last_status: str) -> list[OutputItem]:
    """The output items of the whole reply `out`: each but the last ended (the model wrote the next
    one), the last in `last_status`, as the stream closes them."""
    reply = plan.chat.reply.split(out.text)
    items: list[OutputItem] = [reasoning_item(reply.reasoning, "completed")] if reply.reasoning else []
    if reply.content or not reply.calls:
        items.append(message_item(reply.content, "completed", token_logprobs(plan, out)))
    items += [call_item(new_call_id(), c.name, c.arguments, "completed") for c in reply.calls]
    items[-1].status = last_status
    return items


def reasoning_tokens(plan: ResponsePlan, output_ids: list[int], reasoning: str) -> int:
    """How many output tokens wrote `reasoning` (the whole reply's): the shortest prefix of
    `output_ids` whose text holds all of it (the end marker and what follows are not counted).
    The reasoning parser is prefix-stable, so a longer prefix never holds less of it, and a binary
    search finds the prefix in a few decodes."""
    fmt = plan.chat.reply
    assert fmt.reasoning is not None  # there is reasoning only where there is a parser
    split = fmt.reasoning.split

    def holds_it(k: int) -> bool:
        part = split(plan.decode(output_ids[:k]), final=False, inside=fmt.inside)
        return len(part.reasoning or "") >= len(reasoning)

    low, high = 1, len(output_ids)  # the answer is in [low, high]: all tokens when none holds it
    while low < high:
        mid = (low + high) // 2
        if holds_it(mid):
            high = mid
        else:
            low = mid + 1
    return low


def usage(plan: ResponsePlan, out: GenerateOutput, output: list[OutputItem]) -> ResponseUsage:
    """The usage of the final output `out` (complete: all its tokens), whose items are `output`."""
    chat_usage = gen.usage([[out]])
    reasoning = "".join(part.text for item in output if isinstance(item, ReasoningOut) for part in item.content)
    thought = reasoning_tokens(plan, out.output_ids, reasoning) if reasoning else 0
    return ResponseUsage(
        input_tokens=chat_usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=chat_usage.prompt_tokens_details.cached_tokens),
        output_tokens=chat_usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=thought),
        total_tokens=chat_usage.total_tokens,
    )


def response_object(
    plan: ResponsePlan,
    status: str,
    output: list[OutputItem],
    out: GenerateOutput | None = None,
    incomplete: IncompleteDetails | None = None,
    error: str | None = None,
) -> ResponseObject:
    """The response in `status`; `out` (the final output) gives its usage."""
    req = plan.request
    tool_choice: Any = req.tool_choice or "auto"
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = tool_choice.model_dump()
    text_format = req.text.format if req.text is not None and req.text.format is not None else None
    return ResponseObject(
        id=plan.id,
        created_at=plan.created_at,
        completed_at=int(time.time()) if status == "completed" else None,
        status=status,
        model=plan.model,
        output=output,
        error=ResponseErrorInfo(message=error) if error is not None else None,
        incomplete_details=incomplete,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
        reasoning=req.reasoning.model_dump() if req.reasoning is not None else None,
        store=req.store,
        metadata=req.metadata or {},
        user=req.user,
        usage=usage(plan, out, output) if out is not None else None,
    )


def final_response(plan: ResponsePlan, out: GenerateOutput, output: list[OutputItem] | None = None) -> ResponseObject:
    """The finished response for the final output `out`, complete (its whole text and tokens;
    `output`: its items as streamed)."""
    status, incomplete = finish_status(out)
    if output is None:
        output = output_items(plan, out, "incomplete" if status == "incomplete" else "completed")
    return response_object(plan, status, output, out, incomplete)


def stored_conversation(plan: ResponsePlan, response: ResponseObject) -> list[dict[str, Any]]:
    """The conversation a later `previous_response_id` continues: this one's, then the reply as an
    assistant turn (its text, its calls under their call ids). A call the budget cut off (status
    "incomplete", its arguments unfinished JSON) is left out: nothing can answer it, and it is
    dropped as an input item too (`responses_protocol.CutOffCallItem`)."""
    text = "".join(part.text for item in response.output if isinstance(item, OutputMessage) for part in item.content)
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output if isinstance(item, FunctionCallOut) and item.status != "incomplete"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return plan.conversation + [turn]
