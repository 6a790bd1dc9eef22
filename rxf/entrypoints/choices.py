"""Several native requests for one call, whoever makes it: the n choices of a prompt
(`Runtime.generate(n=...)`, the OpenAI layer's `n`) and batch prompts.

Choice i of a prompt is its own request, derived from the prompt's one prepared request (tokenized
and validated once), under a rid of its own; with a seed it samples with seed + i mod 2**64 (choice 0
keeps the caller's seed; `SamplingParams.for_choice`), so choice i of a seeded call is the same
through either front door. Before n > 1 choices run, their prompt is prefilled once so that they
share its KV in the radix cache instead of each prefilling it.

Each native request is driven by its own task that feeds one queue. Closing or cancelling the
consumer cancels those tasks, and cancelling a task inside `TokenizerManager.generate` makes that
generator's `finally` send the abort to the scheduler. The tasks are separate from the consumer's
task on purpose: when a server cancels its handler (a client hung up), the handler's cancellation
scope may keep cancelling every await it makes, but the abort is sent from the request's own task,
which is outside that scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import msgspec

from rxf.core.echo import echo
from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc.messages import PreparedRequest

MAX_N = 128  # choices of one prompt

_END = object()


def check_n(n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {echo(n)}")


def choice_requests(prepared: PreparedRequest, rids: list[str]) -> list[PreparedRequest]:
    """The requests of one prompt's choices, one per rid: request i is choice i."""
    return [
        msgspec.structs.replace(prepared, rid=rid, sampling_params=prepared.sampling_params.for_choice(i))
        for i, rid in enumerate(rids)
    ]


def prefill_request(prepared: PreparedRequest) -> PreparedRequest:
    """`prepared`'s prompt prefilled into the cache, no token generated (under a fresh rid)."""
    params = replace(prepared.sampling_params, max_new_tokens=0, min_new_tokens=0)
    options = replace(prepared.options, stream=False, return_logprob=False)
    return msgspec.structs.replace(prepared, rid=uuid.uuid4().hex, sampling_params=params, options=options)


async def warm_prefixes(tm: TokenizerManager, prompts: list[PreparedRequest]) -> None:
    """Prefill each prompt once, so that its KV is in the radix cache before its n choices run
    concurrently: they then share it instead of each prefilling the prompt. Prompts with media are
    not warmed: their choices each prefill (a media prefix shared through a prefill-only request is
    untested)."""
    prefills = [prefill_request(p) for p in prompts if p.mm_items is None]
    async with contextlib.aclosing(interleave(tm, prefills)) as outputs:
        async for _ in outputs:
            pass


async def _pump(tm: TokenizerManager, index: int, req: PreparedRequest, queue: asyncio.Queue[Any]) -> None:
    try:
        async for chunk in tm.generate(req):
            queue.put_nowait((index, chunk))
    except Exception as exc:  # CancelledError is not an Exception: it ends the task (and the request)
        queue.put_nowait((index, exc))
        return
    queue.put_nowait((index, _END))


async def interleave(
    tm: TokenizerManager, reqs: list[PreparedRequest]
) -> AsyncGenerator[tuple[int, GenerateOutput], None]:
    """Runs `reqs` concurrently on `tm` and yields `(request index, chunk)` as chunks arrive. The
    first failure is raised, and the other requests are aborted."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(tm, i, req, queue)) for i, req in enumerate(reqs)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
