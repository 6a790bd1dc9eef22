"""The model runner: weights onto the device, the KV pools (sized by `kv_sizing`; device, dtype and
attention backend chosen by `startup`), and the one place where the scheduler's plain data becomes
device tensors (DESIGN §4: the scheduler never builds them).

Owns, per scheduler process: the model, the two-level KV pool and the attention backend. A forward
takes a `ModelInput` (CPU lists and slot tensors), writes the batch's slots into `req_to_token`,
builds the `ForwardBatch` and returns float32 logits for the rows the scheduler asked for. DECODE
batches go through `cuda_graph_runner`'s packed inputs (two host-to-device copies, no host sync) and,
on GPU, are replayed from a captured CUDA graph when one fits; on the CPU they run the forward
compiled whole (`compiled_decode`) once it is ready.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from rxf.core import quantization
from rxf.core.attention import AttentionContext, AttentionLayer
from rxf.core.config import EngineConfig
from rxf.core.forward import ForwardBatch, ForwardMode
from rxf.core.ipc.messages import MultimodalItem
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool, is_fp8, kv_storage_dtype
from rxf.core.pooling import Pooling
from rxf.core.registry import PluginRegistry
from rxf.core.runner import distributed
from rxf.core.runner.compiled_decode import CompiledDecode
from rxf.core.runner.cuda_graph_runner import (
    INPUT_IDS,
    CudaGraphRunner,
    DecodeBuffers,
    DecodeInputs,
    capture_sizes,
)
from rxf.core.runner.kv_sizing import check_pool_memory, slots_from_memory
from rxf.core.runner.startup import (
    eos_token_ids,
    overlap_enabled,
    resolve_device,
    resolve_dtype,
    select_attention_backend,
)
from rxf.core.runner.step_io import StepBatch, StepResult
from rxf.core.runner.step_runner import StepExecutor, StepHandle
from rxf.core.weight_loader import fill_random_weights, iter_safetensors

if TYPE_CHECKING:
    from rxf.core.runner.cpu_threads import CpuThreads

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    """One forward as the scheduler describes it: requests, token counts and slots, all on the CPU.

    Extend: request i computes its tokens [prefix_lens[i], prefix_lens[i] + extend_lens[i]). Decode:
    extend_lens are all 1. Either way its req_to_token row already holds the slots of its first
    prefix_lens[i] tokens, except where `row_writes[i]` = (start, slots) gives the slots of
    positions [start, start + len(slots)) (a new request's cached prefix, or entries the radix cache
    re-pointed); the runner writes them before the forward.
    """

    mode: ForwardMode  # PREFILL/EXTEND or DECODE
    req_pool_indices: list[int]  # req_to_token rows
    input_ids: list[int]  # new tokens, flattened in request order
    prefix_lens: list[int]  # tokens already in the KV pool
    extend_lens: list[int]  # new tokens per request (all 1 for decode)
    out_cache_loc: torch.Tensor  # CPU int64 [num_tokens]: the slot of each new token
    row_writes: list[tuple[int, torch.Tensor] | None] | None = None  # per request: (start, CPU slots)
    logits_start: list[int] | None = None  # extend: first new-token index with logits (default: last)
    # extend: each request's images/videos (None for text-only ones), whose features the model
    # writes over the pad tokens that fall in this forward's new tokens.
    mm_items: list[list[MultimodalItem] | None] | None = None
    # Input tokens the previous step sampled and the host has not read (their input_ids entries
    # are placeholders): overlap scheduling, and a draft head's own drafts.
    pending: PendingTokens | None = None
    # A draft head's forward (EAGLE-3): the hidden state of each new token, on the device
    # (`ForwardBatch.spec_hidden`).
    hidden: torch.Tensor | None = None
    # A tree verify: per request, the parent of each draft (its new tokens after the first; -1: the
    # first, the request's newest token), or None for a chain. Draft j sits at position
    # prefix_lens[i] + its depth and attends to the prefix, the newest token and its ancestors.
    tree_parents: list[list[int] | None] | None = None


@dataclass
class PendingTokens:
    """`input_ids[index[j]] = source[rows[j]]` on the device, before the forward reads them."""

    index: list[int]
    rows: list[int]
    source: torch.Tensor  # device int64: the previous step's sampled ids

    def apply(self, input_ids: torch.Tensor) -> None:
        pairs = torch.tensor([self.index, self.rows], dtype=torch.int64).to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, pairs[0], self.source.index_select(0, pairs[1]))


def _as_decode_rows(inp: ModelInput, rows: list[int], positions: list[int]) -> ModelInput:
    """`inp`'s new tokens as DECODE rows: token j on req_to_token row rows[j] at positions[j]."""
    return ModelInput(
        mode=ForwardMode.DECODE,
        req_pool_indices=rows,
        input_ids=inp.input_ids,
        prefix_lens=positions,
        extend_lens=[1] * len(rows),
        out_cache_loc=inp.out_cache_loc,
        pending=inp.pending,  # indexes input_ids, whose order is unchanged
    )


class ModelRunner:
    def __init__(
        self, config: EngineConfig, registry: PluginRegistry, model_path: str, *,
        aux_hidden_layers: tuple[int, ...] = (), draft_of: ModelRunner | None = None,
        threads: CpuThreads | None = None, thread_counts: tuple[int, ...] | None = None,
        catches_up: bool = False,
    ) -> None:
        """`aux_hidden_layers`: the target of an EAGLE-3 head, whose forwards also give the inputs of
        these layers (`forward_with_aux`). `draft_of`: this runner holds a draft head (an EAGLE-3 head)
        that runs beside the runner `draft_of`: it reads that runner's req_to_token rows and serves
        its context, and its KV pool has that runner's slots (one more set of layers over the same slot
        numbers, so whatever holds a slot, a request or the radix cache, holds the head's K/V too).
        `threads`: the CPU thread count chosen before each forward (else torch's, or
        `runtime.cpu_threads`, stays). `thread_counts`: without `threads`, the counts the caller
        will run forwards at (what CPU kernels are compiled for; default: the current count).
        `catches_up`: a draft model's runner, whose short extends over the tokens a verify accepted run
        as decode rows of one request (`_extend_rows`), as a speculative target's verifies do."""
        start = time.perf_counter()
        self.config = config
        self.draft_of = draft_of
        self.aux_hidden_layers = aux_hidden_layers
        # Whether a decode batch may hold several rows of one request (AttentionContext.multi_row_decode)
        self.multi_row_decode = catches_up or draft_of is not None or config.speculative.method != "none"
        self.threads = threads
        if config.runtime.cpu_threads:
            torch.set_num_threads(config.runtime.cpu_threads)
        # The counts forwards may run at (what CPU kernels are compiled for), the fewer first.
        self.thread_counts = threads.counts if threads is not None else thread_counts or (torch.get_num_threads(),)
        torch.manual_seed(config.runtime.seed)
        self.device = resolve_device(config.runtime.device)
        self.hf_config = AutoConfig.from_pretrained(
            model_path, trust_remote_code=config.model.trust_remote_code
        )
        text = self.hf_config.get_text_config()  # the language model's config (itself, unless multimodal)
        self.dtype = resolve_dtype(config.model.dtype, self.hf_config, self.device)
        self.vocab_size: int = text.vocab_size
        model_cls = registry.model_class(self.hf_config.architectures or [])
        if getattr(model_cls, "is_draft_head", False) != (draft_of is not None):
            raise ValueError(
                f"{model_path}: {model_cls.__name__} is a draft head; serve it as speculative.draft_model_path"
                if draft_of is None else f"{model_path}: {model_cls.__name__} is not a draft head"
            )
        # A class may say how long a context its checkpoint serves (rope scaling can extend
        # max_position_embeddings); it is then told the context it serves (`context_length=`).
        # A draft head serves its target's positions.
        supported = getattr(model_cls, "max_context_length", None)
        if draft_of is not None:
            if self.vocab_size != draft_of.vocab_size:
                raise ValueError(f"its vocab_size {self.vocab_size} is not the target's {draft_of.vocab_size}")
            checkpoint_len = draft_of.max_context_len
        else:
            checkpoint_len = int(supported(self.hf_config) if supported else text.max_position_embeddings)
        self.max_context_len = config.model.context_length or checkpoint_len
        if self.max_context_len > checkpoint_len:
            raise ValueError(
                f"model.context_length {self.max_context_len} exceeds the {checkpoint_len} tokens the checkpoint "
                f"supports (max_position_embeddings {text.max_position_embeddings}, and its rope scaling)"
            )
        served = {"context_length": self.max_context_len} if supported or draft_of is not None else {}
        random_weights = config.model.load_format == "random"
        method = quantization.select_method(registry, self.hf_config, config.model.quantization, self.dtype,
                                            getattr(model_cls, "native_quant_methods", ()))
        if method is not None and random_weights and method.quant_config is not None:
            raise ValueError("model.load_format 'random' draws dense weights; it cannot serve a quantized checkpoint "
                             "(a method that quantizes at load, model.quantization = 'fp8', quantizes them)")
        # Checked before the model is built: a missing or empty checkpoint raises now.
        weights = None
        if not random_weights:
            weights = method.checkpoint_weights(model_path) if method is not None else None
            weights = iter_safetensors(model_path) if weights is None else weights
        with torch.device(self.device), quantization.building(method):
            self.model = model_cls(self.hf_config, dtype=self.dtype, **served)
        quantization.materialize(self.model, method, self.device)
        if weights is None:
            fill_random_weights(self.model, config.runtime.seed)
        else:
            self.model.load_weights(weights)
        quantization.finish_loading(self.model)
        self.model.eval()
        if aux_hidden_layers:
            capture = getattr(self.model, "capture_aux_hidden_states", None)
            if capture is None:
                raise ValueError(
                    f"speculative.method 'eagle3': {model_cls.__name__} cannot give the hidden states an EAGLE-3 "
                    "head reads (Llama-family targets can)"
                )
            capture(aux_hidden_layers)  # before CUDA graphs are captured: they must return them too
        # An embedding model pools the final hidden states (`hidden_states`) and computes no logits.
        self.pooling = None
        if config.model.task == "embed":
            if not callable(getattr(self.model, "hidden_states", None)):
                raise ValueError(
                    f"model.task = 'embed': {model_cls.__name__} cannot serve embeddings (it gives no hidden_states)"
                )
            self.pooling = Pooling.from_checkpoint(model_path, self.hf_config, config.model.pooling, config.model.normalize)
            logger.info("embedding model: %s pooling, normalize %s", self.pooling.method, self.pooling.normalize)
        feature_cache = getattr(self.model, "feature_cache", None)  # multimodal models' vision features
        if feature_cache is not None:
            feature_cache.max_bytes = config.multimodal.feature_cache_mb * 2**20
        self.eos_token_ids = eos_token_ids(model_path, self.hf_config)
        self._init_memory(text)
        layers = [m for m in self.model.modules() if isinstance(m, AttentionLayer)]
        backend_cls = select_attention_backend(registry, config.attention.backend, self.device, layers, is_fp8(self.kv_dtype))
        self.attn_backend = backend_cls(self._attention_context)
        # A draft head is captured by its loader once it is whole (it may share the target's embedding).
        self.cuda_graphs = self._init_cuda_graphs() if draft_of is None else None
        self.compiled_decode = self._init_compiled_decode()
        # Overlap scheduling: `launch` returns before the step is done (CUDA: the work is only
        # enqueued; CPU: it runs in a worker thread) and the scheduler plans the next one meanwhile.
        self.overlap = overlap_enabled(config, self.device)
        self._steps = StepExecutor(self, background=self.overlap and self.device.type != "cuda")
        logger.info(
            "loaded %s (%s, %s) on %s in %.1fs; KV pool: %d tokens of %s (%.2f GiB), context %d",
            model_path,
            model_cls.__name__,
            str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - start,
            self.max_total_tokens,
            str(self.kv_dtype).removeprefix("torch."),
            self.max_total_tokens * self.token_to_kv_pool.bytes_per_slot() / 2**30,
            self.max_context_len,
        )

    def _init_memory(self, text: Any) -> None:
        # KV layout per rank: the heads this rank's attention layers hold (kv heads replicated, one
        # per rank, when tp_size exceeds them; see QKVParallelLinear).
        tp = distributed.tp_size()
        num_heads = text.num_attention_heads // tp
        num_kv_heads = max(1, (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // tp)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        num_layers = text.num_hidden_layers
        max_running = self.config.scheduler.max_running_requests
        # What the pool stores: the model dtype, or FP8 (one byte an element: twice bf16's tokens).
        self.kv_dtype = kv_storage_dtype(self.config.cache.kv_dtype, self.dtype)
        if self.draft_of is not None:  # the target's rows and slot numbers
            self.max_total_tokens = self.draft_of.max_total_tokens
            self.req_to_token_pool = self.draft_of.req_to_token_pool
        else:
            # An EAGLE-3 head keeps one more layer's K/V per slot (its own pool, built without a
            # check of its own): counted here, in the sizing and in the check.
            sized_layers = num_layers + (1 if self.aux_hidden_layers else 0)
            bytes_per_slot = 2 * sized_layers * num_kv_heads * head_dim * self.kv_dtype.itemsize
            self.max_total_tokens = self.config.cache.max_total_tokens or slots_from_memory(
                self.config.cache, self.device, bytes_per_slot, max_running, self.max_context_len,
            )
            # Every rank's scheduler must admit the same requests: all size their pool like the fullest GPU.
            self.max_total_tokens = distributed.tp_min(self.max_total_tokens)
            # Tree drafts attend through scratch rows: one per verified node (`path_rows`).
            spec = self.config.speculative
            scratch = spec.max_batch_size * spec.num_draft_tokens if spec.tree_topk > 1 else 0
            check_pool_memory(
                self.device, self.max_total_tokens, self.max_context_len,
                self.max_total_tokens * bytes_per_slot,
                (max_running + scratch) * self.max_context_len * 4,
            )
            self.req_to_token_pool = ReqToTokenPool(max_running, self.max_context_len, self.device, scratch)
        self.token_to_kv_pool = TokenToKVPool(
            self.max_total_tokens, num_layers, num_kv_heads, head_dim, self.kv_dtype, self.device
        )
        self._attention_context = AttentionContext(
            self.req_to_token_pool,
            self.token_to_kv_pool,
            num_heads,
            num_kv_heads,
            head_dim,
            self.dtype,
            self.device,
            max_running,
            self.max_context_len,
            self.thread_counts,
            self.multi_row_decode,
        )

    def capture_cuda_graphs(self) -> None:
        """A draft head's CUDA graphs (if `cuda_graph.enabled`), once its weights are all in place."""
        assert self.draft_of is not None and self.cuda_graphs is None, "a target captures at construction"
        self.cuda_graphs = self._init_cuda_graphs()

    def _init_cuda_graphs(self) -> CudaGraphRunner | None:
        cfg = self.config.cuda_graph
        if self.device.type != "cuda" or not cfg.enabled or self.pooling is not None:
            return None  # (an embedding model never decodes)
        if not self.attn_backend.supports_cuda_graph:
            logger.info("CUDA graphs off: backend %s cannot be captured", type(self.attn_backend).__name__)
            return None
        # The most rows a decode forward has: every running request, or, when speculating, a short
        # extend's tokens (a verify: each speculating request's newest token and drafts;
        # `_extend_rows`).
        spec = self.config.speculative
        rows = self.config.scheduler.max_running_requests
        if spec.method != "none":
            rows = max(rows, spec.max_batch_size * (spec.num_draft_tokens + 1))
        sizes = capture_sizes(cfg, rows)
        # With tensor parallelism every rank must capture (and replay) the same sizes, since the
        # captured forwards meet in collectives; a time budget could cut them at different sizes.
        budget_s = cfg.capture_budget_s if distributed.tp_size() == 1 else float("inf")
        # A draft head's decode rows read a hidden state each (its own previous feature).
        hidden = (self.hf_config.hidden_size, self.dtype) if self.draft_of is not None else None
        with torch.inference_mode():
            return CudaGraphRunner(
                self.model,
                self.attn_backend,
                self.req_to_token_pool,
                self.token_to_kv_pool,
                sizes,
                budget_s,
                self.device,
                spec_hidden=hidden,
            )

    def _init_compiled_decode(self) -> CompiledDecode | None:
        when = self.config.runtime.cpu_compile
        if (
            self.device.type != "cpu"
            or when == "off"
            or self.pooling is not None  # an embedding model never decodes
            or distributed.tp_size() > 1  # (collectives are not traced)
            or not self.attn_backend.supports_compiled_decode
            # EAGLE-3: the target's decode also returns hidden states, a draft head reads them
            or self.aux_hidden_layers or self.draft_of is not None
        ):
            return None
        return CompiledDecode(self.model, self.attn_backend, self._attention_context, when)

    # ---- one scheduler step (the `StepRunner` protocol) ----
    def launch(self, batch: StepBatch) -> StepHandle:
        return self._steps.launch(batch)

    def resolve(self, handle: StepHandle) -> StepResult:
        return self._steps.resolve(handle)

    def start_profile(self, out_dir: Path, num_steps: int | None, kernels: bool) -> None:
        """Profile the steps from the next launch on (`rxf/core/runner/step_profiler.py`)."""
        self._steps.start_profile(out_dir, num_steps, kernels)

    def stop_profile(self) -> Path:
        return self._steps.stop_profile()

    # ---- forward ----
    def _validate(self, inp: ModelInput) -> None:
        """An internal invariant check, not request validation (the front door's
        `RequestPreparer` did that, and the scheduler plans only batches that fit): a batch that
        fails it is a bug in its caller, refused before it could write outside the pools."""
        bs = len(inp.req_pool_indices)
        if not bs or len(inp.prefix_lens) != bs or len(inp.extend_lens) != bs:
            raise ValueError(
                "req_pool_indices, prefix_lens and extend_lens must be non-empty and equal in length"
            )
        num_tokens = sum(inp.extend_lens)
        if len(inp.input_ids) != num_tokens or inp.out_cache_loc.numel() != num_tokens:
            raise ValueError(
                f"{num_tokens} new tokens by extend_lens, but {len(inp.input_ids)} input_ids and "
                f"{inp.out_cache_loc.numel()} out_cache_loc slots"
            )
        if min(inp.extend_lens) < 1 or (inp.mode.is_decode() and max(inp.extend_lens) != 1):
            raise ValueError(f"bad extend_lens for {inp.mode.name}: {inp.extend_lens}")
        longest = max(p + e for p, e in zip(inp.prefix_lens, inp.extend_lens, strict=True))
        if longest > self.max_context_len:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds the context length {self.max_context_len}"
            )
        if inp.row_writes is not None:
            if len(inp.row_writes) != bs or any(
                w is not None and not 0 <= w[0] <= w[0] + w[1].numel() <= p
                for w, p in zip(inp.row_writes, inp.prefix_lens, strict=True)
            ):
                raise ValueError("row_writes[i] must give slots of positions within request i's prefix")
        if inp.logits_start is not None and not all(
            0 <= s < e for s, e in zip(inp.logits_start, inp.extend_lens, strict=True)
        ):
            raise ValueError(f"logits_start {inp.logits_start} must lie within extend_lens {inp.extend_lens}")

    def _write_req_to_token(
        self, inp: ModelInput, rows: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> None:
        """req_to_token[row, pos] = slot for every row write and, when `positions` is given, every
        new token; one index_put."""
        r, c, v = [], [], []
        if positions is not None and rows is not None:
            r.append(rows.repeat_interleave(torch.tensor(inp.extend_lens)))
            c.append(positions)
            v.append(inp.out_cache_loc)
        for row, write in zip(inp.req_pool_indices, inp.row_writes or [], strict=False):
            if write is not None and write[1].numel():
                start, slots = write
                r.append(torch.full((slots.numel(),), row, dtype=torch.int64))
                c.append(torch.arange(start, start + slots.numel()))
                v.append(slots)
        if not r:
            return
        # non_blocking from pageable memory: staged before the call returns, and the host does not wait.
        index = (torch.cat(r).to(self.device, non_blocking=True), torch.cat(c).to(self.device, non_blocking=True))
        self.req_to_token_pool.req_to_token.index_put_(index, torch.cat(v).to(self.device, torch.int32, non_blocking=True))

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """float32 logits `[num_logits, vocab]` on the device: per request in order, its requested
        rows (decode: its one token; extend: new tokens logits_start[i].. or the last) ascending.
        An embedding model (`pooling` set) returns those rows' final hidden states instead."""
        return self.forward_with_aux(inp)[0]

    def forward_with_aux(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s result and what the model put in `ForwardBatch.aux_hidden` (None unless the model
        captures auxiliary hidden states or is a draft head), on the device."""
        self._validate(inp)
        if self.threads is None:
            return self._forward_with_aux(inp)
        self.threads.before_forward()
        try:
            return self._forward_with_aux(inp)
        finally:
            self.threads.after_forward()

    def _forward_with_aux(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        if inp.mode.is_decode():
            with torch.inference_mode():
                return self._forward_decode(inp)
        if inp.tree_parents is not None:
            with torch.inference_mode():
                self._write_req_to_token(inp)  # first: the scratch rows copy the requests' rows
                return self._forward_decode(self._tree_rows(inp))
        rows = self._extend_rows(inp)
        if rows is not None:
            with torch.inference_mode():
                self._write_req_to_token(inp)  # the requests' row writes; the rows' slots go with the packed inputs
                return self._forward_decode(rows, self._logits_rows(inp))
        bs = len(inp.req_pool_indices)
        extend_lens = torch.tensor(inp.extend_lens)
        prefix_lens = torch.tensor(inp.prefix_lens)
        token_starts = extend_lens.cumsum(0) - extend_lens
        num_tokens = len(inp.input_ids)
        # Token t of request i sits at absolute position prefix_lens[i] + (t - token_starts[i]).
        positions = torch.arange(num_tokens) - (token_starts - prefix_lens).repeat_interleave(extend_lens)
        rows = torch.tensor(inp.req_pool_indices, dtype=torch.int64)
        if inp.logits_start is None:
            logits_indices = token_starts + extend_lens - 1
        else:
            logits_indices = torch.cat(
                [
                    torch.arange(s + first, s + n)
                    for s, first, n in zip(
                        token_starts.tolist(), inp.logits_start, inp.extend_lens, strict=True
                    )
                ]
            )
        seq_lens = prefix_lens + extend_lens
        dev, nb = self.device, True  # non_blocking: see _write_req_to_token
        with torch.inference_mode():
            self._write_req_to_token(inp, rows, positions)
            input_ids = torch.tensor(inp.input_ids, dtype=torch.int64).to(dev, non_blocking=nb)
            if inp.pending is not None:
                inp.pending.apply(input_ids)
            batch = ForwardBatch(
                mode=inp.mode,
                batch_size=bs,
                input_ids=input_ids,
                positions=positions.to(dev, non_blocking=nb),
                req_pool_indices=rows.to(dev, non_blocking=nb),
                seq_lens=seq_lens.to(dev, torch.int32, non_blocking=nb),
                prefix_lens=prefix_lens.to(dev, torch.int32, non_blocking=nb),
                extend_lens=extend_lens.to(dev, torch.int32, non_blocking=nb),
                out_cache_loc=inp.out_cache_loc.to(dev, torch.int64, non_blocking=nb),
                seq_lens_cpu=seq_lens.tolist(),
                prefix_lens_cpu=list(inp.prefix_lens),
                extend_lens_cpu=list(inp.extend_lens),
                logits_indices=logits_indices.to(dev, non_blocking=nb),
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool=self.token_to_kv_pool,
                attn_backend=self.attn_backend,
                mm_items=inp.mm_items,
                spec_hidden=inp.hidden,
            )
            self.attn_backend.init_forward_metadata(batch)
            out = self.model.hidden_states(batch) if self.pooling is not None else self.model(batch)
            return out, batch.aux_hidden

    def _extend_rows(self, inp: ModelInput) -> ModelInput | None:
        """An extend as DECODE rows through a captured or compiled decode forward, or None (it runs as
        the extend it is). Token t of request i becomes a row of request i's req_to_token row at
        position prefix_lens[i] + t, which attends up to itself (seq_len prefix_lens[i] + t + 1): exact
        where the backend says `verifies_as_decode`, else only with one new token a request; only the
        rows whose logits the extend asks for get them (`_logits_rows`), auxiliary states stay per
        token as an extend gives them. No images, no pooling, not a draft head's forward (its graphs
        take its own rows' states). The caller writes `inp`'s row writes.
        - CUDA: short extends (at most `speculative.num_draft_tokens` + 1 new tokens per request: a
          speculative verify, a draft model's catch-up over the tokens a verify accepted, a prompt's
          last few uncached tokens) that a graph holds: on the H200 a 9-token verify replayed costs
          1.07x a decode step against 3.7x as an eager extend (benchmarks/RESULTS.md).
        - CPU: every extend once the decode forward is compiled for this thread count: the backend's
          op reads an extend's tokens as such rows anyway (`plugins/attention/cpu.py`), and compiled,
          the forward's norms, rope and activations fuse as decode's do (issue 22)."""
        if self.pooling is not None or inp.mm_items is not None or inp.hidden is not None:
            return None
        if not self.attn_backend.verifies_as_decode and max(inp.extend_lens) > 1:
            return None  # one row a request still does (a prompt whose last token alone is uncached)
        compiled = self.compiled_decode
        compiled_rows = compiled is not None and compiled.ready_for(torch.get_num_threads())
        short = max(inp.extend_lens) <= self.config.speculative.num_draft_tokens + 1
        if not compiled_rows and not (short and self._replays(len(inp.input_ids))):
            return None
        rows: list[int] = []
        positions: list[int] = []
        for row, prefix, n in zip(inp.req_pool_indices, inp.prefix_lens, inp.extend_lens, strict=True):
            rows += [row] * n
            positions += range(prefix, prefix + n)
        return _as_decode_rows(inp, rows, positions)

    def _tree_rows(self, inp: ModelInput) -> ModelInput:
        """A tree verify as DECODE rows (replayed from a graph where a bucket holds them, else eager):
        each request's newest token on its own row at position prefix_lens[i], draft j on a scratch
        row (`path_rows`) holding the request's prefix and the slots of the newest token and of j's
        ancestors, at position prefix_lens[i] + depth(j). A chain in the batch (parents None) stays
        on its own row, as `_extend_rows` puts it: its row then holds every verified slot at
        its position, as the scheduler's bookkeeping of a chain expects. Its logits are every row's."""
        assert inp.tree_parents is not None
        if not self.attn_backend.verifies_as_decode:
            raise ValueError(f"{type(self.attn_backend).__name__} cannot verify tree drafts (verifies_as_decode)")
        if inp.logits_start is None or any(inp.logits_start) or inp.mm_items is not None:
            raise ValueError("a tree verify asks for every new token's logits and carries no images")
        slots = inp.out_cache_loc.tolist()
        rows, positions, src, starts, paths = [], [], [], [], []
        first = 0
        for row, prefix, n, parents in zip(inp.req_pool_indices, inp.prefix_lens, inp.extend_lens, inp.tree_parents,
                                           strict=True):
            mine = slots[first : first + n]
            first += n
            if parents is None:  # a chain: its own row, consecutive positions
                rows += [row] * n
                positions += range(prefix, prefix + n)
                continue
            if len(parents) != n - 1 or any(not -1 <= p < j for j, p in enumerate(parents)):
                raise ValueError(f"tree_parents {parents}: each draft's parent must come before it")
            rows.append(row)
            positions.append(prefix)
            node_paths: list[list[int]] = []
            for j, p in enumerate(parents):
                path = (node_paths[p] if p >= 0 else [mine[0]]) + [mine[1 + j]]
                node_paths.append(path)
                src.append(row)
                starts.append(prefix)
                paths.append(path)
                positions.append(prefix + len(path) - 1)
            rows += [-1] * len(parents)  # filled with scratch rows below
        scratch = iter(self.path_rows(src, starts, paths))
        return _as_decode_rows(inp, [r if r >= 0 else next(scratch) for r in rows], positions)

    def path_rows(self, src: list[int], starts: list[int], paths: list[list[int]]) -> list[int]:
        """Scratch rows of req_to_token, one per j: row src[j]'s entries before starts[j], then the
        slots paths[j] (written on the device now, in stream order before the next forward)."""
        scratch = self.req_to_token_pool.scratch_rows
        if len(src) > len(scratch):
            raise ValueError(f"{len(src)} tree rows, {len(scratch)} scratch rows (speculative.tree_topk sizes them)")
        rows = list(scratch[: len(src)])
        table = self.req_to_token_pool.req_to_token
        width = max(starts, default=0)
        dev = self.device
        with torch.inference_mode():
            if width:
                index = torch.tensor([rows, src], dtype=torch.int64).to(dev, non_blocking=True)
                table[index[0], :width] = table[index[1], :width]
            r = [row for row, path in zip(rows, paths, strict=True) for _ in path]
            c = [s + k for s, path in zip(starts, paths, strict=True) for k in range(len(path))]
            v = [slot for path in paths for slot in path]
            if r:
                pairs = torch.tensor([r, c, v], dtype=torch.int64).to(dev, non_blocking=True)
                table[pairs[0], pairs[1]] = pairs[2].to(torch.int32)
        return rows

    @staticmethod
    def _logits_rows(inp: ModelInput) -> list[int] | None:
        """The token rows whose logits an extend asks for (None: all of them): per request, its new
        tokens from logits_start[i] (default: its last) on."""
        starts = inp.logits_start or [n - 1 for n in inp.extend_lens]
        if not any(starts):
            return None
        wanted, first = [], 0
        for start, n in zip(starts, inp.extend_lens, strict=True):
            wanted += range(first + start, first + n)
            first += n
        return wanted

    def _replays(self, rows: int) -> bool:
        """Whether a decode forward of this many rows replays a captured graph."""
        return self.cuda_graphs is not None and self.cuda_graphs.can_run(ForwardMode.DECODE, rows)

    def _forward_decode(
        self, inp: ModelInput, logits_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replayed from a CUDA graph when a captured bucket holds the batch, else compiled (CPU, once
        ready) or eager; either way the inputs reach the device in two non-blocking copies and only
        real rows write req_to_token. Logits of the rows `logits_rows` (default: every row's)."""
        self._write_req_to_token(inp)  # row writes only: new tokens' slots go with the packed inputs
        ids = [0 if t < 0 else t for t in inp.input_ids]  # placeholders of pending tokens, patched below
        args = (ids, inp.prefix_lens, inp.req_pool_indices, inp.out_cache_loc.tolist())
        patch = inp.pending.apply if inp.pending is not None else None
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(inp.mode, len(inp.input_ids)):
            logits, aux = graphs.replay(graphs.pack(*args), patch, inp.hidden)
            if logits_rows is not None:
                logits = logits.index_select(0, torch.tensor(logits_rows).to(logits.device, non_blocking=True))
            # The next replay overwrites graph memory, and the auxiliary states are read after the
            # step (when the next one may already have run, with overlap): copied out.
            return logits, None if aux is None else aux.clone()
        host = DecodeInputs.pack(*args, padded_bs=len(inp.input_ids))
        wanted = logits_rows
        if wanted is not None and len(wanted) == 1 < host.bs:
            # Two logits rows, the second dropped: the compiled graph of several rows was traced with
            # several (a dynamic size of 1 would be specialized, and the forward run eagerly).
            wanted = wanted * 2
        dev = DecodeBuffers.upload(host, self.device, wanted)
        if patch is not None:
            patch(dev.ints[INPUT_IDS])
        dev.write_req_to_token(self.req_to_token_pool.req_to_token, host.bs)
        batch = dev.forward_batch(host, self.req_to_token_pool, self.token_to_kv_pool, self.attn_backend)
        batch.spec_hidden = inp.hidden
        self.attn_backend.init_forward_metadata(batch)
        compiled = self.compiled_decode
        ready = compiled is not None and compiled.ready_for(torch.get_num_threads())
        logits = compiled(batch) if ready else self.model(batch)
        if len(logits) != len(batch.logits_indices):
            raise RuntimeError(f"{type(self.model).__name__} returned {len(logits)} rows of logits for "
                               f"{len(batch.logits_indices)} logits_indices (a model returns those rows only)")
        if wanted is not logits_rows:
            logits = logits[:1]
        return logits, batch.aux_hidden
