"""GPU speculative-decoding benchmark (issue 20): what a verify forward costs, and what each method gives.

    python benchmarks/gpu_spec.py [--preset llama3-8b|tiny] [--phases verify,ngram,draft,eagle3]
        [--backends triton,flashinfer] [--model-dir DIR] [--output FILE] [--device cuda|cpu] [--quick]

Weights: with `--model-dir`, the checkpoint gpu_decode.py's build wrote there (loaded through rxf's
normal path); without, gpu_decode.py's config and tokenizer for the preset in /tmp/rxf-spec-<preset>
and the weights drawn at load (`model.load_format = "random"`, seconds for 8B). Either way every
attention block's o_proj is then zeroed in place: attention still runs at full cost, but the target's
next token becomes a function of the current token alone, so its greedy continuation of a prompt
that holds that function's orbit copies the prompt. That is the input-grounded workload n-gram
speculation needs, which random weights otherwise never give; the draft model and the EAGLE-3 head
are random and agree with the target about never (their accept length is ~1, reported as measured).

Phases (each guarded: a failure prints its traceback and the others still run):
  verify  per backend: wall time (synchronised, median of 25) of a verify forward of the newest
          token + k drafts (k = 2, 4, 8: an EXTEND of k + 1 tokens per request over a 512-token
          context) over one DECODE step, at batch 1 and 16: as serving runs it (decode rows,
          replayed from a CUDA graph) and as the eager extend it replaces; the decode step
          replayed from a CUDA graph and eagerly
  ngram   end to end through the in-process Scheduler, batch 1 and 4: 1024-token prompts holding
          the target's orbit (a random map of a 128k vocabulary enters its cycle after ~450 tokens,
          so 256-token prompts mostly held none of the continuation), 256 new tokens, ngram (k = 8)
          on vs off: tok/s, their ratio, and the accept length (completion tokens / verify forwards)
  draft   a Llama-3.2-1B-shaped random draft model, k = 4, batch 1 and 4
  eagle3  an EAGLE-3 head of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's shape (one layer, draft vocabulary
          32000, the target's embedding), random weights, chain of k = 4, batch 1 and 4; the target
          captures its three layers' states
  eagle3_tree  (with eagle3 in --phases too) the same head drafting trees: tree_topk 4, tree_depth
          5, the 16 best nodes verified
For draft and eagle3, `speculative steps x accept length = speed-up`: the accept length (tokens
per request per step), the step-time ratio (a plain decode step's time over a speculative step's,
both whole scheduler steps: drafting, verify, sampling, bookkeeping) and their product, which is
the measured tok/s ratio; a trained draft's speed-up is its accept length times the same ratio.
Takes ~2-3 minutes on an H200 with FlashInfer's JIT cache warm (gpu_decode.py --phases jit).
Prints a table; writes the figures as JSON to --output or $OUT/gpu_spec.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode as gd  # noqa: E402  (its presets, checkpoint building and phase guard)

RESULTS = gd.RESULTS
DEVICE = "cuda"
# The runners' speculative settings size their CUDA graphs (a verify's rows are decode rows): the
# shared runner's for the verify and ngram phases (the schedulers bring their own settings); the
# draft and EAGLE-3 phases speculate with MECHANICS.
VERIFY_ROWS = {"method": "ngram", "num_draft_tokens": 8, "max_batch_size": 16}
MECHANICS = {"num_draft_tokens": 4, "max_batch_size": 16}
EAGLE_TREE = {"tree_topk": 4, "tree_depth": 5, "num_draft_tokens": 16}  # (SGLang's EAGLE-3 examples: 8 / 5 / 64)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- engines
def _base_config(model_dir: Path, backend: str, random_load: bool, extra: dict[str, Any] | None = None) -> dict:
    config = {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if DEVICE == "cuda" else "float32", "context_length": 4096,
                  "load_format": "random" if random_load else "safetensors"},
        "runtime": {"device": DEVICE, "log_level": "warning"},
        "attention": {"backend": backend},
        "scheduler": {"max_running_requests": 16, "log_interval": 10**9},
        "cache": {"max_total_tokens": 32768},
        # Buckets up to 16 requests x (8 drafts + 1): verifies replay decode graphs too.
        "cuda_graph": {"max_bs": 144, "capture_budget_s": 300},
    }
    for section, values in (extra or {}).items():
        config[section] = {**config.get(section, {}), **values}
    return config


def _runner(config: Any, aux: tuple[int, ...] = ()) -> Any:
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner

    start = time.perf_counter()
    runner = ModelRunner(config, PluginRegistry.load(), config.model.path, aux_hidden_layers=aux)
    with torch.no_grad():
        for name, param in runner.model.named_parameters():
            if name.endswith("o_proj.weight"):
                param.zero_()  # in place: captured CUDA graphs read the same memory
    print(f"runner ({config.attention.backend}, aux {list(aux)}) in {time.perf_counter() - start:.1f}s", flush=True)
    return runner


def _scheduler(config: Any, runner: Any, draft: Any = None) -> Any:
    from transformers import AutoTokenizer

    from rxf.core.scheduler.scheduler import Scheduler

    runner.req_to_token_pool.clear()  # a fresh scheduler over the runner's pools (the last one flushed)
    runner.token_to_kv_pool.clear()
    return Scheduler(config, runner, AutoTokenizer.from_pretrained(config.model.path), draft=draft)


def _add(sched: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> None:
    from rxf.core.ipc.messages import PreparedRequest
    from rxf.core.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(PreparedRequest(f"{tag}{i}", ids, params))


def _run(sched: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    while sched.has_work:
        for o in sched.step():
            r = out.setdefault(o.rid, {"ids": [], "verify": 0})
            r["ids"] += o.new_token_ids
            r["verify"] = o.spec_verify_ct
    return out


def _random_prompts(bs: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(bs)]


# ---------------------------------------------------------------- verify
def _median_s(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def verify_phase(runner: Any, vocab: int, backend: str, iters: int, context: int = 512) -> None:
    from rxf.core.forward import ForwardMode
    from rxf.core.runner.model_runner import ModelInput

    out: dict[str, float] = {}
    for bs in (1, 16):
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool.clear()
        rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
        prompts = _random_prompts(bs, context, vocab, bs)
        runner.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in prompts for t in p], [0] * bs, [context] * bs,
                                  runner.token_to_kv_pool.alloc(bs * context)))
        slots = runner.token_to_kv_pool.alloc(bs * 9)  # positions context .. context + 8, rewritten by every call
        last = [p[-1] for p in prompts]

        step = ModelInput(ForwardMode.DECODE, rows, last, [context] * bs, [1] * bs, slots[:bs])

        def decode(step: ModelInput = step) -> None:
            runner.forward(step)

        saved = runner.cuda_graphs
        if saved is not None:
            out[f"b{bs}_decode_graph_ms"] = 1e3 * _median_s(decode, iters)
        runner.cuda_graphs = None
        try:
            out[f"b{bs}_decode_eager_ms"] = 1e3 * _median_s(decode, iters)
        finally:
            runner.cuda_graphs = saved
        for k in (2, 4, 8):
            inp = ModelInput(ForwardMode.EXTEND, rows, last * (k + 1), [context] * bs, [k + 1] * bs,
                             slots[: bs * (k + 1)], logits_start=[0] * bs)
            # As serving runs it: decode rows (replayed from a graph where a bucket holds them) ...
            ms = 1e3 * _median_s(lambda i=inp: runner.forward(i), iters)
            out[f"b{bs}_verify_k{k}_ms"] = ms
            base = out.get(f"b{bs}_decode_graph_ms", out[f"b{bs}_decode_eager_ms"])
            out[f"b{bs}_verify_k{k}_over_decode"] = ms / base
            # ... and as the eager extend it replaces.
            attn = runner.attn_backend
            attn.verifies_as_decode = False
            try:
                out[f"b{bs}_verify_extend_k{k}_ms"] = 1e3 * _median_s(lambda i=inp: runner.forward(i), iters)
            finally:
                del attn.verifies_as_decode  # back to the class's
    RESULTS[f"verify_{backend}"] = out
    print(json.dumps(out, indent=1))


# ---------------------------------------------------------------- ngram (end to end)
def orbit_prompts(runner: Any, config: Any, bs: int, length: int, vocab: int) -> list[list[int]]:
    """Prompts whose greedy continuation repeats them: a random token, then `length - 1` greedy
    tokens of the target (a function of the current token: it enters a cycle)."""
    sched = _scheduler(config, runner)
    seeds = _random_prompts(bs, 1, vocab, 7)
    _add(sched, seeds, length - 1, "orbit")
    out = _run(sched)
    sched.flush_cache()
    return [seeds[i] + out[f"orbit{i}"]["ids"] for i in range(bs)]


def e2e(sched: Any, prompts: list[list[int]], new: int, tag: str) -> dict[str, Any]:
    _sync()
    start = time.perf_counter()
    _add(sched, prompts, new, tag)
    out = _run(sched)
    _sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(r["ids"]) for r in out.values())
    verify = sum(r["verify"] for r in out.values())
    sched.flush_cache()
    return {"tok_s": tokens / seconds, "accept_length": tokens / verify if verify else None,
            "outputs": [out[f"{tag}{i}"]["ids"] for i in range(len(prompts))]}


def ngram_phase(runner: Any, base: dict, vocab: int, new: int) -> None:
    from rxf.core.config import load_config

    out: dict[str, Any] = {}
    plain = load_config(base)
    ngram = load_config(base, **{"speculative.method": "ngram", "speculative.num_draft_tokens": 8,
                                 "speculative.max_batch_size": 16})
    for bs in (1, 4):
        prompts = orbit_prompts(runner, plain, bs, 1024, vocab)
        off = e2e(_scheduler(plain, runner), prompts, new, f"off{bs}-")
        on = e2e(_scheduler(ngram, runner), prompts, new, f"on{bs}-")
        # The prompts' distinct tokens: how much the orbit varies (1 would be a fixed point).
        out[f"b{bs}"] = {"off_tok_s": off["tok_s"], "on_tok_s": on["tok_s"], "speedup": on["tok_s"] / off["tok_s"],
                         "accept_length": on["accept_length"], "same_tokens": on["outputs"] == off["outputs"],
                         "distinct_prompt_tokens": [len(set(p)) for p in prompts]}
    RESULTS["ngram"] = out
    print(json.dumps(out, indent=1))


# ---------------------------------------------------------------- draft and eagle3 mechanics
def step_rates(sched: Any, prompts: list[list[int]], steps: int, warm: int = 4) -> tuple[float, float]:
    """(seconds per scheduler step, tokens per request per step) over `steps` steps once every
    request decodes."""
    _add(sched, prompts, 1 + 9 * (warm + steps), "s")
    while sched.waiting or any(not r.decoding for r in sched.running):
        sched.step()
    for _ in range(warm):
        sched.step()
    _sync()
    generated, start = sched.counters.generated_tokens, time.perf_counter()
    for _ in range(steps):
        sched.step()
    _sync()
    seconds = time.perf_counter() - start
    tokens = sched.counters.generated_tokens - generated
    for r in list(sched.running):
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()
    sched.flush_cache()
    return seconds / steps, tokens / (steps * len(prompts))


def mechanics(name: str, plain_runner: Any, spec_runner: Any, base: dict, spec: dict, load: Any, vocab: int,
              steps: int) -> None:
    from rxf.core.config import load_config
    from rxf.core.registry import PluginRegistry

    plain = load_config(base)
    config = load_config(base, speculative={**MECHANICS, **spec})
    drafter = load(config, PluginRegistry.load(), spec_runner)
    out: dict[str, Any] = {}
    for bs in (1, 4):
        prompts = _random_prompts(bs, 128, vocab, 11 + bs)
        t_plain, _ = step_rates(_scheduler(plain, plain_runner), prompts, steps)
        t_spec, accept = step_rates(_scheduler(config, spec_runner, drafter), prompts, steps)
        out[f"b{bs}"] = {"plain_step_ms": 1e3 * t_plain, "spec_step_ms": 1e3 * t_spec, "accept_length": accept,
                         "step_ratio": t_plain / t_spec, "speedup": accept * t_plain / t_spec}
    RESULTS[name] = out
    print(json.dumps(out, indent=1))


def draft_dir(p: gd.Preset, root: Path) -> Path:
    """config.json of a Llama-3.2-1B-shaped draft (a quarter of the preset's width for others)."""
    from transformers import AutoConfig

    path = root / "draft"
    path.mkdir(parents=True, exist_ok=True)
    big = p.hidden >= 4096
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8) if big else dict(hidden_size=p.hidden // 2, intermediate_size=p.intermediate // 2,
                                                        num_hidden_layers=2, num_attention_heads=p.heads // 2,
                                                        num_key_value_heads=p.kv_heads)
    AutoConfig.for_model("llama", vocab_size=p.vocab, tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
                         bos_token_id=1, eos_token_id=2, dtype="bfloat16", **shape, **p.extra).save_pretrained(path)
    return path


def head_dir(p: gd.Preset, root: Path) -> Path:
    """config.json of an EAGLE-3 head for the preset, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's reads."""
    path = root / "eagle3"
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": p.hidden, "intermediate_size": p.intermediate, "num_attention_heads": p.heads,
              "num_key_value_heads": p.kv_heads, "vocab_size": p.vocab, "draft_vocab_size": min(32000, p.vocab // 4),
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# ---------------------------------------------------------------- report
def report() -> None:
    print("\n| figure | value |\n|---|---|")
    for key in [k for k in RESULTS if k.startswith("verify_")]:
        v = RESULTS[key]
        for bs in (1, 16):
            base = v.get(f"b{bs}_decode_graph_ms")
            print(f"| {key} b{bs} decode step: graph {base or float('nan'):.2f} ms, eager {v[f'b{bs}_decode_eager_ms']:.2f} ms | |")
            for k in (2, 4, 8):
                print(f"| {key} b{bs} verify {k} drafts ({k + 1} tokens) | {v[f'b{bs}_verify_k{k}_ms']:.2f} ms = "
                      f"{v[f'b{bs}_verify_k{k}_over_decode']:.2f}x a decode step "
                      f"(as an eager extend: {v[f'b{bs}_verify_extend_k{k}_ms']:.2f} ms) |")
    for bs, row in RESULTS.get("ngram", {}).items():
        print(f"| ngram {bs}: {row['off_tok_s']:.1f} -> {row['on_tok_s']:.1f} tok/s | {row['speedup']:.2f}x at accept length "
              f"{row['accept_length']:.2f} (same tokens: {row['same_tokens']}) |")
    for name in ("draft", "eagle3", "eagle3_tree"):
        for bs, row in RESULTS.get(name, {}).items():
            print(f"| {name} {bs}: step {row['plain_step_ms']:.2f} -> {row['spec_step_ms']:.2f} ms | accept length "
                  f"{row['accept_length']:.2f} x step ratio {row['step_ratio']:.2f} = {row['speedup']:.2f}x |")
    if RESULTS.get("failed"):
        print("failed phases:", ", ".join(RESULTS["failed"]))


def main() -> None:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["llama3-8b", "tiny"], default="llama3-8b")
    ap.add_argument("--phases", default="verify,ngram,draft,eagle3")
    ap.add_argument("--backends", default="triton,flashinfer", help="verify per backend; the others use the last")
    ap.add_argument("--model-dir", type=Path, default=None, help="a checkpoint gpu_decode.py built (loaded)")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the script")
    ap.add_argument("--quick", action="store_true", help="few iterations and tokens (a smoke run)")
    args = ap.parse_args()
    DEVICE = args.device
    p, phases, backends = gd.PRESETS[args.preset], set(args.phases.split(",")), args.backends.split(",")
    random_load = args.model_dir is None
    model_dir = args.model_dir or Path(f"/tmp/rxf-spec-{args.preset}")
    if random_load:
        model_dir.mkdir(parents=True, exist_ok=True)
        gd.hf_config(p).save_pretrained(model_dir)
        gd.save_word_tokenizer(p, model_dir)
    iters, new, steps = (5, 24, 6) if args.quick else (25, 256, 32)
    RESULTS.update(date=datetime.now(UTC).isoformat(timespec="seconds"), preset=args.preset, command=" ".join(sys.argv),
                   device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                   weights="random at load" if random_load else str(model_dir))
    from rxf.core.config import load_config

    runner = base = None
    for i, backend in enumerate(backends):
        base = _base_config(model_dir, backend, random_load)
        if "verify" in phases or i == len(backends) - 1:
            if runner is not None:
                del runner
                gc.collect()
            runner = _runner(load_config(base, speculative=VERIFY_ROWS))
        if "verify" in phases:
            gd.phase(f"verify {backend}", lambda b=backend, r=runner: verify_phase(r, p.vocab, b, iters))
    if "ngram" in phases:
        gd.phase("ngram", lambda: ngram_phase(runner, base, p.vocab, new))
    if "draft" in phases:
        from rxf.core.speculative.draft import load_draft_model

        spec = {"method": "draft", "draft_model_path": str(draft_dir(p, model_dir.parent / f"{model_dir.name}-drafts"))}
        gd.phase("draft", lambda: mechanics("draft", runner, runner, base, spec, load_draft_model, p.vocab, steps))
    if "eagle3" in phases:
        from rxf.core.speculative.eagle import load_eagle3, target_aux_layers

        spec = {"method": "eagle3", "draft_model_path": str(head_dir(p, model_dir.parent / f"{model_dir.name}-drafts"))}

        def eagle3(name: str, extra: dict[str, Any]) -> None:
            config = load_config(base, speculative={**spec, **MECHANICS, **extra})
            target = _runner(config, target_aux_layers(config, str(model_dir)))
            mechanics(name, runner, target, base, {**spec, **extra}, load_eagle3, p.vocab, steps)

        gd.phase("eagle3", lambda: eagle3("eagle3", {}))
        if "eagle3_tree" in phases:
            gd.phase("eagle3_tree", lambda: eagle3("eagle3_tree", EAGLE_TREE))
    output = args.output or (Path(os.environ["OUT"]) / "gpu_spec.json" if os.environ.get("OUT") else None)
    if output is not None:
        output.write_text(json.dumps(RESULTS, indent=1))
    report()


if __name__ == "__main__":
    main()
