"""GPU decode benchmark (issues 4, 18): one script for one call on the GPU machine.

    python benchmarks/gpu_decode.py [--preset llama3-8b|qwen3-8b|qwen3-30b-a3b|gpt-oss-20b|tiny] [--num-requests 1000]
        [--phases jit,build,bandwidth,decode,decode1,eager,routing,kvcache,kernels,offline,hf] [--model-dir DIR] [--output FILE]

A preset is a transformers config (architecture + fields): `llama3-8b` (Llama-3-8B), `qwen3-8b` and
`qwen3-30b-a3b` (Qwen/Qwen3-8B's and Qwen/Qwen3-30B-A3B's config.json: 36 layers, head_dim 128; 48
layers of 128 experts, top 8), `gpt-oss-20b` and `tiny`; its tensors are the ones transformers names
for it (gpt-oss-20b: the MXFP4 tensors OpenAI ships, from its own builder).

Phases run in this order; each is guarded (a failure prints its traceback and the others still run),
and each frees its GPU memory before the next:
  jit        FlashInfer's kernels for the preset's shapes compiled concurrently (else ~3 min serially
             on a fresh machine; cached under $FLASHINFER_WORKSPACE_BASE)
  build      a checkpoint of the preset's shape with random bf16 weights (drawn on the GPU, written
             with safetensors to the machine's disk; rxf then loads it through its normal path), plus a
             word-level tokenizer covering the whole vocabulary. gpt-oss-20b: its experts in MXFP4, as
             OpenAI ships them (13.7 GB on disk instead of 42 GB; rxf dequantizes them to bf16 at load).
             qwen3-30b-a3b (61 GB) does not fit the disk: config and tokenizer only, and the decode
             phase loads it with `model.load_format = "random"` (offline and hf, which need the
             files, are skipped for it)
  bandwidth  device-to-device copy bandwidth (bytes read + written) -> batch-1 roofline = bandwidth
             / bytes one decode token reads: every dense weight, the top_k / num_experts share of
             each MoE layer's experts, one row of the embedding table (see `weight_bytes`). The
             roofline over all weights, as ../shared/device/README.md and the earlier Llama-3-8B
             figures count it, is reported beside it (for a dense model the two differ by the
             embedding table: 1.05 GB of Llama-3-8B's 16.06 GB)
  decode     per backend (triton, flashinfer), an in-process ModelRunner + Scheduler: batch-1 decode
             tok/s with CUDA graphs on and off, decode throughput at larger batches (graphs on), and
             the HF workload (128 prompt + 128 new tokens, end to end) at batch 1 and 64. Timed
             spans cover whole scheduler steps (schedule, forward, sample, outputs), between
             torch.cuda.synchronize() calls.
  decode1    batch 1, 4, 8 and 16 (`--decode1-batches`) with CUDA graphs only, on an engine of 16 requests
             (or the largest batch): the quick A/B of a kernel setting (run it once per setting, e.g.
             RXF_PDL=0 and 1)
  eager      batch 1 and 4 with CUDA graphs off (an engine that captures none), then a cProfile of 16
             batch-1 steps: the host functions with the most time of their own (what eager steps pay)
  routing    MoE presets: the distinct experts a layer's decode step reads at batch 1, 4, 8, 64
             (eager), beside uniform routing's expectation: what the batch figures read
  kvcache    per backend, decode throughput at long contexts with `cache.kv_dtype` = auto (bf16) and
             fp8_e4m3, each pool sized from the same memory (cache.mem_fraction_static): 256 requests of
             4096-token prompts are queued, and once every admitted request decodes, 64 decode steps are
             timed. A bf16 pool may not hold all 256 (Llama-3-8B: 128 KiB a token), so it decodes
             the batch that fits and the rest wait, as a server would; the running batch is reported
             beside each rate. Not in the default phases (its prefill is ~1M tokens per KV dtype)
  kernels    attention micro-benchmarks, triton vs flashinfer vs torch_native, decode and extend at
             the model's head shape, with each output's error against torch_native: GPU time (kernel
             durations from torch.profiler, what a CUDA-graph replay pays) and wall time per call
             (triton.testing.do_bench, adding the host's launch overhead that eager steps pay)
  offline    `Runtime` throughput over N random requests (input 1024 +- 50%, output 256, ignore_eos)
  hf         transformers `generate` on the same checkpoint, batch 1 and 64, 128 prompt + 128 new

`--quantization bf16,fp8,ct-fp8,awq` (default `bf16`) runs the decode and offline phases once per
listed format, bf16 first, in the same call: `fp8` is the bf16 checkpoint's projections in
Hugging Face's block-wise FP8 (128 x 128), `ct-fp8` compressed-tensors FP8 per channel with dynamic
per-token activations, `awq` AWQ int4 (group 128); each is quantized on the GPU from the bf16
checkpoint into `<model-dir>-<format>` (`rxf.testing.quantized_checkpoints`), and rxf serves it as
a quantized checkpoint. A preset whose checkpoint is not on disk (qwen3-30b-a3b, or
--random-weights) runs `fp8` as online FP8 instead: `model.quantization = "fp8"` over the random
bf16 weights quantizes every projection, experts included, per output row at load (the other
formats need a checkpoint and are skipped for it). Figures of a format carry its name
(`decode_triton_fp8`, `offline_awq`) and the table gives each batch-1 and offline figure's ratio to bf16.
Prints a table last; writes all figures as JSON to --output or, when $OUT is set, $OUT/gpu_decode.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import random
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    decode_batches: tuple[int, ...]
    offline_input: int  # mean prompt length (+- 50%)
    offline_output: int
    hf_batches: tuple[int, ...]
    hf_tokens: int  # prompt and new tokens each, for HF and rxf's end-to-end comparison
    head_dim: int = 0  # 0: hidden // heads
    experts: int = 0  # MoE: experts per layer and experts per token (0: a dense MLP)
    top_k: int = 0
    model_type: str = "llama"  # transformers' config type ("gpt_oss": its own MXFP4 builder)
    arch: str = "LlamaForCausalLM"  # the architecture rxf loads
    extra: dict[str, Any] = field(default_factory=dict)  # further config fields (rope, ...)
    # False: too large for the GPU machine's disk (Qwen3-30B-A3B is 61 GB); build writes config and
    # tokenizer only and the decode phase loads random weights (`model.load_format = "random"`);
    # the phases that need a checkpoint on disk, offline and hf, are skipped.
    on_disk: bool = True

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
QWEN3 = {"max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default",
                                                                                    "rope_theta": 1e6}}
LLAMA3 = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_parameters": LLAMA3_ROPE}
PRESETS = {
    "llama3-8b": Preset(4096, 32, 32, 8, 14336, 128256, (16, 64, 256), 1024, 256, (1, 64), 128, extra=LLAMA3),
    "tiny": Preset(512, 4, 8, 2, 1408, 32000, (16, 64), 256, 32, (1, 8), 32, extra=LLAMA3),
    # Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B's config.json (all 48 layers, 128 experts, top 8).
    "qwen3-8b": Preset(4096, 36, 32, 8, 12288, 151936, (16, 64, 256), 1024, 256, (1, 64), 128, head_dim=128,
                       model_type="qwen3", arch="Qwen3ForCausalLM", extra=QWEN3),
    "qwen3-30b-a3b": Preset(2048, 48, 32, 4, 6144, 151936, (16, 64, 256), 1024, 256, (1, 64), 128, head_dim=128,
                            experts=128, top_k=8, model_type="qwen3_moe", arch="Qwen3MoeForCausalLM",
                            extra={**QWEN3, "moe_intermediate_size": 768, "norm_topk_prob": True,
                                   "decoder_sparse_step": 1, "mlp_only_layers": []}, on_disk=False),
    "gpt-oss-20b": Preset(2880, 24, 64, 8, 2880, 201088, (16, 64), 1024, 256, (1, 64), 128, head_dim=64,
                          experts=32, top_k=4, model_type="gpt_oss", arch="GptOssForCausalLM"),
}
RESULTS: dict[str, Any] = {}


def phase(name: str, fn: Callable[[], None]) -> None:
    print(f"\n=== {name} ===", flush=True)
    start = time.perf_counter()
    try:
        fn()
    except Exception:
        traceback.print_exc()
        RESULTS.setdefault("failed", []).append(name)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        print(f"=== {name}: {time.perf_counter() - start:.1f}s", flush=True)


# ---------------------------------------------------------------- build
_EXPERTS_FIELD = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}  # the config's name for E


def hf_config(p: Preset) -> Any:
    from transformers import AutoConfig

    shape = {"vocab_size": p.vocab, "hidden_size": p.hidden, "intermediate_size": p.intermediate,
             "num_hidden_layers": p.layers, "num_attention_heads": p.heads, "num_key_value_heads": p.kv_heads,
             **({"head_dim": p.head_dim} if p.head_dim else {}),
             **({_EXPERTS_FIELD[p.model_type]: p.experts, "num_experts_per_tok": p.top_k} if p.experts else {})}
    return AutoConfig.for_model(p.model_type, **shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                dtype="bfloat16", architectures=[p.arch], **p.extra)


def checkpoint_tensors(p: Preset) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the preset's checkpoint, as transformers names them (its
    model built on the meta device: no memory). MoE experts come as transformers 5's fused stacks
    `mlp.experts.gate_up_proj` / `down_proj`, which rxf loads as it loads per-expert tensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(p))
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def random_weights(p: Preset, device: str = "cuda") -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with random bf16 values drawn on the GPU (seconds, not minutes, for
    8B): N(0, 0.02) weights and unit norm weights, one tensor at a time."""
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in checkpoint_tensors(p):
        if "norm" in name:
            yield name, torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            yield name, (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * 0.02).bfloat16()


def weight_bytes(p: Preset, path: Path) -> dict[str, int]:
    """`weight_bytes`: every weight in bf16. `read_bytes`: what one batch-1 decode step reads, the
    roofline's denominator = every dense weight (attention, norms, routers, dense MLPs, LM head)
    + the top_k / num_experts share of each MoE layer's experts + one row of the embedding table
    (a lookup reads one row; the LM head, untied here, reads its whole matrix). Reads of the KV
    cache (under 1% of these at the decode phase's ~400-token contexts) are not counted.
    gpt-oss-20b: from its checkpoint's MXFP4 shapes (`gpt_oss_bytes`)."""
    if p.model_type == "gpt_oss":
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return gpt_oss_bytes({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, p)
    total = read = 0
    for name, shape in checkpoint_tensors(p):
        size = 2 * math.prod(shape)
        total += size
        if name.endswith("embed_tokens.weight"):
            read += 2 * shape[-1]
        elif ".experts." in name:
            read += size * p.top_k // p.experts
        else:
            read += size
    return {"weight_bytes": total, "read_bytes": read}


def build_checkpoint(p: Preset, path: Path) -> None:
    """config.json, a word-level tokenizer covering the vocabulary and, for presets that fit the
    disk, model.safetensors with `random_weights` (rxf then loads it through its normal path)."""
    from safetensors.torch import save_file

    if p.model_type == "gpt_oss":
        build_gpt_oss_checkpoint(p, path)
        return
    path.mkdir(parents=True, exist_ok=True)
    hf_config(p).save_pretrained(path)
    if p.on_disk:
        save_file({n: t.cpu() for n, t in random_weights(p)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_word_tokenizer(p, path)
    sizes = weight_bytes(p, path)
    where = "in " if p.on_disk else "drawn at load; config and tokenizer in "
    print(f"checkpoint: {sizes['weight_bytes'] / 1e9:.2f} GB ({sizes['read_bytes'] / 1e9:.2f} GB read per "
          f"batch-1 token), {where}{path}")


def save_word_tokenizer(p: Preset, path: Path) -> None:
    """A word-level tokenizer whose words t0 .. t{vocab - 1} are the token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rxf.testing.checkpoints import CHATML_TEMPLATE

    vocab = {f"t{i}": i for i in range(p.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0",
                            chat_template=CHATML_TEMPLATE).save_pretrained(path)


def build_gpt_oss_checkpoint(p: Preset, path: Path) -> None:
    """gpt-oss-20b's config (yarn to 128k, a 128-token window on even layers, swiglu limit 7) with
    random weights: bf16 attention (biases, sinks), router and embeddings; the experts as MXFP4
    blocks of random FP4 codes with one scale, 2^-7 (weights of rms ~0.023), and bf16 biases."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig

    path.mkdir(parents=True, exist_ok=True)
    config = GptOssConfig(
        vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, head_dim=p.hd, num_local_experts=p.experts,
        num_experts_per_tok=p.top_k, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        dtype="bfloat16", architectures=["GptOssForCausalLM"],
    )
    config.save_pretrained(path)
    meta = json.loads((path / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(meta, indent=2))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32) * 0.02).to(dtype).cpu()

    def mxfp4(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (p.experts, rows, cols // 32, 16), device="cuda", generator=gen,
                               dtype=torch.uint8).cpu()
        return blocks, torch.full((p.experts, rows, cols // 32), 127 - 7, dtype=torch.uint8)

    q, kv = p.heads * p.hd, p.kv_heads * p.hd
    tensors = {"model.embed_tokens.weight": rand(p.vocab, p.hidden), "lm_head.weight": rand(p.vocab, p.hidden),
               "model.norm.weight": torch.ones(p.hidden, dtype=torch.bfloat16)}
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        for name, (rows, cols) in (("q_proj", (q, p.hidden)), ("k_proj", (kv, p.hidden)), ("v_proj", (kv, p.hidden)),
                                   ("o_proj", (p.hidden, q))):
            tensors[f"{pre}self_attn.{name}.weight"], tensors[f"{pre}self_attn.{name}.bias"] = rand(rows, cols), rand(rows)
        tensors[pre + "self_attn.sinks"] = rand(p.heads)
        tensors[pre + "mlp.router.weight"], tensors[pre + "mlp.router.bias"] = rand(p.experts, p.hidden), rand(p.experts)
        for name, (rows, cols) in (("gate_up_proj", (2 * p.intermediate, p.hidden)), ("down_proj", (p.hidden, p.intermediate))):
            tensors[f"{pre}mlp.experts.{name}_blocks"], tensors[f"{pre}mlp.experts.{name}_scales"] = mxfp4(rows, cols)
            tensors[f"{pre}mlp.experts.{name}_bias"] = rand(p.experts, rows)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[pre + norm + ".weight"] = torch.ones(p.hidden, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_word_tokenizer(p, path)
    sizes = gpt_oss_bytes({n: tuple(t.shape) for n, t in tensors.items()}, p)
    file_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"checkpoint: {file_bytes / 1e9:.2f} GB on disk, {sizes['weight_bytes'] / 1e9:.2f} GB in bf16, "
          f"{sizes['read_bytes'] / 1e9:.2f} GB read per batch-1 token, in {path}")


def gpt_oss_bytes(shapes: dict[str, tuple[int, ...]], p: Preset) -> dict[str, int]:
    """bf16 bytes of the checkpoint once loaded (MXFP4 blocks hold two values per byte; the scales
    are gone), and of what a batch-1 decode token reads: the embedding's one row instead of the
    table, top_k of num_experts experts per layer (their weights and biases)."""
    total = experts = embedding = 0
    for name, shape in shapes.items():
        if name.endswith("_scales"):
            continue
        size = 2 * math.prod(shape) * (2 if name.endswith("_blocks") else 1)
        total += size
        experts += size if ".mlp.experts." in name else 0
        embedding += size if name == "model.embed_tokens.weight" else 0
    read = total - embedding + 2 * p.hidden - experts * (p.experts - p.top_k) // p.experts
    return {"weight_bytes": total, "embedding_bytes": embedding, "read_bytes": read}


# ---------------------------------------------------------------- bandwidth
def copy_rate() -> float:
    """The device's copy rate in bytes a second, read + write: the median of 10 timed 2 GiB copies."""
    src = torch.randn(2 * 2**30 // 4, device="cuda")  # 2 GiB, far beyond L2
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() * 4 / times[len(times) // 2]


def bandwidth() -> None:
    bw = copy_rate()
    RESULTS["copy_bandwidth_GBps"] = bw / 1e9
    # The bytes a batch-1 token reads (`weight_bytes`' formula); callers that set only weight_bytes
    # (gpu_moe.py) have already counted it so.
    RESULTS["roofline_b1_tok_s"] = bw / RESULTS.get("read_bytes", RESULTS["weight_bytes"])
    if "read_bytes" in RESULTS:  # every weight once: the roofline of the earlier Llama figures
        RESULTS["roofline_b1_all_weights_tok_s"] = bw / RESULTS["weight_bytes"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s -> batch-1 roofline {RESULTS['roofline_b1_tok_s']:.1f} tok/s")


# ---------------------------------------------------------------- decode (in-process engine)
def _engine(
    model_dir: Path, backend: str, max_running: int, slots: int | None, random_load: bool = False,
    kv_dtype: str = "auto", quantization: str | None = None, graphs: bool = True,
) -> Any:
    """An in-process Scheduler + ModelRunner on `model_dir` (`random_load`: no checkpoint read,
    `model.load_format = "random"`; `slots` None: the pool sized from memory; `quantization`:
    `model.quantization`; `graphs` False: no CUDA graphs captured)."""
    from transformers import AutoTokenizer

    from rxf.core.config import load_config
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.scheduler.scheduler import Scheduler

    config = load_config({
        "model": {"path": str(model_dir), "dtype": "bfloat16", "context_length": 8192,
                  "load_format": "random" if random_load else "safetensors", "quantization": quantization},
        "runtime": {"device": "cuda", "log_level": "warning"},
        "attention": {"backend": backend},
        "scheduler": {"max_running_requests": max_running, "max_prefill_tokens": 16384, "log_interval": 10**9},
        "cache": {"max_total_tokens": slots, "kv_dtype": kv_dtype},
        # Each bucket's first-use kernel compiles (e.g. the MoE blocks tuned per token count) count
        # toward the capture budget; every bucket is to be captured here, as a server would after warm-up.
        "cuda_graph": {"capture_budget_s": 300, "enabled": graphs},
    })
    start = time.perf_counter()
    runner = ModelRunner(config, PluginRegistry.load(), str(model_dir))
    RESULTS[f"{backend}_runner_start_s"] = time.perf_counter() - start
    return Scheduler(config, runner, AutoTokenizer.from_pretrained(model_dir))


def _add(sched: Any, bs: int, prompt_len: int, new_tokens: int, vocab: int, tag: str) -> None:
    from rxf.core.ipc.messages import PreparedRequest
    from rxf.core.sampling_params import SamplingParams

    rng = random.Random(bs * 1000 + prompt_len)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        sched.add_request(PreparedRequest(f"{tag}{i}", ids, params))


def decode_rate(sched: Any, bs: int, steps: int, vocab: int, graphs: bool, warm: int = 8) -> float:
    """Generated tok/s over `steps` decode steps of `bs` requests (128-token prompts), timed after
    every prompt is prefilled and `warm` decode steps ran."""
    runner, saved = sched.runner, sched.runner.cuda_graphs
    runner.cuda_graphs = saved if graphs else None
    try:
        _add(sched, bs, 128, 1 + warm + steps, vocab, f"d{bs}")
        while sched.waiting or any(not r.decoding for r in sched.running):
            sched.step()
        for _ in range(warm):
            sched.step()
        torch.cuda.synchronize()
        generated, start = sched.counters.generated_tokens, time.perf_counter()
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
        rate = (sched.counters.generated_tokens - generated) / (time.perf_counter() - start)
        while sched.has_work:  # stragglers, if admission split the prefill across decode steps
            sched.step()
        return rate
    finally:
        runner.cuda_graphs = saved


def end_to_end_rate(sched: Any, bs: int, tokens: int, vocab: int) -> float:
    """New tokens/s for `bs` requests of `tokens` prompt + `tokens` new, from queueing to the last token."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    _add(sched, bs, tokens, tokens, vocab, f"e{bs}")
    while sched.has_work:
        sched.step()
    torch.cuda.synchronize()
    return bs * tokens / (time.perf_counter() - start)


QUANT_FORMATS = {"fp8": ("fp8", {}), "ct-fp8": ("ct-channel", {}), "awq": ("awq", {"group_size": 128})}


def quantize_phase(model_dir: Path, name: str) -> Path:
    """`<model_dir>-<name>`: the bf16 checkpoint with its projections quantized (on the GPU)."""
    from rxf.testing.quantized_checkpoints import quantize_checkpoint

    fmt, opts = QUANT_FORMATS[name]
    target = model_dir.parent / f"{model_dir.name}-{name}"
    if not (target / "model.safetensors").exists():
        quantize_checkpoint(model_dir, target, fmt, device="cuda", **opts)
    size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    RESULTS[f"checkpoint_bytes_{name}"] = size
    print(f"{name} checkpoint: {size / 1e9:.2f} GB in {target}")
    return target


def decode_phase(p: Preset, model_dir: Path, backend: str, tag: str = "", quantization: str | None = None) -> None:
    sched = _engine(model_dir, backend, max(p.decode_batches), max(p.decode_batches) * 512 + 4096, not p.on_disk,
                    quantization=quantization)
    graphs = sched.runner.cuda_graphs
    if graphs is not None:
        RESULTS[f"{backend}_graphs"] = {"sizes": graphs.sizes, "capture_s": graphs.capture_s,
                                        "first_use_warm_up_s": graphs.warm_up_s}
        print(f"{backend}: {len(graphs.sizes)} graphs captured in {graphs.capture_s:.1f}s "
              f"(first-use warm-up {graphs.warm_up_s:.1f}s)")
    out: dict[str, float] = {}

    def record(key: str, value: float) -> None:  # printed as it comes: a bounded run keeps what it measured
        out[key] = value
        print(f"decode {backend}{tag} {key}: {value:.1f}", flush=True)

    decode_rate(sched, 1, 16, p.vocab, graphs=True)  # first-use compilation out of the figures
    record("b1_graphs", decode_rate(sched, 1, 256, p.vocab, graphs=True))
    if getattr(sched.runner, "overlap", False):  # the same with overlap scheduling off
        sched.runner.overlap = False
        record("b1_graphs_no_overlap", decode_rate(sched, 1, 256, p.vocab, graphs=True))
        record("b64_graphs_no_overlap", decode_rate(sched, 64, 64, p.vocab, graphs=True))
        sched.runner.overlap = True
    record("b1_eager", decode_rate(sched, 1, 64, p.vocab, graphs=False))
    for bs in p.decode_batches:
        record(f"b{bs}_graphs", decode_rate(sched, bs, 64, p.vocab, graphs=True))
    for bs in p.hf_batches:
        record(f"e2e_b{bs}", end_to_end_rate(sched, bs, p.hf_tokens, p.vocab))
    RESULTS[f"decode_{backend}{tag}"] = out
    print(json.dumps(out, indent=1))


def decode1_phase(p: Preset, model_dir: Path, backend: str, tag: str = "", quantization: str | None = None,
                  batches: tuple[int, ...] = (4, 8, 16)) -> None:
    """The quick A/B of a kernel setting: batch 1 (and `batches`: by default 4, 8, 16, the decode GEMV
    serving up to 8 rows) with CUDA graphs only, an engine of 16 requests or the largest batch (few
    graphs to capture)."""
    size = max((16, *batches))
    sched = _engine(model_dir, backend, size, size * 512 + 4096, not p.on_disk, quantization=quantization)
    decode_rate(sched, 1, 16, p.vocab, graphs=True)  # first-use compilation out of the figures
    out = {"b1_graphs": decode_rate(sched, 1, 256, p.vocab, graphs=True)}
    print(f"decode1 {backend}{tag} b1_graphs: {out['b1_graphs']:.1f}", flush=True)  # kept if a bound stops the rest
    for bs in batches:
        out[f"b{bs}_graphs"] = decode_rate(sched, bs, 64, p.vocab, graphs=True)
    RESULTS[f"decode1_{backend}{tag}"] = out
    print(f"decode1 {backend}{tag}: {json.dumps(out)}", flush=True)


def eager_phase(p: Preset, model_dir: Path, backend: str, tag: str = "", quantization: str | None = None) -> None:
    """Decode with CUDA graphs off (`cuda_graph.enabled = false`), batch 1 and 4, then where a batch-1
    step's host time goes: cProfile over 16 steps, the functions with the most time of their own.
    Run it once per setting (RXF_GEMV=cublas, RXF_PDL=0) for the A/B of what eager steps pay."""
    import cProfile
    import pstats

    sched = _engine(model_dir, backend, 16, 16 * 512 + 4096, not p.on_disk, quantization=quantization, graphs=False)
    decode_rate(sched, 1, 8, p.vocab, graphs=False)  # first-use compilation out of the figures
    out = {}
    for bs in (1, 4):
        out[f"b{bs}_eager"] = decode_rate(sched, bs, 64, p.vocab, graphs=False)
        print(f"eager {backend}{tag} b{bs}_eager: {out[f'b{bs}_eager']:.1f}", flush=True)
    RESULTS[f"eager_{backend}{tag}"] = out
    _add(sched, 1, 128, 64, p.vocab, "prof")
    for _ in range(24):  # the prefill and a few decode steps before the profiled ones
        sched.step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(16):
        sched.step()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    for (file, line, name), (_, calls, own, total, _) in rows:
        print(f"eager profile: {own / 16 * 1e3:7.3f} ms/step own, {total / 16 * 1e3:7.3f} cumulative, "
              f"{calls // 16:5d} calls/step  {Path(file).name}:{line} {name}", flush=True)
    while sched.has_work:
        sched.step()


def routing_phase(p: Preset, model_dir: Path, backend: str) -> None:
    """MoE presets: the distinct experts each layer's decode step reads at batch 1, 4, 8 and 64
    (eager steps, their mean over layers and steps), against uniform routing's expectation: what the
    batch figures' weight reads rest on (random weights whose routing collapsed would read fewer)."""
    from rxf.plugins.models.layers.moe import FusedExperts

    if not p.experts:
        print("routing: a dense preset")
        return
    sched = _engine(model_dir, backend, 64, 64 * 512 + 4096, not p.on_disk, graphs=False)
    forward, counts = FusedExperts.forward, {}

    def counting(self: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        counts.setdefault(x.shape[0], []).append(ids.unique().numel())
        return forward(self, x, weights, ids)

    FusedExperts.forward = counting
    try:
        out = {}
        for bs in (1, 4, 8, 64):
            counts.clear()
            decode_rate(sched, bs, 4, p.vocab, graphs=False, warm=2)
            hit = counts.get(bs, [])
            uniform = p.experts * (1 - (1 - p.top_k / p.experts) ** bs)
            out[f"b{bs}"] = {"experts_hit": sum(hit) / max(len(hit), 1), "uniform": uniform, "calls": len(hit)}
            print(f"routing b{bs}: {out[f'b{bs}']['experts_hit']:.1f} of {p.experts} experts a layer "
                  f"({len(hit)} layer-steps; uniform routing: {uniform:.1f})", flush=True)
    finally:
        FusedExperts.forward = forward
    RESULTS[f"routing_{backend}"] = out


def long_context_rate(sched: Any, bs: int, context: int, steps: int, vocab: int, warm: int = 8) -> dict[str, float]:
    """Generated tok/s over `steps` decode steps once every admitted request of `bs` queued ones
    (`context`-token prompts) decodes; no request finishes within the window. The engine is spent
    afterwards (requests are left queued and running)."""
    _add(sched, bs, context, warm + steps + 64, vocab, f"k{bs}")
    while True:  # admit until the queue is empty or a step admits nothing (the pool is full)
        admitted = len(sched.running)
        sched.step()
        prefilling = any(not r.decoding for r in sched.running)
        if not prefilling and (not sched.waiting or len(sched.running) == admitted):
            break
    for _ in range(warm):
        sched.step()
    torch.cuda.synchronize()
    generated, start, running = sched.counters.generated_tokens, time.perf_counter(), 0
    for _ in range(steps):
        running += len(sched.running)
        sched.step()
    torch.cuda.synchronize()
    return {"tok_s": (sched.counters.generated_tokens - generated) / (time.perf_counter() - start),
            "mean_running": running / steps, "waiting": len(sched.waiting),
            "max_total_tokens": sched.runner.max_total_tokens}


def kvcache_phase(p: Preset, model_dir: Path, backend: str, bs: int = 256, context: int = 4096) -> None:
    out: dict[str, Any] = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        sched = _engine(model_dir, backend, bs, None, not p.on_disk, kv_dtype=kv_dtype)
        out[kv_dtype] = long_context_rate(sched, bs, context, 64, p.vocab)
        print(kv_dtype, json.dumps(out[kv_dtype]), flush=True)
        del sched
        gc.collect()
        torch.cuda.empty_cache()
    out["fp8_over_bf16"] = out["fp8_e4m3"]["tok_s"] / out["auto"]["tok_s"]
    RESULTS[f"kvcache_{backend}"] = out


# ---------------------------------------------------------------- attention kernels
def kernel_time_us(fn: Callable[[], Any], iters: int = 20) -> tuple[float, dict[str, float]]:
    """Mean GPU kernel time per call of `fn` (sum of kernel durations, launch gaps excluded) and the
    per-kernel-name split, from a torch.profiler trace of `iters` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_name[evt.name] += evt.device_time / iters
    return sum(per_name.values()), dict(per_name)


@dataclass
class AttentionCase:
    """One layer's attention inputs over a scattered page-1 pool (random K/V), for any backend."""

    ctx: Any  # AttentionContext
    batch: Any  # ForwardBatch; its attn_backend is set per backend
    layer: Any  # RadixAttention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def make(cls, p: Preset, mode: Any, bs: int, prefix: int, new: int) -> AttentionCase:
        from rxf.core.attention import AttentionContext
        from rxf.core.forward import ForwardBatch
        from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
        from rxf.plugins.models.layers import RadixAttention

        dev, dt, hd, seq, n = torch.device("cuda"), torch.bfloat16, p.hd, prefix + new, bs * new
        req_pool, kv_pool = ReqToTokenPool(bs, seq, dev), TokenToKVPool(bs * seq, 1, p.kv_heads, hd, dt, dev)
        kv_pool.k_buffer[0].normal_()
        kv_pool.v_buffer[0].normal_()
        slots = torch.randperm(bs * seq, device=dev).add_(1).view(bs, seq)  # scattered, like a used pool
        req_pool.req_to_token.copy_(slots)

        def lens(value: int) -> torch.Tensor:
            return torch.full((bs,), value, dtype=torch.int32, device=dev)

        batch = ForwardBatch(
            mode=mode, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=(prefix + torch.arange(new, device=dev)).repeat(bs), req_pool_indices=torch.arange(bs, device=dev),
            seq_lens=lens(seq), prefix_lens=lens(prefix), extend_lens=lens(new),
            out_cache_loc=slots[:, prefix:].reshape(-1).to(torch.int64), seq_lens_cpu=[seq] * bs,
            prefix_lens_cpu=[prefix] * bs, extend_lens_cpu=[new] * bs, logits_indices=torch.arange(n, device=dev),
            req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, attn_backend=None,  # type: ignore[arg-type]
        )
        return cls(
            AttentionContext(req_pool, kv_pool, p.heads, p.kv_heads, hd, dt, dev, bs, seq), batch,
            RadixAttention(0, p.heads, p.kv_heads, hd), torch.randn(n, p.heads, hd, device=dev, dtype=dt),
            torch.randn(n, p.kv_heads, hd, device=dev, dtype=dt), torch.randn(n, p.kv_heads, hd, device=dev, dtype=dt),
        )

    def forward(self, backend_cls: Any) -> tuple[Any, torch.Tensor]:
        """A fresh backend planned for this batch, and its output (the first call: JIT happens here)."""
        backend = backend_cls(self.ctx)
        self.batch.attn_backend = backend
        backend.init_forward_metadata(self.batch)
        return backend, backend.forward(self.q, self.k, self.v, self.layer, self.batch)


def jit_phase(p: Preset) -> None:
    """FlashInfer compiles each kernel on first use, one nvcc run after another when the engine meets
    them; here they compile concurrently (threads wait on nvcc): the fused layer ops and the
    flashinfer backend's decode, ragged and paged prefill kernels at the preset's head shape."""
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope

    from rxf.core.forward import ForwardMode
    from rxf.core.registry import PluginRegistry

    fi_backend = PluginRegistry.load().attention_backend("flashinfer")
    dev, dt, hd = "cuda", torch.bfloat16, p.hd
    x, w = torch.randn(4, p.hidden, device=dev, dtype=dt), torch.ones(p.hidden, device=dev, dtype=dt)
    q, k = torch.randn(4, p.heads * hd, device=dev, dtype=dt), torch.randn(4, p.kv_heads * hd, device=dev, dtype=dt)
    jobs: dict[str, Callable[[], Any]] = {
        "norm": lambda: flashinfer.norm.fused_add_rmsnorm(x, x.clone(), w, 1e-5),
        "silu_and_mul": lambda: flashinfer.activation.silu_and_mul(torch.randn(4, 2 * p.intermediate, device=dev, dtype=dt)),
        "rope": lambda: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            torch.arange(4, device=dev), q, k, hd, torch.randn(64, hd, device=dev), True),
        "decode": lambda: AttentionCase.make(p, ForwardMode.DECODE, 2, 15, 1).forward(fi_backend),
        "ragged": lambda: AttentionCase.make(p, ForwardMode.PREFILL, 2, 0, 16).forward(fi_backend),
        "paged": lambda: AttentionCase.make(p, ForwardMode.EXTEND, 2, 8, 8).forward(fi_backend),
    }
    times: dict[str, str] = {}

    def run(name: str) -> None:
        start = time.perf_counter()
        try:
            jobs[name]()
            torch.cuda.synchronize()
            times[name] = f"{time.perf_counter() - start:.1f}s"
        except Exception as e:
            times[name] = f"failed: {type(e).__name__}: {e}"[:300]

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    RESULTS["flashinfer_jit"] = times
    print("flashinfer JIT, concurrent:", times)


def kernels_phase(p: Preset, backends: list[str]) -> None:
    import triton.testing

    from rxf.core.forward import ForwardMode
    from rxf.core.registry import PluginRegistry

    registry, hd = PluginRegistry.load(), p.hd
    # (label, mode, batch, prefix tokens, new tokens per request)
    shapes = [("decode b1 ctx4096", ForwardMode.DECODE, 1, 4095, 1), ("decode b64 ctx1024", ForwardMode.DECODE, 64, 1023, 1),
              ("extend 8x512 on 512", ForwardMode.EXTEND, 8, 512, 512), ("prefill 4x1024", ForwardMode.PREFILL, 4, 0, 1024)]
    out: dict[str, dict[str, Any]] = {}
    for label, mode, bs, prefix, new in shapes:
        seq = prefix + new
        case = AttentionCase.make(p, mode, bs, prefix, new)
        row: dict[str, Any] = {}
        ref = None
        for name in ["torch_native", *backends]:
            try:
                backend, result = case.forward(registry.attention_backend(name))
                result = result.float()
                ref = result if ref is None else ref
                err = ((result - ref).norm() / ref.norm()).item()
                call = functools.partial(backend.forward, case.q, case.k, case.v, case.layer, case.batch)
                # GPU time is what a CUDA-graph replay pays; do_bench's wall time adds the host's
                # launch overhead (Python launchers), which only eager steps pay.
                gpu_us, _ = kernel_time_us(call)
                wall_ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                ms = gpu_us * 1e-3
                row[name] = {"us": gpu_us, "wall_us": wall_ms * 1e3, "rel_err_vs_torch_native": err}
                if mode.is_decode():  # K and V of every cached token, read once
                    row[name]["kv_TBps"] = bs * seq * p.kv_heads * hd * 2 * 2 / (ms * 1e-3) / 1e12
                else:  # QK^T and PV over the causal-with-prefix region
                    flops = 4 * bs * p.heads * hd * (new * prefix + new * (new + 1) / 2)
                    row[name]["TFLOPs"] = flops / (ms * 1e-3) / 1e12
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        out[label] = row
        print(label, json.dumps(row))
    RESULTS["kernels"] = out


# ---------------------------------------------------------------- offline (Runtime)
def flush_idle(rt: Any, tries: int = 50) -> None:
    """Flush the prefix cache once the scheduler has no request left (its last step may still be
    finishing when `generate` returns)."""
    for _ in range(tries):
        ok, message = rt.flush_cache()
        if ok:
            return
        time.sleep(0.1)
    raise RuntimeError(f"offline: the cache could not be flushed: {message}")


def offline_phase(p: Preset, model_dir: Path, n: int, backend: str, tag: str = "", profile_dir: Path | None = None,
                  kv_dtype: str = "auto", max_running: int = 256, repeats: int = 1) -> None:
    """`kv_dtype`: the KV pool's (`cache.kv_dtype`; figures then tagged `_kv<dtype>`). `max_running`: the
    scheduler's `max_running_requests` and the largest captured decode graph (256 by default; above it,
    the KV pool bounds how many run: an FP8 pool holds twice bf16's tokens; figures then tagged `_r<N>`).
    `repeats`: timed runs in this process, each on its own prompts (the first run's are always the same
    set) after the prefix cache is flushed; the figures are their mean, each run's in `req_s_runs`.
    `profile_dir`: the first timed run is profiled step by step (`Runtime.start_profile`: two CUDA events
    a step), and a second run of n // 4 requests afterwards traces the kernels of two windows (10
    steps from 2 s in, 40 from 8 s in: prefill and decode) into the same folder."""
    from rxf.entrypoints.runtime import Runtime

    lo, hi = p.offline_input // 2, p.offline_input * 3 // 2

    def draw(seed: int, count: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, p.vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]

    runs = [draw(seed, n) for seed in range(repeats)]
    prompts = runs[0]
    params = {"max_new_tokens": p.offline_output, "temperature": 0.0, "ignore_eos": True}
    # Warm-up on other prompts of the same lengths: whole prefill chunks, mixed steps and decode at tens
    # of rows, so that the Triton kernels' first compiles for the row counts a run meets (a launch
    # specializes on an integer argument divisible by 16, say) fall here and not in a timed run, where
    # they fell on whichever tree of a comparison ran first.
    warm_prompts = draw(-1, 48)
    start = time.perf_counter()
    runtime = {"device": "cuda", "log_level": "warning"} | ({"profile_dir": str(profile_dir)} if profile_dir else {})
    with Runtime.from_config({
        "model": {"path": str(model_dir), "dtype": "bfloat16", "context_length": hi + p.offline_output + 64},
        "runtime": runtime,
        "attention": {"backend": backend},
        "scheduler": {"max_running_requests": max_running, "max_prefill_tokens": 16384},
        "cuda_graph": {"max_bs": max_running},
        "cache": {"kv_dtype": kv_dtype},
    }) as rt:
        started = time.perf_counter() - start
        rt.generate(input_ids=warm_prompts, sampling_params=params | {"max_new_tokens": 16})
        times = []
        for r, run_prompts in enumerate(runs):
            flush_idle(rt)  # every run starts from an empty pool
            if profile_dir and r == 0:
                rt.start_profile()
            start = time.perf_counter()
            results = rt.generate(input_ids=run_prompts, sampling_params=params)
            times.append(time.perf_counter() - start)
            if profile_dir and r == 0:
                print("offline step profile:", rt.stop_profile())
            print(f"offline run {r}: {times[-1]:.2f} s, {n / times[-1]:.2f} req/s", flush=True)
        print("offline stats:", rt.get_stats())  # the KV pool's size among them
        if profile_dir:
            windows = [threading.Timer(at, lambda k=k: print("kernel profile:", rt.start_profile(k, kernels=True)))
                       for at, k in ((2.0, 10), (8.0, 40))]
            for w in windows:
                w.start()
            rt.generate(input_ids=prompts[: n // 4], sampling_params=params)
    elapsed = sum(times) / repeats
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)  # the same in every run
    in_tokens = sum(len(x) for run_prompts in runs for x in run_prompts) / repeats
    tag += ("" if kv_dtype == "auto" else f"_kv{kv_dtype}") + ("" if max_running == 256 else f"_r{max_running}")
    RESULTS[f"offline{tag}"] = {"kv_dtype": kv_dtype, "max_running": max_running, "requests": n, "backend": backend, "startup_s": started, "seconds": elapsed,
                                "req_s": n / elapsed, "req_s_runs": [round(n / t, 2) for t in times],
                                "output_tok_s": out_tokens / elapsed,
                                "total_tok_s": (in_tokens + out_tokens) / elapsed}
    print(json.dumps(RESULTS[f"offline{tag}"], indent=1))


# ---------------------------------------------------------------- transformers
def hf_phase(p: Preset, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # MXFP4 experts (gpt-oss): transformers dequantizes them to bf16 too, on the GPU as it loads.
    quantized = {"quantization_config": Mxfp4Config(dequantize=True), "device_map": "cuda"} if p.model_type == "gpt_oss" else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **quantized).cuda().eval()
    rng = random.Random(1)
    out: dict[str, float] = {}
    for bs in p.hf_batches:
        ids = torch.tensor([[rng.randrange(3, p.vocab) for _ in range(p.hf_tokens)] for _ in range(bs)], device="cuda")
        kwargs = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=p.hf_tokens, min_new_tokens=p.hf_tokens, **kwargs)
        torch.cuda.synchronize()
        out[f"b{bs}"] = bs * p.hf_tokens / (time.perf_counter() - start)
    RESULTS["hf_generate_tok_s"] = out
    print(json.dumps(out))
    del model


# ---------------------------------------------------------------- report
def report(p: Preset) -> None:
    roof, roof_all = RESULTS.get("roofline_b1_tok_s"), RESULTS.get("roofline_b1_all_weights_tok_s")
    hf = RESULTS.get("hf_generate_tok_s", {})
    print("\n| figure | tok/s | ratio |\n|---|---|---|")
    if roof:
        print(f"| roofline batch 1 ({RESULTS['copy_bandwidth_GBps'] / 1e3:.2f} TB/s over "
              f"{RESULTS['read_bytes'] / 1e9:.2f} GB read per token) | {roof:.1f} | |")
        print(f"| roofline batch 1 over all {RESULTS['weight_bytes'] / 1e9:.2f} GB of weights (earlier figures') "
              f"| {roof_all:.1f} | |")
    for backend in ("triton", "flashinfer"):
        d = RESULTS.get(f"decode_{backend}")
        if not d:
            continue
        for key, value in d.items():
            ratio = ""
            if key.startswith("b1_") and roof:
                ratio = f"{value / roof:.1%} of roofline ({value / roof_all:.1%} of all-weights roofline)"
            elif key.startswith("e2e_b") and hf.get(key[4:]):
                ratio = f"{value / hf[key[4:]]:.2f}x HF"
            print(f"| {backend} {key} | {value:.1f} | {ratio} |")
    for backend in ("triton", "flashinfer"):
        k = RESULTS.get(f"kvcache_{backend}")
        for kv_dtype in ("auto", "fp8_e4m3") if k else ():
            row = k[kv_dtype]
            ratio = f"{k['fp8_over_bf16']:.2f}x bf16 KV" if kv_dtype != "auto" else ""
            print(f"| {backend} decode, 256 x 4096-token contexts, kv_dtype {kv_dtype} ({row['max_total_tokens']} "
                  f"slots, {row['mean_running']:.0f} running) | {row['tok_s']:.1f} | {ratio} |")
    for key, value in hf.items():
        print(f"| HF generate {key} ({p.hf_tokens}+{p.hf_tokens}) | {value:.1f} | |")
    if "offline" in RESULTS:
        o = RESULTS["offline"]
        print(f"| offline {o['requests']} req ({o['backend']}): output tok/s | {o['output_tok_s']:.1f} | "
              f"{o['req_s']:.2f} req/s |")
    for label, row in RESULTS.get("kernels", {}).items():
        cells = ", ".join(f"{k} {v['us']:.1f}us (wall {v['wall_us']:.1f})" if "us" in v else f"{k} failed"
                          for k, v in row.items())
        tri, fi = row.get("triton", {}).get("us"), row.get("flashinfer", {}).get("us")
        print(f"| kernel {label} (GPU time) | {cells} | {f'triton/flashinfer {tri / fi:.2f}' if tri and fi else ''} |")
    for name in QUANT_FORMATS:
        for backend in ("triton", "flashinfer"):
            d, base = RESULTS.get(f"decode_{backend}_{name}"), RESULTS.get(f"decode_{backend}", {})
            for key, value in (d or {}).items():
                ratio = f"{value / base[key]:.2f}x bf16" if base.get(key) else ""
                print(f"| {backend} {name} {key} | {value:.1f} | {ratio} |")
        o, base = RESULTS.get(f"offline_{name}"), RESULTS.get("offline")
        if o:
            ratio = f"{o['output_tok_s'] / base['output_tok_s']:.2f}x bf16" if base else ""
            print(f"| offline {o['requests']} req {name} ({o['backend']}): output tok/s | {o['output_tok_s']:.1f} | {ratio} |")
    if RESULTS.get("failed"):
        print("failed phases:", ", ".join(RESULTS["failed"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--num-requests", type=int, default=1000, help="offline phase requests")
    ap.add_argument("--phases", default="jit,build,bandwidth,decode,kernels,offline,hf")
    ap.add_argument("--backends", default="triton,flashinfer", help="decode/kernels; offline uses the last")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: /tmp/rxf-bench-<preset>")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--profile-dir", type=Path, default=None,
                    help="offline: profile the timed run's steps and trace two kernel windows into this folder")
    ap.add_argument("--offline-kv-dtype", default="auto", help="offline: the KV pool's dtype (auto, fp8_e4m3)")
    ap.add_argument("--offline-max-running", type=int, default=256,
                    help="offline: max_running_requests and the largest decode graph")
    ap.add_argument("--offline-repeats", type=int, default=1,
                    help="offline: timed runs in one process (each on its own prompts); figures are their mean")
    ap.add_argument("--decode1-batches", default="4,8,16", help="decode1: the batch sizes after batch 1")
    ap.add_argument("--random-weights", action="store_true",
                    help="no checkpoint written: the decode phase draws the weights at load, as for presets too large for the disk")
    ap.add_argument("--quantization", default="bf16",
                    help=f"comma-separated: bf16 and/or {', '.join(QUANT_FORMATS)}; decode and offline run per format")
    args = ap.parse_args()
    decode1_batches = tuple(int(b) for b in args.decode1_batches.split(",") if b)
    formats = args.quantization.split(",")
    unknown = sorted(set(formats) - {"bf16", *QUANT_FORMATS})
    if unknown:
        ap.error(f"--quantization: unknown {', '.join(unknown)} (bf16, {', '.join(QUANT_FORMATS)})")
    p, phases, backends = PRESETS[args.preset], set(args.phases.split(",")), args.backends.split(",")
    if args.random_weights:
        p = dataclasses.replace(p, on_disk=False)
    model_dir = args.model_dir or Path(f"/tmp/rxf-bench-{args.preset}")
    RESULTS.update(date=datetime.now(UTC).isoformat(timespec="seconds"), preset=args.preset, command=" ".join(sys.argv),
                   device=torch.cuda.get_device_name(), torch=torch.__version__)
    if "jit" in phases:
        phase("jit", lambda: jit_phase(p))
    if "build" in phases or not (model_dir / ("model.safetensors" if p.on_disk else "config.json")).exists():
        phase("build", lambda: build_checkpoint(p, model_dir))
    RESULTS.update(weight_bytes(p, model_dir))
    if not p.on_disk and phases & {"offline", "hf"}:
        print(f"offline and hf skipped: {args.preset}'s weights are random in the decode phase (load_format random), not on disk")
        phases -= {"offline", "hf"}
    if "bandwidth" in phases:
        phase("bandwidth", bandwidth)
    dirs, online = {"bf16": model_dir}, {}  # format -> checkpoint; format -> model.quantization over random weights
    if not p.on_disk:
        skipped = [f for f in formats if f not in ("bf16", "fp8")]
        if skipped:
            print(f"{', '.join(skipped)} skipped: {args.preset}'s checkpoint is not on disk (fp8 runs online)")
        formats = [f for f in formats if f in ("bf16", "fp8")]
        if "fp8" in formats:
            dirs["fp8"], online["fp8"] = model_dir, "fp8"
    for name in formats:
        if name not in dirs and phases & {"decode", "decode1", "offline"}:
            phase(f"quantize {name}", lambda n=name: dirs.update({n: quantize_phase(model_dir, n)}))
    runs = [(name, "" if name == "bf16" else f"_{name}") for name in formats if name in dirs]
    if "decode" in phases:
        for name, tag in runs:
            for backend in backends:
                phase(f"decode {backend} {name}",
                      lambda b=backend, n=name, t=tag: decode_phase(p, dirs[n], b, t, online.get(n)))
    if "decode1" in phases:
        for name, tag in runs:
            for backend in backends:
                phase(f"decode1 {backend} {name}",
                      lambda b=backend, n=name, t=tag: decode1_phase(p, dirs[n], b, t, online.get(n), decode1_batches))
    if "eager" in phases:
        for name, tag in runs:
            for backend in backends:
                phase(f"eager {backend} {name}",
                      lambda b=backend, n=name, t=tag: eager_phase(p, dirs[n], b, t, online.get(n)))
    if "routing" in phases:
        phase("routing", lambda: routing_phase(p, model_dir, backends[0]))
    if "kvcache" in phases:
        for backend in backends:
            phase(f"kvcache {backend}", lambda b=backend: kvcache_phase(p, model_dir, b))
    if "kernels" in phases:
        phase("kernels", lambda: kernels_phase(p, backends))
    if "offline" in phases:
        for name, tag in runs:
            phase(f"offline {name}", lambda n=name, t=tag: offline_phase(
                p, dirs[n], args.num_requests, backends[-1], t, args.profile_dir, args.offline_kv_dtype,
                args.offline_max_running, args.offline_repeats))
    if "hf" in phases:
        phase("hf", lambda: hf_phase(p, model_dir))
    output = args.output or (Path(os.environ["OUT"]) / "gpu_decode.json" if os.environ.get("OUT") else None)
    if output is not None:
        output.write_text(json.dumps(RESULTS, indent=1))
    report(p)


if __name__ == "__main__":
    main()
