"""The plugin registry: entry points, every hook, allow/deny lists, clear errors."""

from __future__ import annotations

import collections
import subprocess
import sys
import types

import pluggy
import pytest

from rxf.core.hookspecs import hookimpl
from rxf.core.registry import PluginNotFoundError, PluginRegistry, parse_plugin_filter
from rxf.plugins.chat_templates.builtin import ChatMLTemplate


class _Backend:
    pass


class _Processor:
    pass


def _plugin() -> types.SimpleNamespace:
    """A third-party-style plugin registering one thing through each hook."""

    @hookimpl
    def rxf_register_attention_backends(register):
        register("test_backend", _Backend)

    @hookimpl
    def rxf_register_models(register):
        register("TestForCausalLM", "collections:OrderedDict")  # lazy "module:attr" string

    @hookimpl
    def rxf_register_multimodal_processors(register):
        register("TestVisionForConditionalGeneration", _Processor)

    @hookimpl
    def rxf_register_chat_templates(register):
        register(_TEMPLATE)

    return types.SimpleNamespace(**{f.__name__: f for f in (
        rxf_register_attention_backends, rxf_register_models,
        rxf_register_multimodal_processors, rxf_register_chat_templates,
    )})


_TEMPLATE = ChatMLTemplate(name="test-template", stop_strings=("<end>",))


@pytest.fixture
def registry() -> PluginRegistry:
    reg = PluginRegistry()
    reg.register_plugin(_plugin(), "test-plugin", "test-dist", "1.2.3")
    return reg


def test_attention_backend_hook(registry):
    assert registry.attention_backend("test_backend") is _Backend


def test_models_hook_resolves_lazy_strings(registry):
    assert registry.model_class(["Unknown", "TestForCausalLM"]) is collections.OrderedDict


def test_multimodal_processor_hook(registry):
    assert registry.multimodal_processor("TestVisionForConditionalGeneration") is _Processor
    assert registry.multimodal_processor("Nope") is None


def test_chat_template_hook(registry):
    assert registry.chat_template("test-template") is _TEMPLATE


def test_plugin_info_records_what_was_registered(registry):
    info = registry.plugins["test-plugin"]
    assert (info.distribution, info.version) == ("test-dist", "1.2.3")
    assert info.registered["attention_backends"] == ["test_backend"]
    assert info.registered["models"] == ["TestForCausalLM"]


def test_unknown_name_lists_available(registry):
    with pytest.raises(PluginNotFoundError, match="available: test_backend"):
        registry.attention_backend("nope")
    with pytest.raises(PluginNotFoundError, match="TestForCausalLM"):
        registry.model_class(["GPTBogusForCausalLM"])


def test_implementation_matching_no_hook_is_rejected():
    @hookimpl
    def rxf_register_modles(register):  # typo: no such hook
        pass

    with pytest.raises(pluggy.PluginValidationError):
        PluginRegistry().register_plugin(types.SimpleNamespace(rxf_register_modles=rxf_register_modles), "typo")


def test_builtins_load_through_entry_points():
    reg = PluginRegistry.load()
    assert {"attention", "models", "chat_templates"} <= set(reg.plugins)
    assert reg.plugins["models"].distribution == "rxf"
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(reg.names("models"))
    assert "torch_native" in reg.names("attention_backends")
    assert {"chatml", "llama-2", "llama-3"} <= set(reg.names("chat_templates"))


def test_allow_and_deny_lists(monkeypatch):
    assert parse_plugin_filter("a, b,-c") == (["a", "b"], ["c"])
    assert parse_plugin_filter("-c") == (None, ["c"])
    assert set(PluginRegistry.load(allow=["models"]).plugins) == {"models"}
    assert "models" not in PluginRegistry.load(deny=["models"]).plugins
    monkeypatch.setenv("RXF_PLUGINS", "-chat_templates")
    reg = PluginRegistry.load()
    assert "chat_templates" not in reg.plugins and "models" in reg.plugins
    monkeypatch.setenv("RXF_PLUGINS", "attention")
    assert set(PluginRegistry.load().plugins) == {"attention"}


def test_rxf_plugins_command_lists_builtins():
    out = subprocess.run(
        [sys.executable, "-m", "rxf.entrypoints.cli", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    assert "models  (rxf " in out
    assert "LlamaForCausalLM" in out and "torch_native" in out and "chatml" in out
