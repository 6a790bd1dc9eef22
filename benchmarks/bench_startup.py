"""`rxf launch CONFIG` start-up: seconds until /health answers 200, then until a first chat answer,
for one or more checkouts in turn (issue 22's `make demo` bound: healthy within 10 s).

    python benchmarks/bench_startup.py [--rounds 2] [--config examples/demo.toml] CHECKOUT [CHECKOUT ...]

Each checkout runs with PYTHONPATH set to it and its own copy of CONFIG (relative to the checkout),
the model already cached; the servers start one at a time and are stopped before the next.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

QUESTION = {"model": "demo", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 32}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(checkout: str, config: str) -> tuple[float, float, str]:
    port, env = free_port(), dict(os.environ, PYTHONPATH=checkout)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rxf.entrypoints.cli", "launch", os.path.join(checkout, config),
                             "--port", str(port)], env=env, cwd=checkout, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{checkout}: the server exited with {proc.returncode}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        healthy = time.perf_counter() - start
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(QUESTION).encode(),
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=300).read())
        return healthy, time.perf_counter() - start, reply["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkouts", nargs="+")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", default="examples/demo.toml")
    args = p.parse_args()
    for _ in range(args.rounds):
        for checkout in args.checkouts:
            healthy, answered, text = start_once(os.path.abspath(checkout), args.config)
            print(f"{checkout}: healthy {healthy:.1f} s, first answer {answered:.1f} s ({text[:40]!r}; "
                  f"load average {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
