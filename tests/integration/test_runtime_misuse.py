"""A `Runtime` misused: calls after `shutdown()` fail at once (they waited forever on the stopped
loop), a batch larger than the engine ever holds fails before it is tokenized with a ValueError (it
was an OverloadedError, "retry later", which could never succeed), and input_ids that are not lists
are refused naming the argument (a tensor's or generator's truth value gave torch's or Python's own
errors)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rxf import Runtime
from rxf.core.frontend.requests import RequestError

LIMITS = {"scheduler.max_running_requests": 4, "scheduler.max_queued_requests": 8}  # 12 in flight at most


@pytest.fixture(scope="module")
def rt(tiny_llama):
    config = {"model": {"path": str(tiny_llama)}, "runtime": {"device": "cpu", "cpu_threads": 1},
              "attention": {"backend": "torch_native"}}
    runtime = Runtime.from_config(config, **LIMITS)
    yield runtime
    runtime.shutdown()


def test_a_batch_past_the_engine_is_refused_before_it_is_tokenized(rt):
    # Counted first: the batch's bad last prompt (an id past the vocabulary) is never reached.
    with pytest.raises(RequestError, match="needs 13 generations"):
        rt.generate(input_ids=[[1, 2]] * 12 + [[10**6]], sampling_params={"max_new_tokens": 1})
    with pytest.raises(RequestError, match="needs 14 generations"):
        rt.generate(input_ids=[[1, 2]] * 6 + [[10**6]], sampling_params={"max_new_tokens": 1}, n=2)
    with pytest.raises(RequestError, match="needs 13 generations"):
        asyncio.run(rt.async_generate(input_ids=[[1, 2]] * 12 + [[10**6]], sampling_params={"max_new_tokens": 1}))
    assert len(rt.generate(input_ids=[[1, 2]] * 12, sampling_params={"max_new_tokens": 1})) == 12


@pytest.mark.parametrize("ids", [torch.tensor([1, 2, 3]), (i for i in [1, 2, 3]), (1, 2, 3)],
                         ids=["tensor", "generator", "tuple"])
def test_input_ids_that_are_not_lists_are_refused_naming_them(rt, ids):
    with pytest.raises(ValueError, match="input_ids: expected a list of ints"):
        rt.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})


def test_calls_after_shutdown_fail_at_once(tiny_llama):
    config = {"model": {"path": str(tiny_llama)}, "runtime": {"device": "cpu", "cpu_threads": 1},
              "attention": {"backend": "torch_native"}}
    runtime = Runtime.from_config(config)
    assert runtime.generate("hello", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
    runtime.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        runtime.generate("hello", {"max_new_tokens": 2})
    with pytest.raises(RuntimeError, match="shut down"):
        list(runtime.generate("hello", {"max_new_tokens": 2}, stream=True))
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(runtime.async_generate("hello", {"max_new_tokens": 2}))
    with pytest.raises(RuntimeError, match="shut down"):
        runtime.get_stats()
    runtime.shutdown()  # twice: nothing more to do
