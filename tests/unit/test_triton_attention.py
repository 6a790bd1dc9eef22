"""The triton attention backend against torch_native, on CPU under the Triton interpreter (tiny shapes).

TRITON_INTERPRET must be set before any kernel module is imported: `triton.jit` picks interpreted or
compiled at decoration time, and the setting holds for the rest of the process. On a machine with CUDA
this module is skipped instead (tests/gpu covers the compiled kernels, and interpreted kernels would
clash with them in one process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_triton_attention_gpu.py covers the compiled kernels",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.core.attention import AttentionBackend, AttentionContext  # noqa: E402
from rxf.core.forward import ForwardBatch, ForwardMode  # noqa: E402
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from rxf.core.registry import PluginRegistry  # noqa: E402
from rxf.plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from rxf.plugins.attention.triton import decode  # noqa: E402
from rxf.plugins.attention.triton import extend as extend_module  # noqa: E402
from rxf.plugins.attention.triton.backend import TritonAttnBackend  # noqa: E402
from rxf.plugins.attention.triton.decode import decode_attention  # noqa: E402
from rxf.plugins.attention.triton.extend import extend_attention  # noqa: E402
from rxf.testing.attention import Layer  # noqa: E402

MAX_CONTEXT = 48
NUM_SLOTS = 200
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@dataclass
class Case:
    """One batch, built twice over identical pool contents: `native` for the reference, `triton`."""

    layer: Layer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    native: ForwardBatch
    triton: ForwardBatch


def build(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int,
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
) -> Case:
    """`kv_dtype` an FP8 format: the pools store it, with k_scale 2 and v_scale 0.5, and the new k/v are
    FP8 values times their scales (see `fp8_exact`)."""
    torch.manual_seed(0)
    bs = len(prefix_lens)
    layer = Layer(1, heads, kv_heads, head_dim, scaling=0.8 * head_dim**-0.5)
    if kv_dtype is not None:
        layer.k_scale, layer.v_scale = torch.tensor(2.0), torch.tensor(0.5)
    req_pool = ReqToTokenPool(bs + 2, MAX_CONTEXT, "cpu")
    req_pool.req_to_token.random_(1, NUM_SLOTS)  # stale slots past every seq_len
    kv_pool = TokenToKVPool(NUM_SLOTS, 2, kv_heads, head_dim, kv_dtype or dtype, "cpu")
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:  # stale K/V everywhere: a wrong read shows
        buf.copy_(torch.randn(buf.shape))
    rows = [bs + 1 - i for i in range(bs)]  # rows out of order
    kv_pool.alloc(7)  # so that slots are not 1..n
    new_slots = []
    for row, p, e in zip(rows, prefix_lens, extend_lens, strict=True):
        slots = kv_pool.alloc(p + e)[torch.randperm(p + e)]  # scattered slots
        req_pool.req_to_token[row, : p + e] = slots.to(torch.int32)
        new_slots.append(slots[p:])
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, heads, head_dim, dtype=dtype)
    # k/v as strided views of one projection output, as a model would pass them.
    kv = torch.randn(num_tokens, 2 * kv_heads, head_dim, dtype=dtype)
    if kv_dtype is not None:
        kv[:, :kv_heads] = fp8_exact(kv[:, :kv_heads], layer.k_scale, kv_dtype)
        kv[:, kv_heads:] = fp8_exact(kv[:, kv_heads:], layer.v_scale, kv_dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]

    def batch(backend_cls: type[AttentionBackend], pool: TokenToKVPool) -> ForwardBatch:
        ctx = AttentionContext(req_pool, pool, heads, kv_heads, head_dim, dtype, torch.device("cpu"), bs,
                               MAX_CONTEXT)
        return ForwardBatch(
            mode=mode, batch_size=bs,
            input_ids=torch.zeros(num_tokens, dtype=torch.int64),
            positions=torch.zeros(num_tokens, dtype=torch.int64),  # unused by attention
            req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int32),
            out_cache_loc=torch.cat(new_slots),
            seq_lens_cpu=seq_lens, prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
            logits_indices=torch.zeros(bs, dtype=torch.int64),
            req_to_token_pool=req_pool, token_to_kv_pool=pool, attn_backend=backend_cls(ctx),
        )

    twin = TokenToKVPool(NUM_SLOTS, 2, kv_heads, head_dim, kv_dtype or dtype, "cpu")
    for dst, src in zip(twin.k_buffer + twin.v_buffer, kv_pool.k_buffer + kv_pool.v_buffer, strict=True):
        dst.copy_(src)
    return Case(layer, q, k, v, batch(TorchNativeBackend, kv_pool), batch(TritonAttnBackend, twin))


# RXF_DECODE_STORE per case: the K/V store's own launch (extend, decode), or the decode launch storing.
STORE_MODES = [(ForwardMode.EXTEND, "separate"), (ForwardMode.DECODE, "separate"), (ForwardMode.DECODE, "fused")]


@pytest.mark.parametrize(("env", "multi_row", "fused"), [
    ("", False, True), ("auto", True, False), ("", True, False), ("separate", False, False), ("fused", True, True),
])
def test_the_decode_store_is_fused_unless_a_request_may_hold_several_rows(
    env: str, multi_row: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset (or auto), the decode launch stores the new K/V itself unless a decode batch may carry
    several rows of one request (a speculative verify), which it could not serve: then it says so
    (`verifies_as_decode`). RXF_DECODE_STORE=fused / separate override it; anything else is refused."""
    monkeypatch.setenv("RXF_DECODE_STORE", env)
    pool = TokenToKVPool(8, 1, 1, 16, torch.float32, "cpu")
    ctx = AttentionContext(ReqToTokenPool(2, 8, "cpu"), pool, 2, 1, 16, torch.float32, torch.device("cpu"), 2, 8,
                           multi_row_decode=multi_row)
    backend = TritonAttnBackend(ctx)
    assert backend.fused_decode_store is fused and backend.verifies_as_decode is not fused
    monkeypatch.setenv("RXF_DECODE_STORE", "on")
    with pytest.raises(ValueError, match="RXF_DECODE_STORE='on'"):
        TritonAttnBackend(ctx)


def fp8_exact(x: torch.Tensor, scale: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the nearest FP8 value, times `scale`: a value the pool stores exactly. The Triton
    interpreter's float32 -> FP8 cast is wrong where rounding carries into the exponent (0.496 -> 0.25
    in e4m3; 3% of randn values), so CPU tests store values that need no rounding; tests/gpu checks the
    compiled cast's rounding against torch's."""
    return (x.float().to(kv_dtype).float() * scale).to(x.dtype)


def run(batch: ForwardBatch, case: Case) -> torch.Tensor:
    batch.attn_backend.init_forward_metadata(batch)
    return batch.attn_backend.forward(case.q, case.k, case.v, case.layer, batch)


def check(case: Case, out: torch.Tensor) -> None:
    expected = run(case.native, case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    tol = TOL[case.q.dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    for a, b in zip(case.triton.token_to_kv_pool.k_buffer + case.triton.token_to_kv_pool.v_buffer,
                    case.native.token_to_kv_pool.k_buffer + case.native.token_to_kv_pool.v_buffer,
                    strict=True):
        assert torch.equal(a, b), "the pools must hold the same K/V after the forward"


GQA_MHA = pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)], ids=["gqa", "mha"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


@DTYPES
@GQA_MHA
def test_extend_with_cached_prefix(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    case = build(ForwardMode.EXTEND, [0, 5, 9], [1, 4, 7], heads, kv_heads, 16, dtype)
    check(case, run(case.triton, case))


@DTYPES
def test_prefill_ragged(dtype: torch.dtype) -> None:
    case = build(ForwardMode.PREFILL, [0, 0, 0], [3, 1, 6], 4, 2, 16, dtype)
    check(case, run(case.triton, case))


def test_extend_multi_block_and_odd_head_dim() -> None:
    """Blocks of 16 so prefix and new parts span several key blocks and a request several query
    blocks; head_dim 24 runs with BLOCK_D 32 and a mask."""
    case = build(ForwardMode.EXTEND, [20, 0], [18, 3], 2, 1, 24, torch.float32)
    b = case.triton
    b.token_to_kv_pool.set_kv(case.layer.layer_id, b.out_cache_loc, case.k, case.v)
    k_buf, v_buf = b.token_to_kv_pool.get_kv_buffer(case.layer.layer_id)
    out = torch.empty_like(case.q)
    qo_start = torch.cumsum(b.extend_lens, 0, dtype=torch.int32) - b.extend_lens
    extend_attention(case.q, case.k, case.v, out, k_buf, v_buf, b.req_to_token_pool.req_to_token,
                     b.req_pool_indices, b.prefix_lens, b.extend_lens, qo_start, max(b.extend_lens_cpu),
                     case.layer.scaling, block_m=16, block_n=16)
    check(case, out)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model", "e4m3"])
@pytest.mark.parametrize(("block_m", "block_n", "heads", "pack"), [
    (16, 16, 4, False), (32, 16, 4, True), (16, 32, 8, True), (32, 16, 8, True),
], ids=["one-head-16x16", "pack2-32x16", "pack4-16x32", "pack4-32x16"])
def test_extend_key_blocks_below_the_diagonal_skip_the_mask(block_m: int, block_n: int, heads: int, pack: bool,
                                                             kv_dtype: torch.dtype | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """head_dim 16 (loads without a head mask) and prompts of 3-45 new tokens over blocks of 16-32:
    later row blocks read their whole key blocks unmasked (from the inputs, or back from an FP8
    pool) and only the blocks across the diagonal masked; block_n > block_m leaves a row block with
    none unmasked. With `pack` a block's rows are the 2 or 4 query heads of a KV head over 1/2 or
    1/4 as many tokens. A key counted twice, skipped, or seen before its row, or a row stored under
    another head or token, would show."""
    monkeypatch.setattr(extend_module, "_config", lambda head_dim, kv_fp8: (block_m, block_n, 4, 2))
    monkeypatch.setattr(extend_module, "PACK_GQA", pack)
    case = build(ForwardMode.EXTEND, [0, 7, 0], [45, 33, 3], heads, 2, 16, torch.float32, kv_dtype)
    check(case, run(case.triton, case))


def test_rxf_extend_sets_the_launch_and_a_malformed_value_fails_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """RXF_EXTEND=p16,16,4,2: packed blocks of 16 rows (8 tokens of 2 heads) over a 45-token prompt,
    right against torch_native; a value that is not a setting fails building the backend."""
    monkeypatch.setattr(extend_module, "_config", lambda head_dim, kv_fp8: pytest.fail("RXF_EXTEND must win"))
    try:
        for value in ("p16,16,4,2", "16,32,4,2"):
            monkeypatch.setenv(extend_module.ENV, value)
            extend_module._env_settings.cache_clear()
            case = build(ForwardMode.EXTEND, [0, 7], [45, 20], 4, 2, 16, torch.float32)
            check(case, run(case.triton, case))
        for value in ("p128,64,8", "24,64,4,2", "big"):
            monkeypatch.setenv(extend_module.ENV, value)
            extend_module._env_settings.cache_clear()
            with pytest.raises(ValueError, match="RXF_EXTEND="):
                build(ForwardMode.EXTEND, [0], [3], 4, 2, 16, torch.float32)
    finally:  # the value is read once per process: later tests must not see these
        monkeypatch.delenv(extend_module.ENV)
        extend_module._env_settings.cache_clear()


@pytest.fixture(params=["tile", "loop"])
def merge_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the last program merges a request's chunks: as one tile, or chunk by chunk (what a tile
    above `decode.MERGE_TILE_LIMIT` takes)."""
    if request.param == "loop":
        monkeypatch.setattr(decode, "MERGE_TILE_LIMIT", 0)
    return request.param


@pytest.mark.parametrize("max_splits", [1, 2, 4])
@DTYPES
@GQA_MHA
def test_decode_splits(heads: int, kv_heads: int, dtype: torch.dtype, max_splits: int, merge_mode: str) -> None:
    # seq_lens 1 / 6 / 13: at 4 splits request 1 gets chunks of 2 and an empty fourth one.
    case = build(ForwardMode.DECODE, [0, 5, 12], [1, 1, 1], heads, kv_heads, 16, dtype)
    backend = case.triton.attn_backend
    assert isinstance(backend, TritonAttnBackend)
    backend.min_split_len, backend.max_kv_splits, backend.target_programs = 1, max_splits, 1 << 20
    out = run(case.triton, case)
    assert backend._decode is not None
    assert backend._decode.num_kv_splits.tolist() == [1, min(6, max_splits), min(13, max_splits)]
    check(case, out)


def _decode_reference(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Explicit softmax in float64 over each request's first seq_len slots; zeros where seq_len is 0."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_buf.shape[1]
    for i, (row, n) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        if n == 0:
            continue
        slots = req_to_token[row, :n].long()
        k = k_buf[slots].double().repeat_interleave(group, 1)
        v = v_buf[slots].double().repeat_interleave(group, 1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(q.dtype)


def test_decode_kernel_more_splits_than_tokens_and_head_blocks(merge_mode: str) -> None:
    """Split counts above some sequence lengths (empty chunks), a padded entry with seq_len 0 (zeros),
    several key blocks per chunk, and a GQA group of 32 split over two programs of 16 heads."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, slots = 32, 1, 16, 64
    k_buf, v_buf = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
    req_to_token = torch.randint(1, slots, (4, MAX_CONTEXT), dtype=torch.int32)
    rows = torch.tensor([3, 0, 2, 1])
    seq_lens = torch.tensor([1, 0, 40, 3], dtype=torch.int32)
    num_kv_splits = torch.tensor([4, 2, 3, 4], dtype=torch.int32)
    q = torch.randn(4, heads, head_dim)
    out = torch.full_like(q, float("nan"))
    mid_o, mid_lse = torch.empty(4, heads, 4, head_dim), torch.empty(4, heads, 4)
    counters = torch.zeros(8, dtype=torch.int32)  # 4 requests x 2 head blocks
    decode_attention(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, num_kv_splits, 4, mid_o, mid_lse,
                     counters, 0.25, block_h=16, block_n=16)
    assert not counters.any(), "a merge counter was left set"
    expected = _decode_reference(q, k_buf, v_buf, req_to_token, rows, seq_lens, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "rope", "rope_head_norm", "fp8"])
def test_decode_with_its_own_store_matches_the_store_then_decode(kind: str) -> None:
    """`decode_attention(store=...)` = `rope_store_kv` (or `store_kv`) then `decode_attention`: the same
    output and the same pool. A GQA group of 32 over two programs of 16 heads (both store the token),
    a padded entry with seq_len 0 (its split 0 stores), split counts above some lengths, one chunk of
    three key blocks (the new token, stored by the launch, read back in the last),
    head_dim 24 (the rotation's halves of 12, masked lanes), an FP8 pool with scales."""
    from rxf.core.attention import HeadNorm
    from rxf.plugins.attention.triton.decode import DecodeStore
    from rxf.plugins.attention.triton.store_kv import rope_store_kv, store_kv
    from rxf.plugins.models.layers import RotaryEmbedding

    torch.manual_seed(2)
    heads, kv_heads, head_dim, slots, bs = 64, 2, 24, 5 * MAX_CONTEXT + 1, 5
    kv_dtype = torch.float8_e4m3fn if kind == "fp8" else torch.float32
    scales = (torch.tensor(2.0), torch.tensor(0.5)) if kind == "fp8" else (None, None)
    seq_lens = torch.tensor([1, 0, 40, 3, 37], dtype=torch.int32)
    rows = torch.tensor([3, 0, 2, 1, 4])
    req_to_token = torch.randperm(slots - 1)[: 5 * MAX_CONTEXT].add_(1).to(torch.int32).view(5, MAX_CONTEXT)
    loc = torch.stack([req_to_token[r, max(int(n) - 1, 0)] for r, n in zip(rows, seq_lens, strict=True)]).long()
    positions = (seq_lens - 1).clamp(min=0).long()
    pool = torch.randn(2, slots, kv_heads, head_dim)
    if kind == "fp8":
        pool = pool.to(kv_dtype).float()
    qkv = torch.randn(bs, heads + 2 * kv_heads, head_dim)
    if kind == "fp8":  # values the FP8 store keeps exactly (`fp8_exact`)
        qkv[:, heads:heads + kv_heads] = fp8_exact(qkv[:, heads:heads + kv_heads], scales[0], kv_dtype)
        qkv[:, heads + kv_heads:] = fp8_exact(qkv[:, heads + kv_heads:], scales[1], kv_dtype)
    rope = RotaryEmbedding(head_dim, MAX_CONTEXT, LLAMA3_ROPE, torch.float32) if kind.startswith("rope") else None
    norm = None
    if kind == "rope_head_norm":
        norm = HeadNorm(torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5, 1e-6)
    outs, pools = [], []
    for fused in (False, True):
        k_buf, v_buf = (pool[i].clone().to(kv_dtype) for i in range(2))
        views = qkv.clone()
        q, k, v = views[:, :heads], views[:, heads:heads + kv_heads], views[:, heads + kv_heads:]
        store = None
        if fused:
            store = DecodeStore(k, v, loc, (positions, rope.cos_sin_cache) if rope else None, norm)
        elif rope is not None:
            rope_store_kv(k_buf, v_buf, loc, q, k, v, positions, rope.cos_sin_cache, k_scale=scales[0],
                          v_scale=scales[1], head_norm=norm)
        else:
            store_kv(k_buf, v_buf, loc, k, v, *scales)
        out = torch.full_like(q, float("nan"))
        mid_o, mid_lse = torch.empty(bs, heads, 4, head_dim), torch.empty(bs, heads, 4)
        counters = torch.zeros(bs * kv_heads * 2, dtype=torch.int32)
        decode_attention(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, torch.tensor([4, 2, 3, 4, 1], dtype=torch.int32),
                         4, mid_o, mid_lse, counters, 0.25, block_h=16, block_n=16, k_scale=scales[0],
                         v_scale=scales[1], store=store)
        assert not counters.any()
        outs.append(out)
        pools.append((k_buf.float(), v_buf.float()))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(pools[1], pools[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(pools[1][0], pool[0].to(kv_dtype).float()), "the new keys were stored"


def test_cuda_graph_metadata_is_static_and_refilled() -> None:
    """Capture then replay with new sequence lengths: the metadata tensors keep their storage, the
    split counts are refilled in place, and the results stay right."""
    case = build(ForwardMode.DECODE, [3, 17, 30], [1, 1, 1], 4, 2, 16, torch.float32)
    backend = case.triton.attn_backend
    assert isinstance(backend, TritonAttnBackend)
    backend.min_split_len, backend.max_kv_splits, backend.target_programs = 8, 4, 1 << 20
    backend.init_cuda_graph_state(max_bs=8)
    backend.init_forward_metadata_capture(case.triton)
    meta = backend._decode
    assert meta is not None and meta.grid_splits == backend.split_cap(3) == 4
    assert meta.num_kv_splits.tolist() == [1, 3, 4]
    ptrs = (meta.num_kv_splits.data_ptr(), meta.mid_o.data_ptr(), meta.mid_lse.data_ptr())

    # Replay: the runner rewrites the batch's tensors in place (here: the last request is shorter).
    for b in (case.triton, case.native):
        b.seq_lens[2] = 9
        b.seq_lens_cpu[2] = 9
    backend.init_forward_metadata_replay(case.triton)
    meta = backend._decode
    assert (meta.num_kv_splits.data_ptr(), meta.mid_o.data_ptr(), meta.mid_lse.data_ptr()) == ptrs
    assert meta.num_kv_splits.tolist() == [1, 3, 2] and meta.grid_splits == 4
    out = case.triton.attn_backend.forward(case.q, case.k, case.v, case.layer, case.triton)
    check(case, out)


def test_split_policy_and_registration() -> None:
    assert TritonAttnBackend.auto_priority == 10 and TritonAttnBackend.supports_cuda_graph
    assert not TritonAttnBackend.is_available(torch.device("cpu"))
    case = build(ForwardMode.DECODE, [0], [1], 32, 8, 16, torch.float32)
    backend = case.triton.attn_backend
    assert isinstance(backend, TritonAttnBackend)
    backend.target_programs = 4 * 132  # an H200: 8 kv-head programs per request and split
    assert [backend.split_cap(bs) for bs in (1, 4, 8, 64, 256)] == [16, 16, 9, 2, 1]
    registry = PluginRegistry.load()
    assert registry.attention_backend("triton") is TritonAttnBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_pool_set_kv(dtype: torch.dtype) -> None:
    from rxf.plugins.attention.triton.store_kv import store_kv

    torch.manual_seed(0)
    heads, head_dim, n = 3, 24, 5  # non-powers of two: the masks matter
    ref = TokenToKVPool(NUM_SLOTS, 1, heads, head_dim, dtype, torch.device("cpu"))
    ours = TokenToKVPool(NUM_SLOTS, 1, heads, head_dim, dtype, torch.device("cpu"))
    loc = torch.randperm(NUM_SLOTS - 1)[:n].add_(1)
    qkv = torch.randn(n, 3 * heads, head_dim, dtype=torch.float32)  # strided views, as models pass them
    k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    ref.set_kv(0, loc, k, v)
    store_kv(*ours.get_kv_buffer(0), loc, k, v)
    for a, b in zip(ref.get_kv_buffer(0), ours.get_kv_buffer(0), strict=True):
        assert torch.equal(a, b)
    assert ours.k_buffer[0][loc].abs().sum() > 0  # rows were written


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# yarn scales cos and sin by its attention factor (1.14 here): the fused table must carry it. A
# partial rotation has no fused table: triton must leave it to the module.
ROPES = pytest.mark.parametrize("rope_params", [
    LLAMA3_ROPE,
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
], ids=["llama3", "yarn", "partial"])


@pytest.mark.parametrize("separate_q_out", [False, True], ids=["q_in_place", "q_out"])
@DTYPES
def test_rope_store_kv_matches_rotary_then_set_kv(dtype: torch.dtype, separate_q_out: bool) -> None:
    """One launch = RotaryEmbedding's torch rotation + pool.set_kv: a GQA group of 3 (not a power of
    two, masked) and head_dim 24 (halves of 12, masked), q/k/v as strided views of one projection."""
    from rxf.plugins.attention.triton.store_kv import rope_store_kv
    from rxf.plugins.models.layers import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, head_dim, n = 6, 2, 24, 5
    rope = RotaryEmbedding(head_dim, MAX_CONTEXT, LLAMA3_ROPE, dtype)
    positions = torch.tensor([0, 3, 17, 40, 47])
    loc = torch.randperm(NUM_SLOTS - 1)[:n].add_(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_ref, k_ref = rope.forward_native(positions, qkv[:, : heads * head_dim], qkv[:, heads * head_dim : -kv_heads * head_dim])
    v = qkv[:, -kv_heads * head_dim :].unflatten(-1, (kv_heads, head_dim))
    ref = TokenToKVPool(NUM_SLOTS, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    ref.set_kv(0, loc, k_ref.unflatten(-1, (kv_heads, head_dim)), v)

    ours = TokenToKVPool(NUM_SLOTS, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    views = qkv.clone().unflatten(-1, (heads + 2 * kv_heads, head_dim))
    q, k, v_view = views[:, :heads], views[:, heads : heads + kv_heads], views[:, heads + kv_heads :]
    q_out = torch.full(q.shape, float("nan"), dtype=dtype) if separate_q_out else None
    q_rot = rope_store_kv(*ours.get_kv_buffer(0), loc, q, k, v_view, positions, rope.cos_sin_cache, q_out=q_out)

    tol = TOL[dtype]
    assert (q_rot is q_out) if separate_q_out else (q_rot.data_ptr() == q.data_ptr())
    torch.testing.assert_close(q_rot.flatten(-2), q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k.flatten(-2), k_ref, rtol=tol, atol=tol)  # k rotated in place
    for a, b in zip(ours.get_kv_buffer(0), ref.get_kv_buffer(0), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert torch.equal(v_view, v), "v must not change"


@DTYPES
def test_rope_store_kv_with_head_norms_matches_norms_then_rotary(dtype: torch.dtype) -> None:
    """Qwen3's per-head q / k norms in the same launch = `norm_heads_`'s torch code, then the torch
    rotation and set_kv; and `HeadNormedRotary` called (for a backend that does not fuse it) computes
    the same. A GQA group of 3 and head_dim 24 (masked lanes the norm must not count)."""
    from rxf.core.attention import HeadNorm
    from rxf.plugins.attention.triton.store_kv import rope_store_kv
    from rxf.plugins.models.layers import RMSNorm, RotaryEmbedding
    from rxf.plugins.models.layers.head_norm import HeadNormedRotary, norm_heads_

    torch.manual_seed(1)
    heads, kv_heads, head_dim, n = 6, 2, 24, 5
    rope = RotaryEmbedding(head_dim, MAX_CONTEXT, LLAMA3_ROPE, dtype)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6, dtype), RMSNorm(head_dim, 1e-6, dtype)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    positions = torch.tensor([0, 3, 17, 40, 47])
    loc = torch.randperm(NUM_SLOTS - 1)[:n].add_(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype) * 3
    q_cols, kv_cols = heads * head_dim, kv_heads * head_dim

    normed = qkv.clone()
    norm_heads_(normed, q_norm, k_norm, heads, kv_heads, head_dim)  # CPU: the modules' torch code
    q_ref, k_ref = rope.forward_native(positions, normed[:, :q_cols], normed[:, q_cols : q_cols + kv_cols])
    v = qkv[:, -kv_cols:].unflatten(-1, (kv_heads, head_dim))
    ref = TokenToKVPool(NUM_SLOTS, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    ref.set_kv(0, loc, k_ref.unflatten(-1, (kv_heads, head_dim)), v)

    ours = TokenToKVPool(NUM_SLOTS, 1, kv_heads, head_dim, dtype, torch.device("cpu"))
    views = qkv.clone().unflatten(-1, (heads + 2 * kv_heads, head_dim))
    q, k, v_view = views[:, :heads], views[:, heads : heads + kv_heads], views[:, heads + kv_heads :]
    q_rot = rope_store_kv(*ours.get_kv_buffer(0), loc, q, k, v_view, positions, rope.cos_sin_cache,
                          head_norm=HeadNorm(q_norm.weight, k_norm.weight, 1e-6))
    tol = TOL[dtype]
    torch.testing.assert_close(q_rot.flatten(-2), q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k.flatten(-2), k_ref, rtol=tol, atol=tol)
    for a, b in zip(ours.get_kv_buffer(0), ref.get_kv_buffer(0), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)

    wrapped = HeadNormedRotary(rope, q_norm, k_norm, head_dim)
    assert wrapped.cos_sin_cache is rope.cos_sin_cache and wrapped.head_norm.q_weight is q_norm.weight
    q_w, k_w = wrapped(positions, qkv[:, :q_cols].clone(), qkv[:, q_cols : q_cols + kv_cols].clone())
    torch.testing.assert_close(q_w, q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k_w, k_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(("mode", "decode_store"), STORE_MODES,
                         ids=["extend", "decode", "decode-fused-store"])
def test_qwen3_attention_hands_its_head_norms_to_the_fusing_backend(mode: ForwardMode, decode_store: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's attention block on torch_native (norms, then rotation, then attention, in torch) and on
    triton (the norms and the rotation inside the K/V store launch, or with RXF_DECODE_STORE=fused
    inside the decode launch): the same output."""
    from types import SimpleNamespace

    monkeypatch.setenv("RXF_DECODE_STORE", decode_store)

    from rxf.plugins.models.layers import RotaryEmbedding
    from rxf.plugins.models.qwen3 import Qwen3Attention

    prefix_lens, extend_lens = ([0, 5, 9], [1, 4, 7]) if mode == ForwardMode.EXTEND else ([4, 17, 30], [1, 1, 1])
    heads, kv_heads, head_dim, hidden = 4, 2, 16, 32
    case = build(mode, prefix_lens, extend_lens, heads, kv_heads, head_dim, torch.float32)
    config = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, rms_norm_eps=1e-6, attention_bias=False)
    rope = RotaryEmbedding(head_dim, MAX_CONTEXT, LLAMA3_ROPE, torch.float32)
    torch.manual_seed(2)
    block = Qwen3Attention(config, case.layer.layer_id, False, rope, torch.float32)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape) * (0.2 if p.dim() > 1 else 1.0))
    positions = torch.cat([p + torch.arange(e) for p, e in zip(prefix_lens, extend_lens, strict=True)])
    x = torch.randn(len(positions), hidden)
    outs = []
    for batch in (case.native, case.triton):
        batch.positions = positions
        batch.attn_backend.init_forward_metadata(batch)
        outs.append(block(x, batch))
    assert case.triton.attn_backend.fuses_head_norm and not case.native.attn_backend.fuses_head_norm
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("mode", "decode_store"), STORE_MODES,
                         ids=["extend", "decode", "decode-fused-store"])
@DTYPES
@ROPES
def test_rotary_fused_into_store_matches_torch_native(mode: ForwardMode, decode_store: str, dtype: torch.dtype,
                                                      rope_params, monkeypatch: pytest.MonkeyPatch) -> None:
    """RadixAttention handed the rotary embedding: torch_native gets q and k rotated by the module's
    torch code first, triton rotates them inside its K/V store (RXF_DECODE_STORE=fused: inside the
    decode launch, which leaves q as it was); outputs and pools agree."""
    from rxf.plugins.models.layers import RadixAttention, RotaryEmbedding

    monkeypatch.setenv("RXF_DECODE_STORE", decode_store)

    prefix_lens, extend_lens = ([0, 5, 9], [1, 4, 7]) if mode == ForwardMode.EXTEND else ([4, 17, 30], [1, 1, 1])
    heads, kv_heads, head_dim = 4, 2, 16
    case = build(mode, prefix_lens, extend_lens, heads, kv_heads, head_dim, dtype)
    positions = torch.cat([p + torch.arange(e) for p, e in zip(prefix_lens, extend_lens, strict=True)])
    rope = RotaryEmbedding(head_dim, MAX_CONTEXT, rope_params, dtype)
    attn = RadixAttention(case.layer.layer_id, heads, kv_heads, head_dim, case.layer.scaling)
    qkv = torch.cat([case.q.flatten(-2), case.k.flatten(-2), case.v.flatten(-2)], dim=-1)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    outs = []
    for batch in (case.native, case.triton):
        batch.positions = positions
        batch.attn_backend.init_forward_metadata(batch)
        q, k, v = qkv.clone().split(sizes, dim=-1)
        outs.append(attn(q, k, v, batch, rotary=rope))
        if batch is case.triton and rope.cos_sin_cache is None:
            assert not batch.attn_backend.fuses_rope(rope)
        elif batch is case.triton and decode_store == "fused":  # rotated inside the decode launch, not in place
            assert batch.attn_backend.fuses_rope(rope) and not batch.attn_backend.verifies_as_decode
            torch.testing.assert_close(q, qkv.split(sizes, dim=-1)[0], rtol=0, atol=0)
        elif batch is case.triton:  # the fused path rotated q in place (the torch path does not)
            assert batch.attn_backend.fuses_rope(rope)
            q_ref, _ = rope.forward_native(positions, *qkv.split(sizes, dim=-1)[:2])
            torch.testing.assert_close(q, q_ref, rtol=TOL[dtype], atol=TOL[dtype])
    tol = TOL[dtype]
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    for a, b in zip(case.triton.token_to_kv_pool.k_buffer + case.triton.token_to_kv_pool.v_buffer,
                    case.native.token_to_kv_pool.k_buffer + case.native.token_to_kv_pool.v_buffer, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


FP8 = pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])


@FP8
@DTYPES
@pytest.mark.parametrize(("mode", "decode_store"), STORE_MODES,
                         ids=["extend", "decode", "decode-fused-store"])
def test_fp8_kv_matches_torch_native(mode: ForwardMode, decode_store: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 pool with k_scale 2 and v_scale 0.5: the store quantizes with the scales, the kernels
    dequantize (a kernel that skipped a scale, or read the new tokens' unquantized k from the inputs
    and scaled it again, would be off by a factor of 2); RXF_DECODE_STORE=fused: the decode launch
    stores."""
    monkeypatch.setenv("RXF_DECODE_STORE", decode_store)
    prefix_lens, extend_lens = ([0, 5, 9], [1, 4, 7]) if mode == ForwardMode.EXTEND else ([4, 17, 30], [1, 1, 1])
    case = build(mode, prefix_lens, extend_lens, 4, 2, 16, dtype, kv_dtype)
    if mode == ForwardMode.DECODE:
        backend = case.triton.attn_backend
        assert isinstance(backend, TritonAttnBackend)
        backend.min_split_len, backend.max_kv_splits, backend.target_programs = 4, 4, 1 << 20  # several splits
    out = run(case.triton, case)
    assert case.triton.token_to_kv_pool.k_buffer[1].dtype == kv_dtype
    check(case, out)


@FP8
def test_fp8_store_kv_matches_pool_set_kv(kv_dtype: torch.dtype) -> None:
    """The store kernel writes what `TokenToKVPool.set_kv` writes: x / scale in FP8, saturated (a
    value past the format's largest finite one is stored as it, not as NaN)."""
    from rxf.plugins.attention.triton.store_kv import store_kv

    torch.manual_seed(0)
    heads, head_dim, n = 3, 24, 5
    k_scale, v_scale = torch.tensor(0.25), torch.tensor(4.0)
    ref = TokenToKVPool(NUM_SLOTS, 1, heads, head_dim, kv_dtype, "cpu")
    ours = TokenToKVPool(NUM_SLOTS, 1, heads, head_dim, kv_dtype, "cpu")
    loc = torch.randperm(NUM_SLOTS - 1)[:n].add_(1)
    qkv = torch.randn(n, 3 * heads, head_dim)
    qkv[:, heads : 2 * heads] = fp8_exact(qkv[:, heads : 2 * heads], k_scale, kv_dtype)
    qkv[:, 2 * heads :] = fp8_exact(qkv[:, 2 * heads :], v_scale, kv_dtype)
    big = torch.finfo(kv_dtype).max * 4
    qkv[0, heads, :2] = torch.tensor([big, -big])  # k / 0.25 is 16x past the largest finite value
    k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    ref.set_kv(0, loc, k, v, k_scale, v_scale)
    store_kv(*ours.get_kv_buffer(0), loc, k, v, k_scale, v_scale)
    for a, b in zip(ref.get_kv_buffer(0), ours.get_kv_buffer(0), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    fmax = torch.finfo(kv_dtype).max
    assert ours.k_buffer[0][loc[0], 0, :2].float().tolist() == [fmax, -fmax]


class SpiedBackend(TritonAttnBackend):
    """Records the requests each attention launch receives: ("extend" | "decode", their count, the
    decode kernel's q rows). Several KV splits at these tiny lengths."""

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        self.min_split_len, self.max_kv_splits, self.target_programs = 4, 4, 1 << 20
        self.launches: list[tuple[str, int, list[int] | None]] = []
        extend, decode = self._extend_attention, self._decode_attention

        def spied_extend(*args, **kw) -> None:
            self.launches.append(("extend", len(args[7]), None))  # args[7]: req_pool_indices
            extend(*args, **kw)

        def spied_decode(*args, **kw) -> None:
            self.launches.append(("decode", len(args[5]), kw["q_rows"].tolist()))
            decode(*args, **kw)

        self._extend_attention, self._decode_attention = spied_extend, spied_decode


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["kv-model", "kv-e4m3"])
@DTYPES
@GQA_MHA
def test_mixed_batch_sends_its_one_token_rows_to_the_decode_kernel(heads, kv_heads, dtype, kv_dtype) -> None:
    """A mixed chunked-prefill batch: decode rows (one new token after a cached prefix, split over the
    KV length) interleaved with prefill chunks with and without a prefix. The extend kernel runs the
    chunks only, the decode kernel the one-token rows, both into one output equal to torch_native's."""
    case = build(ForwardMode.EXTEND, [5, 0, 12, 9, 30], [1, 6, 1, 7, 1], heads, kv_heads, 16, dtype, kv_dtype)
    ctx = case.triton.attn_backend.ctx
    backend = case.triton.attn_backend = SpiedBackend(ctx)
    check(case, run(case.triton, case))
    assert backend.launches == [("extend", 2, None), ("decode", 3, [0, 7, 15])]
    assert backend._extend is not None and backend._extend.decode_rows is not None
    assert backend._extend.decode_rows.plan.num_kv_splits.tolist() == [2, 4, 4]
    assert not backend._counters.any()


def test_extend_batch_of_one_token_rows_runs_no_extend_kernel() -> None:
    """Every request with one new token (with or without a prefix): the decode kernel alone."""
    case = build(ForwardMode.EXTEND, [0, 7, 3], [1, 1, 1], 4, 2, 16, torch.float32)
    backend = case.triton.attn_backend = SpiedBackend(case.triton.attn_backend.ctx)
    check(case, run(case.triton, case))
    assert backend.launches == [("decode", 3, [0, 1, 2])]
