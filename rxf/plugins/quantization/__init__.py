"""Builtin quantization methods, registered lazily (imported only when a checkpoint selects one).

`fp8` (Hugging Face block-wise FP8, and online FP8 of an unquantized checkpoint), `compressed-tensors`
(llm-compressor's FP8 checkpoints), `awq` and `gptq` (int4 weight-only). See `rxf.core.quantization`.
"""

from __future__ import annotations

from rxf.core.hookspecs import RegisterFactory, hookimpl


@hookimpl
def rxf_register_quantization_methods(register: RegisterFactory) -> None:
    register("fp8", "rxf.plugins.quantization.fp8:Fp8Method")
    register("compressed-tensors", "rxf.plugins.quantization.compressed_tensors:CompressedTensorsMethod")
    register("awq", "rxf.plugins.quantization.awq:AwqMethod")
    register("gptq", "rxf.plugins.quantization.gptq:GptqMethod")
