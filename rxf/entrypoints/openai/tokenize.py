"""POST /v1/tokenize and /v1/detokenize, with vLLM's bodies, and the same at vLLM's own paths
(`/tokenize`, `/detokenize`, at the root).

A prompt is tokenized as /v1/completions tokenizes it (special tokens added unless
`add_special_tokens` is false); messages as /v1/chat/completions renders them (the template
writes its own special tokens, so none are added unless asked).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.messages import render_messages, template_messages
from rxf.entrypoints.chat.tool_parsers import ToolCallParser
from rxf.entrypoints.json_route import MsgspecJSONRoute
from rxf.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from rxf.entrypoints.openai.sampling import bad_request, check_model
from rxf.entrypoints.openai.serving_chat import tool_parser
from rxf.entrypoints.server_state import ServerState, server_state

router = APIRouter(route_class=MsgspecJSONRoute)


def prompt_text(req: TokenizeRequest, chat_template: Any, parser: ToolCallParser | None = None) -> tuple[str, bool]:
    """The text to tokenize and whether to add the tokenizer's special tokens."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        return req.prompt, req.add_special_tokens is not False
    try:
        items = template_messages([msg.model_dump(exclude_unset=True) for msg in req.messages])
        text = render_messages(items, chat_template, parser, add_generation_prompt=req.add_generation_prompt)
    except ChatInputError as exc:
        raise bad_request(str(exc), exc.param) from None
    return text, bool(req.add_special_tokens)


def _tokenize(body: TokenizeRequest, state: ServerState) -> tuple[list[int], list[str] | None]:
    text, add_special = prompt_text(body, state.chat_template, tool_parser(state))
    ids = state.tokenizer.encode(text, add_special_tokens=add_special)
    return ids, state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None


@router.post("/v1/tokenize")
@router.post("/tokenize", operation_id="tokenize_root")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    # Off the event loop: this text has no context bound, and megabytes take seconds to tokenize
    # (the tokenizer releases the GIL meanwhile); rendering thousands of messages and naming a
    # million tokens are Python loops, which yield the GIL to the event loop every few ms.
    ids, strs = await asyncio.to_thread(_tokenize, body, state)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=tm.max_context_len, token_strs=strs)


@router.post("/v1/detokenize")
@router.post("/detokenize", operation_id="detokenize_root")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    # Bounded, because decoding holds the GIL (a thread would not free the event loop): a million
    # ids took 1.4 s. No sequence the model reads or writes is longer than its context.
    if len(body.tokens) > tm.max_context_len:
        raise bad_request(
            f"{len(body.tokens)} token ids are more than the model's context length {tm.max_context_len}", "tokens"
        )
    if not all(0 <= t < tm.vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {tm.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
