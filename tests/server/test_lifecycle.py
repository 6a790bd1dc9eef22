"""The server's life: 503 while loading, the ready log line, API keys, engine death, failed start-up,
SIGTERM (during load and after). Each test runs a `rxf launch` subprocess of its own."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from rxf.core.config import load_config
from rxf.entrypoints.http_server import DRAIN_S


def poll_health_until_ready(url: str, proc, timeout: float = 120.0) -> list[int | None]:
    """Statuses of /health from the first moment (None: not listening yet) until the first 200."""
    seen: list[int | None] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status: int | None = httpx.get(f"{url}/health", timeout=2).status_code
        except httpx.TransportError:
            status = None
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"never healthy; statuses seen: {seen}")


def test_starts_503_then_200_logs_its_url_and_stops_on_sigterm(server_factory, long_context_model_dir):
    srv = server_factory({"model.path": str(long_context_model_dir), "cache.max_total_tokens": 32768}, wait=False)
    statuses = poll_health_until_ready(srv.url, srv.proc)
    assert 503 in statuses and statuses[-1] == 200, statuses
    assert statuses.index(503) < statuses.index(200)
    server_factory.wait_ready(srv)  # records the children and the IPC directory
    assert f"rxf serving {long_context_model_dir} at {srv.url}" in srv.log()
    assert len(srv.children) >= 2  # scheduler and detokenizer
    assert os.path.isdir(srv.ipc_dir)

    # A stream still running at SIGTERM gets DRAIN_S to finish, then ends with an abort, properly.
    events: list[str] = []
    first_chunk = threading.Event()

    def read_stream() -> None:
        body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 15000, "ignore_eos": True}}
        with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_chunk.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first_chunk.wait(30)
    elapsed = server_factory.stop(srv)  # asserts exit 0, no surviving child, IPC directory removed
    reader.join(10)
    assert elapsed < DRAIN_S + 5
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert "engine stopped" in srv.log()


def test_sigterm_during_model_load(server_factory):
    srv = server_factory(wait=False)
    deadline = time.monotonic() + 60
    while True:  # wait for the loading phase: listening, 503
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 503:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log_tail()
        time.sleep(0.05)
    while not psutil.Process(srv.proc.pid).children():
        assert time.monotonic() < deadline, "the engine's processes did not start"
        time.sleep(0.05)
    srv.children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert server_factory.stop(srv) < 15  # exit 0 and no surviving child
    assert "shutdown during model load" in srv.log()


def test_sigterm_while_the_server_imports(server_factory):
    # `rxf launch` starts the engine's children before it imports the server (start-up time); a
    # SIGTERM in that window stops them too and exits 0.
    srv = server_factory(wait=False)
    deadline = time.monotonic() + 60
    while not psutil.Process(srv.proc.pid).children():
        assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log_tail()
        time.sleep(0.01)
    with pytest.raises(httpx.TransportError):  # not listening yet: the window this test is about
        httpx.get(f"{srv.url}/health", timeout=2)
    srv.children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert server_factory.stop(srv) < 15  # exit 0 and no surviving child


def test_api_key(server_factory):
    # RXF_API_KEY (the short alias of RXF_SERVER__API_KEY) and a CLI-style override, end to end.
    srv = server_factory(
        {"scheduler.max_running_requests": 3, "model.served_model_name": "tiny-llama"},
        api_key="s3cret", env={"RXF_API_KEY": "s3cret"},
    )
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.get(f"{srv.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
        for method, path, body in (("POST", "/generate", gen), ("GET", "/v1/models", None), ("GET", "/metrics", None)):
            r = httpx.request(method, f"{srv.url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert err["code"] == 401 and err["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    with srv.client() as http:
        assert http.post("/generate", json=gen).status_code == 200
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-llama"]
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).json()["model"] == "tiny-llama"
        info = http.get("/get_server_info").json()
        assert info["config"]["server"]["api_key"] == "<set>"  # never echoed
        assert info["config"]["scheduler"]["max_running_requests"] == 3
        assert "s3cret" not in json.dumps(info)
    server_factory.stop(srv, signal.SIGINT)  # Ctrl-C: the same clean exit as SIGTERM
    assert "s3cret" not in srv.log()


def test_api_key_from_the_nested_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("RXF_SERVER__API_KEY", "from-env")
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 1234\napi_key = "from-file"\n')
    config = load_config(path)
    assert (config.server.api_key, config.server.port) == ("from-env", 1234)
    assert load_config(path, **{"server.api_key": "from-cli"}).server.api_key == "from-cli"


def test_engine_death_fails_requests_and_turns_503(server_factory):
    # Kept serving 503 (a supervisor may probe it); the default, exiting, is in tests/reliability.
    srv = server_factory({"server.exit_on_engine_death": False})
    scheduler = next(p for p in srv.children if "rxf-scheduler" in " ".join(p.cmdline()))
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        scheduler.send_signal(signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == 503
    deadline = time.monotonic() + 10
    while httpx.get(f"{srv.url}/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = httpx.post(f"{srv.url}/generate", json={"text": "hi"})
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
    assert "exited unexpectedly" in srv.log()
    server_factory.stop(srv)  # still a clean exit: the survivors are stopped, the IPC directory removed


def _failed_launch_log(server_factory, settings: dict) -> str:
    """Launch with `settings`, expect exit status 1, return the server's log."""
    srv = server_factory(settings, wait=False)
    try:
        code = srv.proc.wait(60)
    finally:
        server_factory.started.remove(srv)
    assert code == 1, srv.log_tail()
    return srv.log()


def test_failed_start_exits_nonzero(server_factory, tmp_path):
    log = _failed_launch_log(server_factory, {"model.path": str(tmp_path / "no-such-model")})
    assert "the engine failed to start" in log


def test_unknown_tool_call_parser_fails_the_launch(server_factory):
    log = _failed_launch_log(server_factory, {"model.tool_call_parser": "no-such-parser"})
    assert "unknown tool call parser 'no-such-parser'" in log


def test_launch_help(capsys):
    from rxf.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--set"):
        assert flag in out


@pytest.mark.parametrize("engine_first", [True, False])
def test_serving_is_announced_once_both_the_engine_and_the_socket_are_up(engine_first):
    """`rxf launch` loads the engine ahead, so it can be ready before uvicorn binds; the line that
    names the URL waits for both, in either order, and carries the bound port (config port 0)."""
    import asyncio

    import uvicorn

    from rxf.core.config import EngineConfig
    from rxf.entrypoints.http_server import _Server
    from rxf.entrypoints.server_state import ServerState

    async def app(scope, receive, send):
        raise AssertionError("no request is sent")

    async def run() -> None:
        server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off"), ServerState(EngineConfig(), "m"))
        announced: list[int] = []
        server.on_serving = announced.append
        if engine_first:
            server.engine_ready()
        serving = asyncio.create_task(server.serve())
        while not server.started:
            assert not serving.done()
            await asyncio.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        if not engine_first:
            assert announced == []
            server.engine_ready()
        server.should_exit = True
        await serving
        assert announced == [bound] and bound != 0

    asyncio.run(run())
