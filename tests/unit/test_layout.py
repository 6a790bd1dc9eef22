"""The layout of `rxf.core` is checked, not just described (its `__init__` says which process runs
each package): core never imports the layers built on it, and its packages depend on one another
only in the directions the process split allows.

Imports are read from the source with `ast`, at every depth (a function's lazy import counts), so
an import that runs only on some path cannot slip through. Imports under `if TYPE_CHECKING:` never
run; they may name any core module (a type), but still no layer outside core.

docs/architecture.md, the map of the processes and files, stays true the same way: every file and
function it cites exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "rxf" / "core"

# What core may never import: the layers above it, and test helpers. Plugins are reached through
# the registry's lazy "module:attr" strings only.
OUTSIDE = ("rxf.entrypoints", "rxf.plugins", "rxf.testing", "rxf.bench")

# The core packages each package may import at run time, besides the flat modules of `rxf.core`
# (the plugin API and shared types), which every package may import. Flat modules import flat ones.
ALLOWED = {
    "": set(),
    "ipc": set(),
    "frontend": {"ipc"},
    "detokenizer": {"ipc"},
    "kvcache": set(),
    "runner": {"ipc"},
    "scheduler": {"ipc", "kvcache", "runner", "launch", "speculative"},  # launch: the process entry's logging
    "speculative": {"runner"},  # runner: the draft model's ModelRunner
    "launch": {"ipc", "runner"},  # runner: the tensor-parallel placement of each rank
}


def _package(module: str) -> str:
    """"" for a flat module of rxf.core (or rxf.core itself), else its package's name."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else ""


def _package_of_target(target: str) -> str:
    """The core package an imported name lies in ("" for a flat module or a name in one):
    `rxf.core.runner` itself (`from rxf.core import runner`) counts as the package."""
    name = target.split(".")[2]
    return name if (CORE / name).is_dir() else ""


def _module_name(path: Path) -> str:
    rel = path.relative_to(CORE.parent.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(source: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, only under TYPE_CHECKING) for every absolute import in `source`.
    `from a import b` counts as `a.b` too, so that `from rxf.core import runner` is seen."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno, typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: rxf uses absolute imports only"
            found.append((node.module or "", node.lineno, typing_only))
            found.extend((f"{node.module}.{a.name}", node.lineno, typing_only) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(source), False)
    return found


def violations(module: str, source: str) -> list[str]:
    own = _package(module)
    bad = []
    for target, line, typing_only in imports(source):
        where = f"{module}:{line} imports {target}"
        if target.startswith(OUTSIDE):
            bad.append(f"{where} (core never imports {target.split('.')[1]})")
        elif target.startswith("rxf.core.") and not typing_only:
            dep = _package_of_target(target)
            if dep and dep != own and dep not in ALLOWED[own]:
                bad.append(f"{where} ({own or 'a flat core module'} may not depend on {dep})")
    return bad


def core_modules() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(CORE.rglob("*.py"))}


def test_every_core_package_is_in_the_layout():
    packages = {p.name for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == set(ALLOWED) - {""}
    assert all((CORE / p / "__init__.py").is_file() for p in packages), "a package without __init__.py is not installed"


def test_core_imports_follow_the_layout():
    modules = core_modules()
    assert len(modules) > 40
    bad = [v for module, source in modules.items() for v in violations(module, source)]
    assert bad == []


def test_the_check_catches_what_it_forbids():
    sneaky = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from rxf.plugins.chat_templates.base import HFChatTemplate\n"
        "    from rxf.core.scheduler.req import Req\n"
        "def f():\n"
        "    from rxf.entrypoints.demo_model import resolve_model_path\n"
        "    from rxf.core import runner\n"
        "from rxf.core.scheduler.scheduler import Scheduler\n"
        "from rxf.core.ipc.messages import TokenOut\n"
    )
    assert violations("rxf.core.frontend.x", sneaky) == [
        "rxf.core.frontend.x:4 imports rxf.plugins.chat_templates.base (core never imports plugins)",
        "rxf.core.frontend.x:4 imports rxf.plugins.chat_templates.base.HFChatTemplate (core never imports plugins)",
        "rxf.core.frontend.x:7 imports rxf.entrypoints.demo_model (core never imports entrypoints)",
        "rxf.core.frontend.x:7 imports rxf.entrypoints.demo_model.resolve_model_path (core never imports entrypoints)",
        "rxf.core.frontend.x:8 imports rxf.core.runner (frontend may not depend on runner)",
        "rxf.core.frontend.x:9 imports rxf.core.scheduler.scheduler (frontend may not depend on scheduler)",
        "rxf.core.frontend.x:9 imports rxf.core.scheduler.scheduler.Scheduler (frontend may not depend on scheduler)",
    ]


DOC = CORE.parents[1] / "docs" / "architecture.md"


def doc_problems(text: str) -> list[str]:
    """The `path.py` and `path.py: name` citations of `text` that name no single file of rxf or
    tests, or a name that file does not define."""
    repo = CORE.parents[1]
    files = sorted(p.relative_to(repo).as_posix() for top in ("rxf", "tests") for p in (repo / top).rglob("*.py"))
    problems = []
    for m in re.finditer(r"`([\w/]+\.py)(?:: (\w+(?:\.\w+)?))?`", text):
        path, name = m.group(1), m.group(2)
        found = [f for f in files if f == path or f.endswith("/" + path)]
        if len(found) != 1:
            problems.append(f"{path}: {len(found)} files")
        elif name is not None:
            pattern = rf"^\s*(def|class|async def) {name.split('.')[-1]}\b|^{name} = "
            if not re.search(pattern, (repo / found[0]).read_text(), re.M):
                problems.append(f"{path}: no {name}")
    return problems


def test_the_architecture_page_cites_files_and_names_that_exist():
    text = DOC.read_text()
    assert len(re.findall(r"\.py[:`]", text)) > 40
    assert doc_problems(text) == []
    assert doc_problems("`runner/step_runner.py: launch_twice`, `nowhere/gone.py`, `process.py`") == [
        "runner/step_runner.py: no launch_twice", "nowhere/gone.py: 0 files", "process.py: 2 files",
    ]
