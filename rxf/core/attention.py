"""The attention backend interface: what every attention plugin implements.

A backend receives a narrow view of the engine (`AttentionContext`), never the model runner. It owns
the write of each layer's new K/V into the pool: `forward` stores k/v at `batch.out_cache_loc` and then
attends over the request's whole sequence, read through `req_to_token`.

A model may hand its rotary embedding to `forward` instead of applying it: a backend that can fold the
rotation into its K/V store (one launch instead of two per layer) says so in `fuses_rope`; for every
other backend `forward` applies the embedding first, so backends that know nothing of it work unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rxf.core.forward import ForwardBatch
    from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool


@runtime_checkable
class AttentionLayer(Protocol):
    """What a backend may read off the calling attention layer (per tensor-parallel rank).

    The optional features, each None when the layer does not use it (Hugging Face's meanings):
      sliding_window  W: the query at absolute position i attends the keys at positions j with
                      i - W < j <= i (W keys, itself included). FlashInfer's `window_left` is W - 1.
      logit_cap       c: each score s (after `scaling`) becomes c * tanh(s / c) before the softmax
                      (Gemma 2's attn_logit_softcapping).
      sinks           float32 [num_heads]: a learned per-head logit that joins the softmax's
                      denominator only (exp(sink) is added to the sum; it has no value), gpt-oss.

    k_scale / v_scale (float32 0-d tensors on the layer's device, 1.0 unless the checkpoint gives them)
    are the layer's per-tensor KV-cache scales: an FP8 pool stores k / k_scale and v / v_scale, and a
    backend reading it multiplies back (`rxf.core.kv_pool`); a pool of the model dtype ignores them.
    """

    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # kv heads on this rank
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5
    sliding_window: int | None
    logit_cap: float | None
    sinks: torch.Tensor | None
    k_scale: torch.Tensor
    v_scale: torch.Tensor


# The optional features, by their AttentionLayer attribute names (what `AttentionBackend.features` lists).
ATTENTION_FEATURES = ("sliding_window", "logit_cap", "sinks")


def layer_features(layer: AttentionLayer) -> set[str]:
    """The optional features `layer` uses."""
    return {name for name in ATTENTION_FEATURES if getattr(layer, name, None) is not None}


class Rotary(Protocol):
    """What `forward` may receive as `rotary`: the model's rotary embedding (shared by its layers)."""

    # float32 [max_position, head_dim]: row p is a * cos(p * theta_j) | a * sin(p * theta_j), j < head_dim / 2
    # (a: the rope scaling's attention factor, usually 1), for a NeoX rotate-half rotation of the whole
    # head; None when the rotation has another form, e.g. partial (a backend must then not fuse it).
    cos_sin_cache: torch.Tensor | None

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[n, heads * head_dim]` and k `[n, kv_heads * head_dim]` by `positions` [n]; may work
        in place (callers keep only the returned tensors)."""
        ...


@dataclass(frozen=True)
class HeadNorm:
    """Per-head RMSNorms of q and k before the rotation (Qwen3's `q_norm` / `k_norm`): each head vector
    of head_dim values is normalised on its own, with `q_weight` [head_dim] for every query head and
    `k_weight` for every key head. A rotary handed to a backend whose `fuses_head_norm` is True may
    carry one as its attribute `head_norm`; the backend applies it before rotating."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class AttentionContext:
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    num_heads: int  # per rank
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_batch_size: int
    max_context_len: int
    # CPU: the torch thread counts the forwards may run at (torch.compile guards on the count, and
    # Inductor's kernels are made for it); default: the count current where the context is made.
    thread_counts: tuple[int, ...] = field(default_factory=lambda: (torch.get_num_threads(),))
    # Whether a decode batch may hold several rows of one request, each attending over the others' new
    # tokens (a speculative verify, a draft model's catch-up: `ModelRunner._extend_rows`). Where none
    # may, a backend can store each row's K/V inside its attention launch (the triton backend does).
    multi_row_decode: bool = True


class AttentionBackend(ABC):
    """Contract: q is [num_tokens, num_heads, head_dim]; k, v are [num_tokens, num_kv_heads, head_dim]
    for the batch's new tokens; the result is [num_tokens, num_heads, head_dim] in q's dtype.
    Extend attention is causal within the new tokens and full over the cached prefix.
    `init_forward_metadata` is called once per forward, before any layer runs, and may plan kernels.
    """

    # `attention.backend = "auto"` picks the available backend with the highest priority;
    # None keeps a backend out of automatic selection (it must be named explicitly).
    auto_priority: int | None = None
    # The optional layer features (ATTENTION_FEATURES) this backend implements, in every mode it
    # runs (extend over any cached prefix, decode, CUDA graphs).
    features: frozenset[str] = frozenset()
    # Whether it stores into and reads an FP8 pool (`cache.kv_dtype`): quantizing with the layer's
    # k_scale / v_scale on store and dequantizing on read, as `rxf.core.kv_pool` defines. A backend
    # without it is refused for such a pool (it would read the bytes as the wrong values).
    fp8_kv: bool = False

    @classmethod
    def missing_features(cls, layers: Iterable[AttentionLayer]) -> dict[str, list[int]]:
        """Each feature some layer needs and this backend lacks -> the ids of those layers."""
        missing: dict[str, list[int]] = {}
        for layer in layers:
            for name in sorted(layer_features(layer) - cls.features):
                missing.setdefault(name, []).append(layer.layer_id)
        return missing

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether this backend can run on `device` (e.g. its kernel library imports, the GPU fits)."""
        return True

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx

    def init_forward_metadata(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Plan once per batch (shared by all layers). Default: nothing to plan."""

    def fuses_rope(self, rotary: Rotary) -> bool:
        """Whether this backend rotates q and k itself with `rotary` (the model then hands it over
        instead of rotating). If so, `forward` and with it `forward_extend` / `forward_decode` receive it
        as the keyword argument `rotary`, and must rotate q and k by `batch.positions` before attending
        and storing k (the pool holds rotated keys). Default: no; nothing receives the keyword."""
        return False

    # Whether a rotary that `fuses_rope` accepts may carry a `head_norm` (`HeadNorm`), which the
    # backend then applies to q and k before rotating them (one launch for both); a model hands one
    # over only where this is True, and normalises the heads itself elsewhere.
    fuses_head_norm: bool = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        """`rotary` is given only where `fuses_rope(rotary)` is True: q and k are then still unrotated."""
        fused = {} if rotary is None else {"rotary": rotary}
        if batch.mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch, **fused)
        return self.forward_extend(q, k, v, layer, batch, **fused)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor: ...

    # Whether `forward_decode` stores every row's K/V before any row attends and attends row r over
    # req_to_token[req_pool_indices[r], :seq_lens[r]] alone, whatever the other rows (they need not
    # be distinct requests). Then a speculative verify, a request's newest token and its drafts, runs
    # as decode rows of one request at consecutive positions, causal through seq_lens, and so from
    # the decode CUDA graphs (`ModelRunner._extend_rows`).
    verifies_as_decode: bool = False

    # Whether `forward_decode` can be traced whole into a model's compiled CPU decode forward
    # (`rxf.core.runner.compiled_decode`): it creates no state and takes no lock while tracing, and
    # its graph depends only on the backend's type and tensors, so one traced on another instance
    # serves this one.
    supports_compiled_decode: bool = False

    def wait_compiled(self) -> None:  # noqa: B027 - optional hook
        """Block until the backend's own background compiling, if any, is over. Default: none."""

    # CUDA-graph hooks (DECODE only; `rxf.core.runner.cuda_graph_runner` calls them). A backend that cannot
    # be captured keeps these defaults and decode runs eager. One graph is captured per batch size;
    # whatever `forward_decode` reads must then live at fixed device addresses for that size, and must
    # not depend on host values (`batch.*_cpu`) other than `batch.batch_size`. Batches arrive padded to
    # the captured size: a padding row has seq_len 1, req_pool_indices 0 (it reads req_to_token[0, 0],
    # always a valid slot) and out_cache_loc 0 (the reserved slot); its output is discarded.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate static metadata buffers for decode batches of up to `max_bs` rows; called once,
        before any capture."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Point decode's metadata at views of the static buffers for `batch.batch_size` rows and fill
        them for `batch` (all padding rows). Called outside the capture, before an eager warm-up
        forward and the captured forward of that size."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Refill, in place, the static buffers the graph of `batch.batch_size` reads, for this batch;
        called before each replay (host-side planning from `batch.*_cpu` is allowed here). `batch`'s
        tensors are views of the graph runner's static input buffers, already filled."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
