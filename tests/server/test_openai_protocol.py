"""The OpenAI layer's translation, without a server: request models, OpenAI -> native requests
(prepared by the engine's RequestPreparer, as the routes do), responses and stream events (driven by
a scripted TokenizerManager)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from rxf.core.frontend.outputs import GenerateOutput, Logprobs
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.ipc.messages import FinishReason, PreparedRequest
from rxf.core.sampling_params import SamplingParams
from rxf.entrypoints.choices import warm_prefixes
from rxf.entrypoints.openai import serving_chat, serving_completions
from rxf.entrypoints.openai.logprobs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs
from rxf.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, Delta, TokenizeRequest
from rxf.entrypoints.openai.sampling import check_completion, check_model, native_params
from rxf.entrypoints.openai.serving_chat import chat_events, chat_response
from rxf.entrypoints.openai.serving_completions import completion_events, completion_response
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


@pytest.fixture(scope="module")
def prep(tok):
    return RequestPreparer(tok, CTX, VOCAB)


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def plan_completion(prep: RequestPreparer, req: CompletionRequest) -> serving_completions.CompletionPlan:
    check_completion(req)  # as the route does, before it counts the batch
    return serving_completions.plan_completion(req, prep)


def plan_chat(prep: RequestPreparer, req: ChatCompletionRequest, template: Any = None) -> serving_chat.ChatPlan:
    return serving_chat.plan_chat(req, prep, template or HFChatTemplate(prep.tokenizer))


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


def test_prompt_forms(tok, prep):
    for prompt, count in [("x", 1), (["x", "y", "z"], 3), ([5, 6, 7], 1), ([[5, 6], [7]], 2)]:
        plan = plan_completion(prep, completion(prompt=prompt, n=2))
        assert len(plan.prompts) == count and len(plan.reqs) == 2 * count
    plan = plan_completion(prep, completion(prompt=[[5, 6], [7, 8, 9]], n=3))
    assert [r.input_ids for r in plan.reqs] == [[5, 6]] * 3 + [[7, 8, 9]] * 3
    assert [r.rid for r in plan.reqs] == [f"{plan.id}-{k}" for k in range(6)]
    assert plan_completion(prep, completion(prompt="hi")).reqs[0].input_ids == tok.encode("hi")


@pytest.mark.parametrize("prompt", [[], [[]], [[1, VOCAB]], [[-1]], "", ["a", ""]])
def test_bad_prompts(prep, prompt):
    assert api_error(plan_completion, prep, completion(prompt=prompt)).param == "prompt"


# ---- OpenAI -> native ----
def test_every_field_maps_to_the_native_params(prep):
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
    native = {
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
    assert native_params(req, req.max_tokens) == native
    plan = plan_completion(prep, req)
    assert plan.reqs[0].sampling_params == SamplingParams.from_dict(native)
    assert plan.reqs[0].options.stream is False and plan.reqs[0].options.return_logprob is False


def test_defaults_leave_engine_defaults(prep):
    params = native_params(completion(), None)
    assert not {"max_new_tokens", "stop", "seed"} & params.keys()
    assert not {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "logit_bias"} & params.keys()
    assert plan_completion(prep, completion()).reqs[0].sampling_params.max_new_tokens == 16  # OpenAI's default


def test_n_choices_get_distinct_seeds(prep):
    plan = plan_completion(prep, completion(n=3, seed=10, stream=True))
    assert [r.sampling_params.seed for r in plan.reqs] == [10, 11, 12]
    assert all(r.options.stream for r in plan.reqs)
    plan = plan_completion(prep, completion(n=2))
    assert all(r.sampling_params.seed is None for r in plan.reqs)
    # Every seed of [0, 2**64) is taken; choices' seeds wrap around, so each stays in range.
    plan = plan_completion(prep, completion(n=3, seed=2**64 - 2))
    assert [r.sampling_params.seed for r in plan.reqs] == [2**64 - 2, 2**64 - 1, 0]


def test_logprob_options(prep):
    opts = plan_completion(prep, completion(logprobs=3)).reqs[0].options
    assert (opts.return_logprob, opts.top_logprobs_num, opts.logprob_start_len) == (True, 3, -1)
    opts = plan_completion(prep, completion(logprobs=0, echo=True)).reqs[0].options
    assert (opts.return_logprob, opts.top_logprobs_num, opts.logprob_start_len) == (True, 0, 0)
    opts = plan_chat(prep, chat(logprobs=True, top_logprobs=4)).reqs[0].options
    assert (opts.return_logprob, opts.top_logprobs_num) == (True, 4)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 101}, "temperature"),  # the engine's bound, not OpenAI's 2 (as vLLM and SGLang)
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
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
def test_completion_errors_name_their_param(prep, fields, param):
    error = api_error(plan_completion, prep, completion(**fields))
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
def test_chat_errors_name_their_param(prep, template, fields, param, words):
    error = api_error(plan_chat, prep, chat(**fields), template)
    assert (error.status, error.param) == (400, param) and words in error.message


def test_chat_accepts_what_it_may_ignore(prep, template):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for fields in (
        {"tools": tools, "tool_choice": "none"},
        {"tools": []},
        {"response_format": {"type": "text"}},
        {"tool_choice": "auto"},
    ):
        plan_chat(prep, chat(**fields), template)


def test_context_budget(tok, prep):
    def budget(plan) -> int:
        return plan.reqs[0].sampling_params.max_new_tokens

    ids = [5] * 10
    assert budget(plan_completion(prep, completion(prompt=ids))) == 16  # OpenAI's default
    assert budget(plan_completion(prep, completion(prompt=[5] * 60))) == 4  # a default is cut to fit
    assert budget(plan_completion(prep, completion(prompt=ids, max_tokens=54))) == 54
    error = api_error(plan_completion, prep, completion(prompt=ids, max_tokens=55))
    assert error.param == "max_tokens" and "10" in error.message and "64" in error.message
    assert error.message.startswith("max_tokens: ")
    assert api_error(plan_completion, prep, completion(prompt=[5] * CTX)).param == "prompt"
    rendered = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert budget(plan_chat(prep, chat())) == CTX - len(rendered)  # chat: the whole remaining context


def test_chat_prompt_and_template_stops(tok, prep):
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
    plan = plan_chat(prep, req, template)
    rendered = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    assert plan.prompt.input_ids == tok.encode(rendered, add_special_tokens=False)
    params = plan.prompt.sampling_params
    assert params.stop == ["x", "<|im_end|>"] and params.max_new_tokens == 7
    assert len(plan.reqs) == 2


def test_model_name():
    check_model("m", "m")
    check_model(None, "m")  # tokenize's model is optional
    error = api_error(check_model, "other", "m")
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


def test_engine_errors_name_the_openai_field(prep):
    error = api_error(plan_completion, prep, completion(max_tokens=2, min_tokens=3))
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
def _out(
    rid: str, text: str, ids: list[int], prompt: int, done: int, cached: int = 0, finish: FinishReason | None = None,
    logprobs: Logprobs | None = None,
) -> GenerateOutput:
    return GenerateOutput(rid, text, ids, prompt, done, cached, finish, logprobs)


class ScriptedTM:
    """Answers each request with `script(req)` (a list of outputs), records aborts; `hang` blocks
    after the first output until cancelled."""

    def __init__(self, script, hang: bool = False) -> None:
        self.script, self.hang, self.aborted, self.seen = script, hang, [], []

    async def generate(self, req: PreparedRequest):
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


def _stream_script(req: PreparedRequest) -> list[GenerateOutput]:
    k = int(req.rid.rsplit("-", 1)[1])
    return [
        _out(req.rid, f"<{k}", [1], 5, 1, 4, logprobs=Logprobs([(-0.1, 1)], [[(-0.1, 1)]])),
        _out(req.rid, "", [2], 5, 2, 4, logprobs=Logprobs()),
        _out(req.rid, ">", [3], 5, 3, 4, FinishReason("length"), Logprobs([(-0.2, 3)], [[(-0.2, 3)]])),
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


def test_chat_stream_events(prep, template):
    plan = plan_chat(prep, chat(n=2, stream=True, logprobs=True), template)
    tm = ScriptedTM(_stream_script)
    chunks = _payloads(asyncio.run(_drain(chat_events(tm, plan, _strs, "m", include_usage=True))))
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        # The role comes with the choice's first token; no chunk goes out before it.
        assert mine[0]["delta"] == {"role": "assistant", "content": f"<{i}"}
        assert all("role" not in c["delta"] for c in mine[1:])
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


def test_completion_stream_echo_and_no_usage(prep):
    plan = plan_completion(prep, completion(prompt=["p", "q"], stream=True, echo=True, logprobs=1))
    chunks = _payloads(
        asyncio.run(_drain(completion_events(ScriptedTM(_stream_script), plan, _strs, "m", False)))
    )
    for k, prompt in enumerate("pq"):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert "".join(c["text"] for c in mine) == f"{prompt}<{k}>"
        assert mine[-1]["logprobs"]["text_offset"] == [len(f"{prompt}<{k}")]
    assert all("usage" not in c for c in chunks)


def test_completion_response_echo_logprobs_and_usage(tok, prep):
    plan = plan_completion(prep, completion(prompt=[[5, 6], [7]], n=2, echo=True, logprobs=1))
    logprobs = Logprobs([(-0.5, 2)], [[(-0.5, 2)]], [(None, 1), (-1.5, 1)], [[], [(-1.0, 2)]])
    results = [_out(f"r{k}", "bc", [2], 2, 1, k, FinishReason("stop", matched=2), logprobs) for k in range(4)]
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


def test_chat_response(prep, template):
    plan = plan_chat(prep, chat(logprobs=True), template)
    result = _out("r", "bc", [2], 9, 1, 0, FinishReason("stop"), Logprobs([(-0.5, 2)], [[]]))
    response = chat_response(plan, [result], _strs, "m").model_dump()
    assert response["choices"][0]["message"] == {"role": "assistant", "content": "bc"}
    assert response["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert response["object"] == "chat.completion" and response["usage"]["total_tokens"] == 10


def test_engine_abort_is_an_error_and_aborts_the_rest(prep):
    def script(req):
        if req.rid.endswith("-1"):
            return [_out(req.rid, "", [], 5, 0, 0, FinishReason("abort", message="no room"))]
        return _stream_script(req)

    plan = plan_completion(prep, completion(n=2, stream=True))
    tm = ScriptedTM(script, hang=True)

    async def run() -> APIError:
        with pytest.raises(APIError) as info:
            await _drain(completion_events(tm, plan, _strs, "m", False))
        await asyncio.sleep(0.01)  # the request tasks run their cleanup
        return info.value

    error = asyncio.run(run())
    assert error.status == 500 and "no room" in error.message
    assert plan.reqs[0].rid in tm.aborted  # the healthy choice, still running, was aborted


def test_error_mid_stream_becomes_an_event_then_done(prep):
    plan = plan_completion(prep, completion(stream=True))
    tm = ScriptedTM(lambda req: [_out(req.rid, "x", [], 1, 1, 0, FinishReason("abort"))])
    response = sse_response(completion_events(tm, plan, _strs, "m", False))
    events = _payloads(asyncio.run(_drain(response.body_iterator)))
    assert events[0]["error"]["code"] == "request_aborted" and events[-1] == "[DONE]"


def test_closing_a_stream_aborts_every_engine_request(prep, template):
    """A client hanging up closes (or cancels) the event generator: each native request must see
    its generator cancelled, which is what sends the abort to the scheduler."""
    plan = plan_chat(prep, chat(n=3, stream=True), template)
    tm = ScriptedTM(_stream_script, hang=True)

    async def read_some_then_hang_up() -> None:
        events = sse_response(chat_events(tm, plan, _strs, "m", False)).body_iterator
        for _ in range(3):  # each choice's first token; then every request hangs
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


def test_warm_prefixes_prefills_only(prep):
    tm = ScriptedTM(lambda req: [_out(req.rid, "", [], 3, 0, 0, FinishReason("length"))])
    params = {"max_new_tokens": 9, "min_new_tokens": 2, "seed": 1}
    prompts = [plan_completion(prep, completion(prompt=ids, **params)).prompts[0] for ids in ([1, 2], [3])]
    asyncio.run(warm_prefixes(tm, prompts))
    assert [r.input_ids for r in tm.seen] == [[1, 2], [3]]
    assert all(r.sampling_params.max_new_tokens == 0 == r.sampling_params.min_new_tokens for r in tm.seen)
    assert not {r.rid for r in tm.seen} & {p.rid for p in prompts}


def test_delta_omits_what_it_lacks():
    assert Delta().model_dump_json() == "{}" and Delta(content="x").model_dump_json() == '{"content":"x"}'
