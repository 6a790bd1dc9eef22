"""Fixtures that run the real HTTP server: `rxf launch` as a subprocess on a free loopback port.

    def test_something(server):                    # one server per test module (tiny Llama, CPU)
        httpx.get(f"{server.url}/health")
    def test_other(server_factory):                # a server of its own, stopped after the test
        srv = server_factory({"scheduler.max_running_requests": 2}, api_key="k")
    # settings are dotted config keys; {"model.path": ...} serves another checkpoint

Stopping a server (SIGTERM) asserts that it exited 0, that none of its child processes survive it
and that its IPC directory is gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from rxf.testing.checkpoints import make_tiny_checkpoint

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen[bytes]
    api_key: str | None
    config_path: Path
    log_path: Path
    ipc_dir: str | None = None
    children: list[psutil.Process] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        """The OpenAI client's base_url."""
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client for this server, sending the API key when there is one."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    """Write dotted `section.key` settings as a TOML file."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


class ServerFactory:
    """Starts servers and stops (and checks) whatever is still running at `close()`."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.started: list[ServerHandle] = []

    def __call__(
        self,
        settings: dict[str, Any] | None = None,
        *,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> ServerHandle:
        n = len(self.started)
        config = {
            "model.path": str(self.model_dir),
            "attention.backend": "torch_native",
            "cache.max_total_tokens": 4096,
            "runtime.device": "cpu",
            "runtime.cpu_threads": 1,
            # Paths and the IPC directory in /get_server_info (read below, to check the shutdown
            # removes it); a server of the default (false) shows none of them.
            "server.expose_internals": True,
            **(settings or {}),
        }
        if api_key is not None and "RXF_API_KEY" not in (env or {}):
            config["server.api_key"] = api_key
        config_path = write_config(self.workdir / f"server{n}.toml", config)
        port = free_port()
        # Hermetic: the developer's own RXF_* settings must not leak into the server under test.
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("RXF_") or k == "RXF_CACHE_DIR"}
        child_env.update(env or {})
        log_path = self.workdir / f"server{n}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rxf.entrypoints.cli", "launch", str(config_path), "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=self.workdir,
            )
        handle = ServerHandle(f"http://127.0.0.1:{port}", proc, api_key, config_path, log_path)
        self.started.append(handle)
        if wait:
            self.wait_ready(handle)
        return handle

    def wait_ready(self, handle: ServerHandle, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if handle.proc.poll() is not None:
                pytest.fail(f"the server exited with {handle.proc.returncode} during start-up:\n{handle.log_tail()}")
            try:
                if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)
        else:
            pytest.fail(f"the server was not healthy within {timeout:.0f} s:\n{handle.log_tail()}")
        info = httpx.get(f"{handle.url}/get_server_info", headers=handle.headers, timeout=10).json()
        handle.ipc_dir = info["engine"].get("ipc_dir")
        handle.children = psutil.Process(handle.proc.pid).children(recursive=True)

    def stop(self, handle: ServerHandle, sig: int = signal.SIGTERM) -> float:
        """Signal the server, wait for it, check what it leaves behind; returns the seconds it took."""
        if handle.proc.poll() is None:
            handle.children = handle.children or psutil.Process(handle.proc.pid).children(recursive=True)
        start = time.monotonic()
        handle.proc.send_signal(sig)
        try:
            code = handle.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            handle.proc.kill()
            pytest.fail(f"the server did not exit within {STOP_TIMEOUT_S:.0f} s of {sig!r}:\n{handle.log_tail()}")
        elapsed = time.monotonic() - start
        if handle in self.started:
            self.started.remove(handle)
        survivors = [p for p in handle.children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in survivors:
            p.kill()
        assert not survivors, f"child processes outlived the server: {survivors}\n{handle.log_tail()}"
        assert code == 0, f"the server exited with {code}:\n{handle.log_tail()}"
        if handle.ipc_dir is not None:
            assert not os.path.exists(handle.ipc_dir), f"IPC directory left behind: {handle.ipc_dir}"
        return elapsed

    def close(self) -> None:
        for handle in list(self.started):
            self.stop(handle)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-server-llama"), "LlamaForCausalLM")


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 16k context: a request can then run for seconds, long enough to be
    caught in flight (a 512-token one ends within a second)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-server-llama-16k"), "LlamaForCausalLM", max_position_embeddings=16384
    )


@pytest.fixture
def server_factory(tiny_model_dir: Path, tmp_path: Path):
    factory = ServerFactory(tiny_model_dir, tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_server_factory(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`server_factory` for module-scoped servers (stopped and checked after the module)."""
    factory = ServerFactory(tiny_model_dir, tmp_path_factory.mktemp("servers"))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def server(module_server_factory: ServerFactory) -> ServerHandle:
    """The default server: tiny Llama (512-token context, chatml template), 4096 KV slots."""
    return module_server_factory()


@pytest.fixture(scope="module")
def http(server: ServerHandle):
    """An httpx client for the module's `server` (a module picks its server by overriding `server`)."""
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerHandle):
    """The official `openai` client for the module's `server`."""
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key=server.api_key or "unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model's id, as `/v1/models` gives it."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def demo_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo model (SmolLM2-135M-Instruct) behind one server shared by every module that asks
    (structured output and tool calling), stopped and checked at the end of the session."""
    factory = ServerFactory(tiny_model_dir, tmp_path_factory.mktemp("demo-server"))
    yield factory({"model.path": "demo", "cache.max_total_tokens": 8192})
    factory.close()


@pytest.fixture(scope="session")
def demo_runtime():
    """The demo model in a `Runtime` in this process, with `demo_server`'s settings (so the two front
    doors can be compared token for token), shared by every module that asks."""
    from rxf import Runtime

    settings = {"model.path": "demo", "attention.backend": "torch_native", "cache.max_total_tokens": 8192,
                "runtime.device": "cpu", "runtime.cpu_threads": 1}
    with Runtime.from_config(None, **settings) as runtime:
        yield runtime
