"""Self-enforcing plugin documentation (docs/plugins.md):

- every hook in `rxf.core.hookspecs` has a section there (signature, process, since-version, an
  example) and a test that implements it; every example runs and registers through `PluginRegistry`;
- the public API table lists names that exist, and the example plugin and the page's examples
  import nothing else from rxf.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import rxf
from rxf.core import hookspecs
from rxf.core.attention import AttentionBackend
from rxf.core.chat_template import ChatTemplate
from rxf.core.registry import KINDS, PluginRegistry
from rxf.testing.attention import compare_backends

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "plugins.md").read_text()
EXAMPLE = REPO / "examples" / "plugins" / "rxf-example"
HOOKS = sorted(name for name, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec"))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def hook_section(hook: str) -> str:
    match = re.search(rf"^### `{hook}`\n(.*?)(?=^##)", DOC, re.S | re.M)
    assert match, f"docs/plugins.md has no '### `{hook}`' section"
    return match.group(1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def public_api() -> dict[str, set[str]]:
    table = DOC.split("<!-- public-api:begin -->")[1].split("<!-- public-api:end -->")[0]
    api = {}
    for module, names in re.findall(r"^\| `([\w.]+)` \| (.+) \|$", table, re.M):
        api[module] = set(re.findall(r"`(\w+)`", names))
    return api


def test_hook_list_matches_the_registry_kinds():
    assert HOOKS == sorted(f"rxf_register_{kind}" for kind in KINDS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    section = hook_section(hook)
    for field in ("Signature", "Registers", "Used in"):
        assert f"**{field}:**" in section, f"{hook}: no **{field}:** line"
    assert f"`{hook}(register:" in section
    since = re.search(r"\*\*Since:\*\* (\d+\.\d+\.\d+)", section)
    assert since, f"{hook}: no **Since:** version"
    assert _version(since.group(1)) <= _version(rxf.__version__)
    assert python_blocks(section), f"{hook}: no example"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test_implementing_it(hook):
    this = Path(__file__).resolve()
    implementing = [
        p for p in (REPO / "tests").rglob("test_*.py") if p.resolve() != this and f"def {hook}(" in p.read_text()
    ]
    assert implementing, f"no test under tests/ implements {hook}"


@pytest.fixture
def example_on_path(monkeypatch):
    """The example plugin's package importable without installing it (its lazy strings resolve)."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))


def _check_attention_backend(cls):
    assert issubclass(cls, AttentionBackend)
    out, ref, k, ref_k = compare_backends(
        cls, [3, 0], [2, 5], heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"
    )
    torch.testing.assert_close(out, ref)
    assert torch.equal(k, ref_k)


def _check_model(cls):
    assert issubclass(cls, nn.Module) and callable(cls.load_weights)


def _check_chat_template(template):
    assert isinstance(template, ChatTemplate)
    assert "hi there" in template.render([{"role": "user", "content": "hi there"}])


CHECKS = {  # what each kind's example must resolve to; strings of unreleased interfaces stay lazy
    "attention_backends": _check_attention_backend,
    "models": _check_model,
    "chat_templates": _check_chat_template,
    "multimodal_processors": None,
    "grammar_backends": None,
    "tool_call_formats": None,
    "reasoning_parsers": None,
    "quantization_methods": None,
}


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_example_registers(hook, example_on_path):
    kind = hook.removeprefix("rxf_register_")
    module = types.ModuleType(f"docs_example_{kind}")
    exec(compile(python_blocks(hook_section(hook))[0], f"docs/plugins.md ({hook})", "exec"), vars(module))
    registry = PluginRegistry()
    registry.register_plugin(module, f"docs-{kind}", "docs-example", "0")
    registered = registry.plugins[f"docs-{kind}"].registered
    assert set(registered) == {kind}, f"the {hook} example registered {registered}"
    for name in registered[kind]:
        reg = registry.registration(kind, name)
        assert reg.plugin == f"docs-{kind}"
        if CHECKS[kind] is not None:
            CHECKS[kind](registry.get(kind, name))
        else:
            assert isinstance(reg.factory, str) and ":" in reg.factory  # a lazy "module:attr" string


def test_public_api_names_exist():
    api = public_api()
    assert "rxf.core.attention" in api and "AttentionBackend" in api["rxf.core.attention"]
    for module, names in api.items():
        mod = importlib.import_module(module)
        missing = sorted(n for n in names if not hasattr(mod, n))
        assert not missing, f"docs/plugins.md lists {module}.{missing}, which do not exist"


def rxf_imports(source: str, where: str) -> list[tuple[str, str | None, str]]:
    """(module, name or None for `import module`, location) of every import of rxf."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, None, where) for a in node.names if a.name.split(".")[0] == "rxf"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rxf":
            found += [(node.module, a.name, f"{where}:{node.lineno}") for a in node.names]
    return found


def non_public(imports: list[tuple[str, str | None, str]]) -> list[str]:
    api = public_api()
    bad = []
    for module, name, where in imports:
        if name is None:
            ok = module in api
        else:  # `from rxf.x import y`: a listed name, or a listed submodule rxf.x.y
            ok = name in api.get(module, ()) or f"{module}.{name}" in api
        if not ok:
            bad.append(f"{where}: {module}" + (f".{name}" if name else ""))
    return bad


def test_example_plugin_imports_only_the_public_api():
    files = sorted(EXAMPLE.rglob("*.py"))
    assert len(files) >= 5
    imports = [i for p in files for i in rxf_imports(p.read_text(), str(p.relative_to(REPO)))]
    assert {m for m, _, _ in imports} >= {"rxf.core.hookspecs", "rxf.plugins.models.layers", "rxf.core.attention"}
    assert non_public(imports) == []


def test_doc_examples_import_only_the_public_api():
    imports = [i for n, block in enumerate(python_blocks(DOC)) for i in rxf_imports(block, f"docs block {n}")]
    assert imports and non_public(imports) == []


def test_the_scan_catches_a_private_import():
    imports = rxf_imports("from rxf.core.scheduler.scheduler import Scheduler\nimport rxf.core.kv_pool\n", "x")
    assert non_public(imports) == ["x:1: rxf.core.scheduler.scheduler.Scheduler"]
