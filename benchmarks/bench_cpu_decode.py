"""CPU decode benchmark: rxf's `Runtime` against Hugging Face `generate` on the same checkpoint.

    RXF_CACHE_DIR=/tmp/rxfcache python benchmarks/bench_cpu_decode.py \
        [--config examples/demo.toml] [--output results.json] [--rounds 3] [--cold]
        [--quantization none int8 int4 gguf]

What is timed (greedy, N new tokens forced, the same prompt token ids for both engines):
  load     `Runtime.from_config(config)` until it returns (the model already prepared).
  cold     (only with --cold, once) the same in a subprocess whose RXF_CACHE_DIR is a fresh empty
           directory: fetching and converting the demo model, then starting the engine.
  rxf      1 request (`rt.generate`), the same request streamed (TTFT = first chunk; decode rate =
           tokens after the first / time after the first), B requests in one batch call.
  hf       `AutoModelForCausalLM.generate` (--hf-dtype, default float32; CPU, do_sample=False,
           min_new_tokens=N) on the same checkpoint directory: batch 1 (TTFT from a streamer) and
           batch B (left padding). rxf runs in the config's `model.dtype` (the demo's: bfloat16), so
           the ratios compare the two dtypes unless --hf-dtype names rxf's; the report states both.

With --quantization, rxf alone: 1 request (plain and streamed) for each `model.quantization` in
turn (a fresh engine each, every round in the same order), with decode rates as ratios to the first.

Each round runs every rxf measurement, then every HF measurement, so the two engines never compute
at once and a change in the machine's load between rounds hits both alike. The report gives, per
measurement, the median over rounds and the min/max. rxf's radix cache is flushed before each timed
call, so no call reuses an earlier call's prompt KV. HF uses the torch thread count that rxf's
scheduler reports.

The machine may be shared. Before each timed call the script waits (up to --max-wait s) until other
processes use less than --quiet-cores of CPU; during the call it measures the CPU time the rest of
the machine used (all busy time in /proc/stat minus this process tree's own) and repeats a call
during which others used more than --max-other-cores (at most --retries times). The figures for
every call, kept or discarded, are in the JSON output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Chat-style user turns; with the demo model's chat template (system turn included) each prompt is
# 30-60 tokens.
USER_TURNS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while working from home.",
    "Explain in simple terms why the sky looks blue during the day.",
    "Write a short poem about a cat sleeping in the sun.",
    "How do I boil an egg so that the yolk stays soft?",
    "What are the main differences between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Can you suggest a healthy breakfast that takes less than ten minutes to prepare?",
    "Why do leaves change colour in autumn, and which chemicals are involved?",
    "I have a job interview tomorrow for a junior developer position. What should I prepare?",
    "Translate the sentence 'Where is the train station?' into Spanish and explain the grammar.",
    "What is the difference between weather and climate? Please give an example of each.",
    "Describe how a bicycle gear system works to someone who has never ridden a bike.",
    "List some good habits for keeping a houseplant alive, especially for beginners who travel a lot.",
    "My sourdough bread comes out flat and dense every time. What could I be doing wrong?",
    "Plan a relaxing one-day itinerary for a visitor in Kyoto who likes gardens and tea.",
]

_TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- machine and load
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_model": "unknown", "logical_cpus": os.cpu_count(), "platform": platform.platform()}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu_model"] = line.split(":", 1)[1].strip()
            break
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
    return info


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return done.stdout.strip()

    changed = git("status", "--porcelain").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(changed), "changed": changed[:50]}


def _own_tree_ticks() -> int:
    """CPU time of this process tree in clock ticks: utime + stime + cutime + cstime of each live
    process (cutime/cstime hold the descendants it has already reaped, e.g. a stopped engine's)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
        stats[int(entry.name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return sum(stats[pid][1] for pid in tree if pid in stats)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, steal) ticks of the whole machine from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return user + nice + system + irq + softirq, steal


class CpuWindow:
    """CPU used by other processes (and stolen by the hypervisor) between `__init__` and `close()`,
    in cores (1.0 = one core busy the whole time)."""

    def __init__(self) -> None:
        self.t0, self.own0, (self.busy0, self.steal0) = time.perf_counter(), _own_tree_ticks(), _cpu_ticks()

    def close(self) -> dict[str, float]:
        busy, steal = _cpu_ticks()
        own = _own_tree_ticks()
        wall = max(time.perf_counter() - self.t0, 1e-9)
        others = max((busy - self.busy0) - (own - self.own0), 0)
        return {
            "others_cores": round(others / _TICK / wall, 3),
            "steal_cores": round((steal - self.steal0) / _TICK / wall, 3),
            "load_1min": round(os.getloadavg()[0], 2),
        }


def wait_for_quiet(args: argparse.Namespace) -> float:
    """Wait until other processes use less than --quiet-cores (2 s windows); returns the wait."""
    start = time.perf_counter()
    while True:
        window = CpuWindow()
        time.sleep(2.0)
        if window.close()["others_cores"] < args.quiet_cores or time.perf_counter() - start > args.max_wait:
            return time.perf_counter() - start


def timed(args: argparse.Namespace, what: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `call` (which returns its own timings) on a quiet machine; repeat it when others took
    more than --max-other-cores during it. Returns the kept record, with the discarded ones."""
    discarded = []
    for attempt in range(args.retries + 1):
        waited = wait_for_quiet(args)
        window = CpuWindow()
        record = call()
        record["cpu"] = window.close() | {"waited_s": round(waited, 1)}
        if record["cpu"]["others_cores"] <= args.max_other_cores or attempt == args.retries:
            break
        print(f"  {what}: others used {record['cpu']['others_cores']} cores; repeating", flush=True)
        discarded.append({k: v for k, v in record.items() if k != "output_ids"})
    record["discarded"] = discarded
    print(f"  {what}: {_brief(record)}", flush=True)
    return record


def _brief(record: dict[str, Any]) -> str:
    keys = ("wall_s", "output_tok_s", "ttft_s", "decode_tok_s", "load_s")
    parts = [f"{k} {record[k]:.3f}" for k in keys if k in record]
    return ", ".join(parts) + f" (others {record['cpu']['others_cores']} cores)"


# ---------------------------------------------------------------- prompts
def chat_prompt_ids(tokenizer: Any) -> list[list[int]]:
    """The token ids of every user turn rendered with the model's chat template."""
    out = []
    for turn in USER_TURNS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"runtime.cpu_threads": args.threads} if args.threads else {}


# ---------------------------------------------------------------- load times
def cold_child(args: argparse.Namespace) -> None:
    """In a subprocess whose RXF_CACHE_DIR is empty: one timed first-use start, as JSON on stdout."""
    from rxf import Runtime

    start = time.perf_counter()
    rt = Runtime.from_config(args.config, **overrides(args))
    elapsed = time.perf_counter() - start
    load_time = rt.engine.info.get("load_time_s")
    rt.shutdown()
    print(json.dumps({"load_s": elapsed, "engine_load_time_s": load_time}))


def measure_cold(args: argparse.Namespace) -> dict[str, Any]:
    def call() -> dict[str, Any]:
        tmp = tempfile.mkdtemp(prefix="rxf-bench-cold-")
        try:
            cmd = [sys.executable, __file__, "--config", args.config, "--_cold-child"]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            done = subprocess.run(cmd, env=dict(os.environ, RXF_CACHE_DIR=tmp), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"cold start failed:\n{done.stderr[-4000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return timed(args, "cold start", call)


def measure_warm_load(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rxf import Runtime

    def call() -> dict[str, Any]:
        start = time.perf_counter()
        rt = Runtime.from_config(args.config, **overrides(args))
        elapsed = time.perf_counter() - start
        load_time = rt.engine.info["load_time_s"]
        rt.shutdown()
        return {"load_s": elapsed, "engine_load_time_s": load_time}

    return [timed(args, f"warm load {i + 1}", call) for i in range(args.load_repeats)]


# ---------------------------------------------------------------- the two engines
class RxfBench:
    def __init__(self, args: argparse.Namespace, single: list[int], batch: list[list[int]],
                 extra: dict[str, Any] | None = None) -> None:
        from rxf import Runtime

        self.rt = Runtime.from_config(args.config, **overrides(args), **(extra or {}))
        self.single, self.batch = single, batch
        self.params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        self.threads = self.rt.engine.info["torch_threads"]
        print(f"[rxf] scheduler torch threads: {self.threads}", flush=True)
        self.rt.generate(input_ids=single, sampling_params={**self.params, "max_new_tokens": 8})  # warm-up
        self.rt.generate(input_ids=batch, sampling_params={**self.params, "max_new_tokens": 8})

    def one(self) -> dict[str, Any]:
        self.rt.flush_cache()
        start = time.perf_counter()
        out = self.rt.generate(input_ids=self.single, sampling_params=self.params)
        wall = time.perf_counter() - start
        n = out["meta_info"]["completion_tokens"]
        return {"wall_s": wall, "tokens": n, "output_tok_s": n / wall, "output_ids": out["output_ids"]}

    def one_streamed(self) -> dict[str, Any]:
        self.rt.flush_cache()
        start = time.perf_counter()
        first = first_count = None
        count = chunks = 0
        for chunk in self.rt.generate(input_ids=self.single, sampling_params=self.params, stream=True):
            if chunk["output_ids"] and first is None:
                first, first_count = time.perf_counter(), len(chunk["output_ids"])
            count += len(chunk["output_ids"])
            chunks += 1
        end = time.perf_counter()
        return {
            "wall_s": end - start,
            "tokens": count,
            "chunks": chunks,
            "ttft_s": first - start,
            "decode_tok_s": (count - first_count) / (end - first),
        }

    def batched(self) -> dict[str, Any]:
        self.rt.flush_cache()
        start = time.perf_counter()
        outs = self.rt.generate(input_ids=self.batch, sampling_params=self.params)
        wall = time.perf_counter() - start
        n = sum(o["meta_info"]["completion_tokens"] for o in outs)
        return {
            "wall_s": wall,
            "tokens": n,
            "output_tok_s": n / wall,
            "cached_prompt_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "output_ids": [o["output_ids"] for o in outs],
        }

    def close(self) -> None:
        self.rt.shutdown()


class HfBench:
    def __init__(
        self, args: argparse.Namespace, model_path: str, single: list[int], batch: list[list[int]], threads: int
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        print(f"[hf] torch threads: {self.threads}", flush=True)
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.hf_dtype)).eval()
        self.load_s = time.perf_counter() - start
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        self.single, self.batch, self.n = single, batch, args.new_tokens
        self._generate([single], 8)  # warm-up
        self._generate(batch, 8)

    def _generate(self, rows: list[list[int]], new_tokens: int, streamer: Any = None) -> Any:
        import torch

        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=streamer,
            )
        return out[:, width:]

    def one(self) -> dict[str, Any]:
        from transformers.generation.streamers import BaseStreamer

        class FirstTokenTimer(BaseStreamer):
            """generate() calls put() with the prompt first, then once per generated token."""

            calls, first = 0, 0.0

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls == 2:
                    self.first = time.perf_counter()

            def end(self) -> None:
                pass

        timer = FirstTokenTimer()
        start = time.perf_counter()
        out = self._generate([self.single], self.n, streamer=timer)
        end = time.perf_counter()
        n = int(out.numel())
        return {
            "wall_s": end - start,
            "tokens": n,
            "output_tok_s": n / (end - start),
            "ttft_s": timer.first - start,
            "decode_tok_s": (n - 1) / (end - timer.first),
            "output_ids": out[0].tolist(),
        }

    def batched(self) -> dict[str, Any]:
        start = time.perf_counter()
        out = self._generate(self.batch, self.n)
        wall = time.perf_counter() - start
        n = int(out.numel())
        return {"wall_s": wall, "tokens": n, "output_tok_s": n / wall, "output_ids": out.tolist()}


# ---------------------------------------------------------------- report
def summarize(records: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [r[key] for r in records]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def agreement(rxf_ids: list[int], hf_ids: list[int], eos_id: int) -> dict[str, Any]:
    """Common prefix of two greedy continuations, and whether rxf's token where they part is EOS.

    With ignore_eos rxf may emit EOS (and then continue); HF's min_new_tokens masks EOS and takes
    the next-best token, so the two are expected to part at an EOS.
    """
    k = 0
    while k < min(len(rxf_ids), len(hf_ids)) and rxf_ids[k] == hf_ids[k]:
        k += 1
    return {"common_prefix": k, "length": len(rxf_ids), "parted_at_eos": k < len(rxf_ids) and rxf_ids[k] == eos_id}


def fmt(s: dict[str, Any], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def report(results: dict[str, Any]) -> str:
    s, b = results.get("summary", {}), results["settings"]["batch"]
    lines = []
    if "rxf" in s:
        lines += [
            "| measurement | rxf | HF transformers | rxf / HF (medians) | rxf / HF per round |",
            "|---|---|---|---|---|",
        ]
        rows = [
            ("1 request: output tok/s", "bs1_output_tok_s", 1),
            ("1 request: TTFT s", "bs1_ttft_s", 3),
            ("1 request: decode-only tok/s", "bs1_decode_tok_s", 1),
            (f"{b} requests: output tok/s", "batch_output_tok_s", 1),
            (f"{b} requests: wall s", "batch_wall_s", 2),
        ]
        for label, key, digits in rows:
            rxf, hf = s["rxf"][key], s.get("hf", {}).get(key)
            ratio = f"{rxf['median'] / hf['median']:.2f}" if hf else "–"
            pair = s.get("paired_ratio", {}).get(key)
            paired = fmt(pair, 2) if pair else "–"
            lines.append(f"| {label} | {fmt(rxf, digits)} | {fmt(hf, digits) if hf else '–'} | {ratio} | {paired} |")
        lines.append("")
        lines.append(f"torch threads: rxf scheduler {results['rxf_torch_threads']}, HF {results.get('hf_torch_threads')}")
        lines.append(f"dtypes: rxf {results['settings']['rxf_dtype']} (model.dtype), HF {results['settings']['hf_dtype']}")
    if "load_s" in s:
        lines.append(f"rxf warm load (from_config) s: {fmt(s['load_s'], 2)}")
    if "cold" in results:
        lines.append(f"rxf first use (cold cache) from_config s: {results['cold']['load_s']:.2f}")
    if "agreement" in results:
        a = results["agreement"]
        parted = [x for x in [a["bs1"], *a["batch"]] if x["common_prefix"] < x["length"]]
        lines.append(
            f"greedy outputs rxf vs HF: {len(parted)} of {len(a['batch']) + 1} differ, "
            f"{sum(x['parted_at_eos'] for x in parted)} of them first where rxf emitted EOS; "
            f"common prefixes {[x['common_prefix'] for x in parted]}"
        )
    calls = [("cold start", results["cold"])] if "cold" in results else []
    calls += [(f"warm load {i + 1}", c) for i, c in enumerate(results.get("warm_load", []))]
    calls += [(f"round {i + 1} {name}", c) for i, r in enumerate(results.get("rounds", [])) for name, c in r.items()]
    limit = results["settings"]["max_other_cores"]
    noisy = [f"{name} ({c['cpu']['others_cores']} cores)" for name, c in calls if c["cpu"]["others_cores"] > limit]
    lines.append(
        f"{len(noisy)} of {len(calls)} kept calls ran while other processes used more than {limit} cores "
        f"(retries exhausted){': ' + ', '.join(noisy) if noisy else ''}"
    )
    return "\n".join(lines)


def run_rounds(args: argparse.Namespace, results: dict[str, Any], model_path: str) -> None:
    """The decode measurements: `args.rounds` rounds of (every rxf call, then every HF call)."""
    from transformers import AutoTokenizer

    from rxf.core.config import load_config

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = chat_prompt_ids(tokenizer)
    single, batch = prompts[args.bs1_prompt], prompts[: args.batch]
    results["settings"]["prompt_tokens"] = {"bs1": len(single), "batch": [len(p) for p in batch]}
    results["settings"]["rxf_dtype"] = load_config(args.config).model.dtype
    results["settings"]["hf_dtype"] = args.hf_dtype

    rxf = RxfBench(args, single, batch)
    hf = None
    results["rxf_torch_threads"] = rxf.threads
    rounds: list[dict[str, Any]] = []
    try:
        if not args.skip_hf:
            hf = HfBench(args, model_path, single, batch, rxf.threads)
            results["hf_torch_threads"], results["hf_load_s"] = hf.threads, hf.load_s
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds}", flush=True)
            r = {
                "rxf_bs1": timed(args, "rxf 1 request", rxf.one),
                "rxf_bs1_stream": timed(args, "rxf 1 request streamed", rxf.one_streamed),
                "rxf_batch": timed(args, f"rxf {args.batch} requests", rxf.batched),
            }
            if hf is not None:
                r["hf_bs1"] = timed(args, "HF batch 1", hf.one)
                r["hf_batch"] = timed(args, f"HF batch {args.batch}", hf.batched)
            rounds.append(r)
    finally:
        rxf.close()
    results["rounds"] = rounds

    def engine_summary(prefix: str, bs1_stream: str) -> dict[str, Any]:
        col = {k: [r[k] for r in rounds] for k in rounds[0]}
        return {
            "bs1_output_tok_s": summarize(col[f"{prefix}_bs1"], "output_tok_s"),
            "bs1_wall_s": summarize(col[f"{prefix}_bs1"], "wall_s"),
            "bs1_ttft_s": summarize(col[bs1_stream], "ttft_s"),
            "bs1_decode_tok_s": summarize(col[bs1_stream], "decode_tok_s"),
            "batch_output_tok_s": summarize(col[f"{prefix}_batch"], "output_tok_s"),
            "batch_wall_s": summarize(col[f"{prefix}_batch"], "wall_s"),
        }

    results["summary"] = {"rxf": engine_summary("rxf", "rxf_bs1_stream")}
    if "warm_load" in results:
        results["summary"]["load_s"] = summarize(results["warm_load"], "load_s")
    if hf is not None:
        results["summary"]["hf"] = engine_summary("hf", "hf_bs1")
        # Per round, rxf over HF: the two ran back to back, so slow drift in the machine's speed cancels.
        paired = {
            "bs1_output_tok_s": ("rxf_bs1", "hf_bs1", "output_tok_s"),
            "bs1_ttft_s": ("rxf_bs1_stream", "hf_bs1", "ttft_s"),
            "bs1_decode_tok_s": ("rxf_bs1_stream", "hf_bs1", "decode_tok_s"),
            "batch_output_tok_s": ("rxf_batch", "hf_batch", "output_tok_s"),
            "batch_wall_s": ("rxf_batch", "hf_batch", "wall_s"),
        }
        results["summary"]["paired_ratio"] = {
            key: summarize([{"r": r[a][m] / r[h][m]} for r in rounds], "r") for key, (a, h, m) in paired.items()
        }
        last, eos = rounds[-1], tokenizer.eos_token_id
        results["agreement"] = {
            "bs1": agreement(last["rxf_bs1"]["output_ids"], last["hf_bs1"]["output_ids"], eos),
            "batch": [
                agreement(a, h, eos)
                for a, h in zip(last["rxf_batch"]["output_ids"], last["hf_batch"]["output_ids"], strict=True)
            ],
        }


def run_quantizations(args: argparse.Namespace, results: dict[str, Any], model_path: str) -> None:
    """--quantization: 1 request (plain and streamed) with each `model.quantization` in turn, every
    round starting each engine afresh in the same order, so the machine's drift hits all alike."""
    from transformers import AutoTokenizer

    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(model_path))
    single, batch = prompts[args.bs1_prompt], prompts[:1]
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", flush=True)
        r: dict[str, Any] = {}
        for q in args.quantization:
            start = time.perf_counter()
            bench = RxfBench(args, single, batch, {"model.quantization": None if q == "none" else q})
            load_s = time.perf_counter() - start
            try:
                r[q] = {"load_s": load_s, "bs1": timed(args, f"{q}: 1 request", bench.one),
                        "bs1_stream": timed(args, f"{q}: 1 request streamed", bench.one_streamed)}
            finally:
                bench.close()
        rounds.append(r)
    results["rounds_by_quantization"] = rounds
    base = args.quantization[0]
    results["summary_by_quantization"] = {
        q: {
            "load_s": summarize([r[q] for r in rounds], "load_s"),
            "bs1_output_tok_s": summarize([r[q]["bs1"] for r in rounds], "output_tok_s"),
            "bs1_decode_tok_s": summarize([r[q]["bs1_stream"] for r in rounds], "decode_tok_s"),
            f"decode_ratio_to_{base}": summarize(
                [{"r": r[q]["bs1_stream"]["decode_tok_s"] / r[base]["bs1_stream"]["decode_tok_s"]} for r in rounds], "r"),
            "others_cores": summarize([r[q]["bs1_stream"]["cpu"] for r in rounds], "others_cores"),
        }
        for q in args.quantization
    }


def quantization_report(results: dict[str, Any]) -> str:
    summary = results["summary_by_quantization"]
    base = next(iter(summary))
    lines = [f"| model.quantization | 1 request: output tok/s | decode-only tok/s | decode / {base} per round | "
             "engine start s | other processes' cores |", "|---|---|---|---|---|---|"]
    for q, row in summary.items():
        lines.append(f"| {q} | {fmt(row['bs1_output_tok_s'], 1)} | {fmt(row['bs1_decode_tok_s'], 1)} | "
                     f"{fmt(row[f'decode_ratio_to_{base}'], 2)} | {fmt(row['load_s'], 1)} | {fmt(row['others_cores'], 2)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/demo.toml")
    ap.add_argument("--output", default=None, help="write every measurement as JSON here")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (all rxf measurements, all HF ones)")
    ap.add_argument("--load-repeats", type=int, default=3, help="warm-cache engine starts to time (0: none)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help=f"concurrent requests (at most {len(USER_TURNS)})")
    ap.add_argument("--bs1-prompt", type=int, default=1, help="index of the prompt used for 1 request")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--cold", action="store_true", help="also time one first-use start with an empty cache")
    ap.add_argument("--skip-hf", action="store_true", help="rxf only, no reference")
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the reference's dtype (rxf runs in the config's model.dtype)")
    ap.add_argument("--quiet-cores", type=float, default=0.15, help="wait until others use less CPU than this")
    ap.add_argument("--max-wait", type=float, default=300, help="give up waiting for quiet after this many s")
    ap.add_argument("--max-other-cores", type=float, default=0.25, help="repeat a call if others used more")
    ap.add_argument("--retries", type=int, default=3, help="repeats of one call at most")
    ap.add_argument("--quantization", nargs="+", default=None,
                    help="compare these model.quantization values (none: unquantized) at 1 request, rxf only")
    ap.add_argument("--_cold-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._cold_child:
        cold_child(args)
        return
    if not 1 <= args.batch <= len(USER_TURNS):
        ap.error(f"--batch must be in [1, {len(USER_TURNS)}]")

    from rxf.core.config import load_config
    from rxf.entrypoints.demo_model import resolve_model_path

    results: dict[str, Any] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": git_commit(),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")}
        | {"rxf_cache_dir": os.environ.get("RXF_CACHE_DIR")},
    }
    if args.cold:
        results["cold"] = measure_cold(args)
    if args.load_repeats:
        results["warm_load"] = measure_warm_load(args)

    if args.quantization:
        run_quantizations(args, results, resolve_model_path(load_config(args.config).model.path))
        print(quantization_report(results))
    elif args.rounds:
        run_rounds(args, results, resolve_model_path(load_config(args.config).model.path))
    elif "warm_load" in results:
        results["summary"] = {"load_s": summarize(results["warm_load"], "load_s")}
    print(report(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
