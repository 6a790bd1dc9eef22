"""The `flashinfer` attention backend: FlashInfer's paged/ragged prefill and paged decode wrappers.

The page-size-1 pool maps onto FlashInfer's paged layout directly: a K buffer `[slots, Hkv, D]`
viewed as `[slots, page_size=1, Hkv, D]` (NHD), and a request's page list is its req_to_token row
`[0, seq_len)`. Plans are made once per batch, on the first layer's call (which also gives the
softmax scale), and shared by all layers. Host-side lengths come from the ForwardBatch's `*_cpu`
lists, so planning never waits on the GPU.

Rotary embeddings are fused into the K/V store (rxf's Triton kernel, `fuses_rope`), which also writes
the rotated q into the contiguous buffer FlashInfer's `run` takes (saving the copy `q.contiguous()`
made of the strided view). FlashInfer's own fused rope + append kernels do not fit this pool:
`rope.rope_quantize_fp8_append_paged_kv_cache` writes FP8 caches only, and the `cake_fused_qk_rope_append`
family (newer releases) takes head_dim 128 with 8/1 or 64/8 query/kv heads only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from rxf.core.attention import AttentionBackend, AttentionContext, AttentionLayer, Rotary

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


class FlashInferBackend(AttentionBackend):
    auto_priority = 20  # the fastest on CUDA when it imports

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return False
        return True

    supports_cuda_graph = True

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        import flashinfer

        # Triton is installed wherever FlashInfer is (torch's CUDA builds ship it): K and V are
        # written to the pool in one launch instead of pool.set_kv's two.
        from rxf.plugins.attention.triton.store_kv import rope_store_kv, store_kv

        self._fi = flashinfer
        self._store = store_kv
        self._rope_store = rope_store_kv
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.use_tensor_cores = ctx.num_heads // ctx.num_kv_heads >= _TENSOR_CORE_MIN_GROUP
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.paged_prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.ragged_prefill = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: dict[str, torch.Tensor] = {}
        self._active_decode: Any = self.decode_wrapper
        self._pending_plan: tuple[str, dict[str, Any]] | None = None

    # ---- per-batch metadata ----
    def _kv_indices(self, batch: ForwardBatch) -> torch.Tensor:
        """All requests' slots `req_to_token[row, 0:seq_len]`, concatenated (int32, on device)."""
        total = sum(batch.seq_lens_cpu)
        seq_lens = batch.seq_lens.to(torch.int64)
        starts = torch.cumsum(seq_lens, 0) - seq_lens
        rows = batch.req_pool_indices.repeat_interleave(seq_lens, output_size=total)
        cols = torch.arange(total, device=seq_lens.device) - starts.repeat_interleave(seq_lens, output_size=total)
        return batch.req_to_token_pool.req_to_token[rows, cols]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode():
            self._active_decode = self.decode_wrapper
            self._pending_plan = ("decode", self._decode_plan_args(batch, self._kv_indices(batch)))
        elif sum(batch.prefix_lens_cpu) == 0:
            indptr = _cpu_indptr(batch.extend_lens_cpu)
            self._pending_plan = ("ragged", {"qo_indptr": indptr, "kv_indptr": indptr})
        else:
            self._pending_plan = (
                "paged",
                {
                    "qo_indptr": _cpu_indptr(batch.extend_lens_cpu),
                    "paged_kv_indptr": _cpu_indptr(batch.seq_lens_cpu),
                    "paged_kv_indices": self._kv_indices(batch),
                    "paged_kv_last_page_len": torch.ones(batch.batch_size, dtype=torch.int32),
                },
            )

    def _decode_plan_args(self, batch: ForwardBatch, indices: torch.Tensor) -> dict[str, Any]:
        return {
            "indptr": _cpu_indptr(batch.seq_lens_cpu),
            "indices": indices,
            "last_page_len": torch.ones(batch.batch_size, dtype=torch.int32),
        }

    def _plan(self, layer: AttentionLayer, q_dtype: torch.dtype) -> None:
        """Run the plan recorded for this batch, on the first layer (all layers share it)."""
        if self._pending_plan is None:
            return
        kind, args = self._pending_plan
        self._pending_plan = None
        ctx = self.ctx
        common = {"sm_scale": layer.scaling, "q_data_type": q_dtype, "kv_data_type": ctx.dtype}
        if kind == "decode":
            self._active_decode.plan(
                **args, num_qo_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                head_dim=layer.head_dim, page_size=1, **common,
            )
        elif kind == "ragged":
            self.ragged_prefill.plan(
                **args, num_qo_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                head_dim_qk=layer.head_dim, causal=True, **common,
            )
        else:
            self.paged_prefill.plan(
                **args, num_qo_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                head_dim_qk=layer.head_dim, page_size=1, causal=True, **common,
            )

    # ---- attention ----
    def fuses_rope(self, rotary: Rotary) -> bool:
        return rotary.cos_sin_cache is not None

    def _store_kv(
        self, layer: AttentionLayer, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rotary: Rotary | None,
    ) -> torch.Tensor:
        """Store k/v (rotating q and k first, with `rotary`); returns q as `run` takes it (contiguous)."""
        bufs = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if rotary is None:
            self._store(*bufs, batch.out_cache_loc, k, v)
            return q.contiguous()
        assert rotary.cos_sin_cache is not None, "fuses_rope said no to this rotary embedding"
        return self._rope_store(*bufs, batch.out_cache_loc, q, k, v, batch.positions, rotary.cos_sin_cache,
                                q_out=torch.empty(q.shape, dtype=q.dtype, device=q.device))

    def _paged_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.ctx.token_to_kv_pool.get_kv_buffer(layer_id)
        return k.unsqueeze(1), v.unsqueeze(1)  # [slots, page_size=1, Hkv, D]

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        q = self._store_kv(layer, batch, q, k, v, rotary)
        self._plan(layer, q.dtype)
        if sum(batch.prefix_lens_cpu) == 0:
            # No cached prefix: attend over the new tokens' own K/V (no pool gather needed).
            return self.ragged_prefill.run(q, k.contiguous(), v.contiguous())
        return self.paged_prefill.run(q, self._paged_kv(layer.layer_id))

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        q = self._store_kv(layer, batch, q, k, v, rotary)
        self._plan(layer, q.dtype)
        return self._active_decode.run(q, self._paged_kv(layer.layer_id))

    # ---- CUDA graphs (decode) ----
    def init_cuda_graph_state(self, max_bs: int) -> None:
        ctx = self.ctx
        self._graph_buffers = {
            # Every request's whole page list; prefix sharing can list a slot more than once.
            "indices": torch.zeros(max_bs * ctx.max_context_len, dtype=torch.int32, device=ctx.device),
        }

    def _graph_wrapper(self, bs: int) -> Any:
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            dev = self.ctx.device
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=self._graph_buffers["indices"],
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev),
            )
            self._graph_wrappers[bs] = wrapper
        return wrapper

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._set_graph_plan(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self._set_graph_plan(batch)

    def _set_graph_plan(self, batch: ForwardBatch) -> None:
        """Plan into the fixed buffers of this batch size's wrapper; the captured kernels read them.

        Planning happens on the host before capture/replay, so it is done here eagerly (the
        softmax scale is the context's default, which the models use: head_dim ** -0.5)."""
        self._active_decode = self._graph_wrapper(batch.batch_size)
        ctx = self.ctx
        self._active_decode.plan(
            **self._decode_plan_args(batch, self._kv_indices(batch)),
            num_qo_heads=ctx.num_heads, num_kv_heads=ctx.num_kv_heads, head_dim=ctx.head_dim, page_size=1,
            sm_scale=ctx.head_dim**-0.5, q_data_type=ctx.dtype, kv_data_type=ctx.dtype,
        )
        self._pending_plan = None
