"""The public plugin API of rxf: pluggy hook specifications (project name ``rxf``).

A plugin is a module (or object) with functions marked ``@rxf.core.hookspecs.hookimpl`` and
named after the hooks below, exposed through the ``rxf`` entry-point group::

    [project.entry-points.rxf]
    my_plugin = "my_package.rxf_plugin"

Every hook has the ``register_*(register)`` shape: rxf passes a ``register`` callable and the
plugin calls it once per thing it contributes. Factories may be given as ``"module:attr"`` strings;
they are imported only when selected, so loading a plugin must stay cheap and must not touch CUDA.
Plugins load in each process that builds a registry (the server or `Runtime` caller's process and
every scheduler rank), so they must be safe to load more than once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from rxf.core.chat_template import ChatTemplate

PROJECT_NAME = "rxf"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterFactory(Protocol):
    def __call__(self, name: str, factory: str | Any) -> None:
        """Register ``factory`` (an object, or a lazy ``"module:attr"`` string) under ``name``."""


class RegisterChatTemplate(Protocol):
    def __call__(self, template: ChatTemplate) -> None:
        """Register a named chat template (see ``rxf.core.chat_template.ChatTemplate``)."""


@hookspec
def rxf_register_attention_backends(register: RegisterFactory) -> None:
    """Register attention backends by the name users put in ``attention.backend``.

    The factory is a subclass of ``rxf.core.attention.AttentionBackend`` (called with an
    ``AttentionContext``). Called in each scheduler process, when the model runner starts.
    """


@hookspec
def rxf_register_models(register: RegisterFactory) -> None:
    """Register model classes by Hugging Face architecture name (``config.architectures[0]``).

    The factory is an ``nn.Module`` class built as ``cls(hf_config, dtype=...)`` that implements
    ``forward(batch: ForwardBatch) -> logits`` and ``load_weights(iterable of (name, tensor))``.
    A class may also define the classmethod ``max_context_length(hf_config) -> int`` (the longest
    context the checkpoint serves, e.g. extended by its rope scaling; default
    ``max_position_embeddings``); it is then built with ``context_length=`` the context served.
    One that defines ``hidden_states(batch) -> [n, hidden]`` (the final norm applied, the rows of
    ``batch.logits_indices``) can serve embeddings (``model.task = "embed"``).
    Called in each scheduler process, when the model runner loads a checkpoint.
    """


@hookspec
def rxf_register_multimodal_processors(register: RegisterFactory) -> None:
    """Register multimodal input processors by Hugging Face architecture name.

    Called in the process that owns the TokenizerManager (the server or the ``Runtime`` caller),
    which preprocesses and hashes images before a request reaches the scheduler.
    """


@hookspec
def rxf_register_chat_templates(register: RegisterChatTemplate) -> None:
    """Register named chat templates, selectable with ``model.chat_template = "<name>"``.

    Called in the process that owns the TokenizerManager, where prompts are rendered.
    """


@hookspec
def rxf_register_grammar_backends(register: RegisterFactory) -> None:
    """Register grammar backends (constrained decoding) by the name users put in ``grammar.backend``.

    The factory builds the object that compiles ``regex`` / ``json_schema`` / ``ebnf`` constraints
    for a tokenizer and gives the sampler a per-request token bitmask. Called in each scheduler
    process and in the process that owns the TokenizerManager (which rejects invalid grammars).
    It is called as ``factory(tokenizer, vocab_size, config.grammar)`` and returns a
    ``rxf.core.grammar.GrammarBackend`` (``vocab_size``: the model's logits width, padding included).
    The factory runs on the backend's first use (the first constrained request), not at start-up.
    """


@hookspec
def rxf_register_tool_call_formats(register: RegisterFactory) -> None:
    """Register tool-call formats by the name users put in ``model.tool_call_parser``.

    The factory is a subclass of ``rxf.entrypoints.chat.tool_parsers.base.ToolCallParser``: the
    parser that reads the model's calls out of its output (whole or streamed) together with the
    ``syntax`` (a ``rxf.core.tool_syntax.ToolSyntax``) that writes tools and past calls into a
    prompt whose chat template has no tool support, so what is written is what is read back.
    Called in the process that owns the TokenizerManager, where replies are parsed.
    """


@hookspec
def rxf_register_reasoning_parsers(register: RegisterFactory) -> None:
    """Register reasoning parsers by the name users put in ``model.reasoning_parser``.

    The factory is a subclass of ``rxf.entrypoints.chat.reasoning.base.ReasoningParser``, which
    splits a thinking model's output into its reasoning and the reply after it (whole or streamed).
    Called in the process that owns the TokenizerManager, where replies are parsed.
    """


@hookspec
def rxf_register_quantization_methods(register: RegisterFactory) -> None:
    """Register quantization methods by the name a checkpoint's `quantization_config.quant_method`
    gives (or users put in ``model.quantization``, which wins over the checkpoint's).

    The factory is a subclass of ``rxf.core.quantization.QuantizationMethod``, built once per model
    as ``cls(quant_config, dtype)`` (``quant_config``: the checkpoint's quantization_config, None
    for an unquantized checkpoint quantized at load); it gives the linear layers it takes over
    their parameters, their weight loading and their matmul. Called in each scheduler process,
    when the model runner loads a checkpoint.
    """
