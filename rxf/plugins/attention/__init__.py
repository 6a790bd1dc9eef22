"""Builtin attention plugin: the torch_native reference backend, registered lazily by name."""

from __future__ import annotations

from rxf.core.hookspecs import RegisterFactory, hookimpl


@hookimpl
def rxf_register_attention_backends(register: RegisterFactory) -> None:
    register("torch_native", "rxf.plugins.attention.torch_native:TorchNativeBackend")
