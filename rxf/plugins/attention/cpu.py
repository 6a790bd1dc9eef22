"""The CPU attention backend: one C++ op (`cpu_decode.py`) per layer for every forward, reading K/V
from the paged pool in place by slot (never copied out), in float32 whatever the model's dtype.

- DECODE: a row per request, its one new token over its keys.
- EXTEND / MIXED: a row per new token, over its request's keys up to itself. The op scores rows
  whose keys nest (one request's new tokens) together, causally: each block of keys is read and
  converted once for all the rows that see it, so a prompt chunk costs what a flash kernel's causal
  pass does (at the demo's shapes 1.35-1.8x faster than SDPA's CPU flash kernel over gathered K/V,
  bf16; benchmarks/RESULTS.md, issue 22), and rows past a prefix shared through the radix cache read
  that prefix once for all of them.

Every feature torch_native has (GQA, sliding windows, soft-caps, sinks, an FP8 pool dequantized
with the layer's scales as `rxf.core.kv_pool` defines) runs in both modes. The op is built once per
machine (~20 s) and loaded (milliseconds) in a background thread (`COMPILE_ENV`); until it is ready,
and for good without a working C++ compiler (with a warning), the forwards are torch_native's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rxf.core.attention import AttentionContext, AttentionLayer
from rxf.core.runner.cpu_threads import start_background_compile
from rxf.plugins.attention.cpp_build import prepare_build
from rxf.plugins.attention.cpu_decode import SOURCE, decode_attention_op
from rxf.plugins.attention.torch_native import TorchNativeBackend

if TYPE_CHECKING:
    from rxf.core.forward import ForwardBatch

logger = logging.getLogger(__name__)

# When the op is built or loaded: "background" (default: start-up does not wait; the forwards run
# torch_native's until it is ready: milliseconds once built, ~20 s of one core the first time on a
# machine) or "startup" (the backend's constructor waits: what benchmarks and tests want).
COMPILE_ENV = "RXF_CPU_ATTENTION_COMPILE"


class CpuBackend(TorchNativeBackend):
    auto_priority = 5  # above torch_native (0) on the CPU; GPU backends rank above it on CUDA
    supports_compiled_decode = True

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return device.type == "cpu"

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        # Planned by init_forward_metadata for the op, shared by all layers of one forward:
        # (self._slots: the op's table of slots, [requests, longest sequence])
        self._slot_rows = torch.empty(0, dtype=torch.int64)  # [rows]: each row's request's row in self._slots
        self._row_lens = torch.empty(0, dtype=torch.int32)  # [rows]: the keys a row sees (its position + 1)
        self._from_first = torch.empty(0, dtype=torch.int32)  # [rows] zeros: the first visible key without a window
        # Made once, so that a decode forward creates and caches nothing (a forward compiled whole must
        # not mutate Python state), as inference tensors like the runner's (dynamo guards on the kind).
        with torch.inference_mode():
            self._no_sinks = torch.full((ctx.num_heads,), float("-inf"), device=ctx.device)  # float32 [heads]: no sink
            self._unit_scale = torch.ones((), dtype=torch.float32, device=ctx.device)  # a model-dtype pool's scale
        # Until the op is ready the forwards are torch_native's: the same results up to rounding (in
        # bf16 its SDPA rounds the softmax weights to bf16, the op keeps float32).
        self._op: Callable[..., torch.Tensor] | None = None
        self._step_op = self._op
        self.compiled = threading.Event()  # set once compiling is over, done or failed
        when = os.environ.get(COMPILE_ENV, "background")
        if when not in ("background", "startup"):
            raise ValueError(f"{COMPILE_ENV}={when!r}: must be 'background' or 'startup'")
        if when == "startup":
            self._compile()
        else:
            prepare_build(SOURCE)
            start_background_compile(self._compile, "rxf-cpu-attention-compile")

    def wait_compiled(self) -> None:
        self.compiled.wait()

    def _compile(self) -> None:
        start = time.perf_counter()
        try:
            self._op = decode_attention_op()
        except Exception as e:  # e.g. no C++ compiler
            logger.warning("cpu attention: no op (%s: %s); attention stays torch_native's", type(e).__name__, e)
        else:
            logger.info("cpu attention: op ready in %.1f s", time.perf_counter() - start)
        finally:
            self.compiled.set()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._step_op = self._op  # one forward's layers all take the same path
        if self._step_op is None:
            super().init_forward_metadata(batch)
            return
        # The op's rows read their requests' rows of req_to_token, each once in the table however
        # many rows read it (an extend's tokens): the table stays [requests, longest sequence].
        table = batch.req_to_token_pool.req_to_token
        width = max(*batch.seq_lens_cpu, 2)  # (2: see below)
        if batch.mode.is_decode():  # a row per request; a decode may hold several rows of a request (a verify's)
            requests, self._slot_rows = torch.unique(batch.req_pool_indices, return_inverse=True)
            self._row_lens = batch.seq_lens
        else:  # new token t of request i: a row over request i's slots, seeing prefix_lens[i] + t + 1 keys
            rows = len(batch.input_ids)
            requests = batch.req_pool_indices
            self._slot_rows = torch.repeat_interleave(torch.arange(batch.batch_size, device=requests.device),
                                                      batch.extend_lens, output_size=rows)
            first_row = batch.extend_lens.cumsum(0) - batch.extend_lens
            token = torch.arange(rows, device=requests.device) - first_row.index_select(0, self._slot_rows)
            self._row_lens = (batch.prefix_lens.index_select(0, self._slot_rows) + token + 1).to(torch.int32)
        if len(requests) == 1 < len(self._row_lens):
            requests = requests.repeat(2)
        # A table of one row or column has a second, never read: a compiled forward's dynamic sizes
        # are never 1 (`rxf.core.runner.compiled_decode`: dynamo specializes a size of 1).
        # (Entries past a row's keys may be stale: the op reads none of them.)
        self._slots = table[requests, :width].to(torch.int64)
        self._from_first = torch.zeros_like(self._row_lens)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        if self._step_op is None:
            return super().forward_extend(q, k, v, layer, batch)
        self._store_kv(layer, batch, k, v)
        return self._attend_rows(q, layer, batch)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        if self._step_op is None:
            return super().forward_decode(q, k, v, layer, batch)
        self._store_kv(layer, batch, k, v)
        return self._attend_rows(q, layer, batch)

    def _attend_rows(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """The op over the planned rows, one query each: row i at position row_lens[i] - 1 over its keys
        `slots[slot_rows[i], :row_lens[i]]` (stored already)."""
        seq_lens = self._row_lens
        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        # An FP8 pool holds k / k_scale and v / v_scale; a pool of the model dtype holds K/V as they are.
        k_scale, v_scale = (layer.k_scale, layer.v_scale) if pool.is_fp8 else (self._unit_scale, self._unit_scale)
        window = layer.sliding_window
        first = self._from_first if window is None else (seq_lens - window).clamp_min(0)
        sinks = layer.sinks
        if sinks is None:
            sinks = self._no_sinks
            if layer.num_heads != sinks.numel():  # a layer of its own head count (none of today's models)
                sinks = torch.full((layer.num_heads,), float("-inf"), device=q.device)
        return self._step_op(
            q, k_buf, v_buf, k_scale, v_scale, self._slots, self._slot_rows, seq_lens, first, sinks, layer.scaling,
            layer.logit_cap,
        )
