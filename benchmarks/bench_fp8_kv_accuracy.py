"""What an FP8 KV cache costs the logits, on the CPU: a tiny random Llama (`make_tiny_checkpoint`,
initializer_range 0.05, the checkpoint of tests/unit/test_fp8_kv.py), float32 model, torch_native,
every position of three prompts (60, 45 and 30 tokens) prefilled with float32 KV and with each FP8
format. Printed: the largest logit change as a share of the largest logit magnitude, and the share of
positions whose argmax token stays (the figures the README quotes).

    python benchmarks/bench_fp8_kv_accuracy.py [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0", help="checkpoint seeds, comma-separated")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (60, 45, 30)]
    print("| checkpoint seed | KV | largest logit change / largest logit | argmax kept |")
    print("|---|---|---|---|")
    for seed in map(int, args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = make_tiny_checkpoint(tmp, seed=seed, initializer_range=0.05)
            ref = torch.cat(ModelHarness(path).prefill_logits(prompts))
            for kv in ("fp8_e4m3", "fp8_e5m2"):
                got = torch.cat(ModelHarness(path, **{"cache.kv_dtype": kv}).prefill_logits(prompts))
                change = ((got - ref).abs().max() / ref.abs().max()).item()
                kept = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
                print(f"| {seed} | {kv} | {change:.1%} | {kept:.1%} |")


if __name__ == "__main__":
    main()
