"""The example plugin as a user meets it: `pip install` it into a fresh virtual environment, find it in
`rxf plugins`, run its own test suite there (its model against transformers through the whole
engine, its backend against torch_native, its template; fixtures from rxf's pytest plugin), then
`pip uninstall` it and get a clear "unknown architecture" error from the same config.

The environment is a new venv that sees the test venv's packages (torch, transformers and rxf) through
a `.pth` file, so nothing is downloaded: the plugin is built from a copy of its source with
`--no-deps --no-build-isolation --no-index`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "plugins" / "rxf-example"


class PluginVenv:
    def __init__(self, root: Path) -> None:
        venv.EnvBuilder(with_pip=False).create(root / "venv")
        self.python = str(root / "venv" / "bin" / "python")
        site_dir = Path(self.run("-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
        parent = sysconfig.get_path("purelib")  # the test venv's: rxf (editable), torch, pip, setuptools
        (site_dir / "rxf_test_parent_env.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
        # The developer's own RXF_* settings must not leak in; threads kept to one on shared CI cores.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RXF_") or k == "RXF_CACHE_DIR"}
        self.env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")

    def run(self, *args: str, check: bool = True, cwd: Path | None = None, timeout: float = 300):
        proc = subprocess.run(
            [self.python, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
            env=getattr(self, "env", None),
        )
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
        return proc

    def plugins(self) -> dict:
        return json.loads(self.run("-m", "rxf.entrypoints.cli", "plugins", "--json").stdout)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> PluginVenv:
    root = tmp_path_factory.mktemp("plugin-install")
    source = shutil.copytree(EXAMPLE, root / "rxf-example", ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    env = PluginVenv(root)
    env.run("-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(source))
    env.source = source
    return env


def test_rxf_plugins_lists_the_installed_plugin(env: PluginVenv) -> None:
    report = env.plugins()
    example = next(p for p in report["plugins"] if p["name"] == "rxf_example")
    assert (example["distribution"], example["version"]) == ("rxf-example", "0.1.0")
    assert example["registered"] == {
        "models": ["GemmaForCausalLM"],
        "attention_backends": ["batched_sdpa"],
        "chat_templates": ["gemma"],
    }
    text = env.run("-m", "rxf.entrypoints.cli", "plugins").stdout
    assert "rxf_example  (rxf-example 0.1.0)" in text and "models: GemmaForCausalLM" in text


def test_the_plugin_test_suite_passes_with_rxf_fixtures(env: PluginVenv) -> None:
    # Its tests use rxf_tiny_checkpoint / rxf_model_harness / rxf_runtime / rxf_hf_reference with no
    # conftest: the fixtures reach them through rxf's pytest11 entry point.
    out = env.run("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=env.source, timeout=500).stdout
    summary = out.strip().splitlines()[-1]
    # Everything passed: nothing failed, errored or was skipped (a warnings count may follow).
    assert re.fullmatch(r"\d+ passed(, \d+ warnings?)? in [\d.]+s( \([\d:]+\))?", summary), out[-4000:]


def test_after_uninstall_the_config_fails_with_unknown_architecture(env: PluginVenv, tmp_path: Path) -> None:
    checkpoint = tmp_path / "gemma"
    env.run("-c", f"from rxf.testing import make_tiny_checkpoint; make_tiny_checkpoint({str(checkpoint)!r}, "
            "'GemmaForCausalLM', head_dim=32, tie_word_embeddings=True)")
    config = tmp_path / "gemma.toml"
    config.write_text(f'[model]\npath = "{checkpoint}"\n\n[runtime]\ndevice = "cpu"\n')
    env.run("-m", "pip", "uninstall", "-q", "-y", "rxf-example")
    assert "rxf_example" not in {p["name"] for p in env.plugins()["plugins"]}
    failed = env.run("-m", "rxf.entrypoints.cli", "generate", str(config), "hello", check=False)
    assert failed.returncode != 0
    assert "unknown architecture 'GemmaForCausalLM'" in failed.stderr, failed.stderr[-3000:]
    supported = re.search(r"supported: ([\w, ]+)", failed.stderr)
    assert supported and "LlamaForCausalLM" in supported.group(1).split(", "), failed.stderr[-3000:]
    assert "GemmaForCausalLM" not in supported.group(1).split(", ")
