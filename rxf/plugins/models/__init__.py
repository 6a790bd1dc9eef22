"""Builtin model plugin: Llama-family architectures, Mixtral, Phi-3, Gemma 2 / 3, the LLaVA family and EAGLE-3 draft heads, registered lazily by Hugging Face name.

Only strings are registered, so loading this plugin imports neither torch nor the model code.
"""

from __future__ import annotations

from rxf.core.hookspecs import RegisterFactory, hookimpl

_LLAMA = "rxf.plugins.models.llama"
_LLAMA_EAGLE3 = "rxf.plugins.models.llama_eagle3"
_MIXTRAL = "rxf.plugins.models.mixtral"
_LLAVA = "rxf.plugins.models.llava"
_GPT_OSS = "rxf.plugins.models.gpt_oss"
_PHI3 = "rxf.plugins.models.phi3"
_QWEN3 = "rxf.plugins.models.qwen3"
_QWEN3_MOE = "rxf.plugins.models.qwen3_moe"
_GEMMA = "rxf.plugins.models.gemma"
_GEMMA3_MM = "rxf.plugins.models.gemma3_mm"


@hookimpl
def rxf_register_models(register: RegisterFactory) -> None:
    register("LlamaForCausalLM", f"{_LLAMA}:LlamaForCausalLM")
    register("LlamaForCausalLMEagle3", f"{_LLAMA_EAGLE3}:LlamaForCausalLMEagle3")  # a draft head (eagle3)
    register("MistralForCausalLM", f"{_LLAMA}:MistralForCausalLM")
    register("Qwen2ForCausalLM", f"{_LLAMA}:Qwen2ForCausalLM")
    register("MixtralForCausalLM", f"{_MIXTRAL}:MixtralForCausalLM")
    register("Phi3ForCausalLM", f"{_PHI3}:Phi3ForCausalLM")
    register("Qwen3ForCausalLM", f"{_QWEN3}:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", f"{_QWEN3_MOE}:Qwen3MoeForCausalLM")
    register("Gemma2ForCausalLM", f"{_GEMMA}:Gemma2ForCausalLM")
    register("Gemma3ForCausalLM", f"{_GEMMA}:Gemma3ForCausalLM")
    register("Gemma3ForConditionalGeneration", f"{_GEMMA3_MM}:Gemma3ForConditionalGeneration")
    register("LlavaForConditionalGeneration", f"{_LLAVA}:LlavaForConditionalGeneration")
    register("LlavaNextForConditionalGeneration", f"{_LLAVA}:LlavaNextForConditionalGeneration")
    register("LlavaOnevisionForConditionalGeneration", f"{_LLAVA}:LlavaOnevisionForConditionalGeneration")
    register("GptOssForCausalLM", f"{_GPT_OSS}:GptOssForCausalLM")
