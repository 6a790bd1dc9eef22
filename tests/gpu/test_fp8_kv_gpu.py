"""The FP8 KV cache (`cache.kv_dtype`) of the triton and flashinfer backends on the GPU, in bf16.

- The store kernel (plain and with the rotary embedding fused) writes exactly what torch writes:
  `quantize_kv`'s x / scale, saturated, rounded to nearest even (CPU tests cannot check the rounding:
  the Triton interpreter's float32 -> FP8 cast is wrong where rounding carries into the exponent).
- Attention over an FP8 pool against torch_native over the same FP8 pool: both read the same bytes,
  so the bound is the bf16 one of the other backend tests (`assert_bf16_close`), over prefill, extend
  over a cached prefix and decode, plain and with a window, a soft-cap or sinks.
- The same batches against torch_native over a bf16 pool: the cost of FP8 itself. e4m3 keeps 3
  mantissa bits, a relative error of at most 2^-4 per element; over random unit-variance q/k/v at
  these shapes the output moves by up to ~8% of its largest magnitude (measured on CPU in float32:
  0.042 prefill, 0.060 extend, 0.081 decode over 2047 keys), so the bound is 15%.
Decode replayed from CUDA graphs over an FP8 pool: tests/gpu/test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from rxf.core.kv_pool import TokenToKVPool  # noqa: E402
from rxf.core.registry import PluginRegistry  # noqa: E402
from rxf.plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from rxf.testing.attention import assert_bf16_close, make_case, run_backend  # noqa: E402

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
FP8_VS_BF16 = 0.15  # see the module docstring
SCALES = (0.5, 2.0)  # k_scale, v_scale: a backend that drops one is off by a factor of 2
CASES = {
    "prefill": ([0, 0, 0], [37, 512, 129]),
    "extend": ([100, 0, 1500, 7], [17, 64, 300, 1]),
    "decode": ([1, 60, 700, 2047, 4000, 33, 128, 9], [1] * 8),
}
FEATURES = {
    "plain": {},
    "window128_cap50": {"sliding_window": 128, "logit_cap": 50.0},
    "sinks": {"sinks": torch.linspace(-3.0, 6.0, 32)},
}


def _backend(name: str) -> type:
    cls = PluginRegistry.load().attention_backend(name)
    if not cls.is_available(torch.device("cuda")):
        pytest.skip(f"{name} is not available here")
    return cls


def _run(cls: type, case: str, features: dict, kv_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # make_case draws the prefix's values from the global generator too
    ctx, batch, layer, qkv = make_case(
        *CASES[case], heads=32, kv_heads=8, head_dim=128, dtype=BF16, device="cuda", kv_dtype=kv_dtype,
        kv_scales=SCALES if kv_dtype is not None else (1.0, 1.0), **features,
    )
    return run_backend(cls, ctx, batch, layer, qkv)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_fp8_matches_torch_native(backend: str, case: str, features: str) -> None:
    cls = _backend(backend)
    out, k = _run(cls, case, FEATURES[features], E4M3)
    ref, ref_k = _run(TorchNativeBackend, case, FEATURES[features], E4M3)
    assert k.dtype == E4M3 and torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8)), "the stored bytes differ"
    assert_bf16_close(out, ref)
    bf16_ref, _ = _run(TorchNativeBackend, case, FEATURES[features], None)
    err = (out.float() - bf16_ref.float()).abs().max().item()
    assert err <= FP8_VS_BF16 * bf16_ref.float().abs().max().item(), f"FP8 vs bf16 KV: max error {err:.3g}"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_store_rounds_as_torch(kv_dtype: torch.dtype) -> None:
    from rxf.plugins.attention.triton.store_kv import rope_store_kv, store_kv
    from rxf.plugins.models.layers import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, head_dim, n, slots = 32, 8, 128, 300, 1000
    k_scale, v_scale = torch.tensor(0.03, device="cuda"), torch.tensor(7.0, device="cuda")
    loc = torch.randperm(slots, device="cuda")[:n] + 1
    k = torch.randn(n, kv_heads, head_dim, device="cuda", dtype=BF16) * 4
    v = torch.randn_like(k)
    k[0, 0, :2] = torch.tensor([1e4, -1e4])  # far past the largest finite value once divided by 0.03
    ref = TokenToKVPool(slots, 1, kv_heads, head_dim, kv_dtype, "cuda")
    ours = TokenToKVPool(slots, 1, kv_heads, head_dim, kv_dtype, "cuda")
    ref.set_kv(0, loc, k, v, k_scale, v_scale)
    store_kv(*ours.get_kv_buffer(0), loc, k, v, k_scale, v_scale)
    for a, b in zip(ref.get_kv_buffer(0), ours.get_kv_buffer(0), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    # Fused rotation: the kernel quantizes its float32 rotation directly, torch the rotated bf16, so
    # compare against torch quantizing the float32 rotation.
    with torch.device("cuda"):  # its caches where the positions are
        rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    positions = torch.randint(0, 4096, (n,), device="cuda")
    q = torch.randn(n, heads, head_dim, device="cuda", dtype=BF16)
    _, k_rot = rope.forward_native(positions, q.float().flatten(-2), k.float().flatten(-2))
    ref.set_kv(0, loc, k_rot.unflatten(-1, (kv_heads, head_dim)), v, k_scale, v_scale)
    rope_store_kv(*ours.get_kv_buffer(0), loc, q, k.clone(), v, positions, rope.cos_sin_cache,
                  k_scale=k_scale, v_scale=v_scale)
    mismatch = (ref.k_buffer[0].view(torch.uint8) != ours.k_buffer[0].view(torch.uint8)).float().mean().item()
    assert mismatch < 1e-3, f"{mismatch:.2%} of the rotated keys' bytes differ"  # float32 rotation order only
    assert torch.equal(ref.v_buffer[0].view(torch.uint8), ours.v_buffer[0].view(torch.uint8))
