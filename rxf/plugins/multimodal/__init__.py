"""Builtin multimodal processors, registered lazily by Hugging Face architecture name.

A processor factory is called as `factory(model_path, limits, vocab_size)` (limits: the
`multimodal` config section) and returns an object with
`process(input_ids, images, videos) -> (input_ids, list[MultimodalItem])`.
"""

from __future__ import annotations

from rxf.core.hookspecs import RegisterFactory, hookimpl

_LLAVA = "rxf.plugins.multimodal.llava:LlavaProcessor"
_GEMMA3 = "rxf.plugins.multimodal.gemma3:Gemma3Processor"


@hookimpl
def rxf_register_multimodal_processors(register: RegisterFactory) -> None:
    for arch in (
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
        "LlavaOnevisionForConditionalGeneration",
    ):
        register(arch, _LLAVA)
    register("Gemma3ForConditionalGeneration", _GEMMA3)
