"""The triton backend's sliding windows, logit soft-caps and sinks against torch_native, on CPU under
the Triton interpreter (fp32, tiny shapes): extend over a cached prefix longer than the window, an
extend chunk across the window edge, row blocks smaller than the window's reach, decode with its
splits cut to the window, a mixed batch's one-token rows through the decode kernel, CUDA-graph
metadata, all features at once, GQA.

TRITON_INTERPRET must be set before any kernel module is imported (see test_triton_attention.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_attention_features_gpu.py covers the compiled kernels",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import rxf.plugins.attention.triton.extend as extend_module  # noqa: E402
from rxf.plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from rxf.plugins.attention.triton.backend import TritonAttnBackend  # noqa: E402
from rxf.testing.attention import compare_backends, make_case, run_backend  # noqa: E402

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
FEATURES = {
    "window": {"sliding_window": 8},
    "cap": {"logit_cap": 0.9},
    "sinks": {"sinks": SINKS},
    "all": {"sliding_window": 5, "logit_cap": 0.8, "sinks": SINKS},
}
ALL = pytest.mark.parametrize("features", list(FEATURES))
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": torch.float32, "device": "cpu"}  # GQA 2


def assert_same(out: torch.Tensor, ref: torch.Tensor, k: torch.Tensor, ref_k: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k, ref_k), "the pools must hold the same K after the forward"


@ALL
def test_extend_over_prefix_longer_than_window(features: str) -> None:
    # Request 0: a cached prefix of 40 past a window of 8 (or 5); request 1: a short prefix whose
    # 20 new tokens cross the window edge; request 2: no prefix at all.
    assert_same(*compare_backends(TritonAttnBackend, [40, 3, 0], [5, 20, 11], **SHAPE, **FEATURES[features]))


@ALL
@pytest.mark.parametrize("pack", [False, True], ids=["one-head", "packed-gqa"])
def test_extend_small_blocks_skip_keys_before_the_window(features: str, pack: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Row and key blocks of 16: later row blocks start their prefix and new-key loops past keys
    that no row of theirs sees, at offsets that are not block-aligned; packed, a block's rows are
    8 tokens of both query heads of a KV head (each row its own head's sink)."""
    monkeypatch.setattr(extend_module, "_config", lambda head_dim, kv_fp8: (16, 16, 4, 2))
    monkeypatch.setattr(extend_module, "PACK_GQA", pack)
    assert_same(*compare_backends(TritonAttnBackend, [37, 0], [45, 50], **SHAPE, **FEATURES[features]))


@ALL
def test_mixed_batch_decode_rows_through_the_decode_kernel(features: str) -> None:
    """Decode rows (one new token; prefixes longer and shorter than the window) interleaved with prefill
    chunks (one crossing the window edge, one without a prefix): the decode kernel attends the one-token
    rows, split over the KV length and cut to the window, the extend kernel the rest."""
    calls = []

    class Mixed(TritonAttnBackend):
        def init_forward_metadata(self, b) -> None:
            self.min_split_len, self.max_kv_splits, self.target_programs = 4, 4, 1 << 20
            super().init_forward_metadata(b)
            assert self._extend is not None and self._extend.decode_rows is not None
            calls.append((self._extend.decode_rows.q_rows.tolist(), self._extend.req_pool_indices.numel()))

    assert_same(*compare_backends(Mixed, [40, 3, 7, 0, 45], [1, 20, 1, 11, 1], **SHAPE, **FEATURES[features]))
    assert calls == [([0, 21, 33], 2)]


@ALL
def test_decode(features: str) -> None:
    assert_same(*compare_backends(TritonAttnBackend, [1, 7, 30, 45], [1, 1, 1, 1], **SHAPE, **FEATURES[features]))


def test_decode_splits_before_the_window_do_not_run() -> None:
    """By seq_len request 0 gets four splits, but a window of 8 at min_split_len 4 needs two: the other
    two never run (their scratch keeps its NaNs); the result is still the windowed attention."""
    ctx, batch, layer, qkv = make_case([45, 2], [1, 1], **SHAPE, sliding_window=8, logit_cap=0.9, sinks=SINKS)
    ref, _ = run_backend(TorchNativeBackend, ctx, batch, layer, qkv)
    plans = []

    class Poisoned(TritonAttnBackend):
        def init_forward_metadata(self, b) -> None:
            self.min_split_len, self.max_kv_splits, self.target_programs = 4, 4, 1 << 20
            super().init_forward_metadata(b)
            assert self._decode is not None
            self._decode.mid_o.fill_(float("nan"))
            self._decode.mid_lse.fill_(float("nan"))
            plans.append(self._decode)

    out, _ = run_backend(Poisoned, ctx, batch, layer, qkv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (plan,) = plans
    assert plan.num_kv_splits.tolist() == [4, 1] and plan.grid_splits == 4
    written = ~plan.mid_lse[0].isnan()  # [heads, splits] of request 0
    assert written[:, :2].all() and not written[:, 2:].any()


def test_cuda_graph_replay_with_features() -> None:
    """The graph path's static metadata with every feature on: capture at one set of lengths,
    replay at others (window edges move), results right both times."""
    feats = {"sliding_window": 6, "logit_cap": 0.8, "sinks": SINKS}
    for prefix in ([3, 17, 30], [20, 4, 9]):
        ctx, batch, layer, qkv = make_case(prefix, [1, 1, 1], **SHAPE, **feats)
        ref, _ = run_backend(TorchNativeBackend, ctx, batch, layer, qkv)

        class Graphed(TritonAttnBackend):
            def init_forward_metadata(self, b) -> None:
                self.min_split_len, self.max_kv_splits, self.target_programs = 2, 4, 1 << 20
                self.init_cuda_graph_state(max_bs=8)
                self.init_forward_metadata_capture(b)
                self.init_forward_metadata_replay(b)

        out, _ = run_backend(Graphed, ctx, batch, layer, qkv)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
