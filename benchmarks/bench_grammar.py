"""Structured-output benchmark on the CPU (demo model): constraint overhead, compile time, jump-forward.

    RXF_CACHE_DIR=/tmp/rxfcache python benchmarks/bench_grammar.py [--config examples/demo.toml] \
        [--threads 2] [--rounds 3] [--output grammar.json]

One in-process `Scheduler` over one `ModelRunner` (no HTTP, no detokenizer), so every figure is the
engine's own work and both sides of each ratio run in the same process, alternating per round:

  overhead   ms per DECODE step, batch 1 and batch 8, with a JSON-schema constraint vs without it;
             the overhead is the median over rounds of each round's ratio (the two runs of a round
             are back to back).
             Both sides decode exactly the same number of steps: the schema (a list of records) is
             longer than `--tokens`, so the constrained requests end by length like the free ones
             (ignore_eos). Jump-forward is off here, so each step adds one token per request.
             Also reported: the host time spent filling the bitmasks, per step (load-insensitive).
  compile    xgrammar compile of the overhead schema and of a 40-property schema: cold (a fresh
             backend, i.e. an empty cache) and cached (the LRU hit), plus the one-time tokenizer
             preprocessing of a backend.
  jump       wall time per request batch for a schema with long fixed keys, jump-forward on vs off
             (same scheduler; the flag flipped between runs), batch 1 and batch 4, with the
             forward-step counts. Every output is checked against the schema.

Extend (prefill) steps are excluded from the overhead figure and included in the jump figure (a
jump is paid for with an EXTEND of the forced tokens). The radix cache is flushed before every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rxf.core.config import load_config
from rxf.core.grammar import make_grammar_backend
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.entrypoints.demo_model import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Generate sample user records as JSON."
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "users": {
            "type": "array",
            "minItems": 50,
            "maxItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "maxLength": 40},
                    "active": {"type": "boolean"},
                },
                "required": ["name", "age", "email", "active"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["users"],
}
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
        "customer_full_legal_name_as_registered": {"enum": ["Alice", "Bob"]},
        "primary_shipping_address_street_line": {"enum": ["Main St", "Elm St"]},
        "preferred_contact_method_for_notifications": {"enum": ["email", "phone"]},
        "has_accepted_the_terms_and_conditions": {"type": "boolean"},
    },
    "required": [
        "customer_identification_number", "customer_full_legal_name_as_registered",
        "primary_shipping_address_street_line", "preferred_contact_method_for_notifications",
        "has_accepted_the_terms_and_conditions",
    ],
    "additionalProperties": False,
}
WIDE_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": ["integer", "string", "boolean"]} for i in range(40)},
    "required": [f"field_{i}" for i in range(40)],
}


def make_scheduler(config_path: str, threads: int) -> Scheduler:
    torch.set_num_threads(threads)
    config = load_config(config_path, **{"grammar.jump_forward": False})
    model_path = resolve_model_path(config.model.path)
    runner = ModelRunner(config, PluginRegistry.load(), model_path)
    return Scheduler(config, runner, AutoTokenizer.from_pretrained(model_path))


def run(sched: Scheduler, n: int, params: dict[str, Any]) -> dict[str, Any]:
    """n identical requests in one batch; returns outputs and the timing of each step kind."""
    ok, msg = sched.flush_cache()
    assert ok, msg
    ids = sched.stop.tokenizer.encode(PROMPT)
    for i in range(n):
        sched.add_request(PreparedRequest(f"r{i}", ids, SamplingParams.from_dict(params)))
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
    decode_s, decode_steps, steps, start = 0.0, 0, 0, time.perf_counter()
    while sched.has_work:
        before = sched.counters.decode_steps
        t0 = time.perf_counter()
        for out in sched.step():
            outs[out.rid] += out.new_token_ids
        dt = time.perf_counter() - t0
        steps += 1
        if sched.counters.decode_steps > before:
            decode_s += dt
            decode_steps += 1
    return {"wall_s": time.perf_counter() - start, "decode_ms_per_step": 1e3 * decode_s / max(decode_steps, 1),
            "decode_steps": decode_steps, "steps": steps, "outputs": list(outs.values())}


def bench_overhead(sched: Scheduler, tokens: int, rounds: int) -> list[dict[str, Any]]:
    free = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    constrained = {**free, "json_schema": json.dumps(RECORDS_SCHEMA)}
    rows = []
    mask_s = [0.0]
    mask = sched.grammar.mask

    def timed_mask(reqs, device):  # the host-side cost of constraining: fill every row's bitmask
        t0 = time.perf_counter()
        out = mask(reqs, device)
        mask_s[0] += time.perf_counter() - t0
        return out

    sched.grammar.mask = timed_mask
    for bs in (1, 8):
        run(sched, bs, constrained)  # warm-up (and the compile, done once and cached)
        mask_s[0], steps = 0.0, 0
        times: dict[str, list[float]] = {"free": [], "json": []}
        for _ in range(rounds):
            for name, params in (("free", free), ("json", constrained)):
                r = run(sched, bs, params)
                assert all(len(o) == tokens for o in r["outputs"]), "both sides must decode the same steps"
                times[name].append(r["decode_ms_per_step"])
                steps += r["steps"] if name == "json" else 0
        free_ms, json_ms = statistics.median(times["free"]), statistics.median(times["json"])
        # Each round's two runs are back to back, so their ratio sees the same machine load.
        paired = statistics.median(j / f - 1 for f, j in zip(times["free"], times["json"], strict=True))
        rows.append({"batch": bs, "tokens": tokens, "free_ms_per_step": free_ms, "json_ms_per_step": json_ms,
                     "overhead": paired, "mask_ms_per_step": 1e3 * mask_s[0] / steps, "raw": times})
        print(f"overhead bs={bs}: free {free_ms:.1f} ms/step, json {json_ms:.1f} ms/step (medians); median "
              f"per-round ratio {100 * paired:+.1f}%; bitmask fill {rows[-1]['mask_ms_per_step']:.2f} ms/step",
              flush=True)
    sched.grammar.mask = mask
    return rows


def bench_compile(sched: Scheduler, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for name, schema in (("records", RECORDS_SCHEMA), ("long_keys", LONG_KEYS_SCHEMA), ("wide_40", WIDE_SCHEMA)):
        text = json.dumps(schema)
        cold, cached, setup = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            backend = make_grammar_backend(sched.config, sched.stop.tokenizer, sched.runner.vocab_size)
            t1 = time.perf_counter()
            backend.compile("json_schema", text)
            t2 = time.perf_counter()
            backend.compile("json_schema", text)
            t3 = time.perf_counter()
            setup.append(t1 - t0)
            cold.append(t2 - t1)
            cached.append(t3 - t2)
        rows.append({"schema": name, "backend_setup_ms": 1e3 * statistics.median(setup),
                     "cold_ms": 1e3 * statistics.median(cold), "cached_ms": 1e3 * statistics.median(cached)})
        print(f"compile {name}: cold {rows[-1]['cold_ms']:.2f} ms, cached {rows[-1]['cached_ms']:.4f} ms "
              f"(backend setup {rows[-1]['backend_setup_ms']:.0f} ms)", flush=True)
    return rows


def bench_jump(sched: Scheduler, rounds: int) -> list[dict[str, Any]]:
    import jsonschema

    params = {"max_new_tokens": 256, "temperature": 0.0, "json_schema": json.dumps(LONG_KEYS_SCHEMA)}
    rows = []
    for bs in (1, 4):
        stats: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for jump in (True, False):
            sched.grammar.jump_forward = jump
            run(sched, bs, params)  # warm-up
        for _ in range(rounds):
            for jump in (True, False):
                sched.grammar.jump_forward = jump
                r = run(sched, bs, params)
                for ids in r["outputs"]:
                    jsonschema.validate(json.loads(sched.stop.tokenizer.decode(ids, skip_special_tokens=True)),
                                        LONG_KEYS_SCHEMA)
                r["tokens"] = sum(len(o) for o in r.pop("outputs"))
                stats[jump].append(r)
        sched.grammar.jump_forward = False
        on = statistics.median(r["wall_s"] for r in stats[True])
        off = statistics.median(r["wall_s"] for r in stats[False])
        rows.append({"batch": bs, "on_s": on, "off_s": off, "speedup": off / on,
                     "on_steps": stats[True][0]["steps"], "off_steps": stats[False][0]["steps"],
                     "on_tokens": stats[True][0]["tokens"], "off_tokens": stats[False][0]["tokens"]})
        print(f"jump-forward bs={bs}: on {on:.2f} s ({rows[-1]['on_steps']} steps), off {off:.2f} s "
              f"({rows[-1]['off_steps']} steps) -> {off / on:.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "demo.toml"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 threads on a loaded 2-core box spin)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48, help="decode steps per overhead run")
    ap.add_argument("--output", default=None, help="write the full results as JSON")
    args = ap.parse_args()
    sched = make_scheduler(args.config, args.threads)
    load_before = os.getloadavg()
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "threads": args.threads,
        "compile": bench_compile(sched, args.rounds),
        "overhead": bench_overhead(sched, args.tokens, args.rounds),
        "jump_forward": bench_jump(sched, args.rounds),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
