"""What hostile constraints cost xgrammar, and what rxf's bounded forced text costs (demo tokenizer).

    python benchmarks/bench_grammar_limits.py [--timeout 20] [--memory-gb 4]

compile   each constraint compiled by xgrammar in a fresh subprocess under an address-space limit
          and a wall timeout: seconds and peak RSS, or how it ended. These are the figures behind
          `grammar.compile_timeout_s` / `compile_memory_mb` and the front door's worker processes.
forced    per-byte cost of rxf's forced-text search (`rxf.plugins.grammar.forced`) against
          xgrammar's own unbounded `find_jump_forward_string`, on a schema whose forced text is a
          35-byte key (both give the same text).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from rxf.entrypoints.demo_model import resolve_model_path

CASES = {
    "recursive $ref": ("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}},
                                                  "required": ["a"]})),
    "minItems 1e8": ("json_schema", json.dumps({"type": "array", "items": {"const": 1}, "minItems": 10**8})),
    "regex a{100000000}": ("regex", "a{100000000}"),
    "regex ^[^\\n\\r]{1,129}$": ("regex", "^[^\\n\\r]{1,129}$"),
    "ebnf root ::= \"a\" root": ("ebnf", 'root ::= "a" root'),
    "arrays nested 200 deep": ("json_schema", '{"type":"array","items":' * 200 + "{}" + "}" * 200),
    "arrays nested 3000 deep": ("json_schema", '{"type":"array","items":' * 3000 + "{}" + "}" * 3000),
    "regex 100 kB literal": ("regex", "x" * 100_000),
    "regex 1 MB literal": ("regex", "x" * 1_000_000),
    "enum of 400,000 values": ("json_schema", json.dumps({"enum": [f"v{i:07d}" for i in range(400_000)]})),
    "enum of two 1 MB strings": ("json_schema", json.dumps({"enum": ["x" * 10**6, "x" * 10**6 + "y"]})),
    "object of 20,000 properties": ("json_schema", json.dumps(
        {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20_000)}})),
}

_CHILD = """
import resource, sys, time, xgrammar as xgr
from transformers import AutoTokenizer
limit = int(sys.argv[2]) << 30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(sys.argv[1]), vocab_size=49152)
compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
kind, text = sys.stdin.read().split("\\0", 1)
start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
{"regex": compiler.compile_regex, "ebnf": compiler.compile_grammar,
 "json_schema": lambda s: compiler.compile_json_schema(s, any_whitespace=False)}[kind](text)
print(time.perf_counter() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss) // 1024)
"""


def bench_compile(model: str, timeout: float, memory_gb: int) -> None:
    for name, (kind, text) in CASES.items():
        try:
            p = subprocess.run([sys.executable, "-c", _CHILD, model, str(memory_gb)], input=f"{kind}\0{text}",
                               capture_output=True, text=True, timeout=timeout)
            if p.returncode == 0:
                seconds, mb = p.stdout.split()
                result = f"{float(seconds):8.3f} s, +{mb} MB peak RSS"
            else:
                result = "failed: " + (p.stderr.strip().splitlines() or ["?"])[-1][-100:]
        except subprocess.TimeoutExpired:
            result = f"> {timeout:g} s (killed)"
        print(f"compile {name:30s} ({len(text):>9,} chars): {result}", flush=True)


def bench_forced(model: str) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from rxf.plugins.grammar.forced import FirstByteTable, forced_string

    schema = {"type": "object", "properties": {"customer_identification_number": {"type": "integer"}},
              "required": ["customer_identification_number"]}
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model), vocab_size=49152)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema),
                                                                              any_whitespace=False))
    table, scratch = FirstByteTable(info, 49152), xgr.allocate_token_bitmask(1, 49152)
    n = 200
    for name, fn in (("xgrammar find_jump_forward_string", matcher.find_jump_forward_string),
                     ("rxf forced_string", lambda: forced_string(matcher, table, scratch, [2], 4096, 1.0))):
        t = time.perf_counter()
        for _ in range(n):
            text = fn()
        per_call = (time.perf_counter() - t) / n
        print(f"forced {name:34s}: {per_call * 1e3:.3f} ms per call, {len(text)} bytes "
              f"({per_call / len(text) * 1e6:.2f} us/byte) {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per compile")
    ap.add_argument("--memory-gb", type=int, default=4, help="address-space limit of each compile")
    args = ap.parse_args()
    model = resolve_model_path("demo")
    bench_forced(model)
    bench_compile(model, args.timeout, args.memory_gb)


if __name__ == "__main__":
    main()
