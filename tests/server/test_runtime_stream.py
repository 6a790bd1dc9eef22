"""`Runtime.chat` streamed with tools, and `n` choices from Python, against the server: the demo
model behind the real server, driven by the official `openai` client, is the reference (same greedy
text and calls; same seeded choices, choice i sampling with seed + i); a streamed reply adds up to
the non-streamed one; bad `n` is a ValueError naming it."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from test_openai_tools import ASK, NAMED, TOOLS

from rxf.testing.runtime import assert_drained

MAX_TOKENS = 60  # a forced call finishes within it
FORCED = {"named": {"tool_choice": NAMED}, "required": {"tool_choice": "required", "parallel_tool_calls": False}}
SAMPLED = {"temperature": 1.0, "seed": 11, "ignore_eos": True}
PROMPT = "Three short words about the sea:"


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def rt(demo_runtime):
    return demo_runtime


def assemble(chunks: list[dict[str, Any]], index: int | None = None) -> tuple[str, list[tuple[str, str]], str]:
    """Text, calls as (name, arguments) and the last finish type of one reply's chunks, the calls
    accumulated from their deltas as OpenAI clients do (a call's first delta names it)."""
    text, calls, finish = "", {}, None
    for chunk in chunks:
        if index is not None and chunk["index"] != index:
            continue
        text += chunk["text"]
        for delta in chunk["tool_calls"]:
            if delta["index"] not in calls:
                assert delta["id"].startswith("call_") and delta["type"] == "function" and delta["function"]["name"]
                calls[delta["index"]] = [delta["function"]["name"], ""]
            else:
                assert "id" not in delta and "name" not in delta["function"]
            calls[delta["index"]][1] += delta["function"]["arguments"]
        finish = (chunk["meta_info"].get("finish_reason") or {}).get("type") or finish
    return text, [tuple(calls[i]) for i in sorted(calls)], finish


def whole_calls(out: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in out.get("tool_calls", [])]


@pytest.mark.parametrize("case", list(FORCED))
def test_streamed_forced_call_matches_whole_and_server(rt, client, model, case):
    fields = {"tools": TOOLS, **FORCED[case]}
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    chunks = list(rt.chat(ASK, params, stream=True, **fields))
    text, calls, finish = assemble(chunks)
    whole = rt.chat(ASK, params, **fields)
    assert (text, calls) == (whole["text"], whole_calls(whole)) and len(calls) == 1
    assert finish == whole["meta_info"]["finish_reason"]["type"] == "tool_calls"
    assert [c["meta_info"]["finish_reason"] is not None for c in chunks].count(True) == 1
    assert sum(len(c["tool_calls"]) for c in chunks) > 1  # the arguments came in pieces
    server: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, stream=True, temperature=0, max_tokens=MAX_TOKENS, **fields
    ):
        for delta in chunk.choices[0].delta.tool_calls or []:
            server.setdefault(delta.index, [delta.function.name, ""])[1] += delta.function.arguments or ""
    assert calls == [tuple(server[i]) for i in sorted(server)]


def test_streamed_auto_reply_matches_whole_and_leaks_no_markup(rt):
    params = {"max_new_tokens": 40, "temperature": 0}
    chunks = list(rt.chat(ASK, params, tools=TOOLS, stream=True))
    text, calls, _ = assemble(chunks)
    whole = rt.chat(ASK, params, tools=TOOLS)
    assert (text, calls) == (whole["text"], whole_calls(whole))
    assert not any("<tool_call>" in c["text"] for c in chunks)


def test_scripted_markup_streams_as_calls():
    """A reply in Hermes call markup (the demo model never writes it), streamed in small pieces:
    the text deltas carry none of it, the call deltas add up to the whole reply's calls."""
    from rxf.entrypoints.chat.prompt import ChatPrompt
    from rxf.entrypoints.chat.tool_parsers.hermes import HermesParser
    from rxf.entrypoints.chat.tools import ToolPlan
    from rxf.entrypoints.runtime_chat import ChatCall

    reply = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
    pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)]
    stop = {"type": "stop", "matched": 2}
    native = [{"text": p, "meta_info": {"finish_reason": stop if i == len(pieces) - 1 else None}}
              for i, p in enumerate(pieces)]
    plan = ToolPlan(TOOLS, HermesParser())
    chunks = list(ChatCall(ChatPrompt("", None, None), {}, plan, None).reply_stream(c for c in native))
    whole = ChatCall(ChatPrompt("", None, None), {}, plan, None).reply({"text": reply, "meta_info": {"finish_reason": stop}})
    text, calls, finish = assemble(chunks)
    assert (text, calls, finish) == (whole["text"], whole_calls(whole), "tool_calls") and len(calls) == 2
    assert not any(mark in c["text"] for c in chunks for mark in ("<", "{", "get_"))


def test_async_streamed_forced_call(rt):
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}

    async def run() -> list[dict[str, Any]]:
        stream = await rt.async_chat(ASK, params, tools=TOOLS, tool_choice=NAMED, stream=True)
        return [chunk async for chunk in stream]

    whole = rt.chat(ASK, params, tools=TOOLS, tool_choice=NAMED)
    assert assemble(asyncio.run(run()))[:2] == (whole["text"], whole_calls(whole))


def test_greedy_choices_equal_one(rt):
    params = {"max_new_tokens": 8, "temperature": 0}
    one = rt.generate(PROMPT, params)
    choices = rt.generate(PROMPT, params, n=3)
    assert [(c["text"], c["output_ids"]) for c in choices] == [(one["text"], one["output_ids"])] * 3
    batch = rt.generate([PROMPT, "Hello"], params, n=2)
    assert [len(group) for group in batch] == [2, 2] and batch[0][1]["text"] == one["text"]


def test_seeded_choices_match_the_server(rt, client, model):
    params = {"max_new_tokens": 8, **SAMPLED}
    choices = rt.generate(PROMPT, params, n=3)
    server = client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=11,
                                       extra_body={"ignore_eos": True})
    assert [c["text"] for c in choices] == [c.text for c in server.choices]
    assert len({c["text"] for c in choices}) > 1  # the seeds differ per choice
    assert choices[0]["text"] == rt.generate(PROMPT, params)["text"]  # choice 0 keeps the seed
    chat = rt.chat(ASK, params, n=3)
    server_chat = client.chat.completions.create(model=model, messages=ASK, n=3, max_tokens=8, temperature=1.0,
                                                 seed=11, extra_body={"ignore_eos": True})
    assert [c["text"] for c in chat] == [c.message.content for c in server_chat.choices]


def test_streamed_choices_carry_their_index(rt):
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    chunks = list(rt.generate(PROMPT, {"max_new_tokens": 6, **SAMPLED}, n=2, stream=True))
    whole = rt.generate(PROMPT, {"max_new_tokens": 6, **SAMPLED}, n=2)
    assert {c["index"] for c in chunks} == {0, 1}
    assert ["".join(c["text"] for c in chunks if c["index"] == i) for i in range(2)] == [w["text"] for w in whole]
    calls = list(rt.chat(ASK, params, tools=TOOLS, tool_choice=NAMED, n=2, stream=True))
    whole_chat = rt.chat(ASK, params, tools=TOOLS, tool_choice=NAMED, n=2)
    assert [assemble(calls, i)[1] for i in range(2)] == [whole_calls(w) for w in whole_chat]


@pytest.mark.parametrize("n", [0, -1, 129, 2.0, True])
def test_bad_n_is_a_value_error_naming_it(rt, n):
    with pytest.raises(ValueError, match=re.escape(f"n must be an integer in [1, 128], got {n!r}")):
        rt.generate(PROMPT, {"max_new_tokens": 2}, n=n)
    with pytest.raises(ValueError, match=r"^n must"):
        rt.chat(ASK, {"max_new_tokens": 2}, n=n, stream=True)
    assert rt.generate(PROMPT, {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2  # still serving


def test_abandoned_streamed_choices_are_aborted_and_free_kv(rt):
    stream = rt.chat(ASK, {"max_new_tokens": 400, **SAMPLED}, tools=TOOLS, n=2, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert_drained(rt)
