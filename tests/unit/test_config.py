"""Configuration: TOML, RXF_* environment, overrides, and errors that name the key and the file."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rxf.core.config import ConfigError, load_config


@pytest.fixture
def toml(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text(
        '[model]\npath = "./weights"\ndtype = "float32"\n'
        "[scheduler]\nmax_running_requests = 4\npolicy = \"fcfs\"\n"
    )
    return path


def test_defaults():
    c = load_config()
    assert c.model.path == "demo" and c.attention.backend == "auto"
    assert c.scheduler.policy == "lpm" and c.server.host == "127.0.0.1"


def test_toml_values_and_relative_paths(toml):
    c = load_config(toml)
    assert c.scheduler.max_running_requests == 4 and c.scheduler.policy == "fcfs"
    assert c.model.path == str(toml.parent / "weights")  # relative to the file, not the cwd


def test_precedence_override_env_file(toml, monkeypatch):
    monkeypatch.setenv("RXF_SCHEDULER__MAX_RUNNING_REQUESTS", "7")
    c = load_config(toml)
    assert c.scheduler.max_running_requests == 7  # env beats the file
    assert c.scheduler.policy == "fcfs"  # the file's other keys in that section survive
    c = load_config(toml, **{"scheduler.max_running_requests": 9})
    assert c.scheduler.max_running_requests == 9  # overrides beat env
    c = load_config(toml, scheduler__stream_interval=3)
    assert c.scheduler.stream_interval == 3 and c.scheduler.max_running_requests == 7


def test_dict_source_and_config_object():
    c = load_config({"cache": {"disable_radix_cache": True}})
    assert c.cache.disable_radix_cache
    again = load_config(c, **{"cache.max_total_tokens": 100})
    assert again.cache.disable_radix_cache and again.cache.max_total_tokens == 100


def test_frozen():
    c = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        c.scheduler.max_running_requests = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "data, key",
    [
        ({"scheduler": {"max_running_requests": 0}}, "scheduler.max_running_requests"),
        ({"scheduler": {"polcy": "lpm"}}, "scheduler.polcy"),
        ({"model": {"dtype": "float8"}}, "model.dtype"),
        ({"bogus": {}}, "bogus"),
    ],
)
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(data)


def test_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache]\nmax_total_tokens = -5\n")
    with pytest.raises(ConfigError, match=r"bad\.toml[\s\S]*cache\.max_total_tokens"):
        load_config(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("[cache\n")
    with pytest.raises(ConfigError, match="broken.toml: invalid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
