"""The server fixtures of tests/server (`server_factory`, `module_server_factory`, the tiny
checkpoints), loaded from that conftest by path: the tests folders are not packages, and one
definition of how a test server is launched and checked is kept."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).parent.parent / "server" / "conftest.py"
_spec = importlib.util.spec_from_file_location("rxf_reliability_server_fixtures", _path)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _fixtures  # dataclasses look their module up there
_spec.loader.exec_module(_fixtures)

ServerFactory = _fixtures.ServerFactory
ServerHandle = _fixtures.ServerHandle
tiny_model_dir = _fixtures.tiny_model_dir
long_context_model_dir = _fixtures.long_context_model_dir
server_factory = _fixtures.server_factory
module_server_factory = _fixtures.module_server_factory


def server_stats(srv: ServerHandle) -> dict:
    with srv.client() as http:
        return http.get("/get_server_info").json()["stats"]
