"""Random paged-attention batches for checking a backend against `torch_native`.

`compare_backends` builds one ForwardBatch over scattered pool slots (with stale entries elsewhere
in req_to_token, as earlier requests leave them), runs the reference and the candidate on separate
copies of the same pool, and returns both outputs and both pools' K buffers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from rxf.core.attention import AttentionBackend, AttentionContext
from rxf.core.forward import ForwardBatch, ForwardMode
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.plugins.attention.torch_native import TorchNativeBackend


@dataclass
class Layer:  # satisfies rxf.core.attention.AttentionLayer
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    logit_cap: float | None = None
    sinks: torch.Tensor | None = None  # float32 [num_heads]
    # KV-cache scales, float32 0-d on the batch's device (make_case moves them there).
    k_scale: torch.Tensor = field(default_factory=lambda: torch.ones((), dtype=torch.float32))
    v_scale: torch.Tensor = field(default_factory=lambda: torch.ones((), dtype=torch.float32))


def make_case(
    prefix_lens: list[int], extend_lens: list[int], *, heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str, seed: int = 0, sliding_window: int | None = None,
    logit_cap: float | None = None, sinks: torch.Tensor | None = None, kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[AttentionContext, ForwardBatch, Layer, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The layer uses the optional features given (`sinks` float32 [heads], moved to `device`). The
    pool stores `kv_dtype` (default: `dtype`); an FP8 one with the layer's `kv_scales` (k, v)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    max_context = max(seq_lens) + 8
    num_slots = sum(seq_lens) + 64
    req_pool = ReqToTokenPool(bs + 2, max_context, device)
    kv_pool = TokenToKVPool(num_slots, 2, kv_heads, head_dim, kv_dtype or dtype, device)
    req_pool.req_to_token.random_(1, num_slots)  # stale entries beyond each seq_len
    rows = [bs + 1 - i for i in range(bs)]  # rows out of order
    kv_pool.alloc(7)  # slots do not start at 1
    layer = Layer(
        1, heads, kv_heads, head_dim, scaling=head_dim**-0.5, sliding_window=sliding_window, logit_cap=logit_cap,
        sinks=None if sinks is None else sinks.to(device, torch.float32),
        k_scale=torch.tensor(kv_scales[0], device=device), v_scale=torch.tensor(kv_scales[1], device=device),
    )
    new_slots = []
    for row, p, n in zip(rows, prefix_lens, seq_lens, strict=True):
        slots = kv_pool.alloc(n)[torch.randperm(n, generator=gen)]  # scattered slots
        req_pool.req_to_token[row, :n] = slots.to(device, torch.int32)
        k = torch.randn(p, kv_heads, head_dim, generator=gen).to(device, dtype)
        kv_pool.set_kv(layer.layer_id, slots[:p].to(device), k, torch.randn_like(k), layer.k_scale, layer.v_scale)
        new_slots.append(slots[p:])
    t = sum(extend_lens)
    q = torch.randn(t, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(device, dtype)
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) and all(prefix_lens) else ForwardMode.EXTEND
    as_dev = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt).to(device)  # noqa: E731
    batch = ForwardBatch(
        mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=torch.zeros(t, dtype=torch.int64, device=device),  # attention does not read them
        req_pool_indices=as_dev(rows, torch.int64),
        seq_lens=as_dev(seq_lens),
        prefix_lens=as_dev(prefix_lens),
        extend_lens=as_dev(extend_lens),
        out_cache_loc=torch.cat(new_slots).to(device),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        logits_indices=torch.zeros(bs, dtype=torch.int64, device=device),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        attn_backend=None,  # type: ignore[arg-type]  # set per backend by compare_backends
    )
    ctx = AttentionContext(req_pool, kv_pool, heads, kv_heads, head_dim, dtype, torch.device(device), bs, max_context)
    return ctx, batch, layer, (q, k, v)


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A bf16 backend against the reference: both sides round the softmax weights and the output to
    8 mantissa bits, so the bound is 2% of the output's scale (elementwise bounds mean nothing near 0)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= 2e-2 * scale, f"max error {err:.3g} vs output scale {scale:.3g}"


def run_backend(
    backend_cls: type[AttentionBackend], ctx: AttentionContext, batch: ForwardBatch, layer: Layer, qkv
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one backend on its own deep copy of the pools; returns (output, that pool's K buffer)."""
    req_pool, kv_pool = copy.deepcopy((ctx.req_to_token_pool, ctx.token_to_kv_pool))
    backend = backend_cls(replace(ctx, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool))
    b = replace(batch, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, attn_backend=backend)
    backend.init_forward_metadata(b)
    q, k, v = qkv
    out = backend.forward(q, k, v, layer, b)
    return out, kv_pool.k_buffer[layer.layer_id]


def compare_backends(candidate: type[AttentionBackend], *args, **kwargs) -> tuple[torch.Tensor, ...]:
    ctx, batch, layer, qkv = make_case(*args, **kwargs)
    ref_out, ref_k = run_backend(TorchNativeBackend, ctx, batch, layer, qkv)
    out, k = run_backend(candidate, ctx, batch, layer, qkv)
    return out, ref_out, k, ref_k
