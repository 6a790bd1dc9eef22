"""Reasoning output through the server: a tiny checkpoint served with a chat template that thinks
(it opens a `<think>` block after the generation prompt, as DeepSeek-R1's does, unless
`chat_template_kwargs` turns `enable_thinking` off, as Qwen3's does). The reasoning parser is
detected from the template. The reference is the same prompt, rendered by transformers from the
same template, sent raw to /v1/completions: its text is the reply's reasoning, or its content.
The same reply read by /v1/responses is a reasoning item and a message, by /v1/messages a thinking
block and a text block (`thinking` sets `enable_thinking`), through the `openai` and `anthropic` SDKs.

A recorded reply (reasoning, then a qwen3_coder tool call) is forced on the random model by a
`regex` of its exact text, so the server's own reading of it is checked end to end."""

from __future__ import annotations

import json

import anthropic
import pytest
from openai import BadRequestError, OpenAI
from transformers import AutoTokenizer

THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "How many shells does she sell?"}]
PARAMS = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(module_server_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    return module_server_factory({
        "model.chat_template": str(template), "model.served_model_name": "thinker",
        "model.tool_call_parser": "qwen3_coder",
    })


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def raw_completion(client, tiny_model_dir, **variables) -> str:
    """What the model writes after the prompt that transformers renders from the template."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(
        MESSAGES, chat_template=THINKING_TEMPLATE, tokenize=False, add_generation_prompt=True, **variables
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return client.completions.create(model="thinker", prompt=ids, **PARAMS).choices[0].text


def chat(client, stream: bool, **extra):
    body = {"chat_template_kwargs": extra} if extra else None
    return client.chat.completions.create(
        model="thinker", messages=MESSAGES, stream=stream, extra_body=body, **PARAMS
    )


def streamed(client, **extra) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in chat(client, True, **extra):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    return reasoning, content


def test_reasoning_content_while_thinking(client, tiny_model_dir):
    raw = raw_completion(client, tiny_model_dir)
    thought, closed, after = raw.partition("</think>")  # the model may (rarely) close the block
    assert thought.strip()  # the tiny model writes something
    message = chat(client, False).choices[0].message
    assert message.reasoning_content == thought.strip()
    assert (message.content or "") == (after.lstrip() if closed else "")
    assert streamed(client) == (thought.strip(), after.lstrip() if closed else "")


def test_chat_template_kwargs_turn_thinking_off(client, tiny_model_dir):
    raw = raw_completion(client, tiny_model_dir, enable_thinking=False)
    assert raw
    message = chat(client, False, enable_thinking=False).choices[0].message
    assert message.content == raw and getattr(message, "reasoning_content", None) is None
    assert streamed(client, enable_thinking=False) == ("", raw)


def expected_reply(client, tiny_model_dir, **variables) -> tuple[str | None, str, bool]:
    """The (reasoning, content) that the raw completion of the rendered prompt reads as, and
    whether the reasoning was closed."""
    raw = raw_completion(client, tiny_model_dir, **variables)
    if variables.get("enable_thinking") is False:
        return None, raw, False
    thought, closed, after = raw.partition("</think>")  # the model may (rarely) close the block
    assert thought.strip()  # the tiny model writes something
    return thought.strip(), after.lstrip() if closed else "", bool(closed)


def test_responses_reasoning_item(client, tiny_model_dir):
    reasoning, content, closed = expected_reply(client, tiny_model_dir)
    args = {"model": "thinker", "input": MESSAGES[0]["content"], "temperature": 0, "max_output_tokens": 12,
            "reasoning": {"effort": "low"}}
    response = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    streamed = events[-1].response  # response.incomplete: the 12 tokens cut the reply short
    assert response.status == streamed.status == "incomplete"
    for got in (response, streamed):
        item, message = got.output[0], got.output[-1]
        assert item.type == "reasoning" and [part.text for part in item.content] == [reasoning]
        assert message.type == "message" and message.content[0].text == content
        # Every output token wrote reasoning, or those before the end marker did.
        tokens = got.usage.output_tokens_details.reasoning_tokens
        assert 0 < tokens < got.usage.output_tokens if closed else tokens == got.usage.output_tokens
    assert "".join(deltas) == reasoning
    assert len(streamed.output) == len(response.output) and streamed.usage == response.usage


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("thinking", [True, False])
def test_messages_thinking_block(client, claude, tiny_model_dir, thinking):
    """`thinking` enabled: a thinking block, then the text; disabled or left out: the template's
    thinking is off, so the reply is text only."""
    reasoning, content, _ = expected_reply(client, tiny_model_dir, enable_thinking=thinking)
    switch = [{"thinking": {"type": "enabled", "budget_tokens": 1024}}] if thinking else [
        {"thinking": {"type": "disabled"}}, {}]
    for extra in switch:
        args = {"model": "thinker", "messages": MESSAGES, "max_tokens": 12, "extra_body": {"temperature": 0}, **extra}
        message = claude.messages.create(**args)
        with claude.messages.stream(**args) as stream:
            streamed = stream.get_final_message()
        for got in (message, streamed):
            blocks = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in got.content]
            assert blocks == [("thinking", reasoning)] * thinking + [("text", content)] * bool(content)


def test_bad_template_variables_are_400s(client):
    with pytest.raises(BadRequestError) as err:
        chat(client, False, add_generation_prompt=False)
    assert err.value.body["param"] == "chat_template_kwargs" and "set by the server" in err.value.body["message"]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="thinker", messages=MESSAGES, reasoning_effort="extreme", **PARAMS)
    assert err.value.body["param"] == "reasoning_effort"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
RECORDED = (
    "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def literal_regex(text: str) -> str:
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def test_recorded_reply_with_reasoning_and_a_call(client):
    body = {"chat_template_kwargs": {"enable_thinking": False}, "regex": literal_regex(RECORDED)}
    args = {"model": "thinker", "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
            "extra_body": body}
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.message.reasoning_content == "The user wants the weather."
    assert not choice.message.content and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    reasoning, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            assert not delta.content
            arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
            finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, arguments, finish) == ("The user wants the weather.", call.function.arguments, "tool_calls")


HARMONY_RECORDED = (
    "<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
)


@pytest.fixture(scope="module")
def harmony_client(module_server_factory):
    """The tiny checkpoint read as gpt-oss's harmony (its chatml template names no format)."""
    server = module_server_factory({
        "model.served_model_name": "oss", "model.reasoning_parser": "harmony", "model.tool_call_parser": "harmony",
    })
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_recorded_harmony_reply(harmony_client, stream):
    args = {"model": "oss", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "stream": stream,
            "extra_body": {"regex": literal_regex(HARMONY_RECORDED)}}
    if not stream:
        choice = harmony_client.chat.completions.create(**args).choices[0]
        (call,) = choice.message.tool_calls
        got = (choice.message.reasoning_content, choice.message.content, call.function.name, call.function.arguments)
    else:
        reasoning, content, names, arguments = "", "", [], ""
        for chunk in harmony_client.chat.completions.create(**args):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                names += [c.function.name for c in choice.delta.tool_calls or [] if c.function.name]
                arguments += "".join(c.function.arguments or "" for c in choice.delta.tool_calls or [])
        got = (reasoning, content or None, *names, arguments)
    assert got == ("Need the weather in Paris.", None, "get_weather", '{"city": "Paris", "days": 3}')
    assert choice.finish_reason == "tool_calls"


# A model-style reply in each of the other formats, read back by a server that serves it
# (`model.tool_call_parser`): the same call, whole and streamed.
FORMAT_RECORDED = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "pythonic": '[get_weather(city="Paris", days=3)]',
    # V3.1's form (V3's adds a "function" type and a json fence: over the tiny model's 512-token
    # context beside the tools' system prompt, in its byte-level tokens).
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
}


@pytest.mark.parametrize("fmt", list(FORMAT_RECORDED))
def test_recorded_call_of_each_format(module_server_factory, fmt):
    server = module_server_factory({"model.served_model_name": fmt, "model.tool_call_parser": fmt})
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    args = {"model": fmt, "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
            "extra_body": {"regex": literal_regex(FORMAT_RECORDED[fmt])}}
    out = client.chat.completions.create(**args)
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    assert not choice.message.content and choice.finish_reason == "tool_calls", out.usage
    names, arguments, content = [], "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            names += [t.function.name for t in c.delta.tool_calls or [] if t.function.name]
            arguments += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
    assert (names, json.loads(arguments), content) == (["get_weather"], {"city": "Paris", "days": 3}, "")
