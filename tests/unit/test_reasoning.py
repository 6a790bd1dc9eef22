"""Reasoning parsers and the reply reader (`rxf.entrypoints.chat.reply`): whole outputs in the
shapes thinking models write, and the same outputs streamed one character at a time, split in two
at every position and in random chunks, whose deltas must add up to exactly the whole split."""

from __future__ import annotations

import json
import random
import types

import pytest

from rxf.core.hookspecs import RegisterFactory, hookimpl
from rxf.core.registry import PluginRegistry
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.prompt import template_variables
from rxf.entrypoints.chat.reasoning import detect_reasoning_name, make_reasoning_parser
from rxf.entrypoints.chat.reasoning.think import ThinkParser
from rxf.entrypoints.chat.reply import ReplyFormat, reply_format
from rxf.entrypoints.chat.tool_parsers import make_parser
from rxf.entrypoints.chat.tools import ToolPlan
from rxf.plugins.chat_templates.base import JinjaChatTemplate

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
HERMES_CALL = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
QWEN3_PROMPT = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"

# (name, output, starts inside, expected reasoning, expected content, expected calls)
CASES = [
    ("qwen3", "<think>\nThe user asks for the capital.\nIt is Paris.\n</think>\n\nParis.", False,
     "The user asks for the capital.\nIt is Paris.", "Paris.", []),
    ("r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is **4**.", True, "Okay, 2+2 is 4.", "The answer is **4**.", []),
    ("r1 repeats the open", "<think>\nHmm.\n</think>\n\n4", True, "Hmm.", "4", []),
    ("no thinking", "Hello there! <b>bold</b> < 3", False, None, "Hello there! <b>bold</b> < 3", []),
    ("cut short", "<think>\nLet me count: 1, 2, 3", False, "Let me count: 1, 2, 3", "", []),
    ("r1 cut short", "Counting: 1 < 2 </th", True, "Counting: 1 < 2 </th", "", []),
    ("markup lookalikes", "<think>a <thin> b </thinker> c</think>d", False, "a <thin> b </thinker> c", "d", []),
    ("empty block", "<think>\n\n</think>\n\nSure.", False, "", "Sure.", []),
    ("then a call", f"<think>\nI need the weather.\n</think>\n\n{HERMES_CALL}", False, "I need the weather.", "", [CALL]),
    ("text and a call", f"<think>x</think>\nLet me check.\n{HERMES_CALL}", False, "x", "Let me check.", [CALL]),
]
# gpt-oss's harmony output (after the prompt's `<|start|>assistant`); its stop tokens <|return|> and
# <|call|> may be trimmed from the text or kept.
HARMONY = "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|><|start|>assistant"
HARMONY_CASES = [
    ("final", HARMONY + "<|channel|>final<|message|>2 + 2 = 4.<|return|>", "User asks 2+2. Simple.", "2 + 2 = 4.", []),
    ("final, stop trimmed", HARMONY + "<|channel|>final<|message|>4 < 5", "User asks 2+2. Simple.", "4 < 5", []),
    ("call", HARMONY + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
     "User asks 2+2. Simple.", "", [CALL]),
    ("call, recipient first", HARMONY + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
     "User asks 2+2. Simple.", "", [CALL]),
    ("preamble and call", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', None, "Checking.", [CALL]),
    ("no harmony", "Plain <b>text</b>", None, "Plain <b>text</b>", []),
    ("cut short in analysis", "<|channel|>analysis<|message|>Thinking about <|", "Thinking about <|", "", []),
]
IDS = [case[0] for case in CASES]


def fmt(inside: bool, tools: bool) -> ReplyFormat:
    plan = ToolPlan([], make_parser("hermes", None, None)) if tools else None
    return ReplyFormat(ThinkParser(), inside, plan)


def streamed(f: ReplyFormat, pieces: list[str]) -> tuple[str, str, dict[int, list[str]]]:
    stream = f.stream()
    reasoning, content, calls = "", "", {}
    for k, piece in enumerate(pieces):
        delta = stream.feed(piece, final=k == len(pieces) - 1)
        reasoning += delta.reasoning
        content += delta.content
        for call in delta.calls:
            name = call["function"].get("name")
            entry = calls.setdefault(call["index"], [name, ""])
            entry[1] += call["function"]["arguments"]
    return reasoning, content, calls


@pytest.mark.parametrize("name, text, inside, reasoning, content, calls", CASES, ids=IDS)
def test_whole_output(name, text, inside, reasoning, content, calls):
    reply = fmt(inside, tools=True).split(text)
    assert (reply.reasoning, reply.content) == (reasoning, content)
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in reply.calls] == calls


@pytest.mark.parametrize("name, text, inside, reasoning, content, calls", CASES, ids=IDS)
def test_streamed_deltas_add_up_to_the_whole_output(name, text, inside, reasoning, content, calls):
    f = fmt(inside, tools=True)
    whole = f.split(text)
    splits = [list(text)]  # token by token, at worst a character each
    splits += [[text[:k], text[k:]] for k in range(len(text) + 1)]  # split in two at every position
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text)), min(len(text), 5)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        got_reasoning, got_content, got_calls = streamed(f, pieces)
        assert got_reasoning == (whole.reasoning or "") and got_content == whole.content, pieces
        assert [got_calls[k] for k in sorted(got_calls)] == [[c.name, c.arguments] for c in whole.calls]


def harmony_format() -> ReplyFormat:
    return ReplyFormat(make_reasoning_parser("harmony", None), False, ToolPlan([], make_parser("harmony", None, None)))


@pytest.mark.parametrize("name, text, reasoning, content, calls", HARMONY_CASES, ids=[c[0] for c in HARMONY_CASES])
def test_harmony(name, text, reasoning, content, calls):
    f = harmony_format()
    whole = f.split(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in whole.calls] == calls
    expected = (whole.reasoning or "", whole.content, {k: [c.name, c.arguments] for k, c in enumerate(whole.calls)})
    assert streamed(f, list(text)) == expected
    for k in range(len(text) + 1):
        assert streamed(f, [text[:k], text[k:]]) == expected, k


def test_no_marker_leaks_into_streamed_reasoning_or_content():
    text = CASES[0][1]
    stream = fmt(False, tools=False).stream()
    for k, char in enumerate(text):
        delta = stream.feed(char, final=k == len(text) - 1)
        assert "<" not in delta.reasoning and "<" not in delta.content


def test_where_the_output_starts():
    parser = ThinkParser()
    assert not parser.starts_inside(QWEN3_PROMPT)
    assert parser.starts_inside(R1_PROMPT) and parser.starts_inside("<think>\n\n")
    # Qwen3 with enable_thinking false: its template writes an empty, closed block.
    assert not parser.starts_inside(QWEN3_PROMPT + "<think>\n\n</think>\n\n")
    assert reply_format(R1_PROMPT, parser, None, constrained=False).inside
    # A constrained reply still thinks first when the prompt opened the block: its grammar waits for
    # </think> (`constraint_start`).
    assert reply_format(R1_PROMPT, parser, None, constrained=True).inside


def test_choice_of_parser():
    think = JinjaChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}<think>\n")
    plain = JinjaChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert detect_reasoning_name(think) == "think" and detect_reasoning_name(plain) is None
    assert isinstance(make_reasoning_parser(None, think), ThinkParser)
    assert make_reasoning_parser(None, plain) is None and make_reasoning_parser("none", think) is None
    for alias in ("qwen3", "deepseek_r1"):
        assert isinstance(make_reasoning_parser(alias, plain), ThinkParser)
    with pytest.raises(ValueError, match="model.reasoning_parser takes one of .*think"):
        make_reasoning_parser("nope", plain)
    with pytest.raises(ValueError, match="not a ReasoningParser subclass"):
        make_reasoning_parser("json:JSONDecoder", plain)


class ShoutParser(ThinkParser):
    """A third-party parser (reasoning marked as by <think>, for the test)."""

    name = "shout"


def test_plugins_register_formats():
    plugin = types.ModuleType("formats_plugin")

    @hookimpl
    def rxf_register_reasoning_parsers(register: RegisterFactory) -> None:
        register("shout", f"{__name__}:ShoutParser")

    @hookimpl
    def rxf_register_tool_call_formats(register: RegisterFactory) -> None:
        register("hermes2", "rxf.entrypoints.chat.tool_parsers.hermes:HermesParser")

    plugin.rxf_register_reasoning_parsers = rxf_register_reasoning_parsers
    plugin.rxf_register_tool_call_formats = rxf_register_tool_call_formats
    registry = PluginRegistry.load()
    registry.register_plugin(plugin, "formats-plugin")
    assert isinstance(make_reasoning_parser("shout", None, registry), ShoutParser)
    assert make_parser("hermes2", None, None, registry).name == "hermes"
    assert {"think", "qwen3", "deepseek_r1"} <= set(registry.names("reasoning_parsers"))
    assert {"hermes", "llama3_json", "mistral"} <= set(registry.names("tool_call_formats"))


def test_template_variables():
    template = JinjaChatTemplate(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
        "effort={{ reasoning_effort | default('medium') }}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    assert template.render(msgs) == "hieffort=medium"
    bound = template.with_variables(template_variables({"enable_thinking": False}, "high"))
    assert bound.render(msgs) == "hi<think>\n\n</think>\n\neffort=high"
    assert template.render(msgs) == "hieffort=medium"  # the server's template is unchanged
    arithmetic = JinjaChatTemplate("{{ messages[0].content }}{{ n + 1 }}")
    with pytest.raises(ValueError, match="chat template"):  # a 400 naming messages, not a crash
        arithmetic.with_variables({"n": "x"}).render(msgs)
    for bad in ("messages", "add_generation_prompt", "tokenize", "not a name"):
        with pytest.raises(ChatInputError, match="chat_template_kwargs") as err:
            template_variables({bad: 1}, None)
        assert err.value.param == "chat_template_kwargs"


def test_a_constraint_starts_after_the_reasoning_the_prompt_opened():
    """/v1/chat/completions' plan: with a template that opens `<think>`, response_format's and
    forced tools' grammars wait for the `</think>` tokens and the reply is read after them; with one
    that does not (the model may not think), the grammar runs from the first token."""
    from rxf.core.frontend.request_preparer import RequestPreparer
    from rxf.entrypoints.openai.protocol import ChatCompletionRequest
    from rxf.entrypoints.openai.serving_chat import plan_chat
    from rxf.testing import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    opens = JinjaChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}<think>\n")
    plain = JinjaChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    end_ids = tok.encode("</think>", add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for fields in ({"response_format": {"type": "json_object"}}, {"tools": tools, "tool_choice": "required"}):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
        for template, waits in ((opens, True), (plain, False)):
            p = plan_chat(req, RequestPreparer(tok, 2048, 512), template, reasoning_parser=ThinkParser())
            assert p.prompt.sampling_params.json_schema is not None
            assert p.prompt.sampling_params.grammar_after == (end_ids if waits else [])
            assert p.reply.inside == waits


def test_runtime_chat_results_carry_the_reasoning():
    """`Runtime.chat`'s reading of a reply (`ChatCall`): the text after the reasoning,
    `reasoning_content`, and the calls; streamed chunks carry the deltas."""
    from rxf.entrypoints.chat.prompt import ChatPrompt
    from rxf.entrypoints.runtime_chat import ChatCall

    text = f"Checking.\n</think>\n\n{HERMES_CALL}"
    plan = ToolPlan([], make_parser("hermes", None, None))
    call = ChatCall(ChatPrompt("", None, None), {}, plan, None, ReplyFormat(ThinkParser(), True, plan))
    stop = {"finish_reason": {"type": "stop"}}
    out = call.reply({"text": text, "meta_info": stop})
    assert (out["text"], out["reasoning_content"]) == ("", "Checking.")
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_weather"]
    assert out["meta_info"]["finish_reason"]["type"] == "tool_calls"
    chunks = [call.reply_chunk({"text": ch, "meta_info": {"finish_reason": None}}) for ch in text[:-1]]
    chunks.append(call.reply_chunk({"text": text[-1], "meta_info": stop}))
    assert "".join(c["reasoning_content"] for c in chunks) == "Checking."
    assert "".join(c["text"] for c in chunks) == ""
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "tool_calls"
    plain = ChatCall(ChatPrompt("", None, None), {}, None, None, ReplyFormat(ThinkParser(), False, None))
    assert plain.reply({"text": "Hi", "meta_info": stop}) == {"text": "Hi", "reasoning_content": None, "meta_info": stop}


def test_a_bad_format_name_fails_the_launch_front_end(tmp_path):
    """The server's front end loads both parsers at start-up, so a typo fails the launch."""
    from rxf.core.config import load_config
    from rxf.entrypoints.engine_loader import load_frontend
    from rxf.testing import make_tiny_tokenizer

    make_tiny_tokenizer().save_pretrained(tmp_path)
    load_frontend(load_config({"model.reasoning_parser": "qwen3", "model.tool_call_parser": "pythonic"}), str(tmp_path))
    for setting in ("model.reasoning_parser", "model.tool_call_parser"):
        with pytest.raises(ValueError, match=f"{setting} takes one of"):
            load_frontend(load_config({setting: "no-such-format"}), str(tmp_path))
