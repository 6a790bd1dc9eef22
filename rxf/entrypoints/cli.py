"""The `rxf` command line: `rxf launch CONFIG`, `rxf plugins`, `rxf generate CONFIG`, `rxf chat CONFIG`,
`rxf bench serve|offline`."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from rxf.core.launch.logging_setup import setup_logging


def _overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set scheduler.max_running_requests=8` pairs; values parse as JSON when they can."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def cmd_launch(args: argparse.Namespace) -> int:
    """Serve CONFIG over HTTP until Ctrl-C / SIGTERM. Flags are config overrides."""
    from rxf.core.config import ConfigError, load_config

    overrides = _overrides(args.set)
    for key, value in (("server.host", args.host), ("server.port", args.port), ("server.api_key", args.api_key)):
        if value is not None:
            overrides[key] = value
    # RXF_API_KEY is accepted as a short alias of RXF_SERVER__API_KEY (below it, and below --api-key).
    if "server.api_key" not in overrides and "RXF_SERVER__API_KEY" not in os.environ and os.environ.get("RXF_API_KEY"):
        overrides["server.api_key"] = os.environ["RXF_API_KEY"]
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    setup_logging(args.log_level or config.runtime.log_level)
    logging.getLogger(__name__).info("starting the engine for %s", config.model.path)
    if config.parallel.node_rank > 0:  # multi-node: only node 0 serves; the others run scheduler ranks
        from rxf.core.launch.processes import run_worker_node
        from rxf.entrypoints.demo_model import resolve_model_path

        return run_worker_node(config, resolve_model_path(config.model.path))
    from rxf.entrypoints.engine_loader import EngineLoader

    # The children start now and import torch and load the model while this process imports the
    # server (torch, transformers, FastAPI: seconds); until serve() takes over, a SIGTERM or Ctrl-C
    # stops them too. The cyclic collector stays off until the engine is taken (the server's
    # `_start_engine` turns it back on and freezes the heap): the imports' millions of long-lived
    # objects made its passes ~20% of start-up CPU.
    gc.disable()
    stop = threading.Event()
    loaders: list[EngineLoader] = []

    def stop_requested(signum: int, frame: Any) -> None:
        # Runs between two bytecodes of the main thread, maybe inside importlib's machinery: it must
        # not raise. A KeyboardInterrupt raised from here inside a module lock's callback was
        # swallowed ("Exception ignored"): the signal was lost and the lock left held, and the
        # tokenizer thread's next import of that module blocked for good (1 start in 8).
        stop.set()
        for loader in loaders:
            loader.cancel.set()  # the children stop within a poll interval

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_requested)
    loaders.append(loader := EngineLoader(config))
    try:
        from rxf.entrypoints.http_server import serve

        return serve(config, engine_loader=loader, stop=stop)
    finally:
        loader.abandon()  # idempotent; an engine the server took was stopped by its shutdown


def _architectures(registry: Any) -> list[dict[str, str]]:
    """Every model architecture a checkpoint's config.json may name, with the class that serves it."""
    rows = []
    for name in registry.names("models"):
        reg = registry.registration("models", name)
        factory = reg.factory if isinstance(reg.factory, str) else f"{reg.factory.__module__}:{reg.factory.__qualname__}"
        rows.append({"name": name, "class": factory, "plugin": reg.plugin, "distribution": reg.distribution})
    return rows


def cmd_plugins(args: argparse.Namespace) -> int:
    """Each loaded plugin with its distribution, version and what it registered; the model
    architectures rxf can load, with their classes; then the plugins that failed to load (with the
    error) and those the allow/deny lists left out."""
    from dataclasses import asdict

    from rxf.core.registry import KINDS, PluginLoadError, PluginRegistry

    try:
        registry = PluginRegistry.load()
    except PluginLoadError as e:
        print(e, file=sys.stderr)
        return 2
    if args.json:
        report = {
            "plugins": [asdict(info) for info in registry.plugins.values()],
            "architectures": _architectures(registry),
            "failed": [asdict(failure) for failure in registry.failed.values()],
            "skipped": registry.skipped,
        }
        print(json.dumps(report, indent=2))
    else:
        for info in registry.plugins.values():
            print(f"{info.name}  ({info.distribution} {info.version})")
            for kind in KINDS:
                if info.registered.get(kind):
                    print(f"  {kind}: {', '.join(sorted(info.registered[kind]))}")
        architectures = _architectures(registry)
        if architectures:
            print("architectures (config.json `architectures`):")
            width = max(len(row["name"]) for row in architectures)
            for row in architectures:
                print(f"  {row['name']:<{width}}  {row['class']}  ({row['plugin']}, {row['distribution']})")
        for failure in registry.failed.values():
            print(f"{failure.name}  ({failure.distribution} {failure.version})  FAILED TO LOAD: {failure.error}")
        if registry.skipped:
            print(f"skipped by plugins.allow/deny or RXF_PLUGINS: {', '.join(registry.skipped)}")
    if not registry.plugins:
        print("no plugins loaded (is rxf installed? `pip install -e .`)", file=sys.stderr)
        return 1
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}


def cmd_generate(args: argparse.Namespace, chat: bool) -> int:
    gc.disable()  # during start-up, as in cmd_launch
    try:
        from rxf import Runtime

        runtime = Runtime.from_config(args.config, **_overrides(args.set))
    finally:
        gc.freeze()
        gc.enable()
    with runtime as rt:
        start = time.perf_counter()
        if chat:
            chunks = rt.chat([{"role": "user", "content": args.prompt}], _sampling(args), stream=True)
        else:
            chunks = rt.generate(args.prompt, _sampling(args), stream=True)
        n = 0
        for chunk in chunks:
            print(chunk["text"], end="", flush=True)
            n = chunk["meta_info"]["completion_tokens"]
        elapsed = time.perf_counter() - start
        print(f"\n[{n} tokens in {elapsed:.2f} s]", file=sys.stderr)
    return 0


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload and scheduling flags shared by `bench serve` and `bench offline` (rxf.bench)."""
    p.add_argument("--dataset", choices=["random", "shared-prefix", "sharegpt-file"], default="random")
    p.add_argument("--dataset-path", default=None, help="sharegpt-file: a local ShareGPT JSON file")
    p.add_argument("--num-prompts", type=int, default=64, help="random / sharegpt-file")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="random / shared-prefix: new tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1±r)")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed new tokens (default: the gpt turn)")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct system prompts")
    p.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: questions per system prompt")
    p.add_argument("--system-prompt-len", type=int, default=512, help="shared-prefix: shared prefix tokens")
    p.add_argument("--question-len", type=int, default=64, help="shared-prefix: per-prompt tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths then vary)")
    p.add_argument("--output", default=None, help="write the summary and per-request figures as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="serving benchmarks").add_subparsers(dest="bench_command", required=True)
    serve = bench.add_parser("serve", help="benchmark a running server (rxf or any OpenAI-compatible one)")
    serve.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    serve.add_argument("--backend", choices=["openai", "openai-chat", "rxf"], default="openai")
    serve.add_argument("--model", default=None, help="the request's model field (and tokenizer, without --tokenizer)")
    serve.add_argument(
        "--tokenizer", default=None,
        help="tokenizer directory or hub id for building prompts (default: the one the server names)",
    )
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    _add_workload_args(serve)
    offline = bench.add_parser("offline", help="the same workloads through Runtime, without HTTP")
    offline.add_argument("--config", required=True, help="TOML config file")
    offline.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    _add_workload_args(offline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rxf", description="rxf: an LLM serving engine")
    parser.add_argument("--log-level", default=None, help="default: warning; for launch, runtime.log_level")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="serve a model over HTTP (OpenAI-compatible and native routes)")
    launch.add_argument("config", help="TOML config file")
    launch.add_argument("--host", default=None, help="server.host (default 127.0.0.1)")
    launch.add_argument("--port", type=int, default=None, help="server.port (default 30000; 0 picks a free one)")
    launch.add_argument("--api-key", default=None, help="server.api_key (also RXF_API_KEY)")
    launch.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    plugins = sub.add_parser("plugins", help="list installed plugins: distribution, version, what they register")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    for name, help_text in (("generate", "complete a prompt"), ("chat", "answer one chat message")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="TOML config file")
        p.add_argument("prompt")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    _add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "launch":
        return cmd_launch(args)
    setup_logging(args.log_level or "warning")
    if args.command == "plugins":
        return cmd_plugins(args)
    if args.command == "bench":
        if args.bench_command == "serve":
            from rxf.bench.serve import cmd_serve

            return cmd_serve(args)
        from rxf.bench.offline import cmd_offline

        return cmd_offline(args, _overrides(args.set))
    return cmd_generate(args, chat=args.command == "chat")


if __name__ == "__main__":
    sys.exit(main())
