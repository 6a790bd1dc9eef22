"""The checks every model plugin passes against transformers, in one place (issue 18's bar):

    check_logits(path, prompts)          # batched prefill, decode steps, a cached-prefix extend
    check_runtime_greedy(path, prompts, chunk=8, new_tokens=24)
                                         # real processes: batched, chunked prefill, a second pass

Logits must match within 1e-4 of the largest reference logit (fp32); greedy tokens must be
identical. `check_logits` drives `ModelRunner` directly (`ModelHarness`'s pools), so a failure
points at the model or the attention backend; `check_runtime_greedy` runs the scheduler, where a
prompt longer than `chunk` is prefilled in pieces and the second pass reads the radix cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rxf.core.forward import ForwardMode
from rxf.core.runner.model_runner import ModelInput
from rxf.testing.model_harness import ModelHarness
from rxf.testing.reference import HFReference

GREEDY = {"temperature": 0, "ignore_eos": True}


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """1e-4 relative to the largest logit: elementwise relative error means nothing near zero."""
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@torch.inference_mode()
def check_logits(
    path: str | Path,
    prompts: list[list[int]],
    *,
    attention_backend: str = "torch_native",
    decode_steps: int = 3,
    shared_prefix: int | None = None,
    reference: HFReference | None = None,
    **config_overrides: Any,
) -> None:
    """Every prompt position's logits in one batched PREFILL, `decode_steps` batched DECODE steps,
    then an EXTEND of a new request that reuses the first prompt's first `shared_prefix` KV slots
    (default: all but 3 of them) as a radix-cache hit would, each against transformers."""
    ref = reference or HFReference(path)
    harness = ModelHarness(path, attention_backend, **config_overrides)
    runner = harness.runner
    expected = [ref.logits(p) for p in prompts]
    for ours, theirs in zip(harness.prefill_logits(prompts), expected, strict=True):
        assert_logits_close(ours, theirs)

    rows, slots = harness._start(prompts)
    tokens = [list(p) for p in prompts]
    harness._prefill(prompts, rows, slots, all_logits=False)
    for step in range(decode_steps):
        nxt = [(7 + 31 * step + 13 * i) % runner.vocab_size for i in range(len(prompts))]
        new = runner.token_to_kv_pool.alloc(len(prompts))
        lens = [len(t) for t in tokens]
        logits = runner.forward(ModelInput(ForwardMode.DECODE, rows, nxt, lens, [1] * len(prompts), new))
        for i, t in enumerate(nxt):
            tokens[i].append(t)
            slots[i] = torch.cat((slots[i], new[i : i + 1]))
        assert_logits_close(logits, torch.stack([ref.logits(t)[-1] for t in tokens]))

    shared = len(prompts[0]) - 3 if shared_prefix is None else shared_prefix
    suffix = [(31 + 5 * j) % runner.vocab_size for j in range(4)]
    row = runner.req_to_token_pool.alloc()
    logits = runner.forward(
        ModelInput(
            ForwardMode.EXTEND, [row], suffix, [shared], [len(suffix)],
            runner.token_to_kv_pool.alloc(len(suffix)),
            row_writes=[(0, slots[0][:shared])], logits_start=[0],
        )
    )
    assert_logits_close(logits, ref.logits(tokens[0][:shared] + suffix)[shared:])


def runtime_config(path: str | Path, *, chunk: int | None, **extra: Any) -> dict[str, Any]:
    """A CPU `Runtime` config for `path`; `chunk` = scheduler.chunked_prefill_size (None: off)."""
    config: dict[str, Any] = {
        "model": {"path": str(path)},
        "runtime": {"device": "cpu", "cpu_threads": 1, "cpu_compile": "off"},
        "attention": {"backend": "torch_native"},
        "cache": {"max_total_tokens": 4096},
        "scheduler": {"chunked_prefill_size": "off" if chunk is None else chunk},
    }
    for section, values in extra.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def check_runtime_greedy(
    path: str | Path,
    prompts: list[list[int]],
    *,
    chunk: int | None = 8,
    new_tokens: int = 24,
    reference: HFReference | None = None,
    **config_sections: Any,
) -> None:
    """`new_tokens` greedy tokens of every prompt through `Runtime` (scheduler and detokenizer
    processes), all prompts in one batched call, identical to transformers' — and again on a second
    pass, which finds the prompts in the radix cache. `config_sections` add to the config's
    sections, e.g. `attention={"backend": "triton"}`."""
    from rxf import Runtime

    ref = reference or HFReference(path)
    expected = [ref.greedy(p, new_tokens) for p in prompts]
    params = {"max_new_tokens": new_tokens, **GREEDY}
    with Runtime.from_config(runtime_config(path, chunk=chunk, **config_sections)) as rt:
        for attempt in ("first pass", "second pass (cached prefixes)"):
            outs = rt.generate(input_ids=prompts, sampling_params=params)
            for i, (out, want) in enumerate(zip(outs, expected, strict=True)):
                assert out["output_ids"] == want, f"{attempt}, prompt {i}: {out['output_ids']} != {want}"
        cached = [out["meta_info"]["cached_tokens"] for out in outs]
        assert all(c > 0 for c in cached), f"the second pass found no cached prefix: {cached}"
