"""The OpenAI layer's translation, without a server: request models, OpenAI -> native parameters,
responses and stream events (driven by a scripted TokenizerManager)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from rxf.core.tokenizer_manager import GenerateRequest
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.logprobs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs
from rxf.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, Delta, TokenizeRequest
from rxf.entrypoints.openai.sampling import check_model, max_new_tokens, native_params, verify_native
from rxf.entrypoints.openai.serving_chat import chat_events, chat_response, plan_chat
from rxf.entrypoints.openai.serving_completions import completion_events, completion_response, plan_completion
from rxf.entrypoints.openai.sse import sse_response
from rxf.entrypoints.openai.tokenize import prompt_text
from rxf.entrypoints.server_state import APIError
from rxf.plugins.chat_templates.base import HFChatTemplate
from rxf.testing.checkpoints import make_tiny_tokenizer

CTX, VOCAB = 64, 512


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def template(tok):
    return HFChatTemplate(tok)


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def api_error(fn, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


# ---- request models ----
@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("n", 2.0),
        ("n", True),
        ("max_tokens", "16"),
        ("stream", "yes"),
        ("stop", 3),
        ("logprobs", True),
        ("logit_bias", {"1": "x"}),
        ("seed", 1.5),
        ("prompt", [1, "a"]),
        ("prompt", 5),
    ],
)
def test_wrong_types_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValidationError) as info:
        completion(**{field: value})
    assert all(err["loc"][0] == field for err in info.value.errors())


def test_null_means_absent_and_unknown_fields_are_ignored():
    req = completion(n=None, temperature=None, stream=None, foo="bar", best_of=None)
    assert (req.n, req.temperature, req.stream) == (1, 1.0, False)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": None, "prompt": "x"})  # required stays required
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m"})


def test_prompt_forms(tok):
    for prompt, count in [("x", 1), (["x", "y", "z"], 3), ([5, 6, 7], 1), ([[5, 6], [7]], 2)]:
        plan = plan_completion(completion(prompt=prompt, n=2), tok, CTX, VOCAB)
        assert len(plan.prompts) == count and len(plan.reqs) == 2 * count
    plan = plan_completion(completion(prompt=[[5, 6], [7, 8, 9]], n=3), tok, CTX, VOCAB)
    assert [r.input_ids for r in plan.reqs] == [[5, 6]] * 3 + [[7, 8, 9]] * 3
    assert [r.rid for r in plan.reqs] == [f"{plan.id}-{k}" for k in range(6)]
    assert plan_completion(completion(prompt="hi"), tok, CTX, VOCAB).reqs[0].input_ids == tok.encode("hi")


@pytest.mark.parametrize("prompt", [[], [[]], [[1, VOCAB]], [[-1]], "", ["a", ""]])
def test_bad_prompts(tok, prompt):
    assert api_error(plan_completion, completion(prompt=prompt), tok, CTX, VOCAB).param == "prompt"


# ---- OpenAI -> native ----
def test_every_field_maps_to_the_native_params(tok):
    req = completion(
        temperature=0.5,
        top_p=0.9,
        stop="##",
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"17": -100, "3": 2.5},
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        stop_token_ids=[9],
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        no_stop_trim=True,
        min_tokens=2,
        user="u",
        max_tokens=8,
    )
    plan = plan_completion(req, tok, CTX, VOCAB)
    assert plan.reqs[0].sampling_params == {
        "max_new_tokens": 8,
        "min_new_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["##"],
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {17: -100.0, 3: 2.5},
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "ignore_eos": True,
        "stop_token_ids": [9],
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    assert plan.reqs[0].stream is False and plan.reqs[0].return_logprob is False


def test_defaults_leave_engine_defaults(tok):
    params = native_params(completion(), 16)
    assert params["max_new_tokens"] == 16 and "stop" not in params and "seed" not in params
    assert not {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "logit_bias"} & params.keys()


def test_n_choices_get_distinct_seeds(tok):
    plan = plan_completion(completion(n=3, seed=10, stream=True), tok, CTX, VOCAB)
    assert [r.sampling_params["seed"] for r in plan.reqs] == [10, 11, 12]
    assert all(r.stream for r in plan.reqs)
    plan = plan_completion(completion(n=2), tok, CTX, VOCAB)
    assert all("seed" not in r.sampling_params for r in plan.reqs)


def test_logprob_options(tok):
    req = plan_completion(completion(logprobs=3), tok, CTX, VOCAB).reqs[0]
    assert (req.return_logprob, req.top_logprobs_num, req.logprob_start_len) == (True, 3, -1)
    req = plan_completion(completion(logprobs=0, echo=True), tok, CTX, VOCAB).reqs[0]
    assert (req.return_logprob, req.top_logprobs_num, req.logprob_start_len) == (True, 0, 0)
    req = plan_chat(chat(logprobs=True, top_logprobs=4), tok, _template(), CTX, VOCAB).reqs[0]
    assert (req.return_logprob, req.top_logprobs_num) == (True, 4)


def _template():
    return HFChatTemplate(make_tiny_tokenizer(VOCAB))


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": CTX}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"regex": "a+", "ebnf": "root ::= x"}, "ebnf"),
        ({"json_schema": {}, "guided_regex": "a"}, "guided_regex"),
        ({"structural_tag": {}}, "structural_tag"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"lora_path": "x"}, "lora_path"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_completion_errors_name_their_param(tok, fields, param):
    error = api_error(plan_completion, completion(**fields), tok, CTX, VOCAB)
    assert (error.status, error.param) == (400, param)
    assert "sampling_params" not in error.message


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "at most one"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "unique"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"max_completion_tokens": 1000}, "max_completion_tokens", f"context length {CTX}"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
            "images are not supported",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
        ({"messages": [{"role": "user", "content": "word " * 100}]}, "messages", "context length"),
    ],
)
def test_chat_errors_name_their_param(tok, template, fields, param, words):
    error = api_error(plan_chat, chat(**fields), tok, template, CTX, VOCAB)
    assert (error.status, error.param) == (400, param) and words in error.message


def test_chat_accepts_what_it_may_ignore(tok, template):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for fields in (
        {"tools": tools, "tool_choice": "none"},
        {"tools": []},
        {"response_format": {"type": "text"}},
        {"tool_choice": "auto"},
    ):
        plan_chat(chat(**fields), tok, template, CTX, VOCAB)


def test_context_budget():
    assert max_new_tokens(None, "max_tokens", 16, 10, 64, "prompt") == 16
    assert max_new_tokens(None, "max_tokens", 16, 60, 64, "prompt") == 4  # a default is cut to fit
    assert max_new_tokens(None, "max_tokens", None, 10, 64, "messages") == 54
    assert max_new_tokens(54, "max_tokens", 16, 10, 64, "prompt") == 54
    error = api_error(max_new_tokens, 55, "max_tokens", 16, 10, 64, "prompt")
    assert error.param == "max_tokens" and "10" in error.message and "64" in error.message
    assert api_error(max_new_tokens, None, "max_tokens", 16, 64, 64, "prompt").param == "prompt"


def test_chat_prompt_and_template_stops(tok):
    class StopTemplate(HFChatTemplate):
        pass

    template = StopTemplate(tok, stop_strings=("<|im_end|>",))
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        stop=["x"],
        max_tokens=5,
        max_completion_tokens=7,
        n=2,
    )
    plan = plan_chat(req, tok, template, CTX, VOCAB)
    rendered = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    assert plan.ids == tok.encode(rendered, add_special_tokens=False)
    assert plan.params["stop"] == ["x", "<|im_end|>"] and plan.params["max_new_tokens"] == 7
    assert len(plan.reqs) == 2
    assert plan_chat(chat(), tok, template, CTX, VOCAB).params["max_new_tokens"] == CTX - len(
        tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    )


def test_model_name():
    check_model("m", "m")
    check_model(None, "m")  # tokenize's model is optional
    error = api_error(check_model, "other", "m")
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


def test_verify_native_translates_names():
    error = api_error(verify_native, {"max_new_tokens": 2, "min_new_tokens": 3}, VOCAB)
    assert error.param == "min_tokens" and error.message.startswith("min_tokens")


def test_tokenize_bodies(template):
    assert prompt_text(TokenizeRequest(prompt="hi"), template) == ("hi", True)
    assert prompt_text(TokenizeRequest(prompt="hi", add_special_tokens=False), template) == ("hi", False)
    text, special = prompt_text(
        TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}), template
    )
    assert text.endswith("<|im_start|>assistant\n") and special is False
    assert api_error(prompt_text, TokenizeRequest(), template).status == 400


# ---- logprobs ----
def _strs(token_id: int) -> str:
    return {1: "a", 2: "bc", 3: "é"}.get(token_id, "?")


def test_completion_logprobs_shape():
    out, end = completion_logprobs(
        [(None, 1), (-0.5, 2), (-math.inf, 3)], [[], [(-0.5, 2), (-1.0, 1)], [(-1, 3)]], _strs, 4
    )
    assert out.tokens == ["a", "bc", "é"] and end == 8
    assert out.token_logprobs == [None, -0.5, LOGPROB_FLOOR]
    assert out.top_logprobs == [None, {"bc": -0.5, "a": -1.0}, {"é": -1.0}]
    assert out.text_offset == [4, 5, 7]


def test_chat_logprobs_shape():
    (entry,) = chat_logprobs([(-0.25, 3)], [[(-0.25, 3), (-2.0, 1)]], _strs)
    assert (entry.token, entry.logprob, entry.bytes) == ("é", -0.25, [0xC3, 0xA9])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("é", -0.25), ("a", -2.0)]


# ---- responses and streams, from a scripted engine ----
def _meta(
    prompt: int, done: int, cached: int = 0, finish: dict | None = None, **logprobs: Any
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "cached_tokens": cached,
        "finish_reason": finish,
        **logprobs,
    }


class ScriptedTM:
    """Answers each request with `script(req)` (a list of chunks), records aborts; `hang` blocks
    after the first chunk until cancelled."""

    def __init__(self, script, hang: bool = False) -> None:
        self.script, self.hang, self.aborted, self.seen = script, hang, [], []

    async def generate(self, req: GenerateRequest):
        self.seen.append(req)
        finished = False
        try:
            for chunk in self.script(req):
                yield chunk
                await asyncio.sleep(0)
                if self.hang:
                    await asyncio.Event().wait()
            finished = True
        finally:
            if not finished:
                self.aborted.append(req.rid)


def _stream_script(req: GenerateRequest) -> list[dict[str, Any]]:
    k = int(req.rid.rsplit("-", 1)[1])
    return [
        {
            "text": f"<{k}",
            "output_ids": [1],
            "meta_info": _meta(5, 1, 4, output_token_logprobs=[(-0.1, 1)], output_top_logprobs=[[(-0.1, 1)]]),
        },
        {
            "text": "",
            "output_ids": [2],
            "meta_info": _meta(5, 2, 4, output_token_logprobs=[], output_top_logprobs=[]),
        },
        {
            "text": ">",
            "output_ids": [3],
            "meta_info": _meta(
                5,
                3,
                4,
                {"type": "length"},
                output_token_logprobs=[(-0.2, 3)],
                output_top_logprobs=[[(-0.2, 3)]],
            ),
        },
    ]


async def _drain(agen) -> list[Any]:
    out = []
    async with contextlib.aclosing(agen) as events:
        async for item in events:
            out.append(item)
    return out


def _payloads(events: list[str]) -> list[Any]:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [
        e[len("data: ") : -2] if e == "data: [DONE]\n\n" else json.loads(e[len("data: ") :]) for e in events
    ]


def test_chat_stream_events(tok, template):
    plan = plan_chat(chat(n=2, stream=True, logprobs=True), tok, template, CTX, VOCAB)
    tm = ScriptedTM(_stream_script)
    chunks = _payloads(asyncio.run(_drain(chat_events(tm, plan, _strs, "m", include_usage=True))))
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == f"<{i}>"
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in mine) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert all("usage" not in c for c in chunks[:-1]) and tm.aborted == []


def test_completion_stream_echo_and_no_usage(tok):
    plan = plan_completion(completion(prompt=["p", "q"], stream=True, echo=True, logprobs=1), tok, CTX, VOCAB)
    chunks = _payloads(
        asyncio.run(_drain(completion_events(ScriptedTM(_stream_script), plan, _strs, "m", False)))
    )
    for k, prompt in enumerate("pq"):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == f"{prompt}<{k}>"
        assert mine[-1]["logprobs"]["text_offset"] == [len(f"{prompt}<{k}")]
    assert all("usage" not in c for c in chunks)


def test_completion_response_echo_logprobs_and_usage(tok):
    plan = plan_completion(completion(prompt=[[5, 6], [7]], n=2, echo=True, logprobs=1), tok, CTX, VOCAB)
    results = [
        {
            "text": "bc",
            "output_ids": [2],
            "meta_info": _meta(
                2,
                1,
                k,
                {"type": "stop", "matched": 2},
                output_token_logprobs=[(-0.5, 2)],
                output_top_logprobs=[[(-0.5, 2)]],
                input_token_logprobs=[(None, 1), (-1.5, 1)],
                input_top_logprobs=[[], [(-1.0, 2)]],
            ),
        }
        for k in range(4)
    ]
    response = completion_response(plan, results, _strs, "m")
    choice = response.choices[0]
    echo = tok.decode([5, 6], skip_special_tokens=False)
    assert choice.text == echo + "bc" and choice.finish_reason == "stop"
    assert choice.logprobs.tokens == ["a", "a", "bc"] and choice.logprobs.token_logprobs == [None, -1.5, -0.5]
    assert choice.logprobs.top_logprobs == [None, {"bc": -1.0}, {"bc": -0.5}]
    assert choice.logprobs.text_offset == [0, 1, len(echo)]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.model_dump() == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 1 + 3},
    }


def test_chat_response(tok, template):
    plan = plan_chat(chat(logprobs=True), tok, template, CTX, VOCAB)
    result = {
        "text": "bc",
        "output_ids": [2],
        "meta_info": _meta(
            9, 1, 0, {"type": "stop"}, output_token_logprobs=[(-0.5, 2)], output_top_logprobs=[[]]
        ),
    }
    response = chat_response(plan, [result], _strs, "m").model_dump()
    assert response["choices"][0]["message"] == {"role": "assistant", "content": "bc"}
    assert response["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert response["object"] == "chat.completion" and response["usage"]["total_tokens"] == 10


def test_engine_abort_is_an_error_and_aborts_the_rest(tok):
    def script(req):
        if req.rid.endswith("-1"):
            return [
                {
                    "text": "",
                    "output_ids": [],
                    "meta_info": _meta(5, 0, 0, {"type": "abort", "message": "no room"}),
                }
            ]
        return _stream_script(req)

    plan = plan_completion(completion(n=2, stream=True), tok, CTX, VOCAB)
    tm = ScriptedTM(script, hang=True)

    async def run() -> APIError:
        with pytest.raises(APIError) as info:
            await _drain(completion_events(tm, plan, _strs, "m", False))
        await asyncio.sleep(0.01)  # the request tasks run their cleanup
        return info.value

    error = asyncio.run(run())
    assert error.status == 500 and "no room" in error.message
    assert f"{plan.id}-0" in tm.aborted  # the healthy choice, still running, was aborted


def test_error_mid_stream_becomes_an_event_then_done(tok):
    plan = plan_completion(completion(stream=True), tok, CTX, VOCAB)
    tm = ScriptedTM(
        lambda req: [{"text": "x", "output_ids": [], "meta_info": _meta(1, 1, 0, {"type": "abort"})}]
    )
    response = sse_response(completion_events(tm, plan, _strs, "m", False))
    events = _payloads(asyncio.run(_drain(response.body_iterator)))
    assert events[0]["error"]["code"] == "request_aborted" and events[-1] == "[DONE]"


def test_closing_a_stream_aborts_every_engine_request(tok, template):
    """A client hanging up closes (or cancels) the event generator: each native request must see
    its generator cancelled, which is what sends the abort to the scheduler."""
    plan = plan_chat(chat(n=3, stream=True), tok, template, CTX, VOCAB)
    tm = ScriptedTM(_stream_script, hang=True)

    async def read_some_then_hang_up() -> None:
        events = sse_response(chat_events(tm, plan, _strs, "m", False)).body_iterator
        for _ in range(5):
            await anext(events)
        await events.aclose()
        await asyncio.sleep(0.01)  # the request tasks run their cleanup

    asyncio.run(read_some_then_hang_up())
    assert sorted(tm.aborted) == sorted(r.rid for r in plan.reqs)

    async def cancel_mid_read() -> None:
        tm.aborted.clear()
        events = chat_events(tm, plan, _strs, "m", False)
        task = asyncio.create_task(_drain(events))
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)

    asyncio.run(cancel_mid_read())
    assert sorted(tm.aborted) == sorted(r.rid for r in plan.reqs)


def test_warm_prefixes_prefills_only(tok):
    tm = ScriptedTM(
        lambda req: [{"text": "", "output_ids": [], "meta_info": _meta(3, 0, 0, {"type": "length"})}]
    )
    asyncio.run(gen.warm_prefixes(tm, [[1, 2], [3]], {"max_new_tokens": 9, "min_new_tokens": 2, "seed": 1}))
    assert [r.input_ids for r in tm.seen] == [[1, 2], [3]]
    assert all(
        r.sampling_params["max_new_tokens"] == 0 == r.sampling_params["min_new_tokens"] for r in tm.seen
    )


def test_delta_omits_what_it_lacks():
    assert Delta().model_dump_json() == "{}" and Delta(content="x").model_dump_json() == '{"content":"x"}'
