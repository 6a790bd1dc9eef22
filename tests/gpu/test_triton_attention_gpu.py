"""The triton attention backend against torch_native on the GPU: real shapes, bf16, a mixed batch's
one-token rows through the decode kernel, and a captured CUDA graph for decode. Skipped without CUDA (the kernel modules are imported only after that check, so on a
CPU machine they stay free for the interpreter tests in tests/unit)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from rxf.core.attention import AttentionBackend, AttentionContext  # noqa: E402
from rxf.core.forward import ForwardBatch, ForwardMode  # noqa: E402
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from rxf.plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from rxf.plugins.attention.triton import extend as extend_module  # noqa: E402
from rxf.plugins.attention.triton.backend import TritonAttnBackend  # noqa: E402
from rxf.testing.attention import Layer, assert_bf16_close  # noqa: E402
from rxf.testing.pdl import pdl_env  # noqa: E402

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
MAX_CONTEXT = 4096
NUM_SLOTS = 24_000


def build(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int,
    head_dim: int,
) -> tuple[Layer, torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch, ForwardBatch]:
    """(layer, q, k, v, native batch, triton batch): two batches over identical, separate KV pools."""
    torch.manual_seed(0)
    bs = len(prefix_lens)
    layer = Layer(0, heads, kv_heads, head_dim, scaling=head_dim**-0.5)
    req_pool = ReqToTokenPool(bs + 2, MAX_CONTEXT, DEV)
    req_pool.req_to_token.random_(1, NUM_SLOTS)  # stale slots past every seq_len
    pools = [TokenToKVPool(NUM_SLOTS, 1, kv_heads, head_dim, DTYPE, DEV) for _ in range(2)]
    for bufs in zip(*(p.k_buffer + p.v_buffer for p in pools), strict=True):
        noise = torch.randn(bufs[0].shape, device=DEV, dtype=DTYPE)
        for buf in bufs:
            buf.copy_(noise)
    rows = list(range(bs + 1, 1, -1))
    slots = torch.randperm(NUM_SLOTS, device=DEV)[: sum(prefix_lens) + sum(extend_lens)] + 1
    new_slots, used = [], 0
    for row, p, e in zip(rows, prefix_lens, extend_lens, strict=True):
        req_pool.req_to_token[row, : p + e] = slots[used : used + p + e].to(torch.int32)
        new_slots.append(slots[used + p : used + p + e])
        used += p + e
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, heads, head_dim, device=DEV, dtype=DTYPE)
    kv = torch.randn(num_tokens, 2 * kv_heads, head_dim, device=DEV, dtype=DTYPE)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]

    def batch(backend_cls: type[AttentionBackend], pool: TokenToKVPool) -> ForwardBatch:
        ctx = AttentionContext(req_pool, pool, heads, kv_heads, head_dim, DTYPE, DEV, bs, MAX_CONTEXT)
        return ForwardBatch(
            mode=mode, batch_size=bs,
            input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
            positions=torch.zeros(num_tokens, dtype=torch.int64, device=DEV),
            req_pool_indices=torch.tensor(rows, device=DEV),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=DEV),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int32, device=DEV),
            out_cache_loc=torch.cat(new_slots),
            seq_lens_cpu=seq_lens, prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
            logits_indices=torch.zeros(bs, dtype=torch.int64, device=DEV),
            req_to_token_pool=req_pool, token_to_kv_pool=pool, attn_backend=backend_cls(ctx),
        )

    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    return layer, q, k, v, batch(TorchNativeBackend, pools[0]), batch(TritonAttnBackend, pools[1])


def run(batch: ForwardBatch, layer: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch.attn_backend.init_forward_metadata(batch)
    return batch.attn_backend.forward(q, k, v, layer, batch)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, native: ForwardBatch, triton: ForwardBatch) -> None:
    assert_bf16_close(out, expected)
    for a, b in zip(triton.token_to_kv_pool.k_buffer + triton.token_to_kv_pool.v_buffer,
                    native.token_to_kv_pool.k_buffer + native.token_to_kv_pool.v_buffer, strict=True):
        assert torch.equal(a, b), "the pools must hold the same K/V after the forward"


SHAPES = pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(32, 8, 128), (32, 32, 128), (32, 8, 64), (16, 8, 256), (28, 4, 128), (64, 8, 96)],
    ids=["gqa4-d128", "mha-d128", "gqa4-d64", "gqa2-d256", "gqa7-d128", "gqa8-d96"],
)


# Both row layouts of the extend kernel: one query head a block, or the GQA heads of a KV head packed
# (`extend.PACK_GQA`; a group that does not divide BLOCK_M, gqa7, keeps one head a block).
PACK = pytest.mark.parametrize("pack", [False, True], ids=["one-head", "packed-gqa"])


@PACK
@SHAPES
def test_extend_with_cached_prefix(heads: int, kv_heads: int, head_dim: int, pack: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extend_module, "PACK_GQA", pack)
    layer, q, k, v, native, triton = build(
        ForwardMode.EXTEND, [0, 1, 17, 300, 1024, 0, 1500, 64], [1, 33, 128, 7, 512, 700, 548, 1],
        heads, kv_heads, head_dim,
    )
    assert_matches(run(triton, layer, q, k, v), run(native, layer, q, k, v), native, triton)


@PACK
def test_prefill_ragged(pack: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extend_module, "PACK_GQA", pack)
    layer, q, k, v, native, triton = build(
        ForwardMode.PREFILL, [0] * 8, [1, 2048, 100, 777, 64, 65, 1500, 3], 32, 8, 128
    )
    assert_matches(run(triton, layer, q, k, v), run(native, layer, q, k, v), native, triton)


HOPPER = torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HOPPER, reason="programmatic dependent launch needs compute capability 9.0"))], ids=["plain", "pdl"])
@SHAPES
def test_mixed_batch_one_token_rows_take_the_decode_kernel(heads: int, kv_heads: int, head_dim: int, pdl: bool) -> None:
    """Mixed chunked prefill's batch: decode rows at contexts up to 3000 (split over the KV length)
    interleaved with prefill chunks with and without a prefix; the decode kernel (launched with PDL
    when on) writes the one-token rows of the extend forward's output, the extend kernel the rest."""
    prefix, extend = [1023, 0, 64, 2047, 128, 500, 3000, 5], [1, 1024, 1, 1, 512, 1, 1, 1]
    layer, q, k, v, native, triton = build(ForwardMode.EXTEND, prefix, extend, heads, kv_heads, head_dim)
    with pdl_env(pdl):
        out = run(triton, layer, q, k, v)
    backend = triton.attn_backend
    assert isinstance(backend, TritonAttnBackend) and backend._extend is not None
    rows = backend._extend.decode_rows
    assert rows is not None and rows.q_rows.tolist() == [0, 1025, 1026, 1539, 1540, 1541]
    assert backend._extend.max_extend_len == 1024 and backend._extend.req_pool_indices.numel() == 2
    assert max(rows.plan.num_kv_splits.tolist()) > 1
    assert_matches(out, run(native, layer, q, k, v), native, triton)
    assert not backend._counters.any()


# RXF_DECODE_STORE: "separate" the K/V store's launch, then decode; "fused": the decode launch stores
# (backend.py; unset: fused unless a decode batch may hold several rows of one request).
STORES = pytest.mark.parametrize("decode_store", ["separate", "fused"], ids=["store-launch", "fused-store"])


@STORES
@SHAPES
def test_decode_ragged(heads: int, kv_heads: int, head_dim: int, decode_store: str,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RXF_DECODE_STORE", decode_store)
    seq_lens = [1, 7, 64, 129, 500, 1023, 2048, 333]
    layer, q, k, v, native, triton = build(
        ForwardMode.DECODE, [n - 1 for n in seq_lens], [1] * 8, heads, kv_heads, head_dim
    )
    assert_matches(run(triton, layer, q, k, v), run(native, layer, q, k, v), native, triton)


@STORES
@pytest.mark.parametrize("seq_len", [1, 100, 2048, 4000])
def test_decode_batch_one_many_splits(seq_len: int, decode_store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RXF_DECODE_STORE", decode_store)
    layer, q, k, v, native, triton = build(ForwardMode.DECODE, [seq_len - 1], [1], 32, 8, 128)
    out = run(triton, layer, q, k, v)
    backend = triton.attn_backend
    assert isinstance(backend, TritonAttnBackend) and backend._decode is not None
    expected_splits = min(-(-seq_len // backend.min_split_len), backend.split_cap(1))
    assert backend._decode.num_kv_splits.tolist() == [expected_splits]
    assert_matches(out, run(native, layer, q, k, v), native, triton)


@STORES
def test_decode_cuda_graph_replay(decode_store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture one decode forward, then replay it after rewriting the batch's tensors in place (shorter
    sequences, new q/k/v, new target slots): it must match an eager torch_native forward."""
    monkeypatch.setenv("RXF_DECODE_STORE", decode_store)
    seq_lens = [1, 7, 64, 129, 500, 1023, 2048, 333]
    layer, q, k, v, native, triton = build(
        ForwardMode.DECODE, [n - 1 for n in seq_lens], [1] * 8, 32, 8, 128
    )
    backend = triton.attn_backend
    assert isinstance(backend, TritonAttnBackend)
    backend.init_cuda_graph_state(max_bs=16)
    backend.init_forward_metadata_capture(triton)
    backend.forward(q, k, v, layer, triton)  # compiles the kernels outside the capture
    run(native, layer, q, k, v)  # the same K/V write into the reference pool
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, triton)

    new_lens = [1, 3, 200, 129, 17, 1024, 1500, 2]
    rows = triton.req_pool_indices
    for batch in (native, triton):
        batch.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        batch.seq_lens_cpu[:] = new_lens
        # The new token of each request goes to the slot its last position maps to.
        last = batch.req_to_token_pool.req_to_token[rows, batch.seq_lens.long() - 1]
        batch.out_cache_loc.copy_(last.long())
    q.copy_(torch.randn_like(q))
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    backend.init_forward_metadata_replay(triton)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, run(native, layer, q, k, v), native, triton)


@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HOPPER, reason="programmatic dependent launch needs compute capability 9.0"))], ids=["plain", "pdl"])
@pytest.mark.parametrize("kind", ["rope", "rope_head_norm", "fp8"])
def test_decode_with_its_own_store_matches_the_store_then_decode(kind: str, pdl: bool) -> None:
    """The compiled decode launch that stores the new tokens itself (`decode.DecodeStore`) against
    `rope_store_kv` then `decode_attention`, bf16 at Llama's head shape: contexts up to 4000 over 16
    splits (the new token in the last), a padded entry of seq_len 0, Qwen3's head norms, an FP8 pool."""
    from rxf.core.attention import HeadNorm
    from rxf.plugins.attention.triton.decode import DecodeStore, decode_attention
    from rxf.plugins.attention.triton.store_kv import rope_store_kv
    from rxf.plugins.models.layers import RotaryEmbedding

    torch.manual_seed(3)
    heads, kv_heads, head_dim, bs, splits = 32, 8, 128, 6, 16
    kv_dtype = torch.float8_e4m3fn if kind == "fp8" else DTYPE
    scales = (torch.tensor(2.0, device=DEV), torch.tensor(0.5, device=DEV)) if kind == "fp8" else (None, None)
    seq_lens = torch.tensor([1, 0, 4000, 129, 2048, 7], dtype=torch.int32, device=DEV)
    req_to_token = torch.zeros(bs, MAX_CONTEXT, dtype=torch.int32, device=DEV)
    slots = (torch.randperm(NUM_SLOTS - 1, device=DEV) + 1).to(torch.int32)  # distinct, as the pool gives them
    used = 0
    for b, n in enumerate(seq_lens.tolist()):
        req_to_token[b, : max(n, 1)] = slots[used : used + max(n, 1)]
        used += max(n, 1)
    rows = torch.arange(bs, device=DEV)
    loc = req_to_token[rows, (seq_lens.long() - 1).clamp(min=0)].long()
    positions = (seq_lens.long() - 1).clamp(min=0)
    pool = (torch.randn(2, NUM_SLOTS, kv_heads, head_dim, device=DEV) * 0.5).to(kv_dtype)
    qkv = torch.randn(bs, heads + 2 * kv_heads, head_dim, device=DEV, dtype=DTYPE)
    rope = RotaryEmbedding(head_dim, MAX_CONTEXT, {"rope_type": "default", "rope_theta": 500000.0}, DTYPE).to(DEV)
    norm = None
    if kind == "rope_head_norm":
        norm = HeadNorm(torch.rand(head_dim, device=DEV).to(DTYPE) + 0.5, torch.rand(head_dim, device=DEV).to(DTYPE) + 0.5,
                        1e-6)
    splits_t = torch.full((bs,), splits, dtype=torch.int32, device=DEV)
    outs, pools = [], []
    with pdl_env(pdl):
        for fused in (False, True):
            k_buf, v_buf = pool[0].clone(), pool[1].clone()
            views = qkv.clone()
            q, k, v = views[:, :heads], views[:, heads:heads + kv_heads], views[:, heads + kv_heads:]
            store = DecodeStore(k, v, loc, (positions, rope.cos_sin_cache), norm) if fused else None
            if not fused:
                rope_store_kv(k_buf, v_buf, loc, q, k, v, positions, rope.cos_sin_cache, k_scale=scales[0],
                              v_scale=scales[1], head_norm=norm)
            out = torch.full_like(q, float("nan"))
            mid_o = torch.empty(bs, heads, splits, head_dim, device=DEV)
            mid_lse = torch.empty(bs, heads, splits, device=DEV)
            counters = torch.zeros(bs * kv_heads, dtype=torch.int32, device=DEV)
            decode_attention(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, splits_t, splits, mid_o, mid_lse,
                             counters, head_dim**-0.5, min_split_len=128, k_scale=scales[0], v_scale=scales[1],
                             store=store)
            torch.cuda.synchronize()
            assert not counters.any()
            outs.append(out)
            pools.append((k_buf, v_buf))
    assert_bf16_close(outs[1], outs[0])
    for a, b in zip(pools[1], pools[0], strict=True):
        assert torch.equal(a, b), "the fused store must write the bytes rope_store_kv writes"
