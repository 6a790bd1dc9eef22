"""The residual add + RMSNorm taken into the decode GEMV after it (`DecodeGemv.normed`) against the norm
kernel then the GEMV, at batch 1-4 (issue 17: launches of a batch-1 step):

    RXF_PDL=1 python benchmarks/gpu_norm_gemv.py [--preset llama3-8b] [--gemv triton|LABEL]

GPU time per call as a decode graph pays it (`gpu_gemv.graph_us`: one call per rotating weight copy,
>= 2 GiB in flight so L2 holds none, captured in one graph and replayed), for qkv_proj and gate_up_proj
(with SiLU·mul) of the preset. The norm runs as `RMSNorm.forward` would at decode: `rmsnorm_kernel`
(the decode norm under PDL) or FlashInfer's fused add + norm (without PDL). Prints a table and
writes $OUT/gpu_norm_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gpu_decode as gd
import torch
from gpu_gemv import DEVICE, graph_us, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(gd.PRESETS), default="llama3-8b")
    ap.add_argument("--gemv", default="triton", help="GEMV setting: 'triton' or a label like n32k256s2st4w4")
    ap.add_argument("--rows", default="1,2,4")
    args = ap.parse_args()
    from rxf.plugins.models.layers.gemv import DecodeGemv, GemvSettings
    from rxf.plugins.models.layers.norm import RMSNorm

    settings = GemvSettings() if args.gemv == "triton" else GemvSettings.parse(args.gemv)
    p = gd.PRESETS[args.preset]
    results: dict[str, dict[int, dict[str, float]]] = {}
    print(f"RXF_PDL={os.environ.get('RXF_PDL', '0')} GEMV {settings.label}")
    print(f"{'role':<14} {'rows':>4} {'norm+gemv_us':>13} {'fused_us':>9} {'saved_us':>9}")
    for role in ("qkv_proj", "gate_up_proj"):
        n, k = shapes(p)[role]
        copies = max(2, min(8, (2 << 30) // (n * k * 2)))
        ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        op = DecodeGemv(settings, ws[0], gated=role == "gate_up_proj")
        norm = RMSNorm(k, 1e-5, torch.bfloat16).to(DEVICE)
        results[role] = {}
        for m in (int(r) for r in args.rows.split(",")):
            h = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            res = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)

            def apart(w: torch.Tensor, h: torch.Tensor = h, res: torch.Tensor = res, op: DecodeGemv = op,
                      norm: RMSNorm = norm) -> torch.Tensor:
                x, _ = norm(h, res)  # in place, as at decode (the replays' values drift; times do not)
                return op(x, w, None)

            def fused(w: torch.Tensor, h: torch.Tensor = h, res: torch.Tensor = res, op: DecodeGemv = op,
                      norm: RMSNorm = norm) -> torch.Tensor:
                out = op.normed(h, w, None, res, norm)
                assert out is not None, "the GEMV does not take this norm in"
                return out[0]

            want = apart(ws[0], h.clone(), res.clone()).float()
            err = ((fused(ws[0], h.clone(), res.clone()).float() - want).norm() / want.norm()).item()
            assert err < 2e-3, f"{role} m={m}: fused differs from apart by {err:.2e}"
            t_apart, t_fused = graph_us(apart, ws), graph_us(fused, ws)
            results[role][m] = {"norm_then_gemv_us": t_apart, "fused_us": t_fused}
            print(f"{role:<14} {m:>4} {t_apart:>13.2f} {t_fused:>9.2f} {t_apart - t_fused:>9.2f}", flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_norm_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
