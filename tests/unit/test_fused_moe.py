"""The fused MoE Triton kernels against the torch path (`experts_native`), on CPU under the Triton
interpreter at tiny shapes (fp32 and fp16), and the pair alignment's region map.

As in test_triton_attention.py, TRITON_INTERPRET is set before the kernel module is imported, and the
module is skipped where CUDA is present (tests/gpu/test_moe_gpu.py covers the compiled kernels).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_moe_gpu.py covers the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.models.layers import fused_moe, fused_moe_decode  # noqa: E402
from rxf.plugins.models.layers.fused_moe import BlockConfig, align_pairs, fused_experts  # noqa: E402
from rxf.plugins.models.layers.moe import ExpertScales, GatedActivation, experts_native, select_experts  # noqa: E402
from rxf.testing.quantized_checkpoints import fp8_experts  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
SMALL = BlockConfig(16, 32, 32, down_block_n=16, group_m=2)  # several column and K blocks at tiny shapes


def problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids) -> torch.Tensor:
    return experts_native(x.float(), w13.float(), w2.float(), weights, ids)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "config"),
    [
        (1, 4, 2, 64, 48, None),  # decode: two experts hit, the heuristic's blocks exceed every dim
        (5, 8, 2, 64, 96, SMALL),  # some experts unused; several K and column blocks
        (33, 4, 3, 48, 40, SMALL),  # dims that are not block multiples (masked tails)
        (40, 3, 1, 32, 32, BlockConfig(16, 16, 16, group_m=3)),  # top-1, uneven row groups
        (80, 4, 2, 64, 48, None),  # the heuristic's middle blocks (40 rows per expert)
        (300, 4, 2, 32, 40, None),  # its largest blocks (150 rows per expert)
    ],
)
def test_fused_matches_torch_path(tokens, experts, top_k, hidden, inter, config, dtype) -> None:
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, dtype)
    assert_matches(fused_experts(x, w13, w2, weights, ids, config), reference(x, w13, w2, weights, ids), dtype)


def test_all_tokens_on_one_expert_and_empty_batch() -> None:
    x, w13, w2, weights, _ = problem(37, 4, 2, 32, 32, torch.float32, seed=1)
    ids = torch.tensor([[2, 0]] * 37)  # 37 rows for two experts: several full blocks plus a partial one
    assert_matches(fused_experts(x, w13, w2, weights, ids, SMALL), reference(x, w13, w2, weights, ids),
                   torch.float32)
    assert fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


GPT_OSS = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "biased"),
    [
        (1, 8, 4, 64, 48, False),  # batch-1 decode: four partials summed by the last program
        (3, 4, 1, 48, 40, False),  # top-1: no partials; dims off the block sizes (masked tails)
        (4, 6, 3, 300, 70, True),  # MAX_TOKENS tokens sharing experts, a K tail past one block, biases
    ],
)
def test_decode_kernels_match_torch_path(tokens, experts, top_k, hidden, inter, biased, dtype) -> None:
    """`fused_moe_decode` (which `fused_experts` takes for <= MAX_TOKENS tokens without a config)
    against the torch path, with gpt-oss's biases and clamp where `biased`; the counters it used are
    left zeroed for the next launch (the invariant every later layer relies on)."""
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, dtype, seed=tokens + 10)
    kw = {}
    if biased:
        gen = torch.Generator().manual_seed(3)
        w13 = w13 * 6
        kw = {"b13": torch.randn(experts, 2 * inter, generator=gen).to(dtype),
              "b2": torch.randn(experts, hidden, generator=gen).to(dtype), "activation": GPT_OSS}
    ref = experts_native(x.float(), w13.float(), w2.float(), weights, ids,
                         **{k: v.float() if torch.is_tensor(v) else v for k, v in kw.items()})
    out = fused_moe_decode.decode_experts(x, w13, w2, weights, ids, **kw)
    assert_matches(out, ref, dtype)
    # fused_experts routes here: the same bits (in float32 the grouped kernels round otherwise, so the
    # float32 cases fail if it took them)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, **kw), out)
    assert not fused_moe_decode.launch_counters(x.device, 1).any(), "a counter was left set"


def experts_of(num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16):
    """w13, w2 of a real model's shape, as meta tensors (shapes and dtype, no memory)."""
    return (torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device="meta"),
            torch.empty(num_experts, hidden, inter, dtype=dtype, device="meta"))


def test_decode_kernels_serve_few_tokens_unless_twice_read_experts_cost_more() -> None:
    """`fused_moe_decode.serves`: the H100's measured choices (these kernels at 2-4 tokens beat the
    grouped ones for Qwen3-30B-A3B, lost to them for gpt-oss-20b), one token always, five never."""
    qwen3, gpt_oss, mixtral = experts_of(128, 2048, 768), experts_of(32, 2880, 2880), experts_of(8, 4096, 14336)
    assert [fused_moe_decode.serves(t, *qwen3, 8) for t in (1, 2, 3, 4, 5)] == [True] * 4 + [False]
    assert [fused_moe_decode.serves(t, *gpt_oss, 4) for t in (1, 2, 3, 4)] == [True, False, False, False]
    assert [fused_moe_decode.serves(t, *mixtral, 2) for t in (1, 2)] == [True, False]
    # FP8 experts read half the bytes twice: gpt-oss's 2 tokens (~12 MiB against 16) stay here
    assert fused_moe_decode.serves(2, *experts_of(32, 2880, 2880, torch.float8_e4m3fn), 4)


def test_fused_experts_takes_the_grouped_kernels_where_the_decode_ones_do_not_serve(monkeypatch) -> None:
    x, w13, w2, weights, ids = problem(3, 4, 2, 64, 48, torch.float32, seed=5)
    ids[1] = ids[0]  # an expert two tokens share: read twice by the decode kernels
    decode, grouped = fused_moe_decode.decode_experts(x, w13, w2, weights, ids), fused_experts(x, w13, w2, weights, ids, SMALL)
    assert not torch.equal(decode, grouped)  # float32: the two paths round differently
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), decode)
    monkeypatch.setattr(fused_moe_decode, "DUPLICATE_BYTES_PER_EXPERT", 0)
    monkeypatch.setattr("rxf.plugins.models.layers.fused_moe.pick_config", lambda *args: SMALL)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), grouped)


SMALL_BLOCKS = {"row": ((16, 32, 4, 1, True), (16, 32, 4, 1, True)),  # the default form
                "tile": ((16, 32, 4, 2, False), (16, 32, 4, 2, False))}  # tl.dot over padded tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weights_as", ["half", "biased", "fp8-blocks", "fp8-rows"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("form", SMALL_BLOCKS)
def test_decode_kernels_both_forms_match_torch_path(form: str, tokens: int, weights_as: str, dtype) -> None:
    """Each form of the decode kernels at 32-input tiles against the torch path: K tails past one tile
    (hidden 80, inter 40), gpt-oss's biases and clamp, FP8 weights with block or row scales."""
    x, w13, w2, weights, ids = problem(tokens, 6, 3, 80, 40, dtype, seed=tokens + 30)
    kw: dict = {}
    ref_w13, ref_w2 = w13.float(), w2.float()
    if weights_as == "biased":
        gen = torch.Generator().manual_seed(4)
        w13 = w13 * 6
        ref_w13 = w13.float()
        kw = {"b13": torch.randn(6, 80, generator=gen).to(dtype), "b2": torch.randn(6, 80, generator=gen).to(dtype),
              "activation": GPT_OSS}
    elif weights_as.startswith("fp8"):
        block_k = 16 if weights_as == "fp8-blocks" else None
        w13, s13, ref_w13 = fp8_experts(w13 * 4, block_k)
        w2, s2, ref_w2 = fp8_experts(w2, block_k)
        kw = {"scales": ExpertScales(s13, s2, block_k)}
    ref = experts_native(x.float(), ref_w13, ref_w2, weights, ids,
                         **{k: v.float() if torch.is_tensor(v) else v for k, v in kw.items() if k != "scales"})
    out = fused_moe_decode.decode_experts(x, w13, w2, weights, ids, blocks=SMALL_BLOCKS[form], **kw)
    assert_matches(out, ref, dtype)
    assert not fused_moe_decode.launch_counters(x.device, 1).any(), "a counter was left set"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "config"),
    [(1, 4, 2, 64, 48, None), (33, 4, 3, 48, 40, SMALL), (80, 6, 4, 64, 48, None)],
)
def test_biases_and_clamped_activation_match_torch_path(tokens, experts, top_k, hidden, inter, config, dtype):
    """gpt-oss's experts: per-expert biases on both projections and the clamped SwiGLU, with
    pre-activations scaled past the clamp (|gate|, |up| > 7 for part of the entries)."""
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, dtype, seed=tokens)
    gen = torch.Generator().manual_seed(7)
    w13 = w13 * 6
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    kw = {"b13": b13, "b2": b2, "activation": GPT_OSS}
    gate_up = x.float() @ w13[ids[0, 0]].float().T
    assert (gate_up.abs() > GPT_OSS.limit).any() and (gate_up.abs() < GPT_OSS.limit).any()
    ref = experts_native(x.float(), w13.float(), w2.float(), weights, ids,
                         b13=b13.float(), b2=b2.float(), activation=GPT_OSS)
    assert_matches(fused_experts(x, w13, w2, weights, ids, config, **kw), ref, dtype)
    unclamped = experts_native(x.float(), w13.float(), w2.float(), weights, ids, b13=b13.float(), b2=b2.float(),
                               activation=GatedActivation(alpha=1.702, up_offset=1.0))
    assert not torch.allclose(unclamped, ref, rtol=1e-2), "the clamp changes nothing: the test cannot fail"
    with pytest.raises(ValueError, match="both expert biases or neither"):
        fused_experts(x, w13, w2, weights, ids, b13=b13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "block_k", "config"),
    [
        (1, 80, 48, 32, None),  # decode: its 256-input tiles shrink to the 32-input scale blocks; K tails
        (3, 64, 40, None, None),  # decode, per-row scales
        (33, 80, 48, 64, SMALL),  # grouped: 32-input tiles inside 64-input scale blocks; K tails
        (40, 64, 96, None, SMALL),  # grouped, per-row scales
    ],
)
def test_fp8_weights_match_the_dequantized_experts(tokens, hidden, inter, block_k, config, dtype) -> None:
    """FP8 expert weights with block or per-row scales, upcast in the kernels, against the torch
    path on the float32 weights they encode; a scale that is not applied (all scales differ from 1)
    or applied to the wrong block fails by far more than the tolerance."""
    x, w13, w2, weights, ids = problem(tokens, 6, 2, hidden, inter, dtype, seed=tokens + 20)
    q13, s13, d13 = fp8_experts(w13 * 4, block_k)
    q2, s2, d2 = fp8_experts(w2, block_k)
    assert s13.min() < 0.5 and s13.max() < 1  # far from 1: a missing scale shows
    ref = experts_native(x.float(), d13, d2, weights, ids)
    out = fused_experts(x, q13, q2, weights, ids, config, scales=ExpertScales(s13, s2, block_k))
    assert_matches(out, ref, dtype)
    if block_k is not None:  # each row's first block's scale for all its blocks: a different result
        wrong = ExpertScales(s13[..., :1].expand_as(s13).contiguous(), s2, block_k)
        off = fused_experts(x, q13, q2, weights, ids, config, scales=wrong).float()
        assert (off - ref).abs().max() > 10 * TOL[dtype] * ref.abs().max()


def test_fp8_scales_that_the_kernels_cannot_take_are_refused() -> None:
    x, w13, w2, weights, ids = problem(1, 4, 2, 64, 48, torch.float16)
    q13, s13, _ = fp8_experts(w13, 48)
    q2, s2, _ = fp8_experts(w2, 48)
    with pytest.raises(ValueError, match="scale blocks of 48 inputs"):
        fused_experts(x, q13, q2, weights, ids, scales=ExpertScales(s13, s2, 48))
    q13, s13, _ = fp8_experts(w13, 32)
    q2, s2, _ = fp8_experts(w2, 32)
    with pytest.raises(ValueError, match="w13 scales must be float32"):
        fused_experts(x, q13, q2, weights, ids, scales=ExpertScales(s13.half(), s2, 32))
    with pytest.raises(ValueError, match=r"w2 scales must be float32 \[4, 64, 2\]"):
        fused_experts(x, q13, q2, weights, ids, scales=ExpertScales(s13, s2[:, :, :1].contiguous(), 32))


def test_native_biased_expert_is_the_reference_formula() -> None:
    """One token, one expert: the clamped SwiGLU of transformers' GptOssExperts written out."""
    gen = torch.Generator().manual_seed(3)
    hidden, inter = 8, 6
    x = torch.randn(1, hidden, generator=gen)
    w13, w2 = torch.randn(2, 2 * inter, hidden, generator=gen) * 4, torch.randn(2, hidden, inter, generator=gen)
    b13, b2 = torch.randn(2, 2 * inter, generator=gen), torch.randn(2, hidden, generator=gen)
    gate, up = (w13[1] @ x[0] + b13[1]).chunk(2)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    expected = 0.5 * (w2[1] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + b2[1])
    out = experts_native(x, w13, w2, torch.tensor([[0.5]]), torch.tensor([[1]]), b13=b13, b2=b2, activation=GPT_OSS)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def align_pairs_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The region map built with torch ops: stable sort by expert, each run padded to block_m."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    blocks = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(num_pairs) - (counts.cumsum(0) - counts)[flat[order]]
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32)
    sorted_pairs[(ends - padded)[flat[order]] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(blocks) * block_m, right=True).clamp(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


ALIGN_BY = {"kernel": 1 << 62, "sort": 0}  # fused_moe.ALIGN_SORT_MIN_CHUNKS for each of align_pairs' paths


@pytest.mark.parametrize("path", ALIGN_BY)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(1, 8, 2, 16), (300, 8, 2, 16), (300, 64, 6, 32), (700, 3, 1, 64), (50, 6, 4, 16)])
def test_align_pairs_matches_torch(tokens: int, experts: int, top_k: int, block_m: int, path: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks of the kernel's loops, expert counts that are not powers of two, unused experts;
    the kernel and the sort path alike."""
    monkeypatch.setattr(fused_moe, "ALIGN_SORT_MIN_CHUNKS", ALIGN_BY[path])
    gen = torch.Generator().manual_seed(tokens)
    skew = torch.linspace(0, 3, experts)
    _, ids = torch.topk(torch.randn(tokens, experts, generator=gen) + skew, top_k)
    for got, want in zip(align_pairs(ids, experts, block_m), align_pairs_torch(ids, experts, block_m), strict=True):
        assert torch.equal(got, want)


def test_fused_experts_aligns_by_sort_from_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w13, w2, weights, ids = problem(33, 4, 3, 48, 40, torch.float32, seed=4)
    by_kernel = fused_experts(x, w13, w2, weights, ids, SMALL)
    sorts = []
    monkeypatch.setattr(fused_moe, "ALIGN_SORT_MIN_CHUNKS", 33 * 3 / fused_moe._align_chunk(4))  # from 99 pairs
    monkeypatch.setattr(fused_moe, "_align_by_sort", lambda *a, f=fused_moe._align_by_sort: sorts.append(a) or f(*a))
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, SMALL), by_kernel) and len(sorts) == 1
    fused_experts(x[:32], w13, w2, weights[:32], ids[:32], SMALL)  # 96 pairs: below the threshold
    assert len(sorts) == 1


@pytest.mark.parametrize("path", ALIGN_BY)
def test_align_pairs_region_map(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_moe, "ALIGN_SORT_MIN_CHUNKS", ALIGN_BY[path])
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [3, 0]])  # pairs of expert 3: 0 2 5 6 8; 0: 1 4 9
    block_m, pad = 4, 10  # pad: the pair count marks padding rows
    sorted_pairs, block_expert, total = align_pairs(ids, 5, block_m)
    # capacity 10 + min(10, 5) * 3 = 25 rows -> 7 blocks; experts 0, 1, 2 take one block, 3 two, 4 none.
    assert sorted_pairs.shape == (28,) and total.item() == 20
    assert block_expert.tolist()[:5] == [0, 1, 2, 3, 3]
    assert sorted_pairs[:20].tolist() == [1, 4, 9, pad, 3, pad, pad, pad, 7, pad, pad, pad,
                                          0, 2, 5, 6, 8, pad, pad, pad]
    assert (sorted_pairs[20:] == pad).all()


def test_decode_blocks_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fused_moe_decode.ENV, "n16k256w4st4,n32k512w8st1r")
    fused_moe_decode.default_blocks.cache_clear()
    try:
        assert fused_moe_decode.default_blocks() == ((16, 256, 4, 4, False), (32, 512, 8, 1, True))
        assert fused_moe_decode.label((32, 512, 8, 1, True)) == "n32k512w8st1r"
        assert fused_moe_decode.default_blocks((32, 2880, 2880))[1] == (32, 512, 8, 1, True)  # every shape
        monkeypatch.setenv(fused_moe_decode.ENV, "n16k256w4st4")
        fused_moe_decode.default_blocks.cache_clear()
        with pytest.raises(ValueError, match="GATE_UP,DOWN"):
            fused_moe_decode.default_blocks()
        monkeypatch.delenv(fused_moe_decode.ENV)
        fused_moe_decode.default_blocks.cache_clear()
        defaults = (fused_moe_decode.GATE_UP_BLOCKS, fused_moe_decode.DOWN_BLOCKS)
        assert fused_moe_decode.default_blocks((128, 768, 2048)) == defaults  # Qwen3-30B-A3B: the defaults
        assert fused_moe_decode.default_blocks((32, 2880, 2880)) == (defaults[0], (32, 256, 4, 1, True))  # gpt-oss-20b
    finally:
        fused_moe_decode.default_blocks.cache_clear()
