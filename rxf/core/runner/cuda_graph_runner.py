"""CUDA-graph decode: the model's DECODE forward captured once per batch-size bucket, then replayed.

A decode step of n requests replays the graph of the smallest captured bucket >= n; rows n.. of that
bucket are padding. Invariants:

- Padding rows feed token 0 at position 0, read through req_to_token row 0 with seq_len 1 (so they
  read `req_to_token[0, 0]`, always a valid slot index) and write their K/V to the reserved slot 0 of
  the KV pool. Their req_to_token entries are never written and their logits are dropped, so they
  cannot disturb a real request.
- Graph inputs live in static device buffers sized for the largest bucket; a step fills them in place
  (one host-to-device copy per dtype) before the backend's replay hook and the replay. Outputs live in
  the graphs' shared memory pool and stay valid only until the next replay. The logits of every bucket
  are rows of one tensor, the largest bucket's: a smaller bucket's capture hands those rows to the
  model's logits head (the one module with a `graph_output` attribute), which writes them instead of
  allocating its own. Kept per bucket, float32 logits of a 128k vocabulary took 2.2 GB over the
  default buckets to 256 rows and 19 GB to 768 (benchmarks/RESULTS.md, 2026-12-07: a start out of
  memory beside the KV pool).
- The eager decode path packs its inputs the same way (`DecodeInputs`), without padding, so both paths
  move a decode batch to the device in two copies and never synchronise the host.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rxf.core.forward import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from torch import nn

    from rxf.core.attention import AttentionBackend
    from rxf.core.config import CudaGraphConfig
    from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool

logger = logging.getLogger(__name__)

# Rows of the packed int64 inputs; the int32 pack holds seq_lens then prefix_lens.
INPUT_IDS, POSITIONS, REQ_POOL_INDICES, OUT_CACHE_LOC = range(4)
SEQ_LENS, PREFIX_LENS = range(2)


def capture_sizes(cfg: CudaGraphConfig, max_rows: int) -> list[int]:
    """Ascending bucket sizes. The largest is min(max_bs, max_rows), `max_rows` the most rows a decode
    forward can have (the running requests, or a speculative verify's rows): capturing a bigger one
    would only cost startup time."""
    limit = min(cfg.max_bs, max_rows)
    base = cfg.batch_sizes if cfg.batch_sizes is not None else [1, 2, 4, *range(8, cfg.max_bs + 1, 8)]
    return sorted({b for b in base if b < limit} | {limit})


def pick_bucket(sizes: list[int], bs: int) -> int | None:
    """The smallest size in ascending `sizes` that holds `bs` rows, or None when none does."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def fits_budget(elapsed_s: float, per_graph_s: float | None, graphs_left: int, budget_s: float) -> bool:
    """Whether `graphs_left` more captures of `per_graph_s` each (unknown before the first: yes) end
    within the budget. Asked for each bucket, largest first, counting it and every smaller one: a large
    bucket is skipped rather than a small one when time runs short."""
    return per_graph_s is None or elapsed_s + per_graph_s * graphs_left <= budget_s


@dataclass
class DecodeInputs:
    """One decode batch packed on the host: `bs` real rows, then padding up to `padded_bs`, then filler
    up to the pack's width (a graph's static buffers are always filled whole, in one copy)."""

    bs: int
    padded_bs: int
    ints: torch.Tensor  # CPU int64 [4, width]: input_ids, positions, req_pool_indices, out_cache_loc
    lens: torch.Tensor  # CPU int32 [2, width]: seq_lens, prefix_lens
    seq_lens_cpu: list[int]  # [padded_bs]
    prefix_lens_cpu: list[int]  # [padded_bs]

    @classmethod
    def pack(
        cls,
        input_ids: list[int],
        prefix_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: list[int],
        padded_bs: int,
        width: int | None = None,
    ) -> DecodeInputs:
        bs = len(input_ids)
        width = padded_bs if width is None else width
        if not bs <= padded_bs <= width:
            raise ValueError(f"decode batch of {bs} rows cannot be padded to {padded_bs} within {width}")
        pad = width - bs
        # A padding row: token 0 at position 0, req_to_token row 0, K/V into reserved slot 0, seq_len 1.
        zeros = [0] * pad
        prefix_lens = list(prefix_lens)
        ints = torch.tensor(
            [[*input_ids, *zeros], prefix_lens + zeros, [*req_pool_indices, *zeros], [*out_cache_loc, *zeros]],
            dtype=torch.int64,
        )
        seq_lens = [p + 1 for p in prefix_lens]
        lens = torch.tensor([seq_lens + [1] * pad, prefix_lens + zeros], dtype=torch.int32)
        n_pad = padded_bs - bs
        return cls(bs, padded_bs, ints, lens, seq_lens + [1] * n_pad, prefix_lens + [0] * n_pad)


@dataclass
class DecodeBuffers:
    """Device tensors of a decode batch; a graph's static inputs are one instance at the largest size."""

    ints: torch.Tensor  # int64 [4, width]
    lens: torch.Tensor  # int32 [2, width]
    extend_lens: torch.Tensor  # int32 [width], all ones
    logits_indices: torch.Tensor  # int64 [width], 0..width-1: decode returns every row's logits (or the rows asked)

    @classmethod
    def allocate(cls, width: int, device: torch.device) -> DecodeBuffers:
        return cls(
            torch.zeros(4, width, dtype=torch.int64, device=device),
            torch.zeros(2, width, dtype=torch.int32, device=device),
            torch.ones(width, dtype=torch.int32, device=device),
            torch.arange(width, dtype=torch.int64, device=device),
        )

    @classmethod
    def upload(cls, host: DecodeInputs, device: torch.device, logits_rows: list[int] | None = None) -> DecodeBuffers:
        """Fresh tensors for an eager or compiled forward, with the logits of `logits_rows` (default:
        every row's). Copies from pageable memory with non_blocking=True are staged before the call
        returns, so the host tensors may be dropped at once, and the host does not wait for the device."""
        if logits_rows is None:
            logits_indices = torch.arange(host.padded_bs, dtype=torch.int64, device=device)
        else:
            logits_indices = torch.tensor(logits_rows, dtype=torch.int64).to(device, non_blocking=True)
        return cls(
            host.ints.to(device, non_blocking=True),
            host.lens.to(device, non_blocking=True),
            torch.ones(host.padded_bs, dtype=torch.int32, device=device),
            logits_indices,
        )

    def fill(self, host: DecodeInputs) -> None:
        """In place, whole buffers at once (the pack has this width): addresses the graphs captured."""
        self.ints.copy_(host.ints, non_blocking=True)
        self.lens.copy_(host.lens, non_blocking=True)

    def write_req_to_token(self, table: torch.Tensor, bs: int) -> None:
        """req_to_token[row, position] = slot for the first `bs` (real) rows only."""
        rows, positions = self.ints[REQ_POOL_INDICES, :bs], self.ints[POSITIONS, :bs]
        table[rows, positions] = self.ints[OUT_CACHE_LOC, :bs].to(torch.int32)

    def forward_batch(
        self,
        host: DecodeInputs,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: TokenToKVPool,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        n = host.padded_bs
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=n,
            input_ids=self.ints[INPUT_IDS, :n],
            positions=self.ints[POSITIONS, :n],
            req_pool_indices=self.ints[REQ_POOL_INDICES, :n],
            seq_lens=self.lens[SEQ_LENS, :n],
            prefix_lens=self.lens[PREFIX_LENS, :n],
            extend_lens=self.extend_lens[:n],
            out_cache_loc=self.ints[OUT_CACHE_LOC, :n],
            seq_lens_cpu=host.seq_lens_cpu,
            prefix_lens_cpu=host.prefix_lens_cpu,
            extend_lens_cpu=[1] * n,
            logits_indices=self.logits_indices[:n],
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
        )


class CudaGraphRunner:
    """Captures at construction (bounded by `budget_s`), then `replay`s decode batches that fit a bucket.

    Must be constructed and used inside `torch.inference_mode()` (the static buffers are inference
    tensors, written in place by every step).
    """

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: TokenToKVPool,
        sizes: list[int],
        budget_s: float,
        device: torch.device,
        spec_hidden: tuple[int, torch.dtype] | None = None,
    ) -> None:
        """`spec_hidden` = (width, dtype): a draft head's graphs, whose rows also take a hidden state
        each (`ForwardBatch.spec_hidden`, copied into a static buffer before each replay)."""
        if not attn_backend.supports_cuda_graph:
            raise ValueError(f"{type(attn_backend).__name__} does not support CUDA graphs")
        self.model = model
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.width = max(sizes)
        self.buffers = DecodeBuffers.allocate(self.width, device)
        self.hidden = None if spec_hidden is None else torch.zeros(self.width, spec_hidden[0], dtype=spec_hidden[1],
                                                                   device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per bucket: the logits and the model's `ForwardBatch.aux_hidden` (None unless it sets them).
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.warm_up_s = self.capture_s = 0.0  # startup cost, for logs and benchmarks
        attn_backend.init_cuda_graph_state(self.width)
        self._capture_all(sorted(sizes, reverse=True), budget_s)
        self.sizes = sorted(self.graphs)  # what was captured; other sizes run eagerly

    def can_run(self, mode: ForwardMode, bs: int) -> bool:
        return mode.is_decode() and pick_bucket(self.sizes, bs) is not None

    def pack(self, input_ids: list[int], prefix_lens: list[int], rows: list[int], slots: list[int]) -> DecodeInputs:
        """The batch padded to its bucket (call only when `can_run`)."""
        bucket = pick_bucket(self.sizes, len(input_ids))
        assert bucket is not None, "pack() needs a batch that can_run()"
        return DecodeInputs.pack(input_ids, prefix_lens, rows, slots, bucket, self.width)

    def replay(
        self, host: DecodeInputs, patch: Callable[[torch.Tensor], None] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 logits `[host.bs, vocab]` and the auxiliary hidden states (if the model gives them):
        views into graph memory, valid until the next replay. `patch(input_ids)` may then rewrite
        input ids on the device (tokens the host does not know). `hidden`: a draft head's rows' states
        (required by, and only by, graphs captured with `spec_hidden`)."""
        if (hidden is None) != (self.hidden is None):
            raise ValueError("a draft head's graphs take hidden states, and only they do")
        self.buffers.fill(host)
        if hidden is not None:
            self.hidden[: host.bs].copy_(hidden)
        if patch is not None:
            patch(self.buffers.ints[INPUT_IDS])
        self.buffers.write_req_to_token(self.req_to_token_pool.req_to_token, host.bs)
        batch = self._batch(host)
        self.attn_backend.init_forward_metadata_replay(batch)
        self.graphs[host.padded_bs].replay()
        logits, aux = self.outputs[host.padded_bs]
        return logits[: host.bs], None if aux is None else aux[: host.bs]

    def _batch(self, host: DecodeInputs) -> ForwardBatch:
        batch = self.buffers.forward_batch(host, self.req_to_token_pool, self.token_to_kv_pool, self.attn_backend)
        if self.hidden is not None:
            batch.spec_hidden = self.hidden[: host.padded_bs]
        return batch

    def _capture_all(self, descending: list[int], budget_s: float) -> None:
        """Largest first, so smaller graphs reuse the memory the largest one took from the shared pool.

        The budget favours small buckets (decode latency at low load matters most; see `fits_budget`),
        estimating each capture to take as long as the previous (larger) one did.
        """
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # First-use work (JIT kernel compilation, library handles) happens here, outside the budget:
        # it is paid once whether or not graphs are captured.
        t0 = time.perf_counter()
        self._warm_up(self.width)
        start = time.perf_counter()
        self.warm_up_s = start - t0
        last_s: float | None = None
        skipped: list[int] = []
        heads = [m for m in self.model.modules() if hasattr(m, "graph_output")]
        head = heads[0] if len(heads) == 1 else None
        shared: torch.Tensor | None = None  # the largest bucket's logits (see the module docstring)
        for i, bs in enumerate(descending):
            if not fits_budget(time.perf_counter() - start, last_s, len(descending) - i, budget_s):
                skipped.append(bs)
                continue
            began = time.perf_counter()
            batch = self._warm_up(bs)  # per size: lazily compiled kernel variants must exist before capture
            graph = torch.cuda.CUDAGraph()
            if head is not None and shared is not None:
                head.graph_output = shared[:bs]
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model(batch)
            finally:
                if head is not None:
                    head.graph_output = None
            if shared is None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous():
                shared = logits
            self.outputs[bs] = (logits, batch.aux_hidden)  # the captured forward's tensors
            self.graphs[bs] = graph
            torch.cuda.synchronize()
            last_s = time.perf_counter() - began
        self.capture_s = time.perf_counter() - start
        if skipped:
            logger.warning(
                "CUDA graphs: capture budget of %.0fs spent; batch sizes %s run eagerly "
                "(raise cuda_graph.capture_budget_s or lower cuda_graph.max_bs)",
                budget_s,
                sorted(skipped),
            )
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (%s) in %.1fs, after a first-use warm-up of %.1fs",
            len(self.graphs),
            ", ".join(map(str, sorted(self.graphs))),
            self.capture_s,
            self.warm_up_s,
        )

    def _warm_up(self, bs: int) -> ForwardBatch:
        """An eager forward of `bs` padding rows over the static buffers, with capture metadata."""
        host = DecodeInputs.pack([], [], [], [], bs, self.width)
        self.buffers.fill(host)
        batch = self._batch(host)
        self.attn_backend.init_forward_metadata_capture(batch)
        self.model(batch)
        torch.cuda.synchronize()
        return batch
