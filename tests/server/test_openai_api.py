"""The OpenAI-compatible routes end to end: the real server (tiny random Llama on the CPU) driven by
the official `openai` client, and by httpx where the raw SSE stream matters."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

DATA = Path(__file__).parent / "data"
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded except the final "[DONE]"."""
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def post_stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


def assert_serving(client: OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="still there?", max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


# ---- models, tokenize ----
def test_models(client, model, http, server):
    assert [m.id for m in client.models.list().data] == [model]
    card = http.get(f"/v1/models/{model}").json()
    assert card["id"] == model and card["object"] == "model" and card["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tokenize_round_trip(http, model):
    text = "Hello world, 你好 🚀"
    tokens = http.post("/v1/tokenize", json={"model": model, "prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    assert (
        http.post("/v1/detokenize", json={"model": model, "tokens": tokens["tokens"]})
        .json()["prompt"]
        .endswith(text)
    )
    bare = http.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/v1/detokenize", json={"tokens": bare}).json() == {"prompt": text}
    chat = http.post(
        "/v1/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}
    ).json()
    rendered = http.post("/v1/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for path, body in [
        ("/v1/tokenize", {"prompt": "x", "model": "other"}),
        ("/v1/detokenize", {"tokens": [10**6]}),
        ("/v1/tokenize", {}),
        ("/v1/detokenize", {"tokens": "x"}),
    ]:
        assert http.post(path, json=body).status_code in (400, 404)


def test_root_tokenize_routes_in_vllms_shapes(http, model, tiny_model_dir):
    """vLLM serves /tokenize and /detokenize at the root: the same bodies as /v1's, checked
    against the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Hello world, 你好"
    out = http.post("/tokenize", json={"model": model, "prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert out == {
        "count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)
    }
    messages = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    assert http.post("/tokenize", json=messages).json() == http.post("/v1/tokenize", json=messages).json()
    assert http.post("/detokenize", json={"model": model, "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    for path, body, status, param in [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text


# ---- completions ----
def test_generative_model_refuses_embeddings(client, model):
    """It says how to serve embeddings (tests/server/test_embeddings.py serves them)."""
    with pytest.raises(openai.BadRequestError, match="model.task = 'embed'") as err:
        client.embeddings.create(model=model, input="Hi")
    assert err.value.body["param"] == "model"


def test_completion_basics(client, model):
    out = client.completions.create(model=model, prompt="hello world", **GREEDY)
    assert out.object == "text_completion" and out.model == model and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    usage = out.usage
    assert usage.completion_tokens == 16  # OpenAI's default max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_repeated_prompt_hits_the_cache(client, model):
    prompt = "a prompt long enough to be worth caching: the quick brown fox jumps over the lazy dog"
    client.completions.create(model=model, prompt=prompt, max_tokens=1, **GREEDY)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1, **GREEDY).usage
    assert again.prompt_tokens_details.cached_tokens >= again.prompt_tokens - 1


def test_completion_stream_equals_non_stream(client, model, http):
    kwargs = {"model": model, "prompt": "Once upon a time", "max_tokens": 24, **GREEDY}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert all(c.usage is None for c in chunks)
    raw = post_stream(
        http, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 3, "stream": True}
    )
    assert raw[-1] == "[DONE]" and not any("usage" in e for e in raw[:-1])


def test_completion_stream_usage_only_when_asked(client, model):
    chunks = list(
        client.completions.create(
            model=model,
            prompt="count with me",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None and len(c.choices) == 1 for c in body)


def test_every_stream_starts_with_output(client, model, http):
    """No streamed route sends a chunk before there is output: a client timing the first chunk
    (vLLM's benchmark does) times the first token. Chat's role comes with it."""
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, stream=True, **GREEDY)
    first = next(iter(chat)).choices[0].delta
    assert first.role == "assistant" and first.content
    completion = client.completions.create(model=model, prompt="Once", max_tokens=4, stream=True, **GREEDY)
    assert next(iter(completion)).choices[0].text
    native = post_stream(
        http, "/generate", {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    )
    assert native[0]["output_ids"] and native[0]["text"]


def test_n_choices_share_the_prompt_prefill(client, model):
    prompt = "n choices of one prompt that is long enough to share: she sells sea shells by the sea shore"
    sampled = {"temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=6, **sampled)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 18
    single = client.completions.create(model=model, prompt=prompt, max_tokens=6, **sampled)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert out.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 1
    assert out.choices[0].text == single.choices[0].text  # choice 0 keeps the client's seed
    streamed = list(
        client.completions.create(model=model, prompt=prompt, n=3, max_tokens=6, stream=True, **GREEDY)
    )
    finishes = [
        (c.choices[0].index, c.choices[0].finish_reason) for c in streamed if c.choices[0].finish_reason
    ]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]


def test_batch_and_token_id_prompts(client, model, http):
    prompts = ["first prompt", "the second, longer prompt"]
    ids = [http.post("/v1/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    by_text = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=ids, n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert by_text.choices[0].text == by_text.choices[1].text != by_text.choices[2].text
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert by_text.usage.completion_tokens == 4 * 4
    one = client.completions.create(model=model, prompt=ids[1], max_tokens=4, **GREEDY)
    assert one.choices[0].text == by_text.choices[2].text


def test_completion_logprobs(client, model):
    out = client.completions.create(model=model, prompt="logprobs please", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4) and top.get(token) == pytest.approx(
            logprob, abs=1e-4
        )
    streamed = list(
        client.completions.create(
            model=model, prompt="logprobs please", max_tokens=6, logprobs=3, stream=True, **GREEDY
        )
    )
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed), []) == pytest.approx(
        lp.token_logprobs
    )


def test_completion_text_offset_skips_what_the_text_skips(client, model, tiny_model_dir):
    """Special tokens the choice's text leaves out take no room in it: every offset indexes the
    text (they ran past its end, by the special tokens' own text, when not streamed)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    special = tokenizer.all_special_ids[0]
    out = client.completions.create(model=model, prompt=[7], max_tokens=4, echo=True, logprobs=1,
                                    logit_bias={str(special): 100}, **GREEDY)
    choice = out.choices[0]
    generated = choice.logprobs.text_offset[1:]
    assert choice.logprobs.tokens[1:] == [tokenizer.decode([special])] * 4
    assert generated == [len(choice.text)] * 4, (choice.text, choice.logprobs.text_offset)


def test_echo(client, model):
    prompt = "echo this prompt"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True, **GREEDY)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, **GREEDY)
    assert out.choices[0].text == prompt + plain.choices[0].text
    with_lp = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, echo=True, logprobs=2, **GREEDY
    )
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == with_lp.usage.prompt_tokens + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[-3] == len(prompt)  # generated tokens index the echoed text
    streamed = list(
        client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    scored = client.completions.create(
        model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0


def test_stop_strings_and_stop_tokens(client, model):
    base = client.completions.create(model=model, prompt="stop strings", max_tokens=16, logprobs=0, **GREEDY)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for stream in (False, True):
        out = client.completions.create(
            model=model, prompt="stop strings", max_tokens=16, stop=[stop, "\x00"], stream=stream, **GREEDY
        )
        chunks = list(out) if stream else [out]
        got = "".join(c.choices[0].text for c in chunks)
        assert got == text[: text.index(stop)] and [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    # logit_bias forces token 300 at every step; as a stop token it ends the completion at once.
    out = client.completions.create(
        model=model,
        prompt="stop strings",
        max_tokens=16,
        logit_bias={"300": 100},
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [300]},
    )
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1


def test_sampling_fields(client, model):
    kwargs = {"model": model, "prompt": "sample", "max_tokens": 8, "temperature": 1.0}
    a = client.completions.create(seed=1, **kwargs).choices[0].text
    assert client.completions.create(seed=1, **kwargs).choices[0].text == a
    banned = client.completions.create(
        presence_penalty=1.5,
        frequency_penalty=1.0,
        top_p=0.9,
        user="someone",
        seed=3,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.3,
            "min_tokens": 8,
            "ignore_eos": False,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
        },
        **kwargs,
    )
    assert banned.usage.completion_tokens == 8
    forced = client.completions.create(
        model=model, prompt="bias", max_tokens=5, logit_bias={"300": 100}, logprobs=0, **GREEDY
    )
    assert forced.choices[0].text == forced.choices[0].logprobs.tokens[0] * 5


# ---- chat ----
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_chat_basics(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]}
    ]
    assert (
        client.chat.completions.create(
            model=model, messages=parts, max_completion_tokens=3, **GREEDY
        ).usage.completion_tokens
        == 3
    )
    default = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert default.usage.prompt_tokens + default.usage.completion_tokens == 512  # up to the context length


def test_chat_stream(client, model):
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 12, **GREEDY}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(stream=True, n=2, stream_options={"include_usage": True}, **kwargs)
    )
    *body, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 24
    for i in range(2):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        # The role comes with the choice's first token, in its first chunk (as vLLM streams).
        assert mine[0].delta.role == "assistant" and mine[0].delta.content
        assert all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == full
        assert [c.finish_reason for c in mine].count("length") == 1 and mine[-1].finish_reason == "length"


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=4, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 4 and t.top_logprobs[0].token == t.token
        assert (
            t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
            and bytes(t.bytes).decode() == t.token
        )
    bare = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, logprobs=True, **GREEDY
    )
    assert all(t.top_logprobs == [] for t in bare.choices[0].logprobs.content)


def test_chat_n_and_cache(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, n=4, max_tokens=3, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_accepts_ignorable_fields(client, model):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
        max_tokens=2,
        response_format={"type": "text"},
        tools=tools,
        tool_choice="none",
        user="u",
        seed=3,
        **GREEDY,
    )
    assert out.usage.completion_tokens == 2


# ---- errors ----
COMPLETION_ERRORS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"temperature": 101}, "temperature"),  # the engine's [0, 100] (no OpenAI cap of 2, as vLLM and SGLang)
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 10**6]]}, "prompt"),
    ({"prompt": ""}, "prompt"),  # the tiny tokenizer adds no BOS: no tokens at all
    ({"prompt": "word " * 600}, "prompt"),
    ({"extra_body": {"regex": "[a-z]+", "ebnf": 'root ::= "a"'}}, "ebnf"),
    ({"extra_body": {"top_k": -3}}, "top_k"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"frequency_penalty": 9}, "frequency_penalty"),
    ({"extra_body": {"temperature": "hot"}}, "temperature"),
    ({"extra_body": {"n": "2"}}, "n"),
    ({"extra_body": {"priority": 1}}, "priority"),  # only under scheduler.policy = "priority", as vLLM
]


@pytest.mark.parametrize("fields, param", COMPLETION_ERRORS)
def test_completion_errors(client, model, fields, param):
    fields = {"prompt": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, **fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert_serving(client, model)


CHAT_ERRORS = [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]},
        "messages",
    ),
    ({"messages": [{"role": "nobody", "content": "x"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"),
]


@pytest.mark.parametrize("fields, param", CHAT_ERRORS)
def test_chat_errors(client, model, fields, param):
    fields = {"messages": MESSAGES, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, **fields)
    assert info.value.body["param"] == param, info.value.body
    assert_serving(client, model)


def test_unknown_model_and_missing_fields(client, model, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"model": model})]:
        response = http.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert_serving(client, model)


def _idle(http: httpx.Client) -> bool:
    stats = http.get("/get_server_info").json()["stats"]
    return stats["num_running"] == stats["num_waiting"] == stats["in_flight"] == 0


def test_client_disconnect_aborts_the_stream(model, http, client):
    body = {
        "model": model,
        "prompt": "go on forever",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.monotonic()
    http.post("/v1/completions", json=body).raise_for_status()
    full_s = time.monotonic() - start  # how long the whole generation takes on this machine
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        assert all(json.loads(next(events)[6:])["choices"] for _ in range(3))
    # Leaving the block closed the connection after 3 events; the scheduler must drop the request
    # at once rather than generate the remaining tokens for nobody.
    hung_up = time.monotonic()
    while not _idle(http):
        assert time.monotonic() - hung_up < full_s / 2, "the request kept running after the client left"
        time.sleep(0.01)
    assert_serving(client, model)


# ---- what benchmark tools send ----
@pytest.mark.parametrize("path", sorted(DATA.glob("*.json")), ids=lambda p: p.stem)
def test_recorded_benchmark_bodies(path, model, http):
    body = json.loads(path.read_text())["body"] | {"model": model}
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    events = post_stream(http, route, body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    if "messages" in body:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    *running, last = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(f is None for f in running) and last in ("stop", "length")
    assert text or last == "stop"
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == [] and usage["completion_tokens"] == body.get(
            "max_tokens", body.get("max_completion_tokens")
        )
