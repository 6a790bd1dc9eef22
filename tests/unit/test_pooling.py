"""An embedding model's pooling as its checkpoint describes it (`rxf.core.pooling.Pooling`):
sentence-transformers' modules.json and Pooling config, config.json's Matryoshka fields, and the
pipelines this engine refuses rather than serve different vectors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rxf.core.pooling import Pooling
from rxf.testing.checkpoints import add_sentence_transformers_config


def _config(**fields):
    text = SimpleNamespace(hidden_size=64, **fields)
    return SimpleNamespace(get_text_config=lambda: text)


@pytest.mark.parametrize(
    ("pooling", "normalize", "method"), [("lasttoken", True, "last"), ("mean_tokens", False, "mean")]
)
def test_reads_the_sentence_transformers_config(tmp_path: Path, pooling, normalize, method) -> None:
    add_sentence_transformers_config(tmp_path, pooling, normalize)
    p = Pooling.from_checkpoint(str(tmp_path), _config())
    assert (p.method, p.normalize, p.hidden_size) == (method, normalize, 64)


def test_defaults_and_overrides(tmp_path: Path) -> None:
    """No sentence-transformers files: last-token, not normalised (a decoder model such as
    Qwen3-Embedding); the config's model.pooling / model.normalize override the checkpoint."""
    assert Pooling.from_checkpoint(str(tmp_path), _config()) == Pooling("last", False, 64)
    add_sentence_transformers_config(tmp_path, "lasttoken", normalize=True)
    assert Pooling.from_checkpoint(str(tmp_path), _config(), "mean", False) == Pooling("mean", False, 64)


@pytest.mark.parametrize("pooling", ["cls_token", "max_tokens"])
def test_refuses_poolings_it_cannot_reproduce(tmp_path: Path, pooling) -> None:
    add_sentence_transformers_config(tmp_path, pooling)
    with pytest.raises(ValueError, match=f"pooling_mode_{pooling}"):
        Pooling.from_checkpoint(str(tmp_path), _config())


def test_refuses_a_dense_module(tmp_path: Path) -> None:
    add_sentence_transformers_config(tmp_path)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        Pooling.from_checkpoint(str(tmp_path), _config())


def test_dimensions(tmp_path: Path) -> None:
    """Any size up to hidden unless the config lists the trained sizes or says is_matryoshka: false."""
    free = Pooling.from_checkpoint(str(tmp_path), _config())
    assert free.check_dimensions(7) is None and free.check_dimensions(64) is None
    assert "[1, 64]" in free.check_dimensions(0) and "[1, 64]" in free.check_dimensions(65)
    listed = Pooling.from_checkpoint(str(tmp_path), _config(matryoshka_dimensions=[16, 32]))
    assert listed.check_dimensions(32) is None and listed.check_dimensions(64) is None
    assert "[16, 32]" in listed.check_dimensions(8)
    refused = Pooling.from_checkpoint(str(tmp_path), _config(is_matryoshka=False))
    assert "not trained" in refused.check_dimensions(32) and refused.check_dimensions(64) is None
