"""GPU MoE benchmark (issue 9): one script for one call on one GPU (about 2-3 minutes on an H200).

    python benchmarks/gpu_moe.py [--tiny] [--shape mixtral-8x7b|qwen3-30b-a3b] [--phases jit,kernels,model]
        [--layers 4] [--output FILE]

Phases, each guarded as in gpu_decode.py (a failure prints its traceback and the others still run):
  jit      FlashInfer's norm/rope/attention kernels compiled concurrently (gpu_decode.py's jit phase at
           Llama-3-8B's head shape, which Mixtral-8x7B shares; instant when $FLASHINFER_WORKSPACE_BASE
           holds them already)
  kernels  one MoE layer with random bf16 weights: --shape mixtral-8x7b (hidden 4096, intermediate
           14336, 8 experts, top 2) for 1, 16, 64, 256, 1024 and 4096 tokens, or qwen3-30b-a3b (hidden
           2048, moe_intermediate 768, 128 experts, top 8) for 1, 2, 4, ..., 1024, 4096, 8192 and 16384 tokens;
           skewed random routing, 8 routings cycled through by successive calls (so that few tokens
           read other experts each call, not L2 hits); median time (triton.testing.do_bench) of
             fused      rxf's Triton kernels (fused_moe.fused_experts, alignment included) with the
                        block sizes of the tuned table (`tuned_table` says whether it has the shape
                        on this GPU: benchmarks/gpu_moe_tune.py writes it), else the heuristic's
             fused_default  the same kernels with the heuristic's blocks (`fused_moe.pick_config`)
             torch      rxf's torch path (moe.experts_native: sort, one matmul pair per expert)
             loop       the per-expert loop: transformers' MixtralExperts, experts_implementation="eager"
             hf_grouped transformers' MixtralExperts with "grouped_mm" (torch._grouped_mm), for reference
             fused_kernel_align / fused_sort_align  fused with `align_pairs` on one of its paths (the
                        one-program kernel, the torch-ops sort), and align_kernel / align_sort: the
                        alignment alone (a second table)
           with TFLOP/s (2 * tokens * top_k * 3 * hidden * intermediate), GB/s (weights of the experts
           the tokens hit, plus activations in and out, each read once) and each one's time / fused's;
           `fused_rel_err` is the fused output's relative error against the torch path.
  model    a Mixtral-8x7B-shaped checkpoint with FEWER LAYERS (--layers, default 4 of 32; vocab 32000,
           32/8 heads, random bf16 weights drawn on the GPU, written with safetensors, loaded through
           rxf's normal path), then decode through an in-process Scheduler exactly as gpu_decode.py
           measures it (its decode_rate: 128-token prompts, timed steps after warm-up): batch 1 with
           CUDA graphs on and off, batch 64 with graphs. The batch-1 roofline counts the bytes one
           token reads: every non-expert weight plus top_k of num_experts experts per layer.
--tiny runs the same code on the CPU at toy shapes (float32, torch_native attention; the fused kernels
only under TRITON_INTERPRET=1) to check the script, not to measure anything.
Prints a table last; writes all figures as JSON to --output or, when $OUT is set, $OUT/gpu_moe.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode as gd  # noqa: E402  (its phase guard, jit phase, engine-driving helpers and RESULTS)

RESULTS = gd.RESULTS


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    vocab: int
    tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]


MIXTRAL = Shape(4096, 14336, 8, 2, 32, 8, 32000, (1, 16, 64, 256, 1024, 4096), (1, 64))
# Qwen3-30B-A3B's MoE layer (kernels phase only: its whole model is gpu_decode.py's qwen3-30b-a3b preset).
QWEN3_30B_A3B = Shape(2048, 768, 128, 8, 32, 4, 151936,
                      (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192, 16384), (1, 64))
TINY = Shape(64, 128, 4, 2, 4, 2, 512, (1, 16, 64), (1, 4))
SHAPES = {"mixtral-8x7b": MIXTRAL, "qwen3-30b-a3b": QWEN3_30B_A3B}
ROTATING_SETS = 8  # routings cycled through by the timed calls: each reads other experts (not L2 hits)


def median_time_s(fn: Callable[[], Any], cuda: bool) -> float:
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- kernels
def hf_experts(s: Shape, w13: torch.Tensor, w2: torch.Tensor, impl: str) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=s.hidden, intermediate_size=s.inter, num_local_experts=s.experts,
                           num_experts_per_tok=s.top_k)
    config._experts_implementation = impl
    with torch.device("meta"):
        experts = MixtralExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)  # the same layout: [E, 2I, H]
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return experts


def kernels_phase(s: Shape, dev: torch.device, dtype: torch.dtype, fused_ok: bool) -> None:
    from rxf.plugins.models.layers.moe import experts_native, select_experts

    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(s.experts, 2 * s.inter, s.hidden, device=dev, generator=gen) * s.hidden**-0.5).to(dtype)
    w2 = (torch.randn(s.experts, s.hidden, s.inter, device=dev, generator=gen) * s.inter**-0.5).to(dtype)
    impls: dict[str, Callable[..., torch.Tensor]] = {}
    tuned: dict[int, bool] = {}
    if fused_ok:
        from rxf.plugins.models.layers.fused_moe import fused_experts, pick_config, tuned_config

        impls["fused"] = fused_experts  # the blocks of the tuned table where it has this shape and GPU
        impls["fused_default"] = lambda x, a, b, weights, ids: fused_experts(
            x, a, b, weights, ids, pick_config(ids.numel(), s.experts, x.element_size()))
        tuned = {t: tuned_config(t, w13, dtype) is not None for t in s.tokens}
        from rxf.plugins.models.layers import fused_moe

        def align_by(min_chunks: int, fn: Callable[..., Any]) -> Callable[..., Any]:
            """fn with `align_pairs` on one path: the kernel (min_chunks huge) or the sort (0)."""
            def run(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Any:
                saved, fused_moe.ALIGN_SORT_MIN_CHUNKS = fused_moe.ALIGN_SORT_MIN_CHUNKS, min_chunks
                try:
                    return fn(x, a, b, weights, ids)
                finally:
                    fused_moe.ALIGN_SORT_MIN_CHUNKS = saved
            return run

        def align_only(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Any:
            cfg = tuned_config(x.shape[0], a, x.dtype) or pick_config(ids.numel(), s.experts, x.element_size())
            return fused_moe.align_pairs(ids, s.experts, cfg.block_m)

        # `align_pairs`' two paths (the kernel's one program, the sort's torch ops), in the layer and alone
        impls["fused_kernel_align"], impls["fused_sort_align"] = align_by(1 << 62, fused_experts), align_by(0, fused_experts)
        impls["align_kernel"], impls["align_sort"] = align_by(1 << 62, align_only), align_by(0, align_only)
    impls["torch"] = experts_native
    for name, impl in (("loop", "eager"), ("hf_grouped", "grouped_mm")):
        module = hf_experts(s, w13, w2, impl)
        impls[name] = lambda x, _w13, _w2, weights, ids, m=module: m(x, ids, weights)
    expert_bytes = 3 * s.hidden * s.inter * w13.element_size()
    rows: dict[str, dict[str, Any]] = {}
    for tokens in s.tokens:
        x = torch.randn(tokens, s.hidden, device=dev, generator=gen).to(dtype)
        skew = torch.linspace(0, 2, s.experts, device=dev)  # uneven load across experts
        routings = [select_experts(torch.randn(tokens, s.experts, device=dev, generator=gen) + skew, s.top_k, True)
                    for _ in range(ROTATING_SETS)]
        weights, ids = routings[0]
        hit = sum(int(i.unique().numel()) for _, i in routings) / len(routings)  # per call, on average
        flops = 2 * tokens * s.top_k * 3 * s.hidden * s.inter
        moved = hit * expert_bytes + 2 * tokens * s.hidden * x.element_size()
        row: dict[str, Any] = {"experts_hit": hit, "tuned_table": tuned.get(tokens, False)}
        with torch.inference_mode():
            if "fused" in impls:
                ref = experts_native(x, w13, w2, weights, ids).float()
                out = impls["fused"](x, w13, w2, weights, ids).float()
                row["fused_rel_err"] = ((out - ref).norm() / ref.norm()).item()
            for name, fn in impls.items():
                try:
                    call = functools.partial(rotating, fn, x, w13, w2, itertools.cycle(routings))
                    sec = median_time_s(call, dev.type == "cuda")
                    row[name] = {"us": sec * 1e6, "TFLOPs": flops / sec / 1e12, "GBps": moved / sec / 1e9}
                except Exception as e:  # e.g. grouped_mm unsupported by this torch/GPU
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        if "us" in row.get("fused", {}):
            for name in impls:
                if "us" in row[name]:
                    row[name]["x_fused_time"] = row[name]["us"] / row["fused"]["us"]
        rows[str(tokens)] = row
        print(tokens, json.dumps(row), flush=True)
    RESULTS["moe_layer"] = {"hidden": s.hidden, "intermediate": s.inter, "experts": s.experts, "top_k": s.top_k,
                            "dtype": str(dtype).removeprefix("torch."), "by_tokens": rows}


def rotating(fn: Callable[..., torch.Tensor], x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             routings: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    weights, ids = next(routings)
    return fn(x, w13, w2, weights, ids)


# ---------------------------------------------------------------- model
def build_checkpoint(s: Shape, layers: int, path: Path, dev: torch.device, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import MixtralConfig, PreTrainedTokenizerFast

    from rxf.testing.checkpoints import CHATML_TEMPLATE

    path.mkdir(parents=True, exist_ok=True)
    MixtralConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.inter, num_hidden_layers=layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, num_local_experts=s.experts,
        num_experts_per_tok=s.top_k, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, dtype=str(dtype).removeprefix("torch."),
        architectures=["MixtralForCausalLM"],
    ).save_pretrained(path)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:  # drawn on the device: seconds, not minutes, on a GPU
        return (torch.randn(shape, device=dev, generator=gen) * 0.02).to(dtype).cpu()

    kv = s.kv_heads * (s.hidden // s.heads)

    def ones() -> torch.Tensor:  # a new tensor each time: safetensors refuses shared storage
        return torch.ones(s.hidden, dtype=dtype)

    tensors = {"model.embed_tokens.weight": rand(s.vocab, s.hidden), "lm_head.weight": rand(s.vocab, s.hidden),
               "model.norm.weight": ones()}
    for i in range(layers):
        pre = f"model.layers.{i}."
        for name, shape in (("q_proj", (s.hidden, s.hidden)), ("k_proj", (kv, s.hidden)),
                            ("v_proj", (kv, s.hidden)), ("o_proj", (s.hidden, s.hidden))):
            tensors[f"{pre}self_attn.{name}.weight"] = rand(*shape)
        tensors[f"{pre}block_sparse_moe.gate.weight"] = rand(s.experts, s.hidden)
        for e in range(s.experts):
            for name, shape in (("w1", (s.inter, s.hidden)), ("w3", (s.inter, s.hidden)), ("w2", (s.hidden, s.inter))):
                tensors[f"{pre}block_sparse_moe.experts.{e}.{name}.weight"] = rand(*shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[pre + norm + ".weight"] = ones()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    experts = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." in n)
    RESULTS["weight_bytes_total"] = total
    RESULTS["weight_bytes"] = total - experts * (s.experts - s.top_k) // s.experts  # read per batch-1 token
    vocab = {f"t{i}": i for i in range(s.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0",
                            chat_template=CHATML_TEMPLATE).save_pretrained(path)
    print(f"checkpoint: {layers} layers, {total / 1e9:.2f} GB ({RESULTS['weight_bytes'] / 1e9:.2f} GB "
          f"read per batch-1 token) in {path}")


def model_phase(s: Shape, model_dir: Path, dev: torch.device, dtype: torch.dtype, backend: str) -> None:
    from transformers import AutoTokenizer

    from rxf.core.config import load_config
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.scheduler.scheduler import Scheduler

    max_bs = max(s.decode_batches)
    config = load_config({
        "model": {"path": str(model_dir), "dtype": str(dtype).removeprefix("torch."), "context_length": 4096},
        "runtime": {"device": dev.type, "log_level": "warning"},
        "attention": {"backend": backend},
        "scheduler": {"max_running_requests": max_bs, "max_prefill_tokens": 16384, "log_interval": 10**9},
        "cache": {"max_total_tokens": max_bs * 512 + 4096},
    })
    start = time.perf_counter()
    runner = ModelRunner(config, PluginRegistry.load(), str(model_dir))
    RESULTS["runner_start_s"] = time.perf_counter() - start
    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(model_dir))
    cuda = dev.type == "cuda"
    out: dict[str, float] = {}
    graph_modes = [True, False] if cuda else [False]
    with _no_cuda_sync(not cuda):
        gd.decode_rate(sched, 1, 8, s.vocab, graphs=cuda)  # first use (kernel compilation) out of the figures
        for graphs in graph_modes:
            out[f"b1_{'graphs' if graphs else 'eager'}"] = gd.decode_rate(sched, 1, 128 if cuda else 8, s.vocab, graphs)
        for bs in s.decode_batches[1:]:
            out[f"b{bs}_{'graphs' if cuda else 'eager'}"] = gd.decode_rate(sched, bs, 64 if cuda else 4, s.vocab, cuda)
    RESULTS["decode_tok_s"] = out
    print(json.dumps(out, indent=1))


class _no_cuda_sync:
    """gpu_decode.decode_rate synchronises CUDA around its timed span; on the CPU there is nothing to
    wait for, so --tiny swaps the call for a no-op while it runs."""

    def __init__(self, active: bool) -> None:
        self.active, self.saved = active, torch.cuda.synchronize

    def __enter__(self) -> None:
        if self.active:
            torch.cuda.synchronize = lambda *a, **k: None

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize = self.saved


# ---------------------------------------------------------------- report
def report() -> None:
    layer = RESULTS.get("moe_layer")
    if layer:
        names = ["fused", "fused_default", "torch", "loop", "hf_grouped"]
        print(f"\nMoE layer {layer['hidden']}x{layer['intermediate']}, {layer['experts']} experts, "
              f"top {layer['top_k']}, {layer['dtype']}: us (TFLOP/s, GB/s, time / fused)")
        print("| tokens | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|")
        for tokens, row in layer["by_tokens"].items():
            cells = []
            for n in names:
                r = row.get(n, {})
                cells.append(f"{r['us']:.1f} ({r['TFLOPs']:.1f}, {r['GBps']:.0f}, {r.get('x_fused_time', math.nan):.2f}x)"
                             if "us" in r else ("failed" if r else "-"))
            print(f"| {tokens} | " + " | ".join(cells) + " |")
        aligns = ["fused_kernel_align", "fused_sort_align", "align_kernel", "align_sort"]
        print("\n`align_pairs`' two paths, us: the layer with each, and the alignment alone\n| tokens | "
              + " | ".join(aligns) + " |\n" + "|---" * (len(aligns) + 1) + "|")
        for tokens, row in layer["by_tokens"].items():
            cells = [f"{row[n]['us']:.1f}" if "us" in row.get(n, {}) else "-" for n in aligns]
            print(f"| {tokens} | " + " | ".join(cells) + " |")
    roof = RESULTS.get("roofline_b1_tok_s")
    if RESULTS.get("decode_tok_s"):
        print(f"\nrxf decode, {RESULTS['shape']}-shaped model with {RESULTS['model_layers']} of 32 layers "
              f"({RESULTS.get('weight_bytes_total', 0) / 1e9:.2f} GB of weights):")
    for key, value in RESULTS.get("decode_tok_s", {}).items():
        ratio = f" ({value / roof:.1%} of roofline {roof:.0f})" if roof and key.startswith("b1_") else ""
        print(f"decode {key}: {value:.1f} tok/s{ratio}")
    if RESULTS.get("failed"):
        print("failed phases:", ", ".join(RESULTS["failed"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, toy shapes: checks the script runs")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b",
                    help="the MoE layer of the kernels phase (the model phase is Mixtral's)")
    ap.add_argument("--phases", default="jit,kernels,model")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model phase (Mixtral has 32)")
    ap.add_argument("--backend", default="triton", help="attention backend of the model phase")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    s, phases = (TINY if args.tiny else SHAPES[args.shape]), set(args.phases.split(","))
    if s is not MIXTRAL and not args.tiny and "model" in phases:
        print(f"model phase skipped: it builds Mixtral ({args.shape}'s model: gpu_decode.py --preset {args.shape})")
        phases.discard("model")
    dev = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    layers = 2 if args.tiny else args.layers
    model_dir = args.model_dir or Path(f"/tmp/rxf-bench-mixtral-{'tiny' if args.tiny else layers}")
    RESULTS.update(date=datetime.now(UTC).isoformat(timespec="seconds"), command=" ".join(sys.argv),
                   device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                   shape="tiny" if args.tiny else args.shape, model_layers=layers)
    if "jit" in phases and dev.type == "cuda":
        gd.phase("jit", lambda: gd.jit_phase(gd.PRESETS["llama3-8b"]))
    if "kernels" in phases:
        fused_ok = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        gd.phase("kernels", lambda: kernels_phase(s, dev, dtype, fused_ok))
    if "model" in phases:
        gd.phase("build", lambda: build_checkpoint(s, layers, model_dir, dev, dtype))
        if dev.type == "cuda":
            gd.phase("bandwidth", gd.bandwidth)
        backend = args.backend if dev.type == "cuda" else "torch_native"
        gd.phase("model", lambda: model_phase(s, model_dir, dev, dtype, backend))
    output = args.output or (Path(os.environ["OUT"]) / "gpu_moe.json" if os.environ.get("OUT") else None)
    if output is not None:
        output.write_text(json.dumps(RESULTS, indent=1))
    report()


if __name__ == "__main__":
    main()
