"""The FP8 KV cache (`cache.kv_dtype`) on the CPU: config, pool capacity, the checkpoint's per-layer
scales, and what FP8 costs the logits of a tiny Llama (torch_native, float32 model).

Why the tolerances: e4m3 keeps 3 mantissa bits, so every stored K/V element is off by at most half
an ulp, 2^-4 = 6.25% of its value (RMS ~3.6%); e5m2 keeps 2, twice that. Attention averages the V
errors over many keys, but the K errors move every score by a few percent of its size, and two layers
carry that into the logits. Measured on this checkpoint (initializer_range 0.05: attention scores of
a few units, as in trained models; the suite's default 0.25 makes scores of tens, where a few percent
flips softmaxes): the largest logit moves by 4.6% (e4m3) and 8.7% (e5m2) of the largest logit
magnitude, and 97% of the argmax tokens stay. The bounds are about twice that: 10% / 20%, and 90%.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rxf.core.config import ConfigError, load_config
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelRunner
from rxf.core.weight_loader import load_named_weights
from rxf.plugins.models.layers import RadixAttention
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness

E4M3_TOL, E5M2_TOL, MIN_ARGMAX_AGREEMENT = 0.10, 0.20, 0.90
SCALE = 1024.0  # a power of two: scaling weights and activations by it is exact in float32


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (60, 45, 30)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), initializer_range=0.05)


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[torch.Tensor]:
    """float32 KV: the model dtype's logits of every prompt position."""
    return ModelHarness(ckpt).prefill_logits(_prompts())


def _fp8_logits(path: Path, kv_dtype: str = "fp8_e4m3") -> torch.Tensor:
    harness = ModelHarness(path, **{"cache.kv_dtype": kv_dtype})
    assert harness.runner.token_to_kv_pool.dtype == {"fp8_e4m3": torch.float8_e4m3fn,
                                                     "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
    return torch.cat(harness.prefill_logits(_prompts()))


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize(("kv_dtype", "tol"), [("fp8_e4m3", E4M3_TOL), ("fp8_e5m2", E5M2_TOL)])
def test_fp8_logits_within_tolerance_of_model_dtype_kv(
    ckpt: Path, reference: list[torch.Tensor], kv_dtype: str, tol: float
) -> None:
    ref, got = torch.cat(reference), _fp8_logits(ckpt, kv_dtype)
    assert 0 < _relative_error(got, ref) <= tol  # > 0: the pool really quantized
    if kv_dtype == "fp8_e4m3":
        agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agreement >= MIN_ARGMAX_AGREEMENT, f"argmax tokens agree at {agreement:.0%} of positions"


def test_greedy_tokens_mostly_equal(ckpt: Path) -> None:
    """Greedy continuations with float32 KV, scored teacher-forced with FP8 KV: the FP8 model would
    pick the same next token at most steps (free-running, one early flip would change every later one)."""
    prompts = _prompts()
    continuations = ModelHarness(ckpt).greedy(prompts, 16)
    fp8 = ModelHarness(ckpt, **{"cache.kv_dtype": "fp8_e4m3"})
    same = total = 0
    for prompt, tokens, logits in zip(prompts, continuations, fp8.prefill_logits(
            [p + t for p, t in zip(prompts, continuations, strict=True)]), strict=True):
        picked = logits[len(prompt) - 1 : -1].argmax(-1).tolist()  # row i predicts token i + 1
        same += sum(a == b for a, b in zip(picked, tokens, strict=True))
        total += len(tokens)
    assert same / total >= MIN_ARGMAX_AGREEMENT, f"{same} of {total} greedy tokens kept"


def _scaled_copy(src: Path, dst: Path, with_scales: bool) -> Path:
    """The same model with K and V SCALE times larger (q_proj and o_proj SCALE times smaller, so every
    output is unchanged): its K/V overflow FP8 unless the checkpoint's scales divide them back. Layer 0
    carries the scales as `self_attn.k_scale` / `v_scale`, layer 1 as `k_proj.output_scale` /
    `v_proj.output_scale`."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name in list(weights):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = weights[name] * SCALE
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            weights[name] = weights[name] / SCALE
    if with_scales:
        names = ("model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",
                 "model.layers.1.self_attn.k_proj.output_scale", "model.layers.1.self_attn.v_proj.output_scale")
        weights |= {name: torch.tensor(SCALE) for name in names}
    save_file(weights, dst / "model.safetensors")
    return dst


def test_checkpoint_scales_are_applied(ckpt: Path, reference: list[torch.Tensor], tmp_path: Path) -> None:
    scaled = _scaled_copy(ckpt, tmp_path / "scaled", with_scales=True)
    runner = ModelHarness(scaled, **{"cache.kv_dtype": "fp8_e4m3"}).runner
    attn = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert [(a.k_scale.item(), a.v_scale.item()) for a in attn] == [(SCALE, SCALE)] * 2
    # x / SCALE recovers the unscaled model's K/V exactly: the pool holds the same bytes, so the
    # logits are the unscaled model's FP8 logits.
    torch.testing.assert_close(_fp8_logits(scaled), _fp8_logits(ckpt), rtol=1e-5, atol=1e-5)
    # Without the scales the same model saturates FP8 (and with the model dtype's KV it is unchanged).
    unscaled = _scaled_copy(ckpt, tmp_path / "no-scales", with_scales=False)
    torch.testing.assert_close(torch.cat(ModelHarness(unscaled).prefill_logits(_prompts())), torch.cat(reference),
                               rtol=1e-4, atol=1e-4)
    assert _relative_error(_fp8_logits(unscaled), torch.cat(reference)) > 2 * E4M3_TOL


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k_proj = nn.Linear(4, 4, bias=False)
        self.attn = RadixAttention(0, 2, 1, 4)


def test_kv_scale_names_and_bad_scales() -> None:
    """The deprecated `kv_scale` fills both; ModelOpt's `k_proj.k_scale` / `v_proj.v_scale` too; a scale
    that is not one positive finite number fails naming the tensor. Absent, the scales stay 1."""
    weight = ("layers.0.self_attn.k_proj.weight", torch.zeros(4, 4))
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module(), nn.Module(), nn.Module()])
    for layer in model.layers:
        layer.self_attn = _Block()
    weights = [(f"layers.{i}.self_attn.k_proj.weight", torch.zeros(4, 4)) for i in range(3)]
    load_named_weights(model, weights + [
        ("layers.0.self_attn.kv_scale", torch.tensor([0.5])),
        ("layers.1.self_attn.k_proj.k_scale", torch.tensor(2.0)), ("layers.1.self_attn.v_proj.v_scale", torch.tensor(3.0)),
    ])
    got = [(layer.self_attn.attn.k_scale.item(), layer.self_attn.attn.v_scale.item()) for layer in model.layers]
    assert got == [(0.5, 0.5), (2.0, 3.0), (1.0, 1.0)]
    for bad, reason in ((torch.ones(2), "per-tensor"), (torch.tensor(-1.0), "positive"), (torch.tensor(float("inf")), "positive")):
        with pytest.raises(ValueError, match=rf"layers\.0\.self_attn\.k_scale: .*{reason}"):
            load_named_weights(model, [weight, ("layers.0.self_attn.k_scale", bad)])


def test_bad_kv_dtype_rejected_at_config_load() -> None:
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype: .*'auto', 'fp8_e4m3' or 'fp8_e5m2'.*got 'fp8'"):
        load_config(None, **{"cache.kv_dtype": "fp8"})
    assert load_config(None).cache.kv_dtype == "auto"


def test_fp8_pool_holds_twice_the_bf16_tokens(ckpt: Path) -> None:
    """Sized from the same memory budget, an FP8 pool has twice the slots of a bf16 one (bf16 on the
    CPU here, so that both sizes come from memory: 2 layers x 2 kv heads x head_dim 16 x K and V)."""
    bf16_slot = 2 * 2 * 2 * 16 * 2
    base = {"runtime.device": "cpu", "model.dtype": "bfloat16", "scheduler.max_running_requests": 8,
            "cache.cpu_kv_cache_gb": 1000 * bf16_slot / 2**30}
    runners = {kv: ModelRunner(load_config(None, **base, **{"model.path": str(ckpt), "cache.kv_dtype": kv}),
                               PluginRegistry.load(), str(ckpt)) for kv in ("auto", "fp8_e4m3")}
    bf16, fp8 = runners["auto"], runners["fp8_e4m3"]
    assert bf16.kv_dtype == torch.bfloat16 and fp8.kv_dtype == torch.float8_e4m3fn
    assert (bf16.max_total_tokens, fp8.max_total_tokens) == (1000, 2000)
    assert fp8.token_to_kv_pool.bytes_per_slot() * 2 == bf16.token_to_kv_pool.bytes_per_slot() == bf16_slot


def test_backend_without_fp8_support_refused(ckpt: Path) -> None:
    """A backend that does not say `fp8_kv` would read the pool's bytes as the wrong values: refused
    by name, passed over by "auto"."""
    from rxf.core.hookspecs import hookimpl
    from rxf.plugins.attention.torch_native import TorchNativeBackend

    class Bf16Only(TorchNativeBackend):
        fp8_kv = False

    class Plugin:
        @hookimpl
        def rxf_register_attention_backends(self, register) -> None:
            register("bf16_only", Bf16Only)

    registry = PluginRegistry.load()
    registry.register_plugin(Plugin(), "bf16_only")
    config = load_config(None, **{"runtime.device": "cpu", "cache.max_total_tokens": 64, "cache.kv_dtype": "fp8_e4m3",
                                  "attention.backend": "bf16_only"})
    with pytest.raises(RuntimeError, match="'bf16_only' cannot use an FP8 KV cache"):
        ModelRunner(config, registry, str(ckpt))
    assert ModelRunner(load_config(config, **{"cache.kv_dtype": "auto"}), registry, str(ckpt)).attn_backend.__class__ is Bf16Only
