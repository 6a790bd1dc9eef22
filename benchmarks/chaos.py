"""Chaos against a running rxf server for a given time: normal clients, hostile bodies, slow-header
and slow-body clients, clients hanging up mid-stream (see `rxf.testing.chaos`); prints requests
served, errors by kind, /health latency percentiles, the RSS of each server process over the run
and the KV slots still held after the drain (which must be 0 besides the radix tree).

    rxf launch examples/demo.toml &                                  # loopback by default
    python benchmarks/chaos.py --url http://127.0.0.1:30000 --pid $! --duration 600 \\
        [--hostile-cases more.json] [--normal 4 --hostile 2 --slow-header 20 --slow-body 10]

`--hostile-cases` adds cases from a JSON list of {"name", "path", "body" or "raw", "expect": [...]}.
Slow clients are cut at `server.header_timeout_s` / `body_timeout_s` (60 s by default); a run
shorter than that counts them as outlasting it. Exits 1 on any error, failed /health or leaked slot.
Flushes the prefix cache at the end, so run it against a test server, not a production one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from urllib.parse import urlparse

from rxf.testing.chaos import default_hostile_cases, load_hostile_cases, run_chaos

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--pid", type=int, default=None, help="the server's main process (for RSS sampling)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--normal", type=int, default=4)
    parser.add_argument("--hostile", type=int, default=2)
    parser.add_argument("--slow-header", type=int, default=20)
    parser.add_argument("--slow-body", type=int, default=10)
    parser.add_argument("--disconnecting", type=int, default=4)
    parser.add_argument("--hostile-cases", default=None, help="a JSON file of more hostile cases")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a request counts as an error")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-series", action="store_true", help="print every RSS sample, not just start/max/end")
    args = parser.parse_args()
    if urlparse(args.url).hostname not in _LOOPBACK:
        parser.error("the chaos runs against a loopback server only")
    cases = None
    if args.hostile_cases:
        import httpx

        model = httpx.get(f"{args.url}/v1/models", headers=_auth(args.api_key)).json()["data"][0]["id"]
        cases = default_hostile_cases(model) + load_hostile_cases(args.hostile_cases)
    result = asyncio.run(
        run_chaos(
            args.url, duration_s=args.duration, server_pid=args.pid, normal=args.normal, hostile=args.hostile,
            slow_header=args.slow_header, slow_body=args.slow_body, disconnecting=args.disconnecting,
            hostile_cases=cases, api_key=args.api_key, request_timeout_s=args.timeout, seed=args.seed,
        )
    )
    summary = result.summary()
    if args.rss_series:
        summary["rss_series_mib"] = result.rss_mib
    print(json.dumps(summary, indent=2))
    return 0 if result.ok else 1


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


if __name__ == "__main__":
    sys.exit(main())
