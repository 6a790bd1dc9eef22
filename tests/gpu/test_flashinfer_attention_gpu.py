"""The flashinfer backend against torch_native on the GPU, at real shapes, in bf16."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from rxf.plugins.attention.flashinfer_backend import FlashInferBackend  # noqa: E402
from rxf.testing.attention import compare_backends  # noqa: E402

CASES = {
    "prefill": ([0, 0, 0], [37, 512, 129]),
    "extend": ([100, 0, 1500, 7], [17, 64, 300, 1]),
    "decode": ([1, 60, 700, 2047, 4000, 33, 128, 9], [1] * 8),
}


@pytest.mark.parametrize("case", CASES)
# The head shapes of the 8B benchmark and of the tiny GPU model, so FlashInfer JIT-compiles no extra variants.
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (8, 2, 64)])
def test_matches_torch_native(case, heads, kv_heads, head_dim):
    prefix, extend = CASES[case]
    out, ref, k, ref_k = compare_backends(
        FlashInferBackend, prefix, extend, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        dtype=torch.bfloat16, device="cuda",
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k, ref_k)  # the new K/V landed in the same slots
