"""Sliding windows, logit soft-caps and sinks in the triton and flashinfer backends against
torch_native on the GPU, in bf16 at real shapes: each shape with the layer kinds of the models that
have it (Mistral / Qwen2 windows at head_dim 128, Gemma 2 / 3 local and global layers at head_dim
256, gpt-oss's sink layers at head_dim 64), over a cached prefix longer than the window, an extend
across the window edge, ragged prefill, decode, a mixed batch of decode rows and prefill chunks, and
decode replayed from a CUDA graph with two variants (a local and a global layer) in one capture.

FlashInfer compiles a kernel per (head_dim, window on/off, cap on/off, sinks) on first use; the
first flashinfer case compiles them all concurrently, so the tests do not wait on nvcc one by one
(the triton cases never wait on it).
Skipped without CUDA (the kernel modules import only after that check).
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from rxf.core.attention import AttentionBackend  # noqa: E402
from rxf.core.registry import PluginRegistry  # noqa: E402
from rxf.plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from rxf.testing.attention import Layer, assert_bf16_close, make_case, run_backend  # noqa: E402

BF16 = torch.bfloat16
SINKS = "sinks"  # a feature value filled per shape: float32 [heads]


def sinks(heads: int) -> torch.Tensor:
    """Per-head sinks from well below to well above the scores' range (they matter either way)."""
    return torch.linspace(-3.0, 6.0, heads)


# shape id -> ((heads, kv_heads, head_dim), {feature set id -> layer features}); GQA 8 kv heads.
SHAPES = {
    "d128": ((32, 8, 128), {
        "window128": {"sliding_window": 128},
        "window4096": {"sliding_window": 4096},  # Mistral-7B-v0.1, Qwen2 with use_sliding_window
        "cap50": {"logit_cap": 50.0},
    }),
    "d256": ((16, 8, 256), {  # Gemma-3-12B's heads
        "window1024": {"sliding_window": 1024},  # Gemma 3 local layers (global: plain)
        "window4096_cap50": {"sliding_window": 4096, "logit_cap": 50.0},  # Gemma 2 local layers
        "cap50": {"logit_cap": 50.0},  # Gemma 2 global layers
    }),
    "d64": ((64, 8, 64), {  # gpt-oss-20b's heads
        "window128_sinks": {"sliding_window": 128, "sinks": SINKS},  # local layers
        "sinks": {"sinks": SINKS},  # global layers
    }),
}
# Every feature at once: the triton backend implements the combination; flashinfer refuses it.
ALL = {"sliding_window": 128, "logit_cap": 50.0, "sinks": SINKS}
# (prefix lens, extend lens)
CASES = {
    "extend_long_prefix": ([6000, 5000, 0, 129], [300, 1, 700, 64]),  # prefixes past every window
    "extend_across_edge": ([100, 4000, 1000], [200, 300, 90]),  # new tokens cross the window edges
    "prefill": ([0, 0, 0], [37, 1500, 260]),
    "decode": ([0, 60, 127, 128, 700, 4095, 4096, 9000], [1] * 8),
    # mixed chunked prefill: decode rows (the triton backend's decode kernel) among prefill chunks
    "mixed": ([6000, 0, 127, 3000, 128, 9000, 60], [1, 500, 1, 200, 1, 1, 1]),
}


def backend_cls(name: str, jit: bool = True) -> type[AttentionBackend]:
    cls = PluginRegistry.load().attention_backend(name)
    if not cls.is_available(torch.device("cuda")):
        pytest.skip(f"{name} is not available here")
    if name == "flashinfer" and jit:
        flashinfer_jit(cls)
    return cls


def layer_features(shape: str, features: dict) -> dict:
    """The features as a layer holds them: sinks on the GPU (a kernel cannot read a CPU tensor; the
    CUDA-graph test puts these on its layers directly, make_case would have moved them)."""
    heads = SHAPES[shape][0][0]
    return {k: sinks(heads).cuda() if v == SINKS else v for k, v in features.items()}


def case(shape: str, prefix: list[int], extend: list[int], features: dict, seed: int = 0):
    heads, kv_heads, head_dim = SHAPES[shape][0]
    ctx, batch, layer, (q, k, v) = make_case(
        prefix, extend, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=BF16, device="cuda", seed=seed,
        **layer_features(shape, features),
    )
    if layer.logit_cap is not None:
        q.mul_(20.0)  # scores of ~20 standard deviations, so that a cap of 50 bends them
    return ctx, batch, layer, (q, k, v)


def compare(name: str, shape: str, case_name: str, features: dict) -> None:
    ctx, batch, layer, qkv = case(shape, *CASES[case_name], features)
    out, k = run_backend(backend_cls(name), ctx, batch, layer, qkv)
    ref, ref_k = run_backend(TorchNativeBackend, ctx, batch, layer, qkv)
    assert_bf16_close(out, ref)
    assert torch.equal(k, ref_k), "the new K landed in the same slots"


@functools.cache
def flashinfer_jit(cls: type[AttentionBackend]) -> None:
    """Compile every FlashInfer variant these tests use, concurrently (tiny batches, one per mode);
    once per process, at the first flashinfer case."""
    jobs = [(shape, features, mode) for shape, (_, sets) in SHAPES.items() for features in sets.values()
            for mode in (([0], [16]), ([8], [8]), ([15], [1]))]  # ragged, paged, decode
    failures: list[str] = []

    def build(shape: str, features: dict, mode: tuple[list[int], list[int]]) -> None:
        try:
            run_backend(cls, *case(shape, *mode, features))
            torch.cuda.synchronize()
        except Exception as e:  # reported by the tests themselves; noted here for the log
            failures.append(f"{shape} {features} {mode}: {type(e).__name__}: {e}"[:300])

    start = time.perf_counter()
    threads = [threading.Thread(target=build, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"flashinfer JIT for {len(jobs)} cases: {time.perf_counter() - start:.0f}s; failures: {failures}")


PARAMS = [(shape, fid) for shape, (_, sets) in SHAPES.items() for fid in sets]


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize(("shape", "features"), PARAMS, ids=[f"{s}-{f}" for s, f in PARAMS])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_matches_torch_native(backend: str, shape: str, features: str, case_name: str) -> None:
    compare(backend, shape, case_name, SHAPES[shape][1][features])


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_all_features_at_once(shape: str, case_name: str) -> None:
    compare("triton", shape, case_name, ALL)


def test_flashinfer_refuses_cap_with_sinks() -> None:
    layer = Layer(3, 64, 8, 64, 0.125, sliding_window=128, logit_cap=50.0, sinks=sinks(64))
    assert backend_cls("flashinfer", jit=False).missing_features([layer]) == {"logit_cap together with sinks": [3]}


GRAPH_PAIRS = {  # (local layer, global layer) of one model, captured in one graph
    "d128": ({"sliding_window": 4096}, {}),  # a Qwen2 with max_window_layers
    "d256": ({"sliding_window": 4096, "logit_cap": 50.0}, {"logit_cap": 50.0}),  # Gemma 2
    "d64": ({"sliding_window": 128, "sinks": SINKS}, {"sinks": SINKS}),  # gpt-oss
}


@pytest.mark.parametrize("shape", GRAPH_PAIRS)
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_decode_cuda_graph_local_and_global_layers(backend: str, shape: str) -> None:
    """Capture a decode step of two layers with different variants, then replay it after rewriting
    the batch in place (new lengths at the windows' edges, new q/k/v, new slots): both layers' outputs
    match eager torch_native on the pool as the replay found it."""
    cls = backend_cls(backend)
    local, global_ = (layer_features(shape, f) for f in GRAPH_PAIRS[shape])
    ctx, batch, layer, (q, k, v) = case(shape, [1, 130, 4200, 5000, 9000, 64], [1] * 6, {})  # all decoding
    layers = [replace(layer, layer_id=0, **local), replace(layer, layer_id=1, **global_)]
    if any(lay.logit_cap is not None for lay in layers):
        q.mul_(20.0)
    req_pool, kv_pool = copy.deepcopy((ctx.req_to_token_pool, ctx.token_to_kv_pool))
    impl = cls(replace(ctx, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool))
    b = replace(batch, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, attn_backend=impl)
    impl.init_cuda_graph_state(max_bs=8)
    impl.init_forward_metadata_capture(b)
    for lay in layers:  # the eager warm-up: compiles and plans outside the capture
        impl.forward(q, k, v, lay, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [impl.forward(q, k, v, lay, b) for lay in layers]

    # Each request stays within its own slots (lengths at most the first ones: 2, 131, 4201, 5001,
    # 9001, 65), so no two new tokens share a slot; 129, 4097 and 4096 sit at the window edges.
    new_lens = [1, 129, 4097, 4096, 8000, 2]
    b.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    b.prefix_lens.copy_(b.seq_lens - 1)
    b.seq_lens_cpu[:] = new_lens
    b.prefix_lens_cpu[:] = [n - 1 for n in new_lens]
    # The new token of each request goes to the slot its last position maps to.
    b.out_cache_loc.copy_(req_pool.req_to_token[b.req_pool_indices, b.seq_lens.long() - 1].long())
    for t in (q, k, v):
        t.copy_(torch.randn_like(t) * (20.0 if t is q and layers[0].logit_cap is not None else 1.0))
    ref_pools = copy.deepcopy((req_pool, kv_pool))  # the pool as the replay finds it
    impl.init_forward_metadata_replay(b)
    graph.replay()
    torch.cuda.synchronize()

    ref_ctx = replace(ctx, req_to_token_pool=ref_pools[0], token_to_kv_pool=ref_pools[1])
    ref_batch = replace(b, req_to_token_pool=ref_pools[0], token_to_kv_pool=ref_pools[1])
    for lay, out in zip(layers, outs, strict=True):
        ref, _ = run_backend(TorchNativeBackend, ref_ctx, ref_batch, lay, (q, k, v))
        assert_bf16_close(out, ref)
