"""N-gram speculative decoding on the CPU, demo model, batch 1: on vs off, with llama.cpp's
prompt-lookup decoding (the same idea) on vs off as the peer, in one run.

    .venv/bin/python benchmarks/bench_spec_cpu.py --llamacpp-python /work/venv-llamacpp/bin/python

Workload: input-grounded chat requests, where the answer copies the prompt: "repeat this passage
with one word changed" and code edits (rename, add a line). Each request runs alone (batch 1),
greedy, up to --max-new-tokens tokens (it stops at EOS, the same tokens with speculation on or
off), after one warm-up request, streamed. Reported per engine and mode: output tokens / wall time
of the requests (end to end, prefill included), decode tokens/s (the tokens after the first / the
time after the first token arrived), and for rxf the accept length = completion_tokens /
spec_verify_ct (tokens per decode forward). llama.cpp runs in its own venv (`llama-cpp-python`, given by
--llamacpp-python) on the GGUF the demo model is converted from (Q4_1 weights: its absolute speed is
not comparable with rxf's float32; its on/off ratio is), with `LlamaPromptLookupDecoding`
(`--draft-tokens` tokens, its max n-gram size 2, its default) against no draft model.

`--verify-cost` measures instead what a verify forward costs against a decode step (the demo
model's `ModelRunner` directly, 300-token prefixes): the median of 5 forwards of k + 1 tokens per
request, k = 0 (a decode step), 4 and 8, at batch 1, 2, 4 and 8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_cpu import demo_gguf  # noqa: E402

PASSAGE = (
    "The old lighthouse stood at the edge of the northern cliffs for more than two hundred years. Every "
    "evening the keeper climbed its one hundred and twelve steps, trimmed the wick, polished the great "
    "brass lens and lit the lamp that warned the fishing boats away from the rocks. In winter the storms "
    "rattled the windows and the spray reached the gallery, but the light never failed. When the keeper "
    "grew old, his daughter took over the work, and she kept the same careful log of wind, weather and "
    "passing ships that her father had kept before her."
)
CODE = '''def summarize(orders):
    total = 0
    count = 0
    largest = None
    for order in orders:
        amount = order["quantity"] * order["price"]
        total += amount
        count += 1
        if largest is None or amount > largest:
            largest = amount
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average, "largest": largest}
'''
PROMPTS = [
    f"Repeat this passage with one word changed: replace \"lighthouse\" with \"tower\". Write the whole passage.\n\n{PASSAGE}",
    f"Rename the variable `amount` to `value` in this function. Reply with the complete function only.\n\n{CODE}",
    f"Repeat this passage exactly, word for word.\n\n{PASSAGE}",
    f"Add a docstring line to this function and reply with the complete function.\n\n{CODE}",
]

LLAMACPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
args = json.loads(sys.argv[1])
out = {}
for mode in ("off", "on"):
    draft = LlamaPromptLookupDecoding(num_pred_tokens=args["draft_tokens"]) if mode == "on" else None
    llm = Llama(model_path=args["gguf"], n_ctx=2048, n_threads=args["threads"], n_batch=512, draft_model=draft,
                verbose=False, seed=0)
    msgs = lambda p: [{"role": "user", "content": p}]
    llm.create_chat_completion(msgs("Hello"), max_tokens=8, temperature=0.0)  # warm-up
    tokens, seconds, decode_s, texts = 0, 0.0, 0.0, []
    for p in args["prompts"]:
        start = time.perf_counter()
        first, n, text = None, 0, ""
        for chunk in llm.create_chat_completion(msgs(p), max_tokens=args["max_new_tokens"], temperature=0.0,
                                                stream=True):
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter()
                text += delta
        end = time.perf_counter()
        n = len(llm.tokenize(text.encode(), add_bos=False, special=False))  # streamed chunks carry no usage
        seconds += end - start
        decode_s += end - first
        tokens += n
        texts.append(text)
    out[mode] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                 "decode_tokens_per_s": (tokens - len(args["prompts"])) / decode_s, "texts": texts}
    del llm
print(json.dumps(out))
"""


def run_rxf(method: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rxf import Runtime
    from rxf.entrypoints.demo_model import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("demo"))
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]

    overrides = {"runtime.cpu_threads": args.threads, "speculative.method": method, "model.dtype": args.dtype,
                 "speculative.num_draft_tokens": args.draft_tokens, "speculative.ngram_min_match": args.min_match}
    with Runtime.from_config(REPO / "examples" / "demo.toml", **overrides) as rt:
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
        rt.chat([{"role": "user", "content": "Hello"}], {"temperature": 0, "max_new_tokens": 8})  # warm-up
        tokens = verify = 0
        seconds = decode_s = 0.0
        texts = []
        for p in chats:
            start = time.perf_counter()
            first, text = None, ""
            for chunk in rt.generate(p, params, stream=True):
                first = first or time.perf_counter()
                text += chunk["text"]
                meta = chunk["meta_info"]
            end = time.perf_counter()
            seconds += end - start
            decode_s += end - first
            tokens += meta["completion_tokens"]
            verify += meta.get("spec_verify_ct", 0)
            texts.append(text)
    result = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              "decode_tokens_per_s": (tokens - len(PROMPTS)) / decode_s, "texts": texts}
    if verify:
        result["accept_length"] = tokens / verify
    return result


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    from rxf.entrypoints.demo_model import DEMO_DIRNAME, cache_dir

    gguf = demo_gguf(args.cache_dir, cache_dir() / "models" / DEMO_DIRNAME)  # the demo's own copy when kept
    payload = {"gguf": str(gguf), "threads": args.threads, "draft_tokens": args.draft_tokens,
               "max_new_tokens": args.max_new_tokens, "prompts": PROMPTS}
    proc = subprocess.run([args.llamacpp_python, "-c", LLAMACPP_SCRIPT, json.dumps(payload)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-600:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verify_cost(args: argparse.Namespace) -> None:
    import torch

    from rxf.core.forward import ForwardMode
    from rxf.core.runner.model_runner import ModelInput
    from rxf.entrypoints.demo_model import resolve_model_path
    from rxf.testing.model_harness import ModelHarness

    os.environ.setdefault("RXF_CPU_ATTENTION_COMPILE", "startup")  # the cpu backend's kernels, not its fallback
    harness = ModelHarness(resolve_model_path("demo"), attention_backend=args.backend,
                           **{"runtime.cpu_threads": args.threads, "model.dtype": args.dtype,
                              "cache.max_total_tokens": 8192})
    runner = harness.runner
    attn = runner.attn_backend
    print(f"{args.backend}, {args.dtype}, {args.threads} thread(s); a verify as decode rows (serving's path) "
          "and as the extend it replaces", flush=True)
    for bs in (1, 2, 4, 8):
        prompts = [list(range(100 + i, 400 + i)) for i in range(bs)]
        rows, slots = harness._start(prompts)
        times = {}
        with torch.inference_mode():
            harness._prefill(prompts, rows, slots, all_logits=False)
            for k, as_rows in ((0, True), (4, True), (8, True), (4, False), (8, False)):
                n, runs = k + 1, []
                attn.verifies_as_decode = as_rows
                for _ in range(5):
                    new = runner.token_to_kv_pool.alloc(n * bs)
                    mode = ForwardMode.DECODE if k == 0 else ForwardMode.EXTEND
                    inp = ModelInput(mode, rows, [5] * n * bs, [300] * bs, [n] * bs, new,
                                     logits_start=None if k == 0 else [0] * bs)
                    start = time.perf_counter()
                    runner.forward(inp)
                    runs.append(time.perf_counter() - start)
                    runner.token_to_kv_pool.free(new)
                times[k, as_rows] = sorted(runs)[2]
            del attn.verifies_as_decode
        step = times[0, True]
        print(f"batch {bs}: decode step {step * 1e3:.1f} ms; verify of 5 tokens {times[4, True] / step:.2f}x "
              f"(extend {times[4, False] / step:.2f}x), of 9 tokens {times[8, True] / step:.2f}x "
              f"(extend {times[8, False] / step:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-python", default=None, help="python of a venv with llama-cpp-python (else skipped)")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/rxf-bench-spec"), help="where the GGUF is kept")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--min-match", type=int, default=2, help="rxf's speculative.ngram_min_match")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="cpu", help="--verify-cost: rxf's attention.backend")
    parser.add_argument("--dtype", default="bfloat16", help="rxf's model.dtype (bf16: the demo's; float32 rounds a "
                        "verify extend like a decode step, so its texts match with speculation off)")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--verify-cost", action="store_true", help="measure verify forwards against decode steps")
    args = parser.parse_args()
    if args.verify_cost:
        verify_cost(args)
        return
    load = os.getloadavg()
    results: dict[str, Any] = {"load_before": load, "args": {k: str(v) for k, v in vars(args).items()}}
    results["rxf"] = {"off": run_rxf("none", args), "on": run_rxf("ngram", args)}
    same = results["rxf"]["off"]["texts"] == results["rxf"]["on"]["texts"]
    if args.llamacpp_python:
        results["llamacpp"] = run_llamacpp(args)
    results["load_after"] = os.getloadavg()
    print(f"load average before {load[0]:.2f}, after {results['load_after'][0]:.2f} (cores: {os.cpu_count()})")
    print(f"rxf greedy texts identical with and without speculation: {same}")
    print(f"{'engine':10} {'mode':4} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'decode tok/s':>12} {'accept':>7}")
    for engine in ("rxf", "llamacpp"):
        modes = results.get(engine)
        if modes is None:
            continue
        if "error" in modes:
            print(f"{engine:10} error: {modes['error']}")
            continue
        for mode in ("off", "on"):
            r = modes[mode]
            accept = f"{r['accept_length']:.2f}" if "accept_length" in r else "-"
            print(f"{engine:10} {mode:4} {r['tokens']:7d} {r['seconds']:8.2f} {r['tokens_per_s']:7.2f} "
                  f"{r['decode_tokens_per_s']:12.2f} {accept:>7}")
        on, off = modes["on"], modes["off"]
        print(f"{engine:10} on/off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x end to end, "
              f"{on['decode_tokens_per_s'] / off['decode_tokens_per_s']:.2f}x decode")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
