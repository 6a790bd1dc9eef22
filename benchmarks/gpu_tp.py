"""Tensor-parallel benchmark (issues 9 and 11): tp 1 against tp N on one machine.

    python benchmarks/gpu_tp.py --tp 2                      # the H200 pair (NCCL)
    python benchmarks/gpu_tp.py --tp 1                      # one H200: the same script, tp 1 only
    python benchmarks/gpu_tp.py --tiny --device cpu --tp 2  # toy shapes on gloo: checks the script

Every measurement runs in freshly spawned rank processes (`rxf.testing.parallel.run_tp`: one per
rank, `cuda:<rank>`, NCCL with NVLink multicast off, or gloo on the CPU). Each rank builds its own
ModelRunner + Scheduler and is fed the same requests, so the ranks take the same steps and meet in
the same collectives; rank 0's figures are reported. Phases, each guarded (a failure prints its
traceback and the others still run):
  equality  a small random Llama and a small random Mixtral (rxf.testing's tiny checkpoints, wider):
            greedy tokens of a batch of 4 prompts x 32 new tokens at tp 1 and at tp N, in float32
            (must be equal: the sharded sums differ only in rounding order) and in the model dtype
            (bf16 on GPU: reported as the fraction of equal tokens, since bf16 rounding may flip a
            near-tie)
  decode    a Llama-3-8B-shaped and a Mixtral-8x7B-shaped checkpoint (fewer layers: --llama-layers,
            --mixtral-layers) with random bf16 weights, built once by gpu_decode.py / gpu_moe.py's
            builders; decode tok/s at batch 1 (CUDA graphs on and off) and batch 64 (graphs on),
            measured by gpu_decode.decode_rate (128-token prompts, timed steps after warm-up), for
            tp 1 and tp N
Prints a table last; writes all figures as JSON to --output or, when $OUT is set, $OUT/gpu_tp.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# NVLink SHARP (multicast) stays off on the lent machines (device/KINDS.md); set before any rank starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode as gd  # noqa: E402  (phase guard, Llama-3-8B builder, decode_rate, RESULTS)
import gpu_moe as gm  # noqa: E402  (Mixtral-8x7B builder, CPU stand-in for cuda.synchronize)

from rxf.testing import make_tiny_checkpoint  # noqa: E402
from rxf.testing.parallel import generate_each, run_tp  # noqa: E402

RESULTS = gd.RESULTS
PROMPTS = [[5, 80, 17, 300, 42, 9, 250, 11, 64, 3, 77], [400, 12], [99, 100, 101, 102, 103, 104], [7] * 20]
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2}
SMALL_ARCHS = {"llama": ("LlamaForCausalLM", {}),
               "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2})}


# ---------------------------------------------------------------- equality
def equality_phase(args: argparse.Namespace, work: Path) -> None:
    dtypes = ["float32"] + ([] if args.device == "cpu" else ["bfloat16"])
    keys, jobs = [], []
    for name, (arch, extra) in SMALL_ARCHS.items():
        path = work / f"small-{name}"
        if not (path / "config.json").exists():
            make_tiny_checkpoint(path, arch, seed=5, **SMALL, **extra)
        for dtype in dtypes:
            config = {
                "model": {"path": str(path), "dtype": dtype},
                "runtime": {"device": args.device, "cpu_threads": 1, "log_level": "warning"},
                # float32: the reference backend (GPU kernels' own rounding stays out of the comparison)
                "attention": {"backend": "torch_native" if dtype == "float32" else args.backend},
                "cache": {"max_total_tokens": 4096},
                "scheduler": {"max_running_requests": 8},
            }
            keys.append(f"{name}_{dtype}")
            jobs.append((config, str(path), PROMPTS, 32))
    # One start-up of the ranks for all jobs: (tokens, logits) per job, per rank.
    (ref,) = run_tp(generate_each, 1, (jobs,), device=args.device)
    ranks = run_tp(generate_each, args.tp, (jobs,), device=args.device)
    out: dict[str, Any] = {}
    for i, key in enumerate(keys):
        want, got = ref[i][0], ranks[0][i][0]
        same = sum(a == b for x, y in zip(want, got, strict=True) for a, b in zip(x, y, strict=True))
        out[key] = {"tokens_equal": got == want, "ranks_agree": all(r[i][0] == got for r in ranks),
                    "equal_fraction": same / sum(map(len, want)), "tokens": sum(map(len, want))}
        print(key, out[key], flush=True)
    RESULTS["equality"] = out


# ---------------------------------------------------------------- decode
def decode_job(model_dir: str, dtype: str, device: str, backend: str, batches: list[int], steps: int) -> dict:
    """On every rank: an in-process Scheduler fed gpu_decode's requests; decode tok/s per batch size."""
    from transformers import AutoTokenizer

    from rxf.core.config import load_config
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.scheduler.scheduler import Scheduler

    max_bs = max(batches)
    config = load_config({
        "model": {"path": model_dir, "dtype": dtype, "context_length": None if device == "cpu" else 4096},
        "runtime": {"device": device, "log_level": "warning", "cpu_threads": 1},
        "attention": {"backend": backend},
        "scheduler": {"max_running_requests": max_bs, "max_prefill_tokens": 16384, "log_interval": 10**9},
        "cache": {"max_total_tokens": max_bs * 512 + 4096},
    })
    runner = ModelRunner(config, PluginRegistry.load(), model_dir)
    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(model_dir))
    cuda, vocab = device == "cuda", runner.vocab_size
    out: dict[str, float] = {}
    with gm._no_cuda_sync(not cuda):
        gd.decode_rate(sched, 1, 8, vocab, graphs=cuda)  # first use (kernel compilation) out of the figures
        for graphs in [True, False] if cuda else [False]:
            out[f"b1_{'graphs' if graphs else 'eager'}"] = gd.decode_rate(sched, 1, steps * 2, vocab, graphs)
        for bs in batches[1:]:
            out[f"b{bs}_{'graphs' if cuda else 'eager'}"] = gd.decode_rate(sched, bs, steps, vocab, cuda)
    return out


def build_models(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    paths = {"llama": work / f"llama3-8b-{args.llama_layers}l", "mixtral": work / f"mixtral-{args.mixtral_layers}l"}
    if args.tiny:
        paths = {name: work / f"tiny-{name}" for name in SMALL_ARCHS}
    for name, path in paths.items():
        if (path / "config.json").exists():
            continue
        if args.tiny:
            arch, extra = SMALL_ARCHS[name]
            make_tiny_checkpoint(path, arch, seed=6, **extra)
        elif name == "llama":
            gd.build_checkpoint(dataclasses.replace(gd.PRESETS["llama3-8b"], layers=args.llama_layers), path)
        else:
            gm.build_checkpoint(gm.MIXTRAL, args.mixtral_layers, path, torch.device("cuda"), torch.bfloat16)
    return paths


def decode_phase(args: argparse.Namespace, name: str, path: Path) -> None:
    dtype = "float32" if args.tiny else "bfloat16"
    batches, steps = ([1, 4], 4) if args.tiny else ([1, 64], 64)
    rows = {}
    for tp in sorted({1, args.tp}):
        job = (str(path), dtype, args.device, args.backend, batches, steps)
        rows[f"tp{tp}"] = run_tp(decode_job, tp, job, device=args.device)[0]
        print(name, f"tp{tp}", json.dumps(rows[f"tp{tp}"]), flush=True)
    RESULTS.setdefault("decode", {})[name] = rows


# ---------------------------------------------------------------- report
def report() -> None:
    for key, row in RESULTS.get("equality", {}).items():
        print(f"equality {key}: tokens equal {row['tokens_equal']}, ranks agree {row['ranks_agree']}, "
              f"{row['equal_fraction']:.1%} of {row['tokens']} tokens equal")
    for name, rows in RESULTS.get("decode", {}).items():
        keys = sorted({k for r in rows.values() for k in r}, key=lambda k: (int(k[1:].split("_")[0]), k))
        print(f"\n{name} decode tok/s ({RESULTS['model_layers'][name]} layers)")
        print("| tp | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
        for tp, r in rows.items():
            print(f"| {tp} | " + " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in keys) + " |")
    if RESULTS.get("failed"):
        print("failed phases:", ", ".join(RESULTS["failed"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel runs (compared with tp 1)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy decode models (with --device cpu: checks the script)")
    ap.add_argument("--phases", default="equality,decode")
    ap.add_argument("--models", default="llama,mixtral", help="decode phase models")
    ap.add_argument("--llama-layers", type=int, default=32, help="Llama-3-8B has 32")
    ap.add_argument("--mixtral-layers", type=int, default=4, help="Mixtral-8x7B has 32")
    ap.add_argument("--backend", default="triton", help="attention backend (bf16 runs)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/rxf-bench-tp"))
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        args.backend = "torch_native"
    elif torch.cuda.device_count() < args.tp:
        sys.exit(f"--tp {args.tp} needs {args.tp} GPUs; torch sees {torch.cuda.device_count()}")
    phases, work = set(args.phases.split(",")), args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    RESULTS.update(
        date=datetime.now(UTC).isoformat(timespec="seconds"), command=" ".join(sys.argv), tp=args.tp,
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
        nccl_nvls_enable=os.environ["NCCL_NVLS_ENABLE"],
        model_layers={"llama": 2 if args.tiny else args.llama_layers, "mixtral": 2 if args.tiny else args.mixtral_layers},
    )
    if "equality" in phases:
        gd.phase("equality", lambda: equality_phase(args, work))
    if "decode" in phases:
        paths: dict[str, Path] = {}
        gd.phase("build", lambda: paths.update(build_models(args, work)))
        for name in args.models.split(","):
            if name in paths:
                gd.phase(f"decode {name}", lambda n=name: decode_phase(args, n, paths[n]))
    output = args.output or (Path(os.environ["OUT"]) / "gpu_tp.json" if os.environ.get("OUT") else None)
    if output is not None:
        output.write_text(json.dumps(RESULTS, indent=1))
    report()


if __name__ == "__main__":
    main()
