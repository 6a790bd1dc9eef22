"""The `flashinfer` attention backend: FlashInfer's paged/ragged prefill and paged decode wrappers.

The page-size-1 pool maps onto FlashInfer's paged layout directly: a K buffer `[slots, Hkv, D]`
viewed as `[slots, page_size=1, Hkv, D]` (NHD), and a request's page list is the run of its
req_to_token row it attends over. Host-side lengths come from the ForwardBatch's `*_cpu` lists, so
planning never waits on the GPU.

A plan depends on the layer as well as the batch: its softmax scale, sliding window (FlashInfer's
`window_left` = W - 1) and logit soft-cap are `plan()` arguments, and a layer with sinks needs
FlashInfer's attention-sink wrapper (`BatchAttentionWithAttentionSinkWrapper`, the fa2/fa3 prefill
kernels with a sink variant, run for extend and decode alike; sinks and scale go to its `run`, and it
has no soft-cap). Layers that agree on those share one `Variant` and one plan per batch: a model
with local and global layers (Gemma) plans twice per forward, each wrapper the first time a layer of
its variant runs. A windowed variant's page lists start at the first key the request's first new
token sees, so a window of W reads at most W + extend_len - 1 keys per request at any context and its
decode plan is sized by the window, not the context.

CUDA graphs (decode): one wrapper per (batch size, variant) over fixed buffers. Variants are found
by the eager warm-up forward that the graph runner makes after `init_forward_metadata_capture`
(each is planned there, outside the capture); replay re-plans every variant of its size.

An FP8 pool (`cache.kv_dtype`) is written by rxf's store kernel (quantized with the layer's scales)
and read by FlashInfer's wrappers planned with that `kv_data_type`; the layer's k_scale and v_scale go
to `run` as host floats (FlashInfer folds k_scale into the softmax scale and multiplies the output by
v_scale; the sink variant takes its softmax scale as an argument, so k_scale is folded there by hand).
They are read off the device once per layer and kept: they do not change after loading, and captured
graphs keep them as constants. With an FP8 pool a prefill without cached prefix runs the paged
kernel over the pool instead of the ragged one over the new k/v, so every key is attended as
quantized, as torch_native and triton do.

Rotary embeddings are fused into the K/V store (rxf's Triton kernel, `fuses_rope`, with Qwen3's
per-head q / k norms: `fuses_head_norm`), which also writes the rotated q into the contiguous buffer
FlashInfer's `run` takes (saving the copy `q.contiguous()` made of the strided view). FlashInfer's own
fused rope + append kernels do not fit this pool: `rope.rope_quantize_fp8_append_paged_kv_cache`
writes FP8 caches only, and the `cake_fused_qk_rope_append` family (newer releases) takes head_dim 128
with 8/1 or 64/8 query/kv heads only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rxf.core.attention import ATTENTION_FEATURES, AttentionBackend, AttentionContext, AttentionLayer, Rotary

if TYPE_CHECKING:
    from rxf.core.forward import ForwardBatch

logger = logging.getLogger(__name__)

_WORKSPACE_BYTES = 256 * 1024 * 1024
# Tensor-core decode pays off once several query heads share a KV head (FlashInfer's guidance).
_TENSOR_CORE_MIN_GROUP = 4


def _cpu_indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


@dataclass(frozen=True)
class Variant:
    """What a plan depends on besides the batch; layers that agree on it share one plan."""

    window: int | None  # sliding window W
    logit_cap: float | None
    scaling: float
    sinks: bool  # the layer has sinks (their values go to run, not plan)

    @classmethod
    def of(cls, layer: AttentionLayer) -> Variant:
        return cls(layer.sliding_window, layer.logit_cap, layer.scaling, layer.sinks is not None)

    @property
    def window_left(self) -> int:
        """FlashInfer's window: the query at position i sees keys i - window_left .. i (-1: all)."""
        return -1 if self.window is None else self.window - 1


@dataclass
class _Pages:
    """One batch's page lists for a window: request b attends over req_to_token[row_b, lo_b:seq_len_b]."""

    lens: list[int]  # seq_len_b - lo_b, host side
    indices: torch.Tensor  # int32, on device: the lists concatenated


class FlashInferBackend(AttentionBackend):
    auto_priority = 20  # the fastest on CUDA when it imports
    supports_cuda_graph = True
    features = frozenset(ATTENTION_FEATURES)
    fp8_kv = True
    verifies_as_decode = True

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return False
        return True

    @classmethod
    def missing_features(cls, layers: Iterable[AttentionLayer]) -> dict[str, list[int]]:
        layers = list(layers)
        missing = super().missing_features(layers)
        both = [layer.layer_id for layer in layers if layer.sinks is not None and layer.logit_cap is not None]
        if both:  # FlashInfer's sink variant applies the scale and the sink only
            missing["logit_cap together with sinks"] = both
        return missing

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        import flashinfer

        # Triton is installed wherever FlashInfer is (torch's CUDA builds ship it): K and V are
        # written to the pool in one launch instead of pool.set_kv's two.
        from rxf.plugins.attention.triton.store_kv import rope_store_kv, store_kv

        self._fi = flashinfer
        self._store = store_kv
        self._rope_store = rope_store_kv
        # Every wrapper shares the workspace: they run one after another on one stream.
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.use_tensor_cores = ctx.num_heads // ctx.num_kv_heads >= _TENSOR_CORE_MIN_GROUP
        self._wrappers: dict[tuple[str, Variant], Any] = {}  # eager, by (kind, variant)
        self._graph_wrappers: dict[tuple[int, Variant], Any] = {}  # CUDA graphs, by (batch size, variant)
        self._graph_indices: dict[int | None, torch.Tensor] = {}  # by window; shared by all sizes
        self._graph_max_bs = 0
        # The batch being planned for, and what was planned for it:
        self._batch: ForwardBatch | None = None
        self._graph_bs: int | None = None  # set while the batch runs on graph wrappers
        self._planned: dict[Variant, Any] = {}
        self._pages: dict[int | None, _Pages] = {}
        self._kv_dtype = ctx.token_to_kv_pool.dtype
        self._fp8 = ctx.token_to_kv_pool.is_fp8
        self._kv_scales: dict[int, tuple[float, float]] = {}  # layer id -> (k_scale, v_scale), FP8 pools

    # ---- per-batch metadata ----
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._begin(batch, graph_bs=None)

    def _begin(self, batch: ForwardBatch, graph_bs: int | None) -> None:
        """Forget the last batch's plans; each variant is planned when its first layer runs."""
        self._batch, self._graph_bs = batch, graph_bs
        self._planned, self._pages = {}, {}

    def _kind(self, variant: Variant) -> str:
        """Which wrapper serves `variant` in this batch: "sink", "decode", "ragged" (no cached prefix
        and a pool of the model dtype: the new tokens' own K/V) or "paged"."""
        batch = self._batch
        assert batch is not None, "init_forward_metadata was not called for this batch"
        if variant.sinks:
            return "sink"
        if batch.mode.is_decode():
            return "decode"
        return "ragged" if sum(batch.prefix_lens_cpu) == 0 and not self._fp8 else "paged"

    def _page_lists(self, window: int | None) -> _Pages:
        """Every request's keys from lo = max(0, prefix_len - W + 1) (the first key its first new token
        sees; 0 without a window) to seq_len, concatenated."""
        pages = self._pages.get(window)
        if pages is not None:
            return pages
        batch = self._batch
        assert batch is not None
        if window is None:
            lo_cpu = [0] * batch.batch_size
            lo = torch.zeros_like(batch.seq_lens, dtype=torch.int64)
        else:
            lo_cpu = [max(0, p - window + 1) for p in batch.prefix_lens_cpu]
            lo = (batch.prefix_lens.to(torch.int64) - (window - 1)).clamp_(min=0)
        lens_cpu = [s - first for s, first in zip(batch.seq_lens_cpu, lo_cpu, strict=True)]
        total = sum(lens_cpu)
        lens = batch.seq_lens.to(torch.int64) - lo
        starts = torch.cumsum(lens, 0) - lens
        rows = batch.req_pool_indices.repeat_interleave(lens, output_size=total)
        cols = torch.arange(total, device=lens.device) + (lo - starts).repeat_interleave(lens, output_size=total)
        pages = _Pages(lens_cpu, batch.req_to_token_pool.req_to_token[rows, cols])
        self._pages[window] = pages
        return pages

    def _wrapper(self, layer: AttentionLayer) -> tuple[Any, str]:
        """The wrapper planned for this layer's variant in this batch (planning it now if it is the
        variant's first layer), and its kind."""
        variant = Variant.of(layer)
        kind = self._kind(variant)
        wrapper = self._planned.get(variant)
        if wrapper is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"layer {layer.layer_id}: a new attention variant {variant} during CUDA-graph capture "
                    "(plans must be made by the eager warm-up forward before it)"
                )
            wrapper = self._new_wrapper(kind, variant) if self._graph_bs is None else self._graph_wrapper(variant)
            self._plan(wrapper, kind, variant)
            self._planned[variant] = wrapper
        return wrapper, kind

    def _new_wrapper(self, kind: str, variant: Variant) -> Any:
        wrapper = self._wrappers.get((kind, variant))
        if wrapper is None:
            fi, ws = self._fi, self.workspace
            if kind == "sink":
                wrapper = self._sink_wrapper(variant)
            elif kind == "decode":
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=self.use_tensor_cores)
            elif kind == "ragged":
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            self._wrappers[(kind, variant)] = wrapper
        return wrapper

    def _sink_wrapper(self, variant: Variant, **graph_buffers: torch.Tensor) -> Any:
        """The sink variant is compiled per dtype, head_dim and whether a window is used."""
        ctx = self.ctx
        return self._fi.BatchAttentionWithAttentionSinkWrapper(
            self.workspace, "NHD", use_cuda_graph=bool(graph_buffers), **graph_buffers,
            q_data_type=ctx.dtype, kv_data_type=self._kv_dtype, head_dim_qk=ctx.head_dim, head_dim_vo=ctx.head_dim,
            window_left=variant.window_left,
        )

    def _plan(self, wrapper: Any, kind: str, variant: Variant) -> None:
        batch, ctx = self._batch, self.ctx
        assert batch is not None
        common = {
            "num_qo_heads": ctx.num_heads, "num_kv_heads": ctx.num_kv_heads, "window_left": variant.window_left,
            "sm_scale": variant.scaling, "q_data_type": ctx.dtype, "kv_data_type": self._kv_dtype,
        }
        if kind != "sink":  # the sink variant has no soft-cap (missing_features refuses the pair)
            common["logits_soft_cap"] = variant.logit_cap
        if kind == "ragged":  # never with an FP8 pool: its k/v are the model dtype's
            indptr = _cpu_indptr(batch.extend_lens_cpu)
            wrapper.plan(qo_indptr=indptr, kv_indptr=indptr, head_dim_qk=ctx.head_dim, causal=True, **common)
            return
        pages = self._page_lists(variant.window)
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32)
        if kind == "decode":
            wrapper.plan(
                indptr=_cpu_indptr(pages.lens), indices=pages.indices, last_page_len=last_page_len,
                head_dim=ctx.head_dim, page_size=1, **common,
            )
            return
        # Paged prefill kernels (also the sink variant's decode): queries are aligned to the end of
        # each request's page list, so causal masking holds for a list that starts at lo.
        wrapper.plan(
            qo_indptr=_cpu_indptr(batch.extend_lens_cpu), paged_kv_indptr=_cpu_indptr(pages.lens),
            paged_kv_indices=pages.indices, paged_kv_last_page_len=last_page_len,
            head_dim_qk=ctx.head_dim, page_size=1, causal=True, **common,
        )

    # ---- attention ----
    def fuses_rope(self, rotary: Rotary) -> bool:
        return rotary.cos_sin_cache is not None

    fuses_head_norm = True  # rxf's rope + K/V store kernel normalises the heads first (triton/store_kv.py)

    def _store_kv(
        self, layer: AttentionLayer, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rotary: Rotary | None,
    ) -> torch.Tensor:
        """Store k/v (rotating q and k first, with `rotary`); returns q as `run` takes it (contiguous)."""
        bufs = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
        if rotary is None:
            self._store(*bufs, batch.out_cache_loc, k, v, **scales)
            return q.contiguous()
        assert rotary.cos_sin_cache is not None, "fuses_rope said no to this rotary embedding"
        return self._rope_store(*bufs, batch.out_cache_loc, q, k, v, batch.positions, rotary.cos_sin_cache,
                                q_out=torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                head_norm=getattr(rotary, "head_norm", None), **scales)

    def _host_scales(self, layer: AttentionLayer) -> tuple[float, float]:
        """The layer's (k_scale, v_scale) as floats, read off the device on its first forward (an
        eager one: the graph runner's warm-up precedes every capture)."""
        scales = self._kv_scales.get(layer.layer_id)
        if scales is None:
            scales = (float(layer.k_scale), float(layer.v_scale))
            self._kv_scales[layer.layer_id] = scales
        return scales

    def _run_paged(self, wrapper: Any, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        k, v = self.ctx.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        paged = (k.unsqueeze(1), v.unsqueeze(1))  # [slots, page_size=1, Hkv, D]
        k_scale, v_scale = self._host_scales(layer) if self._fp8 else (1.0, 1.0)
        # A scale of 1 is left out: FlashInfer would spend a kernel multiplying the output by it.
        out_scale = {} if v_scale == 1.0 else {"v_scale": v_scale}
        if layer.sinks is None:
            return wrapper.run(q, paged, **({} if k_scale == 1.0 else {"k_scale": k_scale}), **out_scale)
        # The sink variant's extra arguments: its softmax scale, which k_scale multiplies.
        return wrapper.run(q, paged, layer.sinks, layer.scaling * k_scale, **out_scale)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        q = self._store_kv(layer, batch, q, k, v, rotary)
        wrapper, kind = self._wrapper(layer)
        if kind == "ragged":  # no cached prefix: the new tokens' own K/V, no pool gather
            return wrapper.run(q, k.contiguous(), v.contiguous())
        return self._run_paged(wrapper, q, layer)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        q = self._store_kv(layer, batch, q, k, v, rotary)
        wrapper, _ = self._wrapper(layer)
        return self._run_paged(wrapper, q, layer)

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self._graph_max_bs = max_bs

    def _graph_wrapper(self, variant: Variant) -> Any:
        """This batch size's wrapper for `variant`, over fixed buffers the captured kernels read."""
        bs = self._graph_bs
        assert bs is not None and self._graph_max_bs, "init_cuda_graph_state was not called"
        wrapper = self._graph_wrappers.get((bs, variant))
        if wrapper is not None:
            return wrapper
        dev = self.ctx.device
        indices = self._graph_indices.get(variant.window)
        if indices is None:  # a window's page lists hold at most W slots per decoding request
            per_request = self.ctx.max_context_len if variant.window is None else min(
                variant.window, self.ctx.max_context_len)
            indices = torch.zeros(self._graph_max_bs * per_request, dtype=torch.int32, device=dev)
            self._graph_indices[variant.window] = indices
        indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
        if variant.sinks:
            wrapper = self._sink_wrapper(
                variant, qo_indptr_buf=torch.arange(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last_page_len,
            )
        else:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
        self._graph_wrappers[(bs, variant)] = wrapper
        return wrapper

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        # The warm-up forward that follows plans each variant into this size's wrappers.
        self._begin(batch, graph_bs=batch.batch_size)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Re-plan, into the fixed buffers, every variant captured at this size (host-side planning
        is allowed here: it runs before the replay)."""
        bs = batch.batch_size
        self._begin(batch, graph_bs=bs)
        for (size, variant), wrapper in self._graph_wrappers.items():
            if size == bs:
                self._plan(wrapper, self._kind(variant), variant)
                self._planned[variant] = wrapper
