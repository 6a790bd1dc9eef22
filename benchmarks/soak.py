"""Soak a running rxf server: concurrent streaming completions, some clients hanging up part-way;
prints requests, concurrency, errors, p50/p99 latency and slots leaked (which must be 0).

    rxf launch examples/demo.toml &                      # loopback (127.0.0.1) by default
    python benchmarks/soak.py --url http://127.0.0.1:30000 --requests 200 --concurrency 200 \\
        --disconnect-fraction 0.3 --max-tokens 8

Exits 1 when any request errs or hangs or any slot is leaked. Flushes the server's prefix cache
at the end (to count leaked slots), so run it against a test server, not a production one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from urllib.parse import urlparse

from rxf.testing.soak import run_soak

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--disconnect-fraction", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if urlparse(args.url).hostname not in _LOOPBACK:
        parser.error("the soak runs against a loopback server only")
    result = asyncio.run(
        run_soak(
            args.url, requests=args.requests, concurrency=args.concurrency,
            disconnect_fraction=args.disconnect_fraction, max_tokens=args.max_tokens,
            api_key=args.api_key, request_timeout_s=args.timeout, seed=args.seed,
        )
    )
    summary = result.summary()
    print(json.dumps(summary, indent=2))
    ok = not (result.errors or result.hung or result.slots_leaked or result.leaked_before_flush or result.running_after)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
