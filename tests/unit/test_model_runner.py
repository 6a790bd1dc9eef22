"""ModelRunner: pool sizing, req_to_token bookkeeping, backend selection and load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import rxf.plugins.attention
import rxf.plugins.models
from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.hookspecs import hookimpl
from rxf.core.registry import PluginNotFoundError, PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.plugins.attention.cpu import CpuBackend
from rxf.plugins.attention.torch_native import TorchNativeBackend
from rxf.testing import make_tiny_checkpoint

BYTES_PER_SLOT = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32


def registry(*extra: Any) -> PluginRegistry:
    reg = PluginRegistry()
    reg.register_plugin(rxf.plugins.models, "models")
    reg.register_plugin(rxf.plugins.attention, "attention")
    for i, plugin in enumerate(extra):
        reg.register_plugin(plugin, f"extra{i}")
    return reg


def make_config(**overrides: Any):
    base = {"runtime.device": "cpu", "model.dtype": "float32", "scheduler.max_running_requests": 4}
    return load_config(None, **{**base, **overrides})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"))


def test_pool_sized_from_max_total_tokens(ckpt: Path) -> None:
    runner = ModelRunner(
        make_config(**{"cache.max_total_tokens": 1000, "model.context_length": 128, "model.dtype": "auto"}),
        registry(),
        str(ckpt),
    )
    assert runner.device == torch.device("cpu")
    assert runner.dtype == torch.float32  # model.dtype "auto" serves a float32 checkpoint as stored
    assert runner.max_total_tokens == runner.token_to_kv_pool.num_slots == 1000
    assert runner.token_to_kv_pool.available_size() == 1000
    assert runner.token_to_kv_pool.k_buffer[0].shape == (1001, 2, 16)  # + reserved slot 0
    assert runner.max_context_len == 128 and runner.req_to_token_pool.req_to_token.shape == (4, 128)
    assert runner.vocab_size == 512 and runner.eos_token_ids == [2, 4]
    assert isinstance(runner.attn_backend, TorchNativeBackend)


def test_pool_sized_from_cpu_budget_and_capped(ckpt: Path) -> None:
    small = ModelRunner(
        make_config(**{"cache.cpu_kv_cache_gb": 100 * BYTES_PER_SLOT / 2**30}), registry(), str(ckpt)
    )
    assert small.max_total_tokens == 100 and small.max_context_len == 512  # the checkpoint's
    big = ModelRunner(make_config(**{"cache.cpu_kv_cache_gb": 1.0}), registry(), str(ckpt))
    assert big.max_total_tokens == 4 * 512  # max_running_requests x max_context_len


def test_req_to_token_after_extend_and_decode(ckpt: Path) -> None:
    runner = ModelRunner(make_config(**{"cache.max_total_tokens": 64}), registry(), str(ckpt))
    table = runner.req_to_token_pool.req_to_token
    a, b = runner.req_to_token_pool.alloc(), runner.req_to_token_pool.alloc()
    slots_a = runner.token_to_kv_pool.alloc(5)
    logits = runner.forward(ModelInput(ForwardMode.PREFILL, [a], [10, 11, 12, 13, 14], [0], [5], slots_a))
    assert logits.shape == (1, 512) and logits.dtype == torch.float32
    assert table[a, :5].tolist() == slots_a.tolist()

    # b shares a's first 3 tokens' slots and extends by 2; a decodes one token in the same run order.
    slots_b = runner.token_to_kv_pool.alloc(2)
    runner.forward(
        ModelInput(
            ForwardMode.EXTEND, [b], [20, 21], [3], [2], slots_b, row_writes=[(0, slots_a[:3])], logits_start=[0]
        )
    )
    assert table[b, :5].tolist() == slots_a[:3].tolist() + slots_b.tolist()
    step = runner.token_to_kv_pool.alloc(2)
    logits = runner.forward(ModelInput(ForwardMode.DECODE, [b, a], [22, 15], [5, 5], [1, 1], step))
    assert logits.shape == (2, 512)
    assert table[b, 5].item() == step[0].item() and table[a, 5].item() == step[1].item()
    assert table[a, :5].tolist() == slots_a.tolist()  # untouched by b's prefix write


def test_forward_rejects_inconsistent_input(ckpt: Path) -> None:
    runner = ModelRunner(make_config(**{"cache.max_total_tokens": 64}), registry(), str(ckpt))
    slots = runner.token_to_kv_pool.alloc(3)
    with pytest.raises(ValueError, match="new tokens by extend_lens"):
        runner.forward(ModelInput(ForwardMode.PREFILL, [0], [1, 2], [0], [3], slots))
    with pytest.raises(ValueError, match="bad extend_lens for DECODE"):
        runner.forward(ModelInput(ForwardMode.DECODE, [0], [1, 2, 3], [0], [3], slots))


def test_auto_backend_picks_highest_available_priority(ckpt: Path) -> None:
    class Fast(TorchNativeBackend):
        auto_priority = 10

    class Unavailable(TorchNativeBackend):
        auto_priority = 20

        @classmethod
        def is_available(cls, device: torch.device) -> bool:
            return False

    class Plugin:
        @hookimpl
        def rxf_register_attention_backends(self, register) -> None:
            register("fast", Fast)
            register("unavailable", Unavailable)

    config = make_config(**{"cache.max_total_tokens": 16})
    runner = ModelRunner(config, registry(Plugin()), str(ckpt))
    assert type(runner.attn_backend) is Fast
    with pytest.raises(RuntimeError, match="'unavailable' is not available on cpu"):
        ModelRunner(
            make_config(**{"cache.max_total_tokens": 16, "attention.backend": "unavailable"}),
            registry(Plugin()),
            str(ckpt),
        )


def test_backend_lacking_a_layer_feature_is_refused_or_skipped(tmp_path: Path) -> None:
    """A windowed model: a named backend without `sliding_window` is refused at load, naming the
    feature, the layers and the backend; "auto" passes over it to one that implements it."""

    class NoWindows(TorchNativeBackend):
        auto_priority = 10
        features = frozenset({"logit_cap", "sinks"})

    class Plugin:
        @hookimpl
        def rxf_register_attention_backends(self, register) -> None:
            register("nowindows", NoWindows)

    ckpt = make_tiny_checkpoint(tmp_path / "mistral", "MistralForCausalLM", sliding_window=16)
    with pytest.raises(RuntimeError, match=r"'nowindows' does not implement .*: sliding_window \(layers 0, 1\)"):
        ModelRunner(
            make_config(**{"cache.max_total_tokens": 16, "attention.backend": "nowindows"}),
            registry(Plugin()),
            str(ckpt),
        )
    runner = ModelRunner(make_config(**{"cache.max_total_tokens": 16}), registry(Plugin()), str(ckpt))
    assert type(runner.attn_backend) is CpuBackend  # the CPU's auto choice, which implements windows


def test_unknown_architecture_lists_registered_ones(ckpt: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(ckpt, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(PluginNotFoundError, match="FancyForCausalLM.*LlamaForCausalLM, .*MistralForCausalLM"):
        ModelRunner(make_config(), registry(), str(bad))


def test_directory_without_weights(ckpt: Path, tmp_path: Path) -> None:
    empty = Path(shutil.copytree(ckpt, tmp_path / "noweights"))
    (empty / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*noweights"):
        ModelRunner(make_config(), registry(), str(empty))


def test_a_truncated_weights_file_is_named(ckpt: Path, tmp_path: Path) -> None:
    cut = Path(shutil.copytree(ckpt, tmp_path / "truncated"))
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"truncated/model.safetensors: not a readable safetensors file"):
        ModelRunner(make_config(), registry(), str(cut))


def test_random_load_format_needs_no_weights(ckpt: Path, tmp_path: Path) -> None:
    """`model.load_format = "random"`: the config alone; parameters drawn (norms at 1), logits finite,
    and the same seed draws the same model."""
    empty = Path(shutil.copytree(ckpt, tmp_path / "noweights"))
    (empty / "model.safetensors").unlink()
    runners = [ModelRunner(make_config(**{"model.load_format": "random"}), registry(), str(empty)) for _ in range(2)]
    layer = runners[0].model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    qkv = layer.self_attn.qkv_proj.weight
    assert 0 < qkv.abs().max() <= 1e-3 and qkv.std() > 1e-4
    assert torch.equal(qkv, runners[1].model.model.layers[0].self_attn.qkv_proj.weight)
    runner = runners[0]
    slots = runner.token_to_kv_pool.alloc(3)
    logits = runner.forward(ModelInput(ForwardMode.PREFILL, [runner.req_to_token_pool.alloc()], [5, 6, 7], [0], [3], slots))
    assert logits.shape == (1, runner.vocab_size) and torch.isfinite(logits).all()


def test_load_weights_names_unplaced_and_missing_tensors(ckpt: Path) -> None:
    runner = ModelRunner(make_config(**{"cache.max_total_tokens": 16}), registry(), str(ckpt))
    weights = load_file(ckpt / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # skipped, not an error
    weights["model.layers.0.self_attn.extra.weight"] = torch.ones(2)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    del weights["model.norm.weight"]
    with pytest.raises(ValueError) as err:
        runner.model.load_weights(weights.items())
    message = str(err.value)
    assert "no matching parameter: model.layers.0.self_attn.extra.weight" in message
    assert "model.layers.1.self_attn.qkv_proj.weight (shard k)" in message and "model.norm.weight" in message
    assert "inv_freq" not in message


def test_sharded_checkpoint_follows_its_index(ckpt: Path, tmp_path: Path) -> None:
    sharded = Path(shutil.copytree(ckpt, tmp_path / "sharded"))
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, sharded / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"not.a.parameter": torch.ones(1)}, sharded / "consolidated.safetensors")  # not indexed

    runner = ModelRunner(make_config(**{"cache.max_total_tokens": 16}), registry(), str(sharded))
    torch.testing.assert_close(runner.model.model.norm.weight, weights["model.norm.weight"])

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        ModelRunner(make_config(**{"cache.max_total_tokens": 16}), registry(), str(sharded))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [({"cache.max_total_tokens": 10**12}, "cache.max_total_tokens"),
     ({"scheduler.max_running_requests": 10**9}, "scheduler.max_running_requests")],
    ids=["slots", "rows"],
)
def test_pools_past_the_machines_memory_are_refused_naming_the_setting(ckpt: Path, overrides, words) -> None:
    # 10**12 slots are 256 TB of K/V here; 10**9 request rows of 128 tokens 512 GB: each was
    # allocated (and zero-filled) until the kernel killed the process, or failed in torch's allocator.
    config = make_config(**{"model.context_length": 128, "cache.max_total_tokens": 1000, **overrides})
    with pytest.raises(RuntimeError, match=r"GiB of cpu memory is available; lower them") as err:
        ModelRunner(config, registry(), str(ckpt))
    assert words in str(err.value)


def test_the_memory_check_counts_an_eagle3_heads_pool(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The head's runner builds its one-layer pool of the target's slot count without a check of its
    # own; the target's check left that layer out, so a pool that fit the check could not be built.
    import rxf.core.runner.kv_sizing as kv_sizing

    slots, context = 1000, 128
    config = make_config(**{"model.context_length": context, "cache.max_total_tokens": slots})
    layer_bytes = slots * 2 * 2 * 16 * 4  # K and V, 2 kv heads of 16 dims, float32
    rows = 4 * context * 4
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    # Room for the target's layers and half of the head's.
    monkeypatch.setattr(kv_sizing, "_cpu_available_bytes", lambda: (layers + 0.5) * layer_bytes + rows)
    ModelRunner(config, registry(), str(ckpt))  # no head: fits
    with pytest.raises(RuntimeError, match=r"the KV cache needs .* of cpu memory is available"):
        ModelRunner(config, registry(), str(ckpt), aux_hidden_layers=(0, 1, 1))


@pytest.mark.parametrize("key", ["model.path", "model.tokenizer_path"])
def test_a_model_or_tokenizer_path_that_is_no_directory_fails_naming_it(tmp_path: Path, key: str) -> None:
    # "" was the working directory; a missing tokenizer directory went to transformers' hub code
    # ("Repo id must use alphanumeric chars").
    import threading

    from rxf.entrypoints.engine_loader import load_engine

    settings = {"model.path": ""} if key == "model.path" else {"model.path": str(tmp_path), key: str(tmp_path / "nope")}
    with pytest.raises(FileNotFoundError, match=rf"{key}: .* is not a directory"):
        load_engine(load_config(None, **settings), threading.Event())
