"""Tool-call parsers: whole outputs, and the same outputs streamed in random chunk splits, whose
deltas must add up to exactly the whole output's content and calls. The expected calls are the
objects the outputs were written from, compared after `json.loads`."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from rxf.entrypoints.chat.reply import ReplyFormat
from rxf.entrypoints.chat.tool_parsers import (
    NamedCallParser,
    RequiredCallsParser,
    ToolCallParser,
    detect_parser_name,
    make_parser,
    parser_class,
)
from rxf.entrypoints.chat.tool_parsers.json_scan import scan_call, value_end
from rxf.entrypoints.chat.tool_stream import ToolCallStream
from rxf.entrypoints.chat.tools import ToolPlan
from rxf.entrypoints.openai.tool_calls import reply_message, tool_call_deltas
from rxf.plugins.chat_templates.builtin import BUILTIN_TEMPLATES
from rxf.plugins.chat_templates.tools import DeepSeekV3Syntax, PythonicSyntax, Qwen3CoderSyntax

WEATHER = {"name": "get_weather", "arguments": {"city": "Zürich \"old\" town", "days": [1, 2], "unit": None}}
NESTED = {"name": "search", "arguments": {"q": "a } ] { [ , : \\ b", "filters": {"tags": ["x"], "n": -1.5e3}}}
EMPTY = {"name": "ping", "arguments": {}}


def hermes(calls: list[dict[str, Any]], before: str = "", after: str = "") -> str:
    blocks = "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
    return f"{before}{blocks}{after}"


def llama3(calls: list[dict[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


def mistral(calls: list[dict[str, Any]], before: str = "") -> str:
    return f"{before}[TOOL_CALLS] {json.dumps(calls)}"


def qwen3_coder(calls: list[dict[str, Any]], before: str = "") -> str:
    return before + Qwen3CoderSyntax().format_calls(calls)


def pythonic(calls: list[dict[str, Any]]) -> str:
    return PythonicSyntax().format_calls(calls)


def deepseek_v3(calls: list[dict[str, Any]], before: str = "") -> str:
    return before + DeepSeekV3Syntax().format_calls(calls)


# As Qwen3-Coder writes them (its template's layout), DeepSeek-V3.1's newer form, Llama 4's tags.
QWEN3_CODER_OUTPUT = (
    "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich \"old\" town\n</parameter>\n"
    "<parameter=days>\n[1, 2]\n</parameter>\n<parameter=unit>\nnull\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
)
DEEPSEEK_V31_OUTPUT = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    + json.dumps(WEATHER["arguments"]) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)

# (parser, model output, expected content, expected calls)
CASES = [
    ("qwen3_coder", QWEN3_CODER_OUTPUT, "I'll check both.", [WEATHER, EMPTY]),
    ("qwen3_coder", qwen3_coder([NESTED], before="Searching. "), "Searching.", [NESTED]),
    ("qwen3_coder", "<tool_call>\n<functionary>\n</tool_call> x", "<tool_call>\n<functionary>\n</tool_call> x", []),
    ("qwen3_coder", "No calls: <tool_call is a tag.", "No calls: <tool_call is a tag.", []),
    ("pythonic", pythonic([WEATHER, NESTED, EMPTY]), "", [WEATHER, NESTED, EMPTY]),
    ("pythonic", "<|python_start|>" + pythonic([EMPTY]) + "<|python_end|>", "", [EMPTY]),
    ("pythonic", '[get_weather(city="a)\\"b", days=[1, 2], unit=None)]', "", [
        {"name": "get_weather", "arguments": {"city": 'a)"b', "days": [1, 2], "unit": None}}]),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "[see(1)] positional", "[see(1)] positional", []),
    ("pythonic", "Just text (no list).", "Just text (no list).", []),
    ("deepseek_v3", deepseek_v3([WEATHER, NESTED], before="Let me look.\n\n"), "Let me look.", [WEATHER, NESTED]),
    ("deepseek_v3", DEEPSEEK_V31_OUTPUT, "", [WEATHER]),
    ("deepseek_v3", deepseek_v3([EMPTY]) + " Done.", "Done.", [EMPTY]),
    ("deepseek_v3", "Plain text <｜tool▁sep｜> only", "Plain text <｜tool▁sep｜> only", []),
    ("hermes", hermes([WEATHER]), "", [WEATHER]),
    ("hermes", hermes([WEATHER, NESTED, EMPTY], before="Let me look.\n\n"), "Let me look.", [WEATHER, NESTED, EMPTY]),
    ("hermes", hermes([EMPTY], before="A", after="\nDone."), "A\nDone.", [EMPTY]),
    ("hermes", hermes([EMPTY, EMPTY], after=" x ") + " <tool_call>", "x  <tool_call>", [EMPTY, EMPTY]),
    ("hermes", 'Hi <tool_call>{"name": "f"}</tool_call>', "Hi", [{"name": "f", "arguments": {}}]),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", "broken <tool_call>not json</tool_call> end", "broken <tool_call>not json</tool_call> end", []),
    ("hermes", "ends with <tool", "ends with <tool", []),
    ("hermes", "  spaced  ", "  spaced  ", []),
    ("llama3_json", llama3([WEATHER]), "", [WEATHER]),
    ("llama3_json", " " + llama3([WEATHER, NESTED, EMPTY]), "", [WEATHER, NESTED, EMPTY]),
    ("llama3_json", "<|python_tag|>" + llama3([NESTED]), "", [NESTED]),
    ("llama3_json", "The answer is {1}.", "The answer is {1}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", mistral([WEATHER, EMPTY]), "", [WEATHER, EMPTY]),
    ("mistral", mistral([NESTED], before="Sure. "), "Sure.", [NESTED]),
    ("mistral", "Plain [text] here", "Plain [text] here", []),
]


def collect_stream(parser: ToolCallParser, text: str, rng: random.Random, max_calls: int | None = None):
    """Feed `text` in random chunks; return (content, calls as [name, arguments], first deltas)."""
    stream = ToolCallStream(ToolPlan([], parser, max_calls=max_calls))
    content, calls, firsts = "", {}, []
    i = 0
    while True:
        step = rng.randint(1, 6)
        final = i + step >= len(text)
        piece, calls_delta = stream.feed(text[i : i + step], final=final)
        deltas = tool_call_deltas(calls_delta)  # the OpenAI layer's models over the core's dicts
        i += step
        content += piece
        for delta in deltas:
            if delta.index not in calls:
                firsts.append(delta)
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.id is None and delta.function.name is None  # only the first delta names it
            calls[delta.index][1] += delta.function.arguments
        if final:
            return content, [calls[k] for k in sorted(calls)], firsts


def as_objects(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"name": name, "arguments": json.loads(arguments)} for name, arguments in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_output(name, text, content, calls):
    scan = parser_class(name)().parse(text)
    assert scan.content == content
    assert as_objects([(c.name, c.arguments) for c in scan.calls]) == calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_whole_output(name, text, content, calls):
    parser = parser_class(name)()
    whole = parser.parse(text)
    for seed in range(40):
        streamed, streamed_calls, firsts = collect_stream(parser, text, random.Random(seed))
        assert streamed == whole.content
        assert streamed_calls == [[c.name, c.arguments] for c in whole.calls]
        assert [d.index for d in firsts] == list(range(len(calls)))
        assert all(d.id.startswith("call_") and d.type == "function" for d in firsts)
        assert len({d.id for d in firsts}) == len(firsts)


def fed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[list[str]]]:
    """The content and calls ([name, arguments]) that streaming `pieces` adds up to."""
    stream = ToolCallStream(ToolPlan([], parser))
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += text
        for delta in deltas:
            entry = calls.setdefault(delta["index"], [delta["function"].get("name"), ""])
            entry[1] += delta["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_token_by_token_and_split_at_every_position(name, text, content, calls):
    parser = parser_class(name)()
    whole = parser.parse(text)
    expected = (whole.content, [[c.name, c.arguments] for c in whole.calls])
    assert fed(parser, list(text)) == expected
    for k in range(len(text) + 1):
        assert fed(parser, [text[:k], text[k:]]) == expected, k


def test_qwen3_coder_reads_values_by_the_tools_schemas():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "either": {"type": ["string", "null"]}}}}}]
    parser = parser_class("qwen3_coder")().for_tools(tools)
    text = qwen3_coder([{"name": "f", "arguments": {"code": "42", "n": 7, "either": "true", "other": "x"}}])
    (call,) = parser.parse(text).calls
    assert json.loads(call.arguments) == {"code": "42", "n": 7, "either": "true", "other": "x"}
    # Without the schema, a value that reads as JSON is that JSON.
    assert json.loads(parser_class("qwen3_coder")().parse(text).calls[0].arguments)["code"] == 42


def test_markup_never_leaks_into_streamed_content():
    text = hermes([WEATHER, NESTED], before="Checking. ")
    for seed in range(40):
        stream = ToolCallStream(ToolPlan([], parser_class("hermes")()))
        rng, i, pieces = random.Random(seed), 0, []
        while i < len(text):
            step = rng.randint(1, 3)
            pieces.append(stream.feed(text[i : i + step], final=i + step >= len(text))[0])
            i += step
        assert "".join(pieces) == "Checking." and not any("<" in p or "{" in p for p in pieces)


def test_reply_message_shape():
    plan = ToolPlan([], parser_class("hermes")())
    content, calls = reply_message(ReplyFormat(tools=plan).split(hermes([WEATHER, EMPTY], before="Ok ")))
    assert content == "Ok" and [c.function.name for c in calls] == ["get_weather", "ping"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert reply_message(ReplyFormat(tools=plan).split("just text")) == ("just text", None)
    assert reply_message(ReplyFormat(tools=plan).split(hermes([EMPTY])))[0] is None  # no text besides the call: null content


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = ToolPlan([], parser_class("hermes")(), max_calls=1)
    _, calls = reply_message(ReplyFormat(tools=plan).split(hermes([WEATHER, EMPTY])))
    assert [c.function.name for c in calls] == ["get_weather"]
    _, streamed, _ = collect_stream(plan.parser, hermes([WEATHER, EMPTY]), random.Random(0), max_calls=1)
    assert [c[0] for c in streamed] == ["get_weather"]


def test_forced_parsers():
    required = json.dumps([{"name": c["name"], "parameters": c["arguments"]} for c in (WEATHER, NESTED)])
    assert as_objects([(c.name, c.arguments) for c in RequiredCallsParser().parse(required).calls]) == [WEATHER, NESTED]
    named = NamedCallParser("get_weather")
    scan = named.parse("\n" + json.dumps(WEATHER["arguments"]) + " ")
    assert scan.content == "" and as_objects([(c.name, c.arguments) for c in scan.calls]) == [WEATHER]
    for seed in range(20):
        _, calls, _ = collect_stream(named, json.dumps(NESTED["arguments"]), random.Random(seed))
        assert calls == [["get_weather", json.dumps(NESTED["arguments"])]]
        _, calls, _ = collect_stream(RequiredCallsParser(), required, random.Random(seed))
        assert as_objects(calls) == [WEATHER, NESTED]


def test_mistral_hides_special_tokens_kept_for_its_marker():
    class Tok:
        all_special_tokens = ["<s>", "</s>", "[TOOL_CALLS]"]

    parser = make_parser("mistral", None, Tok())
    assert parser.needs_special_tokens and parser.hidden == ("<s>", "</s>")
    text = mistral([WEATHER], before="Hm. ") + "</s>"
    assert parser.parse(text).content == "Hm." and parser.parse("Hello</s>").content == "Hello"
    for seed in range(20):
        content, calls, _ = collect_stream(parser, "Hello there</s>", random.Random(seed))
        assert content == "Hello there" and calls == []


def test_json_scan_is_prefix_stable():
    text = json.dumps({"name": "f", "arguments": NESTED["arguments"]})
    whole = scan_call(text, 0)
    assert whole.name == "f" and json.loads(whole.arguments) == NESTED["arguments"] and whole.end == len(text)
    for k in range(len(text)):
        part = scan_call(text[:k], 0)
        assert part.valid and whole.arguments.startswith(part.arguments)
        assert part.name in (None, "f") and part.end is None
    assert value_end('"a\\"b" x', 0) == 6 and value_end("[1, [2]", 0) is None and value_end("12,", 0) == 2
    assert not scan_call("[1]", 0).valid and not scan_call('{"name": 3}', 0).valid


def test_parser_choice():
    by_name = {t.name: t for t in BUILTIN_TEMPLATES}
    assert detect_parser_name(by_name["chatml"]) == "hermes"
    assert detect_parser_name(by_name["llama-3"]) == "llama3_json"
    assert detect_parser_name(by_name["vicuna"]) == "hermes"  # the default

    class Template:
        tool_parser = None
        source_text = "{% if tools %}...[TOOL_CALLS]...{% endif %}"

    assert detect_parser_name(Template()) == "mistral"
    Template.source_text = "{% for tool in tools %}...<tool_call>\n<function={{ name }}>..."
    assert detect_parser_name(Template()) == "qwen3_coder"
    assert parser_class("hermes").__name__ == "HermesParser"
    assert parser_class("rxf.entrypoints.chat.tool_parsers.forced:RequiredCallsParser") is RequiredCallsParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        parser_class("nope")
    with pytest.raises(ValueError, match="not a ToolCallParser subclass"):
        parser_class("json:JSONDecoder")
