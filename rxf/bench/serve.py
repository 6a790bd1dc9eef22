"""`rxf bench serve`: drive a streaming server with a workload and report its figures.

Requests arrive as a Poisson process at `request_rate` (exponential gaps drawn from `seed`), or
all at once when the rate is infinite; at most `max_concurrency` are in flight (later arrivals wait
for a slot, as a client pool would). The run's duration is from the first send to the last reply.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from rxf.bench.client import RequestResult, send
from rxf.bench.datasets import BenchRequest
from rxf.bench.metrics import format_table, summarize


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of `n` requests: a Poisson process of rate `request_rate`,
    the first at 0; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError("request_rate must be positive (or inf)")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def run_requests(
    requests: list[BenchRequest],
    send_one: Callable[[BenchRequest], Awaitable[RequestResult]],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Results in request order, and the wall time of the whole run."""
    offsets = arrival_offsets(len(requests), request_rate, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req")
    start = time.perf_counter()

    async def one(offset: float, req: BenchRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if slots is None:
            result = await send_one(req)
        else:
            async with slots:
                result = await send_one(req)
        bar.update(1)
        return result

    try:
        results = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests, strict=True)))
    finally:
        bar.close()
    return list(results), time.perf_counter() - start


async def _server_counters(client: httpx.AsyncClient) -> tuple[int, int] | None:
    """rxf's cumulative (prompt_tokens, cached_tokens) from /get_server_info; None elsewhere."""
    try:
        response = await client.get("/get_server_info", timeout=10)
        stats = response.json()["stats"]
        return int(stats["prompt_tokens"]), int(stats["cached_tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def served_model(client: httpx.AsyncClient) -> str | None:
    """The first model id of /v1/models: OpenAI routes require one, and a server serving a
    single model names it there. None when the server does not say."""
    try:
        response = await client.get("/v1/models", timeout=10)
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def base_root(url: str) -> str:
    """The server root: a trailing `/v1` (an OpenAI client's base_url) is dropped."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def bench_serve(
    base_url: str,
    requests: list[BenchRequest],
    *,
    backend: str = "openai",
    model: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    count_tokens: Callable[[str], int] | None = None,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> tuple[dict[str, Any], list[RequestResult]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_root(base_url), headers=headers, timeout=httpx.Timeout(timeout_s, connect=10), limits=limits
    ) as client:
        if model is None and backend != "rxf":
            model = await served_model(client)
        before = await _server_counters(client)

        def send_one(req: BenchRequest) -> Awaitable[RequestResult]:
            return send(client, backend, model, req, ignore_eos=ignore_eos, extra=extra_body, count_tokens=count_tokens)

        results, duration = await run_requests(requests, send_one, request_rate, max_concurrency, seed, progress)
        after = await _server_counters(client)
    summary = summarize(results, duration)
    if before is not None and after is not None and after[0] > before[0]:
        # The window's own rate: cached / prompt tokens that arrived during this run.
        summary["server_cache_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
    return summary, results


def write_results(path: str | Path, config: dict[str, Any], summary: dict[str, Any], results: list[RequestResult]) -> None:
    per_request = {
        "ok": [r.ok for r in results],
        "prompt_len": [r.prompt_len for r in results],
        "output_len": [r.output_len for r in results],
        "ttft_s": [r.ttft for r in results],
        "e2e_s": [r.e2e for r in results],
        "itl_s": [r.itl for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "error": [r.error for r in results],
    }
    # JSON has no infinity: an unbounded request rate is written as the string "inf".
    config = {k: str(v) if isinstance(v, float) and math.isinf(v) else v for k, v in config.items()}
    Path(path).write_text(json.dumps({"config": config, "summary": summary, "requests": per_request}, indent=1))


def print_summary(summary: dict[str, Any], title: str) -> None:
    print(format_table(summary, title), flush=True)


def server_tokenizer(base_url: str, api_key: str | None = None) -> str | None:
    """The tokenizer a server names in `/get_model_info`: its tokenizer path where it shows one (rxf
    does to a caller with the API key, or with `server.expose_internals`), else its served model
    name (rxf's default is the model's path or hub id; "demo" is the demo model). None when the
    server does not say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = httpx.get(f"{base_root(base_url)}/get_model_info", headers=headers, timeout=10).json()
        name = info.get("tokenizer_path") or info.get("served_model_name")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def _load_tokenizer(args: Any) -> Any:
    """The tokenizer of --tokenizer, else --model, else the one the server names."""
    from rxf.bench.datasets import load_tokenizer
    from rxf.entrypoints.demo_model import resolve_model_path

    name, source = args.tokenizer or args.model, "given"
    if name is None:
        name, source = server_tokenizer(args.base_url, args.api_key), "the server's"
        if name is None:
            raise SystemExit(
                f"{args.base_url} does not name its tokenizer (no /get_model_info): pass --tokenizer PATH or hub id"
            )
    try:
        return load_tokenizer(resolve_model_path(name))
    except (OSError, ValueError) as exc:  # a path of another machine, a name that is no hub id
        raise SystemExit(
            f"{source} tokenizer {name!r} cannot be loaded here ({type(exc).__name__}: {exc}); "
            "pass --tokenizer PATH or hub id"
        ) from None


def cmd_serve(args: Any) -> int:
    """`rxf bench serve`: see the CLI's help."""
    from rxf.bench.datasets import workload_from_args

    tokenizer = _load_tokenizer(args)
    requests = workload_from_args(args, tokenizer)
    extra = json.loads(args.extra_body) if args.extra_body else None
    summary, results = asyncio.run(
        bench_serve(
            args.base_url, requests, backend=args.backend, model=args.model, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, seed=args.seed, ignore_eos=not args.no_ignore_eos,
            extra_body=extra, api_key=args.api_key,
            count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
            progress=not args.no_progress,
        )
    )
    print_summary(summary, f"rxf bench serve: {args.backend} {args.dataset}")
    if args.output:
        write_results(args.output, {k: v for k, v in vars(args).items() if k != "api_key" and not callable(v)}, summary, results)
    return 0 if summary["completed"] else 1
