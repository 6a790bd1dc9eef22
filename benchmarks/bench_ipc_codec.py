"""Encode + decode time of rxf's cross-process messages: the msgspec codec (`rxf.core.ipc.codec`)
against pickle of the same messages as the sockets sent them before (the dataclasses of
`rxf/core/io_struct.py` at `--old-rev`, read with `git show`), on the CPU.

Messages, built as the engine builds them:
- `request-8k`: a `PreparedRequest` of 8,192 prompt ids with sampling parameters (one stop string);
- `request-image`: a short `PreparedRequest` with one LLaVA-1.5-sized image item
  (`pixel_values` float32 [1, 3, 336, 336], 1.35 MB);
- `tokens-256`: a `BatchTokenOut` of 256 requests' outputs of one decode step (one new id each,
  one stop string each: what the scheduler sends the detokenizer each step at batch 256);
- `tokens-256-logprobs`: the same with each output's logprob and 5 top logprobs.

Each figure is the median over `--repeats` of the mean time of `--number` encode + decode pairs,
in microseconds, one thread; decoding reads from a writable buffer (a `bytearray`, as a ZMQ frame
received with `copy=False` is), so the codec's image tensor is a view of it rather than a copy.
The encoded sizes are printed too, and the minor page faults per call: a message of megabytes
costs fresh pages whenever the allocator hands its buffers back to the kernel between calls (glibc
does past its mmap threshold); `MALLOC_MMAP_THRESHOLD_=100000000 MALLOC_TRIM_THRESHOLD_=100000000`
rules that out, so that the codec's own work shows.

    .venv/bin/python benchmarks/bench_ipc_codec.py [--repeats 9] [--number 200] [--output out.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rxf.core.ipc import codec, messages
from rxf.core.sampling_params import SamplingParams

RECEIVERS = {"request-8k": messages.ToScheduler, "request-image": messages.ToScheduler,
             "tokens-256": messages.ToDetokenizer, "tokens-256-logprobs": messages.ToDetokenizer}


def old_messages(rev: str) -> types.ModuleType:
    """The message module as it was at `rev` (before the codec: dataclasses the sockets pickled)."""
    repo = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:rxf/core/io_struct.py"], cwd=repo, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("old_io_struct")
    sys.modules[module.__name__] = module  # pickle finds the classes by module name
    exec(compile(source, f"{rev}:rxf/core/io_struct.py", "exec"), vars(module))
    return module


def build(m: Any) -> dict[str, Any]:
    """The benchmark's messages, made of module `m`'s classes (today's or the old ones)."""
    params = SamplingParams.from_dict({"max_new_tokens": 256, "temperature": 0.7, "top_p": 0.9, "stop": ["</s>"]})
    ids = torch.randint(0, 49152, (8192,), generator=torch.Generator().manual_seed(0)).tolist()
    pixels = torch.randn(1, 3, 336, 336, generator=torch.Generator().manual_seed(1))
    image = m.MultimodalItem("image", 2**63 + 12345, 5, 576, {"pixel_values": pixels})

    def step(logprobs: bool) -> Any:
        outs = []
        for i in range(256):
            done = m.FinishReason("length") if i % 64 == 0 else None
            out = m.TokenOut(f"req-{i:04d}", [1000 + i], done, 700, 1 + i, 512, stop=["</s>"])
            if logprobs:
                out.output_token_logprobs = [-0.25]
                out.output_top_logprobs = [[(1000 + i + k, -0.25 - k) for k in range(5)]]
            outs.append(out)
        return m.BatchTokenOut(outs)

    return {
        "request-8k": m.PreparedRequest("a" * 32, ids, params, m.RequestOptions(stream=True)),
        "request-image": m.PreparedRequest("b" * 32, ids[:600], params, mm_items=[image]),
        "tokens-256": step(False),
        "tokens-256-logprobs": step(True),
    }


def time_us(fn: Callable[[], Any], number: int, repeats: int) -> tuple[float, float]:
    """(median µs per call, minor page faults per call)."""
    fn()
    runs = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e6)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(runs), faults / (number * repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--old-rev", default="3f8bf00", help="the commit whose pickled dataclasses are the baseline")
    ap.add_argument("--output", help="write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    new, old = build(messages), build(old_messages(args.old_rev))
    rows = {}
    for name, msg in new.items():
        decoder, before = codec.Decoder(RECEIVERS[name]), old[name]
        number = max(1, args.number // 20) if "image" in name else args.number
        msgspec_us, msgspec_faults = time_us(
            lambda: decoder.decode(bytearray(codec.encode(msg))), number, args.repeats  # noqa: B023
        )
        pickle_us, pickle_faults = time_us(
            lambda: pickle.loads(bytearray(pickle.dumps(before))), number, args.repeats  # noqa: B023
        )
        rows[name] = {
            "msgspec_us": round(msgspec_us, 1),
            "pickle_us": round(pickle_us, 1),
            "pickle_over_msgspec": round(pickle_us / msgspec_us, 2),
            "msgspec_faults": round(msgspec_faults),
            "pickle_faults": round(pickle_faults),
            "msgspec_bytes": len(codec.encode(msg)),
            "pickle_bytes": len(pickle.dumps(before)),
        }
    print(f"{'message':22} {'msgspec µs':>11} {'pickle µs':>10} {'pickle/msgspec':>15} {'faults m/p':>11} "
          f"{'msgspec B':>10} {'pickle B':>10}")
    for name, r in rows.items():
        print(
            f"{name:22} {r['msgspec_us']:11.1f} {r['pickle_us']:10.1f} {r['pickle_over_msgspec']:15.2f} "
            f"{r['msgspec_faults']:5d}/{r['pickle_faults']:<5d} {r['msgspec_bytes']:10d} {r['pickle_bytes']:10d}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
