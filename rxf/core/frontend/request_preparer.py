"""The one place a generation request is validated and tokenized: `RequestPreparer.prepare` turns a
front door's `GenerateRequest` into the `PreparedRequest` the engine runs.

Every front door (the OpenAI routes, native `/generate` and `/health_generate`, `Runtime` and its
chat) calls it once per prompt and submits what it returns; the TokenizerManager and the scheduler
trust it. Each rule is checked here only, so it means the same on every door:

- the prompt: exactly one of text and ids; a text too long for any tokenization of it to fit the
  context refused before it is tokenized (`check_prompt_chars`); ids in [0, vocab_size); media
  preprocessed; not empty, shorter than the context and than the KV pool;
- the sampling parameters: types and ranges (`SamplingParams.from_dict`, `NUMERIC_BOUNDS`), the
  server's counts (`RequestLimits.check_params`), max_new_tokens fitted next to the prompt
  (`fit_max_new_tokens`), an output constraint validated by the grammar backend;
- the options and the rid: types and ranges (priority: `RequestLimits.check_priority`);
- the task: an embedding request on an embedding model (`pooling` set) and only there; it takes
  no sampling parameters, streaming or logprobs, and is prepared to compute its prompt only.

Errors are `RequestError`s naming the field as the native request names it; another door states
them in its own terms with `RequestError.renamed`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rxf.core.echo import echo
from rxf.core.frontend.requests import (
    MAX_CACHE_SALT_LEN,
    MAX_RID_LEN,
    MAX_TOP_LOGPROBS,
    GenerateRequest,
    RequestError,
    RequestLimits,
    check_prompt_chars,
)
from rxf.core.ipc.messages import MultimodalItem, PreparedRequest, RequestOptions
from rxf.core.pooling import Pooling
from rxf.core.sampling_params import SamplingParams, fit_max_new_tokens

if TYPE_CHECKING:
    from rxf.core.grammar import GrammarBackend

logger = logging.getLogger(__name__)


def _as_list(value: Any) -> list[Any] | None:
    return None if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RequestPreparer:
    """Validates and tokenizes requests for one engine (its context, vocabulary and KV pool)."""

    def __init__(
        self,
        tokenizer: Any,
        max_context_len: int,
        vocab_size: int,
        max_total_tokens: int | None = None,  # the KV pool's slots (None: unbounded)
        limits: RequestLimits | None = None,
        mm_processor: Any = None,  # None: the model takes no images
        grammar: GrammarBackend | None = None,  # None: constraints are not compiled here
        pooling: Pooling | None = None,  # an embedding model's (None: a generative model)
    ) -> None:
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.max_total_tokens = max_total_tokens
        self.limits = limits or RequestLimits()
        self.mm_processor = mm_processor
        self.grammar = grammar
        self.pooling = pooling

    @classmethod
    def for_engine(cls, tokenizer: Any, engine_info: Mapping[str, Any], **kwargs: Any) -> RequestPreparer:
        """A preparer for the engine that reported `engine_info` (its scheduler's figures)."""
        pooling = engine_info.get("pooling")
        return cls(
            tokenizer, engine_info["max_context_len"], engine_info["vocab_size"], engine_info.get("max_total_tokens"),
            pooling=Pooling.from_info(pooling) if pooling is not None else None, **kwargs,
        )

    def prepare(self, req: GenerateRequest) -> PreparedRequest:
        """The prepared request, or a RequestError naming the first field at fault. Blocking
        (tokenizing, media decoding, grammar compiling): on an event loop use `prepare_async`.
        Cheap checks come first, so a malformed request costs no tokenizing."""
        self._check_options(req.options)
        if req.rid is not None and not (isinstance(req.rid, str) and len(req.rid) <= MAX_RID_LEN):
            raise RequestError(f"rid: must be a string of at most {MAX_RID_LEN} characters")
        self._check_task(req)
        if req.embed:  # the prompt is computed and pooled; its one "step" samples nothing
            ids, mm_items = self._prompt(req)
            return PreparedRequest(req.rid or uuid.uuid4().hex, ids, SamplingParams(max_new_tokens=0), req.options, mm_items)
        params, budget_given = self._sampling_params(req.sampling_params)
        ids, mm_items = self._prompt(req)
        start = req.options.logprob_start_len
        if not -1 <= start < len(ids):
            raise RequestError(
                f"logprob_start_len: must be -1 (output tokens only) or in [0, {len(ids)}) (the prompt's "
                f"tokens), got {echo(start)}"
            )
        try:
            params.max_new_tokens = fit_max_new_tokens(
                params.max_new_tokens if budget_given else None, req.default_max_new_tokens, len(ids),
                self.max_context_len, "sampling_params.max_new_tokens",
            )
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        self._check_grammar(params)
        return PreparedRequest(req.rid or uuid.uuid4().hex, ids, params, req.options, mm_items)

    async def prepare_async(self, req: GenerateRequest) -> PreparedRequest:
        """`prepare`, in a worker thread when it may take long (media to decode, a constraint to
        compile), so that the event loop keeps serving other clients meanwhile."""
        if req.slow_to_prepare():
            return await asyncio.to_thread(self.prepare, req)
        return self.prepare(req)

    def _check_task(self, req: GenerateRequest) -> None:
        if self.pooling is not None and not req.embed:
            raise RequestError(
                "model: this model serves embeddings (model.task = 'embed'), not generation; "
                "use /v1/embeddings (Runtime.embed)"
            )
        if self.pooling is None and req.embed:
            raise RequestError(
                "model: this model serves generation, not embeddings; serve an embedding model "
                "with model.task = 'embed' for /v1/embeddings (Runtime.embed)"
            )
        options = req.options
        if self.pooling is None:
            for name in ("dimensions", "normalize"):
                if getattr(options, name) is not None:
                    raise RequestError(f"{name}: only embedding requests take it")
            return
        if req.sampling_params is not None:
            raise RequestError("sampling_params: an embedding request samples nothing; leave them out")
        if options.stream or options.return_logprob:
            raise RequestError(f"{'stream' if options.stream else 'return_logprob'}: not available for embeddings")
        if options.normalize is not None and not isinstance(options.normalize, bool):
            raise RequestError(f"normalize: expected a boolean, got {echo(options.normalize)}")
        if options.dimensions is not None:
            if not _is_int(options.dimensions):
                raise RequestError(f"dimensions: expected an integer, got {echo(options.dimensions)}")
            reason = self.pooling.check_dimensions(options.dimensions)
            if reason is not None:
                raise RequestError(f"dimensions: {reason}")

    def _check_options(self, options: RequestOptions) -> None:
        for name in ("stream", "return_logprob"):
            if not isinstance(getattr(options, name), bool):
                raise RequestError(f"{name}: expected a boolean, got {echo(getattr(options, name))}")
        top = options.top_logprobs_num
        if not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(f"top_logprobs_num: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {echo(top)}")
        if not _is_int(options.logprob_start_len):
            raise RequestError(f"logprob_start_len: expected an integer, got {echo(options.logprob_start_len)}")
        salt = options.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_LEN):
            raise RequestError(f"cache_salt: must be a non-empty string of at most {MAX_CACHE_SALT_LEN} characters")
        self.limits.check_priority(options.priority)

    def _sampling_params(self, given: Any) -> tuple[SamplingParams, bool]:
        """The verified parameters (a copy: their budget is fitted to this prompt) and whether they
        give max_new_tokens (a whole SamplingParams does)."""
        try:
            if isinstance(given, SamplingParams):
                params, budget_given = replace(given), True
                params.verify(self.vocab_size)
            elif given is None or isinstance(given, Mapping):
                params = SamplingParams.from_dict(given, self.vocab_size)
                budget_given = given is not None and "max_new_tokens" in given
            else:
                raise ValueError(f"sampling_params: expected an object, got {echo(given)}")
            self.limits.check_params(params)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return params, budget_given

    def _prompt(self, req: GenerateRequest) -> tuple[list[int], list[MultimodalItem] | None]:
        """The prompt's token ids (media pads in place) and its preprocessed media."""
        if (req.text is None) == (req.input_ids is None):
            raise RequestError("give exactly one of text and input_ids")
        if req.input_ids is not None:
            name = "input_ids"
            if not isinstance(req.input_ids, (list, tuple)):
                raise RequestError(f"input_ids: expected a list of token ids, got {echo(req.input_ids)}")
            ids = list(req.input_ids)
            self._check_length(len(ids), name)  # before the O(n) scan (media only add tokens)
            if not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):  # bool is no id
                raise RequestError(f"input_ids: every id must be an integer in [0, {self.vocab_size})")
        else:
            name = "text"
            if not isinstance(req.text, str):
                raise RequestError(f"text: expected a string, got {echo(req.text)}")
            check_prompt_chars(req.text, self.tokenizer, self.max_context_len, name)
            ids = self.tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens)
        images, videos = _as_list(req.image_data), _as_list(req.video_data)
        mm_items = None
        # A multimodal model checks every prompt: placeholders without images are an error too.
        if images or videos or self.mm_processor is not None:
            if self.mm_processor is None:
                raise RequestError(f"{'image_data' if images else 'video_data'}: this model takes no images or videos")
            try:
                ids, mm_items = self.mm_processor.process(ids, images, videos)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        if not ids:
            raise RequestError(f"{name}: the prompt is empty")
        self._check_length(len(ids), name)
        return ids, mm_items or None

    def _check_length(self, n: int, name: str) -> None:
        """The prompt leaves room for a token in the context and in the KV pool."""
        if n >= self.max_context_len:
            raise RequestError(f"{name}: the prompt has {n} tokens; the model's context length is {self.max_context_len}")
        if self.max_total_tokens is not None and n >= self.max_total_tokens:
            raise RequestError(f"{name}: the prompt has {n} tokens; the KV cache holds only {self.max_total_tokens}")

    def _check_grammar(self, params: SamplingParams) -> None:
        """Validate the constraint now (the backend compiles it within its limits, isolated when a
        compile could crash or stall), so an invalid one is a 400 before the request is queued."""
        from rxf.core.grammar import GrammarError

        constraint = params.grammar
        if constraint is None or self.grammar is None:
            return
        kind, text = constraint
        try:
            self.grammar.validate(kind, text)
        except GrammarError as exc:  # the backend's reason ("invalid regex: ...", or why it has none)
            raise RequestError(f"sampling_params.{kind}: {exc}") from None
