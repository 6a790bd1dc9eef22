"""Builtin attention plugin: backends registered lazily by name (nothing imports until selected)."""

from __future__ import annotations

from rxf.core.hookspecs import RegisterFactory, hookimpl


@hookimpl
def rxf_register_attention_backends(register: RegisterFactory) -> None:
    register("torch_native", "rxf.plugins.attention.torch_native:TorchNativeBackend")
    register("cpu", "rxf.plugins.attention.cpu:CpuBackend")
    register("triton", "rxf.plugins.attention.triton.backend:TritonAttnBackend")
    register("flashinfer", "rxf.plugins.attention.flashinfer_backend:FlashInferBackend")
