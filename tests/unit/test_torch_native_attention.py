"""torch_native against a from-scratch masked-attention reference computed from each request's full K/V,
with and without the optional features (sliding window, logit soft-cap, sinks)."""

from __future__ import annotations

import pytest
import torch

from rxf.core.attention import AttentionContext
from rxf.core.forward import ForwardBatch, ForwardMode
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.plugins.attention.torch_native import TorchNativeBackend
from rxf.testing.attention import Layer

HEAD_DIM = 16
MAX_CONTEXT = 64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, layer: Layer) -> torch.Tensor:
    """q [n, H, D] for positions prefix_len.., k/v [prefix_len + n, KVH, D]: the softmax written out in
    float64, one (query, key) pair at a time where a feature decides."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        for t in range(q.shape[0]):
            i = prefix_len + t  # the query's absolute position
            first = 0 if layer.sliding_window is None else max(0, i - layer.sliding_window + 1)
            s = (k[first : i + 1, h] @ q[t, h].double()) * layer.scaling  # keys first..i
            if layer.logit_cap is not None:
                s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
            w = torch.exp(s - s.max())
            denominator = w.sum()
            if layer.sinks is not None:
                denominator = denominator + torch.exp(layer.sinks[h].double() - s.max())
            out[t, h] = (w[:, None] * v[first : i + 1, h]).sum(0) / denominator
    return out.float()


FEATURES = {
    "plain": {},
    "window": {"sliding_window": 5},
    "cap": {"logit_cap": 0.9},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0, 0.25])},
    "all": {"sliding_window": 3, "logit_cap": 0.8, "sinks": torch.linspace(-1.0, 2.0, 8)},
}


def run_case(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int,
    features: str = "plain",
):
    torch.manual_seed(0)
    bs = len(prefix_lens)
    extra = dict(FEATURES[features])
    if "sinks" in extra:
        extra["sinks"] = extra["sinks"][:heads]
    # A large scale, so that the cap bends the scores (|s| up to ~3 here, the cap is below 1).
    layer = Layer(1, heads, kv_heads, HEAD_DIM, scaling=0.7 * HEAD_DIM**-0.5, **extra)
    req_pool = ReqToTokenPool(bs + 2, MAX_CONTEXT, "cpu")
    kv_pool = TokenToKVPool(300, 2, kv_heads, HEAD_DIM, torch.float32, "cpu")
    # Stale slots everywhere (as left by earlier requests): the backend must look only at [0, seq_len).
    req_pool.req_to_token.random_(1, 300)
    rows = [bs + 1 - i for i in range(bs)]  # rows out of order
    kv_pool.alloc(7)  # so that slots are not 1..n
    full_k, full_v, new_slots = [], [], []
    for row, p, e in zip(rows, prefix_lens, extend_lens, strict=True):
        slots = kv_pool.alloc(p + e)[torch.randperm(p + e)]  # scattered slots
        req_pool.req_to_token[row, : p + e] = slots.to(torch.int32)
        full_k.append(torch.randn(p + e, kv_heads, HEAD_DIM))
        full_v.append(torch.randn(p + e, kv_heads, HEAD_DIM))
        kv_pool.set_kv(layer.layer_id, slots[:p], full_k[-1][:p], full_v[-1][:p])  # the cached prefix
        new_slots.append(slots[p:])
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, heads, HEAD_DIM)
    k = torch.cat([fk[p:] for fk, p in zip(full_k, prefix_lens, strict=True)])
    v = torch.cat([fv[p:] for fv, p in zip(full_v, prefix_lens, strict=True)])
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    ctx = AttentionContext(
        req_pool, kv_pool, heads, kv_heads, HEAD_DIM, torch.float32, torch.device("cpu"), bs, MAX_CONTEXT
    )
    backend = TorchNativeBackend(ctx)
    out_cache_loc = torch.cat(new_slots)
    batch = ForwardBatch(
        mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),  # unused by attention
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int32),
        out_cache_loc=out_cache_loc,
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        logits_indices=torch.zeros(bs, dtype=torch.int64),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        attn_backend=backend,
    )
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)

    assert out.shape == q.shape and out.dtype == q.dtype
    k_buf, v_buf = kv_pool.get_kv_buffer(layer.layer_id)
    torch.testing.assert_close(k_buf[out_cache_loc], k, rtol=0, atol=0)
    torch.testing.assert_close(v_buf[out_cache_loc], v, rtol=0, atol=0)
    assert not kv_pool.get_kv_buffer(0)[0].any(), "other layers untouched"
    expected = torch.cat(
        [
            reference(qi, fk, fv, p, layer)
            for qi, fk, fv, p in zip(q.split(extend_lens), full_k, full_v, prefix_lens, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


HEADS = pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa"])
ALL_FEATURES = pytest.mark.parametrize("features", list(FEATURES))


@ALL_FEATURES
@HEADS
def test_prefill_ragged(heads: int, kv_heads: int, features: str) -> None:
    run_case(ForwardMode.PREFILL, [0, 0, 0], [5, 1, 12], heads, kv_heads, features)


@ALL_FEATURES
@HEADS
def test_extend_with_cached_prefix(heads: int, kv_heads: int, features: str) -> None:
    # With window 5: request 3's prefix (20) is longer than the window; requests 0 and 1 cross the
    # window edge within their new tokens; request 2's one token sees only the prefix's last 4 keys.
    run_case(ForwardMode.EXTEND, [3, 0, 9, 20], [4, 9, 1, 2], heads, kv_heads, features)


@ALL_FEATURES
@HEADS
def test_decode_ragged(heads: int, kv_heads: int, features: str) -> None:
    run_case(ForwardMode.DECODE, [0, 7, 30, 2], [1, 1, 1, 1], heads, kv_heads, features)


def test_auto_selection_attributes() -> None:
    assert TorchNativeBackend.auto_priority == 0
    assert TorchNativeBackend.is_available(torch.device("cpu"))
