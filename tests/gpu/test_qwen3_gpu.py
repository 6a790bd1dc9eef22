"""Qwen3 and Qwen3-MoE on a GPU (skipped without CUDA).

- The one-launch routing kernel (softmax, top 8 of 128, renormalised or not) against its torch code.
- The per-head q/k RMSNorm kernel (`head_norm_kernel.py`) against the `RMSNorm` torch path at the
  real head shapes (32 query heads, 8 or 4 kv heads, head_dim 128), bf16 and float32.
- The fused MoE kernels at Qwen3-30B-A3B's layer shape (hidden 2048, moe_intermediate 768, 128
  experts, top 8) for 1-4096 tokens, with the blocks they pick here (the tuned table's where it has
  this GPU, else the heuristic's), against the torch path in float32 on the same bf16 weights: a
  half-precision rounding error (< 1%) and at most 1.5x (+0.1%) the torch path's own in bf16; and
  every entry the table holds for this GPU, at its token count.
- Tiny random Qwen3 and Qwen3-MoE checkpoints (head_dim 64 != hidden 256 / 8 heads, GQA 8:2; 16
  experts, top 4, renormalised, a dense first layer) through the engine with CUDA graphs on, on
  triton (bf16 and float32) and flashinfer (bf16): greedy tokens scored against transformers as
  tests/gpu/test_cuda_graph_gpu.py scores Llama (float32: every token transformers' argmax within
  rounding; bf16: worst gap within `BF16_GAP_RATIO` times transformers' own bf16 worst gap).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from test_cuda_graph_gpu import (  # noqa: E402
    _assert_as_faithful_as_transformers,
    _available_backends,
    _config,
    _prompts,
    _registry,
)
from transformers import AutoTokenizer  # noqa: E402

from rxf.core.ipc.messages import PreparedRequest  # noqa: E402
from rxf.core.runner.model_runner import ModelRunner  # noqa: E402
from rxf.core.sampling_params import SamplingParams  # noqa: E402
from rxf.core.scheduler.scheduler import Scheduler  # noqa: E402
from rxf.plugins.models.layers import RMSNorm  # noqa: E402
from rxf.plugins.models.layers.fused_moe import BlockConfig, fused_experts  # noqa: E402
from rxf.plugins.models.layers.fused_moe_table import load_table  # noqa: E402
from rxf.plugins.models.layers.head_norm import norm_heads_  # noqa: E402
from rxf.plugins.models.layers.moe import experts_native, select_experts  # noqa: E402
from rxf.testing import make_tiny_checkpoint  # noqa: E402

DEV = torch.device("cuda")
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # one Qwen3-30B-A3B MoE layer


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("kv_heads", [8, 4], ids=["8b", "30b-a3b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_head_norm_kernel_matches_torch(tokens: int, dtype: torch.dtype, kv_heads: int) -> None:
    heads, head_dim = 32, 128
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    with torch.device(DEV):
        q_norm, k_norm = RMSNorm(head_dim, 1e-6, dtype), RMSNorm(head_dim, 1e-6, dtype)
    q_norm.weight.copy_(torch.randn(head_dim, device=DEV, generator=gen) * 0.3 + 1)
    k_norm.weight.copy_(torch.randn(head_dim, device=DEV, generator=gen) * 0.3 + 1)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEV, generator=gen) * 5).to(dtype)
    by_head = qkv.clone().unflatten(-1, (-1, head_dim))
    expected = by_head.clone()
    expected[:, :heads] = q_norm.forward_native(by_head[:, :heads])
    expected[:, heads : heads + kv_heads] = k_norm.forward_native(by_head[:, heads : heads + kv_heads])
    norm_heads_(qkv, q_norm, k_norm, heads, kv_heads, head_dim)  # CUDA: the Triton kernel
    got = qkv.unflatten(-1, (-1, head_dim))
    assert torch.equal(got[:, heads + kv_heads :], by_head[:, heads + kv_heads :]), "v was touched"
    assert rel_err(got, expected) < (1e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_routing_kernel_matches_torch_code(tokens: int, renormalize: bool, dtype: torch.dtype) -> None:
    """select_experts on CUDA (one Triton launch) against its torch code run on the CPU copy: the
    same weights, and ids that are a top 8 of the softmax (bf16 logits repeat, and equal
    probabilities may be chosen either way; float32: the very same experts)."""
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    logits = (torch.randn(tokens, EXPERTS, device=DEV, generator=gen) * 2).to(dtype)
    weights, ids = (t.cpu() for t in select_experts(logits, TOP_K, renormalize))
    want_w, want_i = select_experts(logits.cpu(), TOP_K, renormalize)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, True)
    assert (chosen.sum(-1) == TOP_K).all()
    assert (probs.masked_fill(~chosen, 2.0).min(-1).values >= probs.masked_fill(chosen, -1.0).max(-1).values).all()
    if dtype == torch.float32:
        assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want_i.tolist()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize(("tokens", "experts", "hidden", "top_k", "bias"),
                         [(1, EXPERTS, HIDDEN, TOP_K, False), (16, EXPERTS, HIDDEN, TOP_K, False),
                          (3, 32, 2880, 4, True)])  # gpt-oss-20b's router, with its bias
def test_fused_router_matches_projection_then_routing(tokens, experts, hidden, top_k, bias, dtype) -> None:
    """`moe.route` on CUDA (router projection + routing in one launch) against `F.linear` then the
    torch routing on the CPU: logits that round to the same values in x's dtype give the same
    weights, and the ids are a top k of the reference softmax (float32: the very same experts)."""
    from rxf.plugins.models.layers.routing_kernel import route_cuda

    gen = torch.Generator(device=DEV).manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
    w = (torch.randn(experts, hidden, device=DEV, generator=gen) * hidden**-0.5).to(dtype)
    b = (torch.randn(experts, device=DEV, generator=gen) * 0.1).to(dtype) if bias else None
    logits = torch.nn.functional.linear(x.cpu().float(), w.cpu().float(), None if b is None else b.cpu().float())
    weights, ids = (t.cpu() for t in route_cuda(x, w, b, top_k, True))
    want_w, want_i = select_experts(logits.to(dtype), top_k, True)
    torch.testing.assert_close(weights, want_w, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, True)
    assert (chosen.sum(-1) == top_k).all()
    gap = probs.masked_fill(~chosen, 2.0).min(-1).values - probs.masked_fill(chosen, -1.0).max(-1).values
    assert (gap >= -1e-2 * probs.max(-1).values).all(), "an expert chosen over a clearly likelier one"
    if dtype == torch.float32:
        assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want_i.tolist()]


@pytest.mark.parametrize("tokens", [1, 16])
def test_norm_route_is_the_norm_kernel_then_the_fused_router(tokens: int) -> None:
    """The residual add and the post-attention norm inside the routing launch (`norm_route_cuda`, what
    a Qwen3-MoE decode layer runs) against `rmsnorm_kernel` then `route_cuda`, bf16 at Qwen3-30B-A3B's
    shapes: the same residual, x within one bf16 step, and the same routing where x is the same."""
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm
    from rxf.plugins.models.layers.routing_kernel import norm_route_cuda, route_cuda

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    h = torch.randn(tokens, HIDDEN, device=DEV, generator=gen).to(torch.bfloat16)
    res = (torch.randn(tokens, HIDDEN, device=DEV, generator=gen) * 4).to(torch.bfloat16)
    norm_w = (torch.rand(HIDDEN, device=DEV, generator=gen) + 0.5).to(torch.bfloat16)
    router = (torch.randn(EXPERTS, HIDDEN, device=DEV, generator=gen) * HIDDEN**-0.5).to(torch.bfloat16)
    weights, ids, x, new_res = norm_route_cuda(h, res, norm_w, 1e-6, router, None, TOP_K, True)
    res_ref = res.clone()
    x_ref = rmsnorm(h.clone(), norm_w, 1e-6, res_ref)
    assert torch.equal(new_res, res_ref)
    assert (x.float() - x_ref.float()).abs().max() <= x_ref.float().abs().max() * 2**-7
    if torch.equal(x, x_ref):
        want_w, want_i = route_cuda(x_ref, router, None, TOP_K, True)
        assert torch.equal(ids, want_i) and torch.equal(weights, want_w)


@pytest.fixture(scope="module")
def qwen3_moe_layer() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 expert weights (~2.4 GB), scaled so activations stay O(1)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV, generator=gen).mul_(HIDDEN**-0.5)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEV, generator=gen).mul_(INTER**-0.5)
    return w13, w2


def _routed(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device=DEV, generator=gen), top_k, True)
    return x, weights, ids


def _assert_like_torch_path(x, weights, ids, w13_32, w2_32, config: BlockConfig | None) -> None:
    """x, weights, ids as `_routed` returns them; float32 expert weights."""
    w13, w2 = w13_32.to(x.dtype), w2_32.to(x.dtype)
    ref = experts_native(x.float(), w13.float(), w2.float(), weights, ids)
    fused = fused_experts(x, w13, w2, weights, ids, config)
    assert fused.dtype == x.dtype and fused.shape == x.shape
    err, baseline = rel_err(fused, ref), rel_err(experts_native(x, w13, w2, weights, ids), ref)
    assert err < 1e-2 and err <= 1.5 * baseline + 1e-3, f"fused {err:.2e}, torch path in bf16 {baseline:.2e}"


@pytest.mark.parametrize("tokens", [1, 2, 8, 64, 256, 1024, 4096])
def test_fused_moe_matches_torch_path_at_qwen3_30b_shapes(qwen3_moe_layer, tokens: int) -> None:
    w13, w2 = qwen3_moe_layer
    _assert_like_torch_path(*_routed(tokens, HIDDEN, EXPERTS, TOP_K, seed=tokens), w13, w2, None)


def _table_entries_here() -> list[tuple[str, int, BlockConfig]]:
    name, out = torch.cuda.get_device_name(), []
    for key, buckets in load_table().items():
        if key.endswith(f",device={name}") and ",dtype=bfloat16," in key:
            out += [(key, m, BlockConfig(**b)) for m, b in buckets.items()]
    return out


TABLE = _table_entries_here()


@pytest.mark.parametrize(("key", "tokens", "config"), TABLE, ids=[f"{k}-{m}" for k, m, _ in TABLE])
def test_tuned_table_entries_match_torch_path(key: str, tokens: int, config: BlockConfig) -> None:
    fields = dict(part.split("=", 1) for part in key.split(","))
    experts, inter, hidden = int(fields["E"]), int(fields["N"]), int(fields["K"])
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEV, generator=gen).mul_(hidden**-0.5)
    w2 = torch.randn(experts, hidden, inter, device=DEV, generator=gen).mul_(inter**-0.5)
    top_k = min(TOP_K, experts)  # the key does not say; the blocks do not depend on it
    _assert_like_torch_path(*_routed(tokens, hidden, experts, top_k, seed=tokens), w13, w2, config)


GPU_SHAPE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
             "intermediate_size": 512, "num_hidden_layers": 2}
MODELS = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
                                          "norm_topk_prob": True, "mlp_only_layers": [0]}),
}
CASES = [(m, b, d) for m in MODELS for b in _available_backends() if b in ("triton", "flashinfer")
         for d in (torch.bfloat16, torch.float32) if not (b == "flashinfer" and d == torch.float32)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make_tiny_checkpoint(tmp_path_factory.mktemp(f"gpu-{name}"), arch, seed=3, **GPU_SHAPE, **extra)
            for name, (arch, extra) in MODELS.items()}


@pytest.mark.parametrize(("model", "backend", "dtype"), CASES, ids=[f"{m}-{b}-{str(d)[6:]}" for m, b, d in CASES])
def test_greedy_matches_transformers_with_cuda_graphs(checkpoints, model: str, backend: str, dtype) -> None:
    ckpt = checkpoints[model]
    config = _config(ckpt, backend, dtype, graphs=True)
    runner = ModelRunner(config, _registry(), str(ckpt))
    assert runner.cuda_graphs is not None
    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(ckpt), check_memory=True)
    prompts = _prompts(5, seed=13)  # 5 requests: decode batches of 5 replay the padded bucket 8
    params = SamplingParams.from_dict({"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True})
    for i, p in enumerate(prompts):
        sched.add_request(PreparedRequest(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    while sched.has_work:
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    assert all(len(got[f"r{i}"]) == 32 for i in range(len(prompts)))
    _assert_as_faithful_as_transformers(ckpt, prompts, [got[f"r{i}"] for i in range(len(prompts))], dtype)
