"""Reuse the real-server fixtures (`server_factory`, `tiny_model_dir`) of tests/server.

Both folders are rootless (no __init__.py), so the server conftest is loaded under a name of its
own rather than imported as `conftest`, which would be this very module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).parent.parent / "server" / "conftest.py"
_spec = importlib.util.spec_from_file_location("rxf_tests_server_conftest", _path)
assert _spec is not None and _spec.loader is not None
_server = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _server
_spec.loader.exec_module(_server)

server_factory = _server.server_factory
tiny_model_dir = _server.tiny_model_dir
write_config = _server.write_config
