"""The `triton` attention backend: rxf's own Triton kernels over the page-size-1 KV pool.

This module imports without Triton (so "auto" selection can ask `is_available`); the kernel modules
are imported when a backend is constructed.

Per-batch metadata, planned once in `init_forward_metadata` and shared by all layers, lives in tensors:
  extend: qo_start [bs] (each request's first row in q), plus the host-side longest extend length
          that sizes the grid. Extend always runs eagerly. The requests with one new token (the
          decode rows mixed chunked prefill puts into a prefill forward) are attended by the decode
          kernel instead, with a decode plan of their own (`_DecodeRows`): the extend kernel would
          give each a whole block of BLOCK_M query rows, all but one of them padding. Both kernels
          write the same `out`, each its own rows. That is exact: the decode kernel implements the
          same features (window, soft-cap, sinks, FP8 pool), and the one new key it reads back from
          the pool is the k the extend kernel would read from its input (the pool stores k in the
          model dtype; an FP8 pool's new keys the extend kernel reads back from the pool too).
  decode: num_kv_splits [bs] (each request's chunk count), the scratch for partial results and the
          merge counters (see decode.py), and the host-side grid_splits. For CUDA graphs these live in static buffers sized for `max_bs`
          (`init_cuda_graph_state`); capture and replay refill them in place, and grid_splits depends
          only on the batch size, so one captured graph per size stays valid for any sequence lengths.

Sliding windows, logit soft-caps and sinks are the kernels' (see extend.py / decode.py); each is a
kernel argument read off the layer at launch (window and cap as scalars, sinks as a device tensor),
so layers with different windows share one plan and one captured graph. A windowed layer's decode uses
the first cdiv(min(seq_len, window), min_split_len) of a request's splits; the rest exit at once.

An FP8 pool (`cache.kv_dtype`) is quantized by the store kernel and dequantized in the attention
kernels' registers with the layer's k_scale / v_scale (device tensors, so captured graphs read them
where they live).

Rotary embeddings are fused into the K/V store (`fuses_rope`): one launch per layer rotates q and k
in place and writes the rotated k and v to the pool, for extend and decode alike; Qwen3's per-head q / k
norms run in that launch too (`fuses_head_norm`).

Decode split policy: with bs requests and P = num_kv_heads * head_blocks programs per request
per split, a batch may use up to cap(bs) = clamp(cdiv(target_programs, bs * P), 1, max_kv_splits)
splits, enough to occupy the GPU at small batch and none at large batch; request b uses
clamp(cdiv(seq_len_b, min_split_len), 1, cap(bs)), so short sequences are not split into slivers whose
merge would cost more than it saves.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rxf.core.attention import ATTENTION_FEATURES, AttentionBackend, AttentionContext, AttentionLayer, Rotary

if TYPE_CHECKING:
    from rxf.core.forward import ForwardBatch


@dataclass
class _DecodeMeta:
    num_kv_splits: torch.Tensor  # [bs] int32, each in [1, grid_splits]
    grid_splits: int
    mid_o: torch.Tensor  # [>= bs, H, >= grid_splits, D] fp32 scratch
    mid_lse: torch.Tensor  # [>= bs, H, >= grid_splits] fp32 scratch
    counters: torch.Tensor  # [>= bs * programs per split] int32 zeros (the kernel leaves them zeroed)


@dataclass
class _DecodeRows:
    """The n requests of an extend batch with one new token, for the decode kernel."""

    q_rows: torch.Tensor  # [n] int32: each one's row in q and out (its qo_start)
    req_pool_indices: torch.Tensor  # [n]
    seq_lens: torch.Tensor  # [n] int32
    plan: _DecodeMeta


@dataclass
class _ExtendMeta:
    """The extend kernel's requests (all of the batch's, or all but its decode rows) and the decode rows."""

    req_pool_indices: torch.Tensor  # [m]
    prefix_lens: torch.Tensor  # [m] int32
    extend_lens: torch.Tensor  # [m] int32
    qo_start: torch.Tensor  # [m] int32: each request's first row in q (exclusive prefix sum of extend_lens)
    max_extend_len: int  # over these m requests (0: none)
    decode_rows: _DecodeRows | None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TritonAttnBackend(AttentionBackend):
    auto_priority = 10  # above torch_native (0); flashinfer ranks above this when importable
    supports_cuda_graph = True
    features = frozenset(ATTENTION_FEATURES)
    fp8_kv = True
    verifies_as_decode = True

    # Decode split policy (see the module docstring); first guesses, to be tuned on the GPU. They and
    # the instance's target_programs may be overridden before the first batch and before
    # init_cuda_graph_state (which sizes the static scratch by max_kv_splits).
    max_kv_splits = 16
    min_split_len = 128  # tokens per split at the least
    programs_per_sm = 4  # decode programs wanted per SM before splitting stops paying

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        from rxf.plugins.attention.triton.decode import DecodeStore, decode_attention, head_block_size
        from rxf.plugins.attention.triton.extend import check_env_settings, extend_attention
        from rxf.plugins.attention.triton.store_kv import rope_store_kv, store_kv

        check_env_settings()  # a bad RXF_EXTEND fails the launch, not the first prefill
        self._extend_attention = extend_attention
        self._decode_attention = decode_attention
        self._store = store_kv
        self._rope_store = rope_store_kv
        self._decode_store = DecodeStore
        # The decode launch stores the new K/V itself (one launch a layer fewer; `decode.DecodeStore`)
        # unless a decode batch may hold several rows of one request: a row stores only its own token
        # before it attends, so decode rows can then no longer carry a speculative verify
        # (`verifies_as_decode`). RXF_DECODE_STORE=fused / separate overrides (benchmarks, tests).
        store = os.environ.get("RXF_DECODE_STORE", "") or "auto"
        if store not in ("auto", "fused", "separate"):
            raise ValueError(f"RXF_DECODE_STORE={store!r}: expected auto, fused or separate")
        self.fused_decode_store = store == "fused" or (store == "auto" and not ctx.multi_row_decode)
        if self.fused_decode_store:
            self.verifies_as_decode = False
        group = ctx.num_heads // ctx.num_kv_heads
        self._programs_per_split = ctx.num_kv_heads * _cdiv(group, head_block_size(group))
        sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if (
            ctx.device.type == "cuda") else 1
        self.target_programs = self.programs_per_sm * sms
        self._extend: _ExtendMeta | None = None
        self._decode: _DecodeMeta | None = None
        self._graph: _DecodeMeta | None = None  # static buffers for max_bs, set by init_cuda_graph_state
        # Eager decode's counters, grown as batches grow; the graph state keeps its own, which its
        # captured graphs point at. Layers run one after another, so one buffer serves them all.
        self._counters = torch.zeros(0, dtype=torch.int32, device=ctx.device)

    # ---- planning ----
    def split_cap(self, bs: int) -> int:
        """The most KV splits any request of a decode batch of `bs` requests may use."""
        wanted = _cdiv(self.target_programs, max(bs, 1) * self._programs_per_split)
        return max(1, min(wanted, self.max_kv_splits))

    def _fill_splits(self, seq_lens: torch.Tensor, cap: int, out: torch.Tensor) -> None:
        """out[i] = clamp(cdiv(seq_lens[i], min_split_len), 1, cap), on the device, without a sync."""
        chunks = torch.div(seq_lens + (self.min_split_len - 1), self.min_split_len, rounding_mode="floor")
        out.copy_(chunks.clamp_(1, cap))

    def _scratch(self, bs: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.ctx
        mid_o = torch.empty((bs, ctx.num_heads, splits, ctx.head_dim), dtype=torch.float32, device=ctx.device)
        mid_lse = torch.empty((bs, ctx.num_heads, splits), dtype=torch.float32, device=ctx.device)
        return mid_o, mid_lse

    def _plan_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> _DecodeMeta:
        """The eager decode plan of requests with these lengths (device and host copies)."""
        bs = len(seq_lens_cpu)
        cap = self.split_cap(bs)
        # The grid needs only as many splits as the longest request uses (never more than cap).
        grid_splits = min(cap, _cdiv(max(max(seq_lens_cpu), 1), self.min_split_len))
        splits = torch.empty(bs, dtype=torch.int32, device=seq_lens.device)
        self._fill_splits(seq_lens, cap, splits)
        if self._counters.numel() < bs * self._programs_per_split:
            self._counters = torch.zeros(bs * self._programs_per_split, dtype=torch.int32, device=self.ctx.device)
        return _DecodeMeta(splits, grid_splits, *self._scratch(bs, grid_splits), self._counters)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._extend = self._decode = None  # a stale plan must not serve the next batch
        if batch.mode.is_decode():
            self._decode = self._plan_decode(batch.seq_lens, batch.seq_lens_cpu)
            return
        qo_start = torch.cumsum(batch.extend_lens, 0, dtype=torch.int32) - batch.extend_lens
        single = [i for i, n in enumerate(batch.extend_lens_cpu) if n == 1]
        if not single:
            self._extend = _ExtendMeta(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, qo_start,
                                       max(batch.extend_lens_cpu), None)
            return
        rest = [i for i, n in enumerate(batch.extend_lens_cpu) if n != 1]
        # One upload of both index lists (non_blocking from pageable memory: staged before the call
        # returns, and the host does not wait), then gathers on the device.
        index = torch.tensor(single + rest, dtype=torch.int64).to(batch.extend_lens.device, non_blocking=True)
        dec, ext = index[: len(single)], index[len(single) :]
        seq_lens = batch.seq_lens[dec]
        rows = _DecodeRows(qo_start[dec], batch.req_pool_indices[dec], seq_lens,
                           self._plan_decode(seq_lens, [batch.seq_lens_cpu[i] for i in single]))
        self._extend = _ExtendMeta(batch.req_pool_indices[ext], batch.prefix_lens[ext], batch.extend_lens[ext],
                                   qo_start[ext], max((batch.extend_lens_cpu[i] for i in rest), default=0), rows)

    # ---- CUDA graphs (decode only) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        splits = torch.ones(max_bs, dtype=torch.int32, device=self.ctx.device)
        counters = torch.zeros(max_bs * self._programs_per_split, dtype=torch.int32, device=self.ctx.device)
        self._graph = _DecodeMeta(splits, self.max_kv_splits, *self._scratch(max_bs, self.max_kv_splits), counters)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._use_graph_state(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self._use_graph_state(batch)

    def _use_graph_state(self, batch: ForwardBatch) -> None:
        """Point decode at views of the static buffers (the same storage at capture and at replay) and
        refill the split counts in place. grid_splits is split_cap(bs): a function of bs alone."""
        assert self._graph is not None, "init_cuda_graph_state was not called"
        assert batch.mode.is_decode(), "only decode runs under CUDA graphs"
        bs, g = batch.batch_size, self._graph
        assert bs <= g.num_kv_splits.shape[0], f"batch of {bs} above the graph state's max_bs"
        cap = self.split_cap(bs)
        self._fill_splits(batch.seq_lens, cap, g.num_kv_splits[:bs])
        self._decode = _DecodeMeta(g.num_kv_splits[:bs], cap, g.mid_o, g.mid_lse, g.counters)

    # ---- forward ----
    def fuses_rope(self, rotary: Rotary) -> bool:
        return rotary.cos_sin_cache is not None

    fuses_head_norm = True  # the rope + K/V store kernel normalises the heads first (store_kv.py)

    def _store_kv(
        self, layer: AttentionLayer, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rotary: Rotary | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch for K and V (pool.set_kv takes two), cast to the pool dtype (quantized with the
        layer's scales in an FP8 pool); with `rotary`, the same launch first rotates q and k in place."""
        k_buf, v_buf = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
        if rotary is None:
            self._store(k_buf, v_buf, batch.out_cache_loc, k, v, **scales)
        else:
            assert rotary.cos_sin_cache is not None, "fuses_rope said no to this rotary embedding"
            self._rope_store(k_buf, v_buf, batch.out_cache_loc, q, k, v, batch.positions, rotary.cos_sin_cache,
                             head_norm=getattr(rotary, "head_norm", None), **scales)
        return k_buf, v_buf

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        meta = self._extend
        assert meta is not None, "init_forward_metadata was not called for this batch"
        k_buf, v_buf = self._store_kv(layer, batch, q, k, v, rotary)
        out = q.new_empty(q.shape)
        req_to_token = batch.req_to_token_pool.req_to_token
        features = {"sliding_window": layer.sliding_window, "logit_cap": layer.logit_cap, "sinks": layer.sinks,
                    "k_scale": layer.k_scale, "v_scale": layer.v_scale}
        if meta.max_extend_len:
            self._extend_attention(
                q, k, v, out, k_buf, v_buf, req_to_token, meta.req_pool_indices, meta.prefix_lens, meta.extend_lens,
                meta.qo_start, meta.max_extend_len, layer.scaling, **features,
            )
        rows = meta.decode_rows
        if rows is not None:
            self._decode_attention(
                q, k_buf, v_buf, out, req_to_token, rows.req_pool_indices, rows.seq_lens, rows.plan.num_kv_splits,
                rows.plan.grid_splits, rows.plan.mid_o, rows.plan.mid_lse, rows.plan.counters, layer.scaling,
                min_split_len=self.min_split_len, q_rows=rows.q_rows, **features,
            )
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        meta = self._decode
        assert meta is not None, "init_forward_metadata was not called for this batch"
        store = None
        if self.fused_decode_store:
            k_buf, v_buf = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            rope = None if rotary is None else (batch.positions, rotary.cos_sin_cache)
            store = self._decode_store(k, v, batch.out_cache_loc, rope, getattr(rotary, "head_norm", None))
        else:
            k_buf, v_buf = self._store_kv(layer, batch, q, k, v, rotary)
        out = q.new_empty(q.shape)
        self._decode_attention(
            q, k_buf, v_buf, out, batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
            batch.seq_lens, meta.num_kv_splits, meta.grid_splits, meta.mid_o, meta.mid_lse, meta.counters,
            layer.scaling,
            sliding_window=layer.sliding_window, logit_cap=layer.logit_cap, sinks=layer.sinks,
            min_split_len=self.min_split_len, k_scale=layer.k_scale, v_scale=layer.v_scale, store=store,
        )
        return out
