"""The HTTP server of `rxf launch`: FastAPI on uvicorn, in the main process with the TokenizerManager.

Start-up: uvicorn binds at once and `/health` answers 503 while the engine's child processes load
the model (in a daemon thread, so the event loop keeps answering); the TokenizerManager is then
created on the server's own loop and `ServerState.ready` turns true. A child that dies later fails
every in-flight request and turns the server to 503; then, unless `server.exit_on_engine_death` is
false, the server shuts down and `serve` returns 1 (a supervisor restarts it). Shutdown stops the
children and removes the IPC directory (`EngineProcesses.shutdown`).

SIGTERM / Ctrl-C drains: the listener stays open and every new request gets 503 + Retry-After
(`DrainMiddleware`) while the requests in flight get `DRAIN_S` to finish; those still running are
then aborted (their streams end with finish_reason "abort"), and the server stops. Connections are
served by `GuardedH11Protocol` (read and send timeouts, a connection cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from rxf.core.config import EngineConfig
from rxf.core.frontend.requests import RequestLimits, load_multimodal_processor
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.grammar import make_grammar_backend
from rxf.entrypoints.anthropic import router as anthropic_router
from rxf.entrypoints.engine_loader import EngineLoader
from rxf.entrypoints.http_errors import APIKeyMiddleware, BodyLimitMiddleware, install_error_handlers
from rxf.entrypoints.http_transport import DrainMiddleware, GuardedH11Protocol, ensure_open_files
from rxf.entrypoints.metrics import ServerMetrics
from rxf.entrypoints.native_routes import router as native_router
from rxf.entrypoints.openai import router as openai_router
from rxf.entrypoints.openapi_doc import install_openapi
from rxf.entrypoints.server_state import ServerState

logger = logging.getLogger(__name__)

# On SIGTERM / Ctrl-C, how long requests in flight may run on before they are aborted.
DRAIN_S = 3.0


async def _start_engine(app: FastAPI, state: ServerState, loader: EngineLoader) -> None:
    try:
        await _take_engine(app, state, loader)
    finally:
        gc.enable()  # `rxf launch` starts with the collector off (its imports), see cmd_launch


async def _take_engine(app: FastAPI, state: ServerState, loader: EngineLoader) -> None:
    try:
        loaded = await loader.wait()
    except Exception as e:
        state.startup_error = f"{type(e).__name__}: {e}"
        logger.error("the engine failed to start: %s", state.startup_error)
        app.state.on_startup_failure()
        return
    state.engine, state.tokenizer = loaded.engine, loaded.frontend.tokenizer
    state.chat_template = loaded.frontend.chat_template
    grammar = make_grammar_backend(state.config, state.tokenizer, loaded.engine.info["vocab_size"])
    tm = TokenizerManager(
        state.tokenizer, loaded.engine.addrs, loaded.engine.info, RequestLimits.from_config(state.config),
        mm_processor=load_multimodal_processor(state.config, loaded.engine.info), grammar=grammar,
    )
    await tm.start()
    state.metrics.set_context_len(tm.max_context_len)
    tm.observer = state.metrics
    state.tokenizer_manager = tm
    loop = asyncio.get_running_loop()
    loaded.engine.watch(lambda reason: loop.call_soon_threadsafe(_on_engine_death, app, reason))
    # The heap as it stands (torch, transformers, the tokenizer: hundreds of thousands of objects)
    # is kept out of the collector's sight, as vLLM does: an allocation-heavy request (10,000 chat
    # messages) triggers full collections, which traversed all of it on the event loop (180 ms).
    gc.collect()
    gc.freeze()
    state.ready = True
    app.state.on_ready()


def _on_engine_death(app: FastAPI, reason: str) -> None:
    state: ServerState = app.state.server
    exiting = state.config.server.exit_on_engine_death
    logger.error("engine died: %s; %s", reason, "exiting" if exiting else "answering 503 from now on")
    state.engine_dead = reason
    state.ready = False
    if state.tokenizer_manager is not None:
        state.tokenizer_manager.fail_all(reason)  # every in-flight request gets its error now
    if exiting:
        app.state.on_engine_death()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    loop = asyncio.get_running_loop()
    loader = app.state.engine_loader or EngineLoader(state.config)
    starter = loop.create_task(_start_engine(app, state, loader))
    try:
        yield
    finally:
        state.ready = False
        if not loader.done.is_set():
            logger.info("shutdown during model load: stopping the engine's processes")
        await asyncio.to_thread(loader.abandon)
        starter.cancel()
        try:
            await starter
        except asyncio.CancelledError:
            pass
        except Exception:  # the engine's processes are stopped below all the same
            logger.exception("the engine's start raised")
        if state.tokenizer_manager is not None:
            await state.tokenizer_manager.close()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        logger.info("engine stopped")


def _noop() -> None:
    pass


def create_app(
    config: EngineConfig,
    *,
    on_ready: Callable[[], None] = _noop,
    on_startup_failure: Callable[[], None] = _noop,
    on_engine_death: Callable[[], None] = _noop,
    engine_loader: EngineLoader | None = None,
) -> FastAPI:
    """The server's app. The engine starts with the app's lifespan (or was started already by
    `engine_loader`, which the app then owns); `on_ready` is called on the loop once it serves,
    `on_startup_failure` if it could not start (`state.startup_error` says why), `on_engine_death`
    when a child died and `server.exit_on_engine_death` asks to stop."""
    app = FastAPI(title="rxf", version=_version(), lifespan=_lifespan)
    state = ServerState(config=config, served_model_name=config.model.served_model_name or config.model.path)
    state.metrics = ServerMetrics(state.served_model_name)
    app.state.server = state
    app.state.on_ready = on_ready
    app.state.on_startup_failure = on_startup_failure
    app.state.on_engine_death = on_engine_death
    app.state.engine_loader = engine_loader
    install_error_handlers(app)
    install_openapi(app, with_key=bool(config.server.api_key))
    app.include_router(native_router)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes)
    if config.server.api_key:  # a request without the key reads nothing
        app.add_middleware(APIKeyMiddleware, api_key=config.server.api_key)
    app.add_middleware(DrainMiddleware, state=state)  # added last, so outermost
    return app


def _version() -> str:
    from rxf import __version__

    return __version__


def _url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn, with a drain on shutdown (see the module docstring): uvicorn would close the
    listener at once (new clients refused) and cut requests when its grace period runs out."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.on_serving: Callable[[int], None] = lambda port: None
        self._engine_ready = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._announce()

    def engine_ready(self) -> None:
        self._engine_ready = True
        self._announce()

    def _announce(self) -> None:
        """Once both the engine is ready and the sockets are bound, in either order (an engine that
        `rxf launch` loaded ahead is ready before uvicorn binds): `on_serving(port)`, the bound port,
        which differs from the config's when that is 0."""
        if not (self._engine_ready and self.started):
            return
        ports = [sock.getsockname()[1] for srv in self.servers for sock in srv.sockets]
        self.on_serving(ports[0] if ports else self.config.port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # At the signal, not when uvicorn's main loop next looks at `should_exit` (within 0.1 s).
        self.state.draining = True  # from now on DrainMiddleware answers every new request 503
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.draining = True  # (also when shut down for another reason than a signal)
        await self._drain(DRAIN_S)
        await super().shutdown(sockets)

    async def _drain(self, limit: float) -> None:
        """Wait up to `limit` seconds for the engine requests in flight to end, then abort the rest
        (they end within a scheduler step; uvicorn's shutdown then waits for their answers)."""
        tm = self.state.tokenizer_manager
        if tm is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while tm.states and not self.state.engine_dead and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if tm.states and not self.state.engine_dead:
            logger.info("aborting %d requests still running after %.0f s", len(tm.states), limit)
            for rid in list(tm.states):
                await tm.abort(rid)


def serve(config: EngineConfig, engine_loader: EngineLoader | None = None, stop: threading.Event | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; 0 after a clean shutdown, 1 if the engine failed to start
    or died (and `server.exit_on_engine_death` is on). `engine_loader`: the engine's load, already
    started by the caller (`rxf launch`), who abandons it after serve returns or raises (a server
    that never ran its lifespan, e.g. its port in use, still stops the children). `stop`: set by the
    caller's signal handlers until these take over (0 at once if it is set by then)."""

    def serving(port: int) -> None:
        logger.info("rxf serving %s at %s", app.state.server.served_model_name, _url_of(config.server.host, port))

    def failed() -> None:
        server.should_exit = True

    app = create_app(config, on_ready=lambda: server.engine_ready(), on_startup_failure=failed, on_engine_death=failed,
                     engine_loader=engine_loader)
    ensure_open_files(config.server.max_connections)
    # Threads of this process (chat rendering, tokenizing, grammar compiling) run Python code that
    # holds the GIL; the event loop waits up to this long for it each time it wakes (5 ms by default).
    sys.setswitchinterval(0.001)
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        http=functools.partial(GuardedH11Protocol, limits=config.server),  # type: ignore[arg-type]
        timeout_keep_alive=config.server.keep_alive_timeout_s,  # type: ignore[arg-type]
        log_config=None,  # keep rxf's log format
        access_log=config.runtime.log_level == "debug",
        timeout_graceful_shutdown=5,  # a backstop after the drain, which normally ends every request
    )
    server = _Server(uv_config, app.state.server)
    server.on_serving = serving
    # Until `server.run` installs uvicorn's handlers, a signal makes the server exit as soon as it
    # has started. uvicorn re-raises the signal that stopped it once it is done, to run the previous
    # handler: this one then, harmless, so that a requested, completed shutdown is a normal exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    if stop is not None and stop.is_set():  # asked before these handlers were in place
        return 0
    server.run()
    state = app.state.server
    return 1 if state.startup_error or (state.engine_dead and config.server.exit_on_engine_death) else 0
