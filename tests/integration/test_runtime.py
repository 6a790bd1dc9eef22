"""`Runtime` end to end: real scheduler and detokenizer processes over ZMQ, on a tiny checkpoint.

Greedy tokens and logprobs are checked against transformers (the `hf_reference` fixture).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rxf import Runtime
from rxf.core.frontend.tokenizer_manager import EngineDeadError, RequestError
from rxf.testing.runtime import assert_drained

GREEDY = {"temperature": 0, "ignore_eos": True}


def _config(path, **extra):
    return {
        "model": {"path": str(path)},
        "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"},
        "cache": {"max_total_tokens": 4096},
        **extra,
    }


@pytest.fixture(scope="module")
def rt(tiny_llama):
    with Runtime.from_config(_config(tiny_llama)) as runtime:
        yield runtime


def test_generate_matches_transformers(rt, hf_reference):
    prompt = "hello world, this is a test"
    ids = rt.tokenizer.encode(prompt)
    out = rt.generate(prompt, {"max_new_tokens": 24, **GREEDY})
    assert out["output_ids"] == hf_reference(ids, 24)
    assert out["text"] == rt.tokenizer.decode(out["output_ids"])
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 24)
    assert meta["finish_reason"] == {"type": "length"}


def test_batch_with_per_prompt_params(rt, hf_reference):
    prompts = ["the cat", "a much longer prompt about the dog and the cat", "你好"]
    outs = rt.generate(prompts, [{"max_new_tokens": n, **GREEDY} for n in (3, 9, 5)])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 9, 5]
    for p, o, n in zip(prompts, outs, (3, 9, 5), strict=True):
        assert o["output_ids"] == hf_reference(rt.tokenizer.encode(p), n)


def test_stream_concatenates_to_the_full_result(rt):
    params = {"max_new_tokens": 20, **GREEDY}
    full = rt.generate("streaming test", params)
    chunks = list(rt.generate("streaming test", params, stream=True))
    assert len(chunks) > 1 and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["meta_info"]["cached_tokens"] > 0  # the same prompt ran just before


def test_stop_string_and_stop_token(rt):
    base = rt.generate("stop here", {"max_new_tokens": 16, **GREEDY})
    text, ids = base["text"], base["output_ids"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = rt.generate("stop here", {"max_new_tokens": 16, **GREEDY, "stop": [stop]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = rt.generate("stop here", {"max_new_tokens": 16, **GREEDY, "stop": stop, "no_stop_trim": True})
    assert kept["text"].endswith(stop) and text.startswith(kept["text"])
    out = rt.generate("stop here", {"max_new_tokens": 16, **GREEDY, "stop_token_ids": [ids[4]]})
    assert out["output_ids"] == ids[: ids.index(ids[4]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[4]}


def test_seed_reproduces(rt):
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = rt.generate("seeded", {**params, "seed": 7})
    b = rt.generate(["other prompt", "seeded"], [params, {**params, "seed": 7}])[1]
    c = rt.generate("seeded", {**params, "seed": 8})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_logprobs_match_transformers(rt, tiny_llama):
    prompt = "logprobs please"
    out = rt.generate(
        prompt, {"max_new_tokens": 5, **GREEDY}, return_logprob=True, top_logprobs_num=3, logprob_start_len=0
    )
    ids = rt.tokenizer.encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids + out["output_ids"]])).logits[0].log_softmax(-1)
    meta = out["meta_info"]
    for k, (lp, tok) in enumerate(meta["output_token_logprobs"]):
        assert tok == out["output_ids"][k]
        assert lp == pytest.approx(float(ref[len(ids) - 1 + k, tok]), abs=1e-4)
        top = meta["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tok  # greedy picks the top alternative
    prompt_lps = meta["input_token_logprobs"]
    assert prompt_lps[0] == (None, ids[0])
    for j in range(1, len(ids)):
        assert prompt_lps[j][0] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)


def test_chat_uses_template_and_hits_cache(rt):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = rt.chat(messages, {"max_new_tokens": 8, **GREEDY})
    again = rt.chat(messages, {"max_new_tokens": 8, **GREEDY})
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    rendered = rt.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert first["meta_info"]["prompt_tokens"] == len(rt.tokenizer.encode(rendered, add_special_tokens=False))


def test_async_api(rt):
    async def main():
        one = await rt.async_generate("async", {"max_new_tokens": 6, **GREEDY})
        many = await asyncio.gather(*(rt.async_generate(f"async {i}", {"max_new_tokens": 4}) for i in range(4)))
        chunks = [c async for c in await rt.async_generate("async", {"max_new_tokens": 6, **GREEDY}, stream=True)]
        chat = await rt.async_chat([{"role": "user", "content": "hi"}], {"max_new_tokens": 3})
        return one, many, chunks, chat

    one, many, chunks, chat = asyncio.run(main())
    assert "".join(c["text"] for c in chunks) == one["text"]
    assert len(many) == 4 and chat["meta_info"]["completion_tokens"] <= 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"sampling_params": {"temperature": -1}}, "temperature"),
        ({"sampling_params": {"max_new_tokns": 3}}, "max_new_tokns"),
        ({"sampling_params": {"top_p": 2}}, "top_p"),
        ({"input_ids": [1, 2, 10**6]}, "input_ids"),
        ({"prompt": "x " * 600}, "context length"),
        ({"priority": 1}, "priority"),  # nonzero only under scheduler.policy = "priority"
        ({"priority": "0"}, "priority"),
    ],
)
def test_invalid_requests_are_rejected(rt, kwargs, field):
    kwargs = {"prompt": "ok", **kwargs} if "input_ids" not in kwargs else kwargs
    with pytest.raises(RequestError, match=field):
        rt.generate(**kwargs)
    assert rt.generate("still serving", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_chat_takes_a_priority_keyword(rt):
    messages = [{"role": "user", "content": "hi"}]
    assert rt.chat(messages, {"max_new_tokens": 2}, priority=0)["meta_info"]["completion_tokens"] == 2
    with pytest.raises(RequestError, match="priority: got -1, but priority scheduling is off"):
        rt.chat(messages, {"max_new_tokens": 2}, priority=-1)


def test_abandoned_stream_is_aborted_and_frees_kv(rt):
    stream = rt.generate("abandon me", {"max_new_tokens": 400, **GREEDY}, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert_drained(rt)
    ok, message = rt.flush_cache()
    assert ok, message
    assert rt.get_stats().free_slots == rt.get_stats().total_slots


def test_dead_scheduler_fails_requests_promptly(tiny_llama):
    with Runtime.from_config(_config(tiny_llama)) as runtime:
        stream = runtime.generate("doomed", {"max_new_tokens": 400, **GREEDY}, stream=True)
        next(stream)
        scheduler = next(p for p in runtime.engine.procs if p.name == "rxf-scheduler")
        os.kill(scheduler._popen.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rxf-scheduler exited"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 5
        with pytest.raises(EngineDeadError):
            runtime.generate("after death", {"max_new_tokens": 2})
