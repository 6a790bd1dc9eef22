"""The FP8 row GEMV (batch 1) in float32 against f16x2 arithmetic (`RXF_FP8_PAIRS`), per projection.

    python benchmarks/gpu_fp8_pairs.py [--formats fp8-block,fp8] [--labels rn64k128s0st1w4,...]

For each Llama-3-8B projection shape and weight format (`gpu_qgemv._copy`: random FP8 weights with
block or row scales), each row label (default: the shape's `SHAPE_DEFAULTS` entry and the tiles that
hold more rows a thread, which the pairs favour by `sass_count.py`) runs with `_fp8_fma` (float32, one
weight an operation) and `_fp8_pairs_fma` (two weights an operation in f16x2): GPU time per call over
rotating weight copies in a CUDA graph (`gpu_gemv.graph_us`) and the relative error against F.linear in
float32 on the dequantized weight. Figures go to $OUT/gpu_fp8_pairs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import gpu_qgemv  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
MORE_ROWS = ["rn128k128s0st1w4", "rn64k128s0st1w2", "rn128k128s0st1w2", "rn64k128s0st1w4"]


def main() -> None:
    from rxf.plugins.quantization import qgemv, qgemv_kernel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp8-block,fp8")
    ap.add_argument("--labels", default=None, help="row labels (default: the shape's default and MORE_ROWS)")
    args = ap.parse_args()
    results: dict[str, object] = {"device": torch.cuda.get_device_name()}
    for fmt in args.formats.split(","):
        for role, (n, k) in SHAPES.items():
            gen = torch.Generator(device="cuda").manual_seed(n + k)
            first, dense = gpu_qgemv._copy(fmt, n, k, gen)
            nbytes = sum(t.nbytes for t in (first.weight, first.scales) if t is not None)
            copies = [first] + [SimpleNamespace(**{key: v.clone() if isinstance(v, torch.Tensor) else v
                                                   for key, v in vars(first).items()})
                                for _ in range(max(2, min(32, (512 << 20) // nbytes)) - 1)]
            x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
            ref = F.linear(x.float(), dense)
            default = qgemv.SHAPE_DEFAULTS.get((fmt, n, k), qgemv.BY_DEFAULT[fmt][0].label)
            labels = args.labels.split(",") if args.labels else [default, *(m for m in MORE_ROWS if m != default)]
            row: dict[str, object] = {}
            for label in labels:
                settings = qgemv.QuantSettings.parse(label, fmt)
                ops = {id(c): gpu_qgemv._resolve(fmt, settings, 1, c) for c in copies}
                for pairs in ("0", "1"):
                    qgemv_kernel._FP8_PAIRS_ENV = pairs  # read at each launch
                    errors: dict[str, float] = {}
                    row[f"{label} pairs{pairs}"] = gpu_qgemv._timed(lambda c, o=ops, x=x: o[id(c)](x, None), copies,
                                                                    ref, 1e-2, errors, label)
                    row[f"{label} pairs{pairs} error"] = errors.get(label)
            results[f"{fmt} {role}"] = row
            cells = "  ".join(f"{key.split()[0]}: {row[key + ' pairs0']} -> {row[key + ' pairs1']}"
                              for key in dict.fromkeys(k.rsplit(" ", 1)[0] for k in row if not k.endswith("error")))
            print(f"{fmt} {role} ({nbytes / 1e6:.0f} MB) us float32 -> f16x2: {cells}", flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_fp8_pairs.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
