"""CUDA-graph decode and the fused layer kernels on a GPU (skipped without CUDA).

- The full engine (in-process Scheduler over a tiny random Llama) generates greedy tokens that
  transformers in float32 agrees with for 32 steps, graphs on and off, per backend and dtype. Each
  of our tokens is scored teacher-forced: its gap to the reference's top logit, relative to that logit.
  float32: every gap is rounding-small (our tokens are transformers' greedy tokens). bf16: exact
  equality is not a bf16 property (on this checkpoint transformers' own bf16 greedy tokens show gaps
  up to 5% under its float32 logits), so our worst gap must stay within `BF16_GAP_RATIO` times
  transformers' bf16 worst gap on the same prompts: rxf in bf16 is about as faithful as transformers
  in bf16.
- The same with requests arriving while others decode (mixed chunked prefill: decode rows in the
  prefill forwards), per GPU backend and dtype.
- A graph replay gives the eager forward's logits for batch sizes that fill a bucket and that pad one,
  also over an FP8 KV pool whose checkpoint carries KV-cache scales (triton reads them as device
  tensors, flashinfer captures them as constants).
- FlashInfer's fused norm / activation / rotary agree with the layers' torch code.

Besides the shipped backends, `torch_native_graphs` (below) is torch_native with static decode
metadata, so the graph runner is tested even where no GPU backend is importable.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.hookspecs import hookimpl
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.plugins.attention.torch_native import TorchNativeBackend
from rxf.testing import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# head_dim 64 (the smallest FlashInfer and the triton backend compile for) and a GQA group of 4: the
# head configuration of benchmarks/gpu_decode.py's tiny preset, so both share FlashInfer's JIT cache.
TINY_GPU = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 1024, "num_hidden_layers": 2}
FP32_GAP = 1e-4  # relative gap allowed in float32: rounding between incremental and full forwards
# bf16: our worst gap over a few prompts against transformers' own bf16 worst gap, each the maximum of
# near-ties that rounding decides. 1.5 held while every projection was cuBLAS; with the Triton GEMV
# (the default on Hopper since 2026-12-06) Qwen3-MoE reached 1.65x (0.0132 against 0.0080 on an H100;
# its other prompts' gaps 0.003-0.007, all below transformers' worst), a different rounding of the same
# sums. A wrong kernel shows as gaps of 10% and more, and the float32 cases stay exact.
BF16_GAP_RATIO = 2.0


class GraphableTorchNative(TorchNativeBackend):
    """torch_native whose decode metadata lives in static buffers spanning the whole context."""

    supports_cuda_graph = True

    def init_cuda_graph_state(self, max_bs: int) -> None:
        n, dev = self.ctx.max_context_len, self.ctx.device
        self._cols = torch.arange(n, device=dev)
        self._static_slots = torch.zeros(max_bs, n, dtype=torch.int64, device=dev)
        self._static_valid = torch.zeros(max_bs, n, dtype=torch.bool, device=dev)

    def _plan_static(self, batch: Any) -> None:
        bs = batch.batch_size
        valid = self._cols[None, :] < batch.seq_lens[:, None]
        rows = batch.req_to_token_pool.req_to_token[batch.req_pool_indices]
        self._static_valid[:bs].copy_(valid)
        self._static_slots[:bs].copy_(torch.where(valid, rows, 0))
        self._valid, self._slots, self._extend_masks = self._static_valid[:bs], self._static_slots[:bs], []

    init_forward_metadata_capture = _plan_static
    init_forward_metadata_replay = _plan_static


class _TestBackends:
    @hookimpl
    def rxf_register_attention_backends(self, register) -> None:
        register("torch_native_graphs", GraphableTorchNative)


def _registry() -> PluginRegistry:
    registry = PluginRegistry.load()
    registry.register_plugin(_TestBackends(), "test_backends")
    return registry


def _available_backends() -> list[str]:
    names = ["torch_native_graphs"]
    registry = _registry()
    for name in ("triton", "flashinfer"):
        try:
            if registry.attention_backend(name).is_available(torch.device("cuda")):
                names.append(name)
        except Exception:  # not importable here
            continue
    return names


CASES = [
    (b, d) for b in (_available_backends() if torch.cuda.is_available() else [])
    for d in (torch.bfloat16, torch.float32) if not (b == "flashinfer" and d == torch.float32)
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu-llama"), seed=3, **TINY_GPU)


@pytest.fixture(scope="module")
def scaled_ckpt(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ckpt` plus KV-cache scales (k 0.5, v 2) for every layer, as an FP8 checkpoint carries them."""
    path = tmp_path_factory.mktemp("gpu-llama-kv-scales") / "ckpt"
    shutil.copytree(ckpt, path)
    weights = load_file(path / "model.safetensors")
    for i in range(TINY_GPU["num_hidden_layers"]):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(2.0)
    save_file(weights, path / "model.safetensors")
    return path


def _config(ckpt: Path, backend: str, dtype: torch.dtype, graphs: bool, **extra: Any):
    return load_config(
        {
            "model": {"path": str(ckpt), "dtype": str(dtype).removeprefix("torch.")},
            "runtime": {"device": "cuda"},
            "attention": {"backend": backend},
            "scheduler": {"max_running_requests": 16},
            "cache": {"max_total_tokens": 4096},
            "cuda_graph": {"enabled": graphs, "batch_sizes": [1, 2, 4, 8, 16]},
        },
        **extra,
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _worst_gap(ckpt: Path, prompt: list[int], tokens: list[int]) -> float:
    """max over steps of (top logit - logit of tokens[t]) / |top logit|, from one float32 transformers
    forward over prompt + tokens (row t predicts tokens[t]); 0 when every token is its argmax."""
    seq = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = _hf_model(ckpt, torch.float32)(seq).logits[0, len(prompt) - 1 : -1].float()
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda").view(-1, 1)).view(-1)
    return float(((best - chosen) / best.abs()).max())


def _hf_greedy(ckpt: Path, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    model, seq = _hf_model(ckpt, dtype), torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[0, -1].argmax().view(1, 1)], dim=1)
    return seq[0, len(prompt) :].tolist()


_HF_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def _hf_model(ckpt: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    key = (str(ckpt), dtype)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).cuda().eval()
    return _HF_MODELS[key]


def _scheduler_greedy(
    config: Any, runner: ModelRunner, ckpt: Path, prompts: list[list[int]], n: int, arrive_every: int = 0
) -> list[list[int]]:
    """`n` greedy tokens of every prompt in an in-process Scheduler over `runner`: all queued at once,
    or with `arrive_every` k > 0 one joining every k steps (the others are decoding by then)."""
    from transformers import AutoTokenizer

    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(ckpt), check_memory=True)
    params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    waiting = [PreparedRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    got: dict[str, list[int]] = {}
    step = 0
    while waiting or sched.has_work:
        while waiting and (not arrive_every or step % arrive_every == 0):
            sched.add_request(waiting.pop(0))
            if arrive_every:
                break
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
        step += 1
    tokens = [got[f"r{i}"] for i in range(len(prompts))]
    assert all(len(t) == n for t in tokens)
    return tokens


def _assert_as_faithful_as_transformers(ckpt: Path, prompts: list[list[int]], tokens: list[list[int]],
                                        dtype: torch.dtype) -> None:
    """The module docstring's score: float32, every gap rounding-small; bf16, the worst gap within
    `BF16_GAP_RATIO` times transformers' own bf16 greedy tokens' worst gap."""
    ours = [_worst_gap(ckpt, p, t) for p, t in zip(prompts, tokens, strict=True)]
    if dtype == torch.float32:
        assert max(ours) <= FP32_GAP, f"relative gaps to transformers' argmax per request: {ours}"
        return
    hf = [_worst_gap(ckpt, p, _hf_greedy(ckpt, dtype, p, len(t))) for p, t in zip(prompts, tokens, strict=True)]
    assert max(ours) <= BF16_GAP_RATIO * max(hf) + 1e-3, f"worst relative gaps: rxf {ours}, transformers {hf} (both bf16)"


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
def test_greedy_matches_transformers(ckpt: Path, backend: str, dtype: torch.dtype, graphs: bool) -> None:
    config = _config(ckpt, backend, dtype, graphs)
    runner = ModelRunner(config, _registry(), str(ckpt))
    assert (runner.cuda_graphs is not None) == graphs
    prompts = _prompts(5, seed=11)  # 5 requests: decode batches of 5 replay the padded bucket 8
    _assert_as_faithful_as_transformers(ckpt, prompts, _scheduler_greedy(config, runner, ckpt, prompts, 32), dtype)


MIXED_CASES = [(b, d) for b, d in CASES if b in ("triton", "flashinfer")]


@pytest.mark.parametrize(("backend", "dtype"), MIXED_CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in MIXED_CASES])
def test_mixed_chunked_prefill_greedy_matches_transformers(ckpt: Path, backend: str, dtype: torch.dtype) -> None:
    """Requests joining every 3 steps while the others decode, prompts in chunks of 16: the running
    decodes ride in the prefill forwards (on triton the decode kernel attends those rows, the extend
    kernel the chunk); the tokens stay as faithful as transformers'."""
    config = _config(ckpt, backend, dtype, graphs=True, **{"scheduler.chunked_prefill_size": 16})
    assert config.scheduler.mixed_chunked_prefill
    runner = ModelRunner(config, _registry(), str(ckpt))
    attn, plan, mixed = runner.attn_backend, runner.attn_backend.init_forward_metadata, []

    def spied_plan(batch: Any) -> None:
        plan(batch)
        if not batch.mode.is_decode() and 1 in batch.extend_lens_cpu and max(batch.extend_lens_cpu) > 1:
            mixed.append(backend != "triton" or attn._extend.decode_rows is not None)

    attn.init_forward_metadata = spied_plan
    prompts = _prompts(6, seed=12)
    tokens = _scheduler_greedy(config, runner, ckpt, prompts, 24, arrive_every=3)
    assert len(mixed) >= 3 and all(mixed), mixed
    _assert_as_faithful_as_transformers(ckpt, prompts, tokens, dtype)


REPLAY_CASES = [(b, d, "auto") for b, d in CASES] + [(b, d, "fp8_e4m3") for b, d in CASES if d == torch.bfloat16]


@pytest.mark.parametrize(("backend", "dtype", "kv_dtype"), REPLAY_CASES,
                         ids=[f"{b}-{str(d)[6:]}-{kv}" for b, d, kv in REPLAY_CASES])
def test_replay_equals_eager(ckpt: Path, scaled_ckpt: Path, backend: str, dtype: torch.dtype, kv_dtype: str) -> None:
    if kv_dtype != "auto":
        ckpt = scaled_ckpt
    runner = ModelRunner(_config(ckpt, backend, dtype, graphs=True, **{"cache.kv_dtype": kv_dtype}), _registry(), str(ckpt))
    assert runner.model.model.layers[0].self_attn.attn.v_scale.item() == (1.0 if kv_dtype == "auto" else 2.0)
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    largest = graphs.outputs[16][0]
    assert all(graphs.outputs[bs][0].data_ptr() == largest.data_ptr() for bs in graphs.sizes), (
        "every bucket's logits are rows of the largest bucket's")
    for bs in (1, 3, 8, 13):  # 3 and 13 replay padded buckets (4 and 16)
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool.clear()
        prompts = _prompts(bs, seed=bs)
        rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        slots = runner.token_to_kv_pool.alloc(sum(map(len, prompts)))
        flat = [t for p in prompts for t in p]
        runner.forward(ModelInput(ForwardMode.PREFILL, rows, flat, [0] * bs, [len(p) for p in prompts], slots))
        decode = ModelInput(
            ForwardMode.DECODE, rows, [7] * bs, [len(p) for p in prompts], [1] * bs, runner.token_to_kv_pool.alloc(bs)
        )
        assert graphs.can_run(ForwardMode.DECODE, bs)
        replayed = runner.forward(decode).clone()
        runner.cuda_graphs = None  # the same step again, eagerly: it rewrites the same K/V
        eager = runner.forward(decode)
        runner.cuda_graphs = graphs
        scale = eager.abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(replayed, eager, rtol=0, atol=tol * scale, msg=f"bs={bs}")


def test_fused_layers_match_torch() -> None:
    pytest.importorskip("flashinfer")
    from rxf.plugins.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul

    torch.manual_seed(0)
    dev, dt, n, hidden = torch.device("cuda"), torch.bfloat16, 37, 512
    with torch.device(dev):
        norm = RMSNorm(hidden, 1e-5, dt)
        norm.weight.normal_(1.0, 0.1)
        rope = RotaryEmbedding(128, 4096, {"rope_type": "default", "rope_theta": 500000.0}, dt)
    assert rope.cos_sin_cache is not None, "fused rotary table missing: flashinfer not used"

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, f"{what}: relative error {err:.2e}"

    x, res = torch.randn(n, hidden, device=dev, dtype=dt), torch.randn(n, hidden, device=dev, dtype=dt)
    close(norm(x.clone()), norm.forward_native(x), "rmsnorm")
    ref_out, ref_res = norm.forward_native(x, res)
    out, new_res = norm(x.clone(), res.clone())
    close(out, ref_out, "fused_add_rmsnorm out")
    close(new_res, ref_res, "fused_add_rmsnorm residual")

    gate_up = torch.randn(n, 2 * 1024, device=dev, dtype=dt)
    close(SiluAndMul()(gate_up), SiluAndMul().forward_native(gate_up), "silu_and_mul")

    # q and k as the model has them: strided views into one qkv projection output (8 q, 2 kv heads).
    qkv = torch.randn(n, (8 + 2 + 2) * 128, device=dev, dtype=dt)
    positions = torch.randint(0, 4096, (n,), device=dev)
    q_ref, k_ref = rope.forward_native(positions, qkv[:, : 8 * 128], qkv[:, 8 * 128 : 10 * 128])
    v_before = qkv[:, 10 * 128 :].clone()
    q, k = rope(positions, qkv[:, : 8 * 128], qkv[:, 8 * 128 : 10 * 128])
    close(q, q_ref, "rope q")
    close(k, k_ref, "rope k")
    assert torch.equal(qkv[:, 10 * 128 :], v_before), "rope touched v"
