"""`Runtime`: the engine from Python — the same processes as `rxf launch`, without HTTP.

    with Runtime.from_config("examples/demo.toml") as rt:
        rt.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        rt.chat([{"role": "user", "content": "Weather in Paris?"}], {"max_new_tokens": 64},
                tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}],
                tool_choice="required")["tool_calls"]
        rt.generate("Once upon a time", {"temperature": 0.8, "seed": 7}, n=3)  # three choices

The TokenizerManager runs on an asyncio loop in a background thread of the caller's process; the
sync methods submit to it, the async ones work from any other event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from rxf.core.config import EngineConfig, load_config
from rxf.core.frontend.requests import GenerateRequest, RequestLimits, load_multimodal_processor
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.grammar import make_grammar_backend
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.entrypoints.choices import check_n, choice_requests, interleave, warm_prefixes
from rxf.entrypoints.engine_loader import load_engine
from rxf.entrypoints.runtime_chat import ChatCall, prepare_chat

logger = logging.getLogger(__name__)

_DONE = object()
Prompt = str | list[str] | None
Params = dict[str, Any] | list[dict[str, Any]] | None


class Runtime:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_engine(config, threading.Event())  # the tokenizer loads while the children start
        self.engine, front = loaded.engine, loaded.frontend
        self.registry, self.tokenizer, self.chat_template = front.registry, front.tokenizer, front.chat_template
        self.tool_parser, self.reasoning_parser = front.tool_parser, front.reasoning_parser
        self._shut_down = False
        try:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="rxf-runtime-loop", daemon=True)
            self._thread.start()
            self.tokenizer_manager: TokenizerManager = self._call(self._make_tm())
            self.engine.watch(lambda reason: self._loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, reason))
        except BaseException:
            self.engine.shutdown()
            raise

    async def _make_tm(self) -> TokenizerManager:
        grammar = make_grammar_backend(self.config, self.tokenizer, self.engine.info["vocab_size"], self.registry)
        tm = TokenizerManager(
            self.tokenizer, self.engine.addrs, self.engine.info, RequestLimits.from_config(self.config),
            mm_processor=load_multimodal_processor(self.config, self.engine.info, self.registry), grammar=grammar,
        )
        await tm.start()
        return tm

    @classmethod
    def from_config(cls, source: str | dict[str, Any] | EngineConfig | None = None, **overrides: Any) -> Runtime:
        """A config file path, a dict or a config object, plus dotted/`__` key overrides."""
        return cls(load_config(source, **overrides))

    # ---- sync API ----
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        n: int = 1,
        stream: bool = False,
        **options: Any,
    ) -> Any:
        """Generate for one prompt (→ dict), a list (→ list of dicts) or stream one (→ chunks).

        `n` > 1: n choices of each prompt (as OpenAI's `n`; with a seed, choice i samples with seed
        + i) → a list of n results per prompt; streamed, every chunk carries its choice's `index`.
        `options`: return_logprob, logprob_start_len, top_logprobs_num, rid (with n > 1, choice i's
        is rid-i), cache_salt, priority (an int, lower runs first; nonzero only under
        scheduler.policy = "priority"), image_data, video_data. Bad input raises a ValueError
        naming the field, before anything runs.
        """
        reqs, batched = self._requests(prompt, input_ids, sampling_params, stream, n, options)
        # Counted before anything is tokenized: a batch larger than the engine ever holds is a
        # RequestError (a ValueError), not the OverloadedError of a full engine (no retry could fit it).
        self.tokenizer_manager.check_capacity(len(reqs) * n)
        prepared = [self.tokenizer_manager.preparer.prepare(r) for r in reqs]  # in this thread
        if stream:
            return self._iterate(self._stream(prepared, n))
        results = self._call(self._gather(prepared, n))
        return results if batched else results[0]

    def embed(
        self, prompt: Prompt = None, *, input_ids: list[int] | list[list[int]] | None = None, **options: Any
    ) -> Any:
        """The embedding of one prompt (→ `{"embedding": [floats], "meta_info"}`) or of each of a
        list (→ a list of them), on an embedding model (`model.task = "embed"`). `options`:
        dimensions (keep the first that many values, then renormalise), normalize (None: as the
        model's pooling config says), rid, cache_salt, priority. Bad input raises ValueError naming
        the field."""
        reqs, batched = self._embed_requests(prompt, input_ids, options)
        self.tokenizer_manager.check_capacity(len(reqs))  # as generate's
        prepared = [self.tokenizer_manager.preparer.prepare(r) for r in reqs]
        results = self._call(self._gather(prepared, 1))
        return results if batched else results[0]

    async def async_embed(self, prompt: Prompt = None, *, input_ids: Any = None, **options: Any) -> Any:
        reqs, batched = self._embed_requests(prompt, input_ids, options)
        self.tokenizer_manager.check_capacity(len(reqs))  # as generate's
        prepared = [await self.tokenizer_manager.preparer.prepare_async(r) for r in reqs]
        results = await self._await(self._gather(prepared, 1))
        return results if batched else results[0]

    def chat(
        self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
        tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None, parallel_tool_calls: bool = True,
        n: int = 1, stream: bool = False, **options: Any,
    ) -> Any:
        """Render `messages` (OpenAI's shape; `image_url` parts for a multimodal model) with the chat
        template (adding its stop strings) and generate. `tools`, `tool_choice` ("none", "auto",
        "required" or {"type": "function", "function": {"name": ...}}), `parallel_tool_calls` and
        `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}}}) work as in /v1/chat/completions: with tools, the result's
        text is the reply without the call markup, plus `tool_calls` when the model made calls.
        Streamed with tools, each chunk's `text` is a delta without the markup and `tool_calls` the
        call deltas parsed so far (as the server's SSE). For a thinking model (a reasoning parser),
        `text` is the reply after the reasoning and `reasoning_content` the reasoning (deltas when
        streamed). The keywords `chat_template_kwargs` (e.g. {"enable_thinking": False}) and
        `reasoning_effort` reach the chat template. `n` as in `generate`. Bad input raises
        ValueError naming the field."""
        call, prepared = self._prepare_chat(
            messages, sampling_params, tools, tool_choice, response_format, parallel_tool_calls, n, stream, options
        )
        if stream:
            return call.reply_stream(self._iterate(self._stream([prepared], n)))
        out = self._call(self._gather([prepared], n))[0]
        return [call.reply(r) for r in out] if n > 1 else call.reply(out)

    def flush_cache(self) -> tuple[bool, str]:
        result = self._call(self.tokenizer_manager.flush_cache())
        return result.ok, result.message

    def get_stats(self) -> Any:
        return self._call(self.tokenizer_manager.get_stats())

    def start_profile(self, num_steps: int | None = None, kernels: bool = False) -> str:
        """Profile the engine's steps (needs `runtime.profile_dir`) until `stop_profile`, or for
        `num_steps` steps; `kernels` adds torch.profiler's kernel trace (for short windows). Returns
        the profile's folder; raises ValueError with the reason when refused."""
        return _admin_ok(self._call(self.tokenizer_manager.start_profile(num_steps, kernels)))

    def stop_profile(self) -> str:
        """Write the running profile (`rxf/core/runner/step_profiler.py` says what); its folder."""
        return _admin_ok(self._call(self.tokenizer_manager.stop_profile()))

    # ---- async API (usable from any event loop) ----
    async def async_generate(
        self, prompt: Prompt = None, sampling_params: Params = None, *, input_ids: Any = None,
        n: int = 1, stream: bool = False, **options: Any,
    ) -> Any:
        reqs, batched = self._requests(prompt, input_ids, sampling_params, stream, n, options)
        self.tokenizer_manager.check_capacity(len(reqs) * n)  # as generate's
        prepared = [await self.tokenizer_manager.preparer.prepare_async(r) for r in reqs]
        if stream:
            return self._aiterate(self._stream(prepared, n))
        results = await self._await(self._gather(prepared, n))
        return results if batched else results[0]

    async def async_chat(
        self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
        tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None, parallel_tool_calls: bool = True,
        n: int = 1, stream: bool = False, **options: Any,
    ) -> Any:
        """`chat` for an event loop (rendered and prepared off it: images, constraints)."""
        call, prepared = await asyncio.to_thread(
            self._prepare_chat, messages, sampling_params, tools, tool_choice, response_format, parallel_tool_calls,
            n, stream, options,
        )
        if stream:
            return call.areply_stream(self._aiterate(self._stream([prepared], n)))
        out = (await self._await(self._gather([prepared], n)))[0]
        return [call.reply(r) for r in out] if n > 1 else call.reply(out)

    # ---- lifetime ----
    def shutdown(self) -> None:
        if getattr(self, "_loop", None) is not None and self._loop.is_running() and not self._shut_down:
            self._call(self.tokenizer_manager.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._shut_down = True
        self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- helpers ----
    @staticmethod
    def _requests(
        prompt: Prompt, input_ids: Any, params: Params, stream: bool, n: int, options: dict[str, Any]
    ) -> tuple[list[GenerateRequest], bool]:
        """The native requests, one per prompt (their n choices are derived once each is prepared)."""
        check_n(n)
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            batched = isinstance(prompt, list)
            items = [{"text": p} for p in (prompt if batched else [prompt])]
        else:
            if not isinstance(input_ids, list):  # a tensor, an array or a generator: its truth value misleads
                raise ValueError(f"input_ids: expected a list of ints or a list of such lists, got {type(input_ids).__name__}"
                                 " (a tensor's or array's .tolist() gives one)")
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            items = [{"input_ids": ids} for ids in (input_ids if batched else [input_ids])]
        if stream and batched:
            raise ValueError("stream=True takes a single prompt")
        if isinstance(params, list):
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} sampling_params for {len(items)} prompts")
            per_item = params
        else:
            per_item = [params] * len(items)
        media = {key: options.pop(key) for key in ("image_data", "video_data") if key in options}
        rid, request_options = _split_options(stream, options)
        reqs = [
            GenerateRequest(**item, **media, sampling_params=p, options=request_options, rid=rid)
            for item, p in zip(items, per_item, strict=True)
        ]
        return reqs, batched

    @classmethod
    def _embed_requests(
        cls, prompt: Prompt, input_ids: Any, options: dict[str, Any]
    ) -> tuple[list[GenerateRequest], bool]:
        reqs, batched = cls._requests(prompt, input_ids, None, False, 1, options)
        return [replace(r, embed=True) for r in reqs], batched

    def _prepare_chat(
        self, messages: Any, params: dict[str, Any] | None, tools: Any, tool_choice: Any, response_format: Any,
        parallel_tool_calls: bool, n: int, stream: bool, options: dict[str, Any],
    ) -> tuple[ChatCall, PreparedRequest]:
        """The chat's call (its tool plan reads the replies) and its one prepared request."""
        check_n(n)
        call = prepare_chat(
            messages, params, chat_template=self.chat_template, tool_parser=self.tool_parser,
            tokenizer=self.tokenizer, reasoning_parser=self.reasoning_parser,
            takes_media=self.tokenizer_manager.preparer.mm_processor is not None, tools=tools,
            tool_choice=tool_choice, response_format=response_format, parallel_tool_calls=parallel_tool_calls,
            chat_template_kwargs=options.pop("chat_template_kwargs", None),
            reasoning_effort=options.pop("reasoning_effort", None),
        )
        rid, request_options = _split_options(stream, options)
        return call, call.prepare(self.tokenizer_manager.preparer, request_options, rid)

    async def _gather(self, prompts: list[PreparedRequest], n: int) -> list[Any]:
        """The final results in order; with n > 1 grouped by prompt (a list of n per prompt)."""
        reqs = await self._start_choices(prompts, n)
        results: list[Any] = [None] * len(reqs)
        async with contextlib.aclosing(interleave(self.tokenizer_manager, reqs)) as outputs:
            async for index, result in outputs:  # a non-streaming request yields one result
                results[index] = result.to_dict()
        return results if n == 1 else [results[p : p + n] for p in range(0, len(results), n)]

    async def _stream(self, prompts: list[PreparedRequest], n: int) -> AsyncIterator[dict[str, Any]]:
        """One prompt's chunks; with n > 1 its choices' chunks as they come, each with its `index`."""
        if n == 1:
            async for chunk in self.tokenizer_manager.generate(prompts[0]):
                yield chunk.to_dict()
            return
        reqs = await self._start_choices(prompts, n)
        async with contextlib.aclosing(interleave(self.tokenizer_manager, reqs)) as outputs:
            async for index, chunk in outputs:
                yield {**chunk.to_dict(), "index": index}

    async def _start_choices(self, prompts: list[PreparedRequest], n: int) -> list[PreparedRequest]:
        """Every prompt's n choices, in order. With n > 1: room for all of them first, and each
        prompt prefilled once so that its choices share its cached KV (as the server's `n`)."""
        reqs: list[PreparedRequest] = []
        for p in prompts:  # with n > 1, choice i's rid is `<rid>-<i>`
            reqs += choice_requests(p, [p.rid] if n == 1 else [f"{p.rid}-{i}" for i in range(n)])
        if n > 1:
            self.tokenizer_manager.check_capacity(len(reqs))
            await warm_prefixes(self.tokenizer_manager, prompts)
        return reqs

    def _submit(self, coro: Any) -> Future[Any]:
        """`coro` scheduled on the runtime loop; RuntimeError once `shutdown` stopped it (a call would
        otherwise wait forever on a loop that never runs it)."""
        if self._shut_down:
            coro.close()
            raise RuntimeError("this Runtime is shut down: create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _await(self, coro: Any) -> Any:
        """`coro` run on the runtime loop, awaited from the caller's loop."""
        return await asyncio.wrap_future(self._submit(coro))

    def _call(self, coro: Any) -> Any:
        return self._submit(coro).result()

    def _iterate(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Drive an async generator on the runtime loop, handing its items to this thread."""
        items: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                async for item in agen:
                    items.put(item)
            except BaseException as e:  # surfaces in the consumer's thread
                items.put(e)
            finally:
                items.put(_DONE)

        task = self._submit(pump())
        try:
            while (item := items.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()  # a consumer that stops early aborts the request

    async def _aiterate(self, agen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        caller = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()

        def post(item: Any) -> None:
            # The consumer's loop may be closed by now (it stopped early; the cancel below is on its
            # way): nobody reads the item.
            with contextlib.suppress(RuntimeError):
                caller.call_soon_threadsafe(items.put_nowait, item)

        async def pump() -> None:
            try:
                async for item in agen:
                    post(item)
            except BaseException as e:
                post(e)
            finally:
                post(_DONE)

        task = self._submit(pump())
        try:
            while (item := await items.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()


def _split_options(stream: bool, options: dict[str, Any]) -> tuple[str | None, RequestOptions]:
    """The rid and the RequestOptions among a call's keyword options (an unknown one: TypeError)."""
    rid = options.pop("rid", None)
    return rid, RequestOptions(stream=stream, **options)


def _admin_ok(result: Any) -> str:
    if not result.ok:
        raise ValueError(result.message)
    return result.message
