"""Quantized checkpoints: the contract of a quantization method plugin, and how one is chosen.

A method (registered through `rxf_register_quantization_methods`) owns the weights of the layers it
quantizes — their parameters, how checkpoint tensors load into them, what runs in their forward —
so the core and the models name no method. The model runner:

1. picks the method (`select_method`): `model.quantization` when set, else the checkpoint's
   `quantization_config.quant_method` (unless the model class reads that format itself, listing it
   in `native_quant_methods`: gpt-oss's MXFP4 experts), else none. The configured name wins; the checkpoint's
   `quantization_config` (or None: an unquantized checkpoint, quantized online at load) goes to
   the method, which refuses a config it cannot read;
2. builds the model inside `building(method)`, where the linear layers ask `active_method()`
   whether to leave their dense weight unallocated (`materialize` then gives each layer either the
   method's parameters or, for a layer the method leaves alone, its dense weight);
3. loads the checkpoint (the method's `checkpoint_weights` when it reads another file), then calls
   `finish_loading(model)`: each quantized layer is turned into the
   form its device computes with (repacked for a kernel, or dequantized), and dense layers that
   can are packed for their device's kernels (`pack_for_device`).

Mixture-of-experts layers (`FusedExperts`) go through the same three steps: a method that takes
them over registers their stacked `[E, ...]` parameters and computes their forward in
`apply_experts`. Routers are built inside `unquantized()`: they stay dense under every method (as
quantized MoE checkpoints store them).

Without a method only the dense packing of `finish_loading` runs: unquantized models keep their code path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from rxf.core.registry import PluginRegistry

logger = logging.getLogger(__name__)


class QuantizationMethod:
    """One quantization format. Built once per model as `cls(quant_config, dtype)`: `quant_config`
    is the checkpoint's `quantization_config` dict, or None for an unquantized checkpoint (a method
    that cannot quantize online raises ValueError then); `dtype` is the model's compute dtype.

    The layer-facing calls take the layer module (a linear layer of `rxf.plugins.models.layers`),
    whose geometry (`in_per_rank`, `out_per_rank`, shards, tp slices) the method reads.
    """

    name: ClassVar[str] = ""

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        self.quant_config = quant_config
        self.dtype = dtype

    def checkpoint_weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The `(name, tensor)` pairs to load, for a method that reads its weights from a file other
        than the directory's safetensors (`gguf`); None (the default): the safetensors. Called before
        the model is built, so the method may decide from the file which layers it `quantizes`."""
        return None

    def quantizes(self, module: nn.Module, name: str) -> bool:
        """Whether this method takes over `module` (named `name` in the model); False leaves it
        dense (a checkpoint's ignore list, a layer kind the method does not handle)."""
        raise NotImplementedError

    def create_weights(self, module: nn.Module) -> None:
        """Register the module's parameters (each with its `weight_loader`), on the current device."""
        raise NotImplementedError

    def after_load(self, module: nn.Module, name: str) -> QuantizationMethod | None:
        """The method for a layer that always loads its dense weight and may be quantized after
        (`quantize_after_load`: the logits head, whose weight a tied embedding shares), or None
        (the default): it stays dense. The returned method's `process_loaded` / `apply` serve it."""
        return None

    def process_loaded(self, module: nn.Module) -> None:
        """After the checkpoint is loaded: convert the module's parameters to what `apply` uses."""

    def apply(self, module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The module's `x @ W.T + bias` (the linear layers route their matmul here)."""
        raise NotImplementedError

    def apply_gated(
        self, module: nn.Module, x: torch.Tensor, act: nn.Module, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`apply(module, act(x), bias)` for a gated activation `act` over `x` = `[gate | up]` (an MLP's
        down projection), with `act` folded into the method's own pass over its input (a method that
        quantizes activations computes `act` while quantizing); None (the default) where the method
        has no such path: the layer then runs `act` and `apply`."""
        return None

    def apply_normed(
        self, module: nn.Module, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`apply(module, norm(h + residual), bias)`, `h + residual`) for the projection that opens a
        pre-norm block (qkv, gate/up), with the residual add and the norm folded into the method's own
        pass over its input; the sum is written into `residual` (the norms' in-place contract). None
        (the default) where the method has no such path: the norm then runs as its own launch."""
        return None

    def apply_activated(
        self, module: nn.Module, x: torch.Tensor, act: nn.Module, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`act(apply(module, x, bias))` for a projection whose output a gated activation `act` reads (an
        MLP's gate/up), with `act` folded into the method's own launch; None (the default) where the
        method has no such path: the layer then runs `apply` and `act`."""
        return None

    def apply_experts(
        self, module: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """A `FusedExperts` module's forward (its contract: `moe.experts_native`'s) for the experts
        this method took over; a method that takes none need not define it."""
        raise NotImplementedError


_ACTIVE: list[QuantizationMethod | None] = []


def active_method() -> QuantizationMethod | None:
    """The method of the model being built now (inside `building`, and not `unquantized`), else None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def unquantized() -> Iterator[None]:
    """Layers built inside this stay dense whatever the method (a MoE router)."""
    _ACTIVE.append(None)
    try:
        yield
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def building(method: QuantizationMethod | None) -> Iterator[None]:
    """Build a model inside this for `method` to lay out its quantized layers (no-op for None)."""
    if method is None:
        yield
        return
    _ACTIVE.append(method)
    try:
        yield
    finally:
        _ACTIVE.pop()


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict (the top-level config's, where multimodal
    checkpoints keep it), or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    if not qc.get("quant_method"):
        raise ValueError("config.json: quantization_config has no quant_method")
    return qc


def select_method(
    registry: PluginRegistry, hf_config: Any, configured: str | None, dtype: torch.dtype,
    native: tuple[str, ...] = (),
) -> QuantizationMethod | None:
    """The method that loads this checkpoint (see the module docstring for the rule), or None;
    `native`: the formats the model class reads itself."""
    quant_config = checkpoint_quant_config(hf_config)
    name = configured or (quant_config or {}).get("quant_method")
    if name is None or (configured is None and name in native):
        return None
    if name not in registry.names("quantization_methods"):
        source = "model.quantization" if configured else "config.json quantization_config.quant_method"
        raise ValueError(
            f"{source} {name!r}: no quantization method of that name is registered; registered: "
            f"{', '.join(registry.names('quantization_methods')) or 'none'}"
        )
    cls = registry.get("quantization_methods", name)
    method = cls(quant_config, dtype)
    logger.info("quantization: %s (%s)", name, "checkpoint" if quant_config else "online, at load")
    return method


def materialize(model: nn.Module, method: QuantizationMethod | None, device: torch.device) -> None:
    """Give every layer built under `building(method)` its weights: the method's parameters where it
    `quantizes` the layer, else the dense weight the layer left unallocated; a layer that is
    quantized after loading (`quantize_after_load`) gets the method's `after_load` choice."""
    if method is None:
        return
    with torch.device(device):
        for name, module in model.named_modules():
            if getattr(module, "quant_pending", False):
                module.quant_pending = False
                if method.quantizes(module, name):
                    module.quant = method
                    method.create_weights(module)
                else:
                    module.create_dense_weight()
            elif getattr(module, "quantize_after_load", False):
                module.quant = method.after_load(module, name)


def finish_loading(model: nn.Module) -> None:
    """After the checkpoint is loaded: each quantized layer's `process_loaded`; then every layer left
    dense (or made dense by it) that has a `pack_for_device()` lays its weight out for its device's
    kernels (the linear layers: oneDNN's packed layout for bf16 on the CPU)."""
    for module in model.modules():
        method = getattr(module, "quant", None)
        if method is not None:
            method.process_loaded(module)
        if getattr(module, "quant", None) is None and hasattr(module, "pack_for_device"):
            module.pack_for_device()
