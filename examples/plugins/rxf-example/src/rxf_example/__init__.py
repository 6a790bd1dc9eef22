"""rxf-example: an rxf plugin registering a model, an attention backend and a chat template.

rxf imports this module in each of its processes, so it registers `"module:attr"` strings only: the
model code (and torch) is imported when a checkpoint names the architecture, the backend when
`attention.backend` names it, the template when the hook runs (it is plain Python).
"""

from __future__ import annotations

from rxf.core.hookspecs import RegisterChatTemplate, RegisterFactory, hookimpl


@hookimpl
def rxf_register_models(register: RegisterFactory) -> None:
    register("GemmaForCausalLM", "rxf_example.gemma:GemmaForCausalLM")


@hookimpl
def rxf_register_attention_backends(register: RegisterFactory) -> None:
    register("batched_sdpa", "rxf_example.attention:BatchedSDPABackend")


@hookimpl
def rxf_register_chat_templates(register: RegisterChatTemplate) -> None:
    from rxf_example.chat_template import GEMMA_TEMPLATE

    register(GEMMA_TEMPLATE)
