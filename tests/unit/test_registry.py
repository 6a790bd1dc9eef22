"""The plugin registry: entry points, every hook, allow/deny lists, clear errors."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pluggy
import pytest

from rxf.core.hookspecs import hookimpl
from rxf.core.registry import PluginLoadError, PluginNotFoundError, PluginRegistry, parse_plugin_filter
from rxf.plugins.chat_templates.builtin import ChatMLTemplate


class _Backend:
    pass


class _Processor:
    pass


class _Grammar:
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

    @hookimpl
    def rxf_register_grammar_backends(register):
        register("test_grammar", _Grammar)

    return types.SimpleNamespace(**{f.__name__: f for f in (
        rxf_register_attention_backends, rxf_register_models,
        rxf_register_multimodal_processors, rxf_register_chat_templates, rxf_register_grammar_backends,
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


def test_grammar_backend_hook(registry):
    assert registry.get("grammar_backends", "test_grammar") is _Grammar
    assert registry.registration("grammar_backends", "test_grammar").plugin == "test-plugin"


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


def test_unknown_architecture_lists_the_supported_ones_and_how_to_add_one():
    with pytest.raises(PluginNotFoundError) as err:
        PluginRegistry.load().model_class(["GPTBogusForCausalLM"])
    message = str(err.value)
    assert message.startswith("unknown architecture 'GPTBogusForCausalLM': no installed plugin registers it")
    supported = message.split("supported: ")[1].split(". ")[0].split(", ")
    assert supported == sorted(supported) and {"LlamaForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM"} <= set(supported)
    assert "`rxf_register_models` hook" in message and "docs/plugins.md" in message
    assert 'register("GPTBogusForCausalLM", "my_package.models:GPTBogusForCausalLM")' in message


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
    architectures = out.split("architectures (config.json `architectures`):\n")[1].splitlines()
    assert len(architectures) == len(PluginRegistry.load().names("models"))
    phi3 = next(line.split() for line in architectures if line.split()[0] == "Phi3ForCausalLM")
    assert phi3[1:] == ["rxf.plugins.models.phi3:Phi3ForCausalLM", "(models,", "rxf)"]


def test_readme_table_lists_every_registered_architecture():
    """README's "Supported architectures" table: a row for each registered architecture, and no
    row for one that is not registered unless it says "(pending)"."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme.split("| Architecture | Example models | Notes |\n|---|---|---|\n")[1].split("\n\n")[0]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines()}
    registered = set(PluginRegistry.load().names("models"))
    assert registered - rows.keys() == set(), "registered but missing from the README table"
    stale = {name for name, line in rows.items() if name not in registered and "(pending)" not in line}
    assert stale == set(), "in the README table but not registered"


# ---- third-party distributions: failure policy, filters, `rxf plugins` ----


def _install_fake_dist(root, dist: str, module: str, source: str, version: str = "1.0") -> None:
    """A distribution on sys.path (dist-info + module) exposing `module` as an `rxf` entry point."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[rxf]\n{module} = {module}\n")
    (root / f"{module}.py").write_text(source)


GOOD = '''
from rxf.core.hookspecs import hookimpl

@hookimpl
def rxf_register_attention_backends(register):
    register("fake_backend", "rxf.plugins.attention.torch_native:TorchNativeBackend")
    register("fake_missing", "fake_nowhere.module:Backend")
'''
BROKEN_IMPORT = "import fake_dependency_that_is_not_installed\n"
BROKEN_HOOK = '''
from rxf.core.hookspecs import hookimpl

@hookimpl
def rxf_register_chat_templates(register):
    raise RuntimeError("template table is corrupt")

@hookimpl
def rxf_register_models(register):
    register("FakeForCausalLM", "fake:Model")  # registered before the failure, then rolled back
'''


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    _install_fake_dist(tmp_path, "rxf-fake-good", "fake_good", GOOD, "2.5.0")
    _install_fake_dist(tmp_path, "rxf-fake-import", "fake_broken_import", BROKEN_IMPORT)
    _install_fake_dist(tmp_path, "rxf-fake-hook", "fake_broken_hook", BROKEN_HOOK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RXF_PLUGINS", raising=False)
    return tmp_path


def test_failed_plugins_are_logged_by_name_and_rxf_carries_on(fake_dists, caplog):
    reg = PluginRegistry.load()
    assert reg.plugins["fake_good"].distribution == "rxf-fake-good" and reg.plugins["fake_good"].version == "2.5.0"
    assert reg.attention_backend("fake_backend").__name__ == "TorchNativeBackend"
    assert set(reg.failed) == {"fake_broken_import", "fake_broken_hook"}
    assert "ModuleNotFoundError" in reg.failed["fake_broken_import"].error
    assert "template table is corrupt" in reg.failed["fake_broken_hook"].error
    assert "plugin fake_broken_import (rxf-fake-import 1.0) failed to load" in caplog.text
    assert reg.pm.get_plugin("fake_broken_hook") is None and "FakeForCausalLM" not in reg.names("models")


def test_registration_is_all_or_nothing(registry):
    @hookimpl
    def rxf_register_attention_backends(register):
        register("test_backend", "collections:OrderedDict")  # replaces test-plugin's ...
        register("half_done", "collections:OrderedDict")

    @hookimpl
    def rxf_register_chat_templates(register):
        raise RuntimeError("corrupt")  # ... then fails

    plugin = types.SimpleNamespace(
        rxf_register_attention_backends=rxf_register_attention_backends,
        rxf_register_chat_templates=rxf_register_chat_templates,
    )
    with pytest.raises(RuntimeError, match="corrupt"):
        registry.register_plugin(plugin, "half-broken")
    assert registry.attention_backend("test_backend") is _Backend
    assert "half_done" not in registry.names("attention_backends") and "half-broken" not in registry.plugins
    registry.register_plugin(_plugin(), "test-plugin-2")  # the manager is still consistent


def test_selecting_what_a_failed_plugin_may_provide_names_the_failure(fake_dists):
    reg = PluginRegistry.load()
    with pytest.raises(PluginNotFoundError, match=r"no chat template named 'fake'.*failed to load.*fake_broken_hook"):
        reg.chat_template("fake")
    with pytest.raises(PluginLoadError, match=r"'fake_missing' from plugin fake_good \(rxf-fake-good\).*fake_nowhere"):
        reg.attention_backend("fake_missing")


def test_a_failing_plugin_in_the_allow_list_stops_rxf(fake_dists):
    with pytest.raises(PluginLoadError, match=r"fake_broken_import \(rxf-fake-import 1.0\).*plugins.allow"):
        PluginRegistry.load(allow=["models", "fake_broken_import"])
    with pytest.raises(PluginLoadError, match=r"names not_installed, which no installed distribution provides"):
        PluginRegistry.load(allow=["models", "not_installed"])
    reg = PluginRegistry.load(allow=["models", "fake_good"])  # the broken ones are not asked for
    assert set(reg.plugins) == {"models", "fake_good"} and not reg.failed
    assert "fake_broken_hook" in reg.skipped


def test_rxf_plugins_env_and_config_sections(fake_dists, monkeypatch):
    from rxf.core.config import load_config

    monkeypatch.setenv("RXF_PLUGINS", "models,fake_good,-fake_good")
    config = load_config(None)  # RXF_PLUGINS is a filter string, not the section as JSON
    assert (config.plugins.allow, config.plugins.deny) == (["models", "fake_good"], ["fake_good"])
    assert set(PluginRegistry.load(config.plugins.allow, config.plugins.deny).plugins) == {"models"}
    monkeypatch.delenv("RXF_PLUGINS")
    config = load_config({"plugins": {"deny": ["fake_broken_import", "fake_broken_hook"]}})
    reg = PluginRegistry.load(config.plugins.allow, config.plugins.deny)
    assert not reg.failed and "fake_good" in reg.plugins


def test_rxf_plugins_command_shows_distribution_version_registrations_and_failures(fake_dists):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake_dists), *sys.path])}
    env.pop("RXF_PLUGINS", None)
    cmd = [sys.executable, "-m", "rxf.entrypoints.cli", "plugins"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    assert "fake_good  (rxf-fake-good 2.5.0)\n  attention_backends: fake_backend, fake_missing" in out
    assert "fake_broken_import  (rxf-fake-import 1.0)  FAILED TO LOAD: ModuleNotFoundError" in out
    report = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True, env=env).stdout)
    good = next(p for p in report["plugins"] if p["name"] == "fake_good")
    assert good["registered"] == {"attention_backends": ["fake_backend", "fake_missing"]}
    assert {f["name"] for f in report["failed"]} == {"fake_broken_import", "fake_broken_hook"}
    llama = next(a for a in report["architectures"] if a["name"] == "LlamaForCausalLM")
    assert llama == {"name": "LlamaForCausalLM", "class": "rxf.plugins.models.llama:LlamaForCausalLM",
                     "plugin": "models", "distribution": "rxf"}
