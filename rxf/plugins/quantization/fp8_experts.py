"""FP8 mixture-of-experts weights (`layers/moe.py`'s `FusedExperts`) for the `fp8` and
`compressed-tensors` methods and online FP8.

Checkpoints store each expert's projections as the dense layers store theirs (Qwen3-30B-A3B-FP8:
`mlp.experts.{e}.gate_proj.weight` FP8 `[I, H]` and `...gate_proj.weight_scale_inv` `[ceil(I / 128),
ceil(H / 128)]`; compressed-tensors: `weight_scale` `[out, 1]` per channel or one value per tensor,
and with static activations `input_scale`). They load into parameters of `w13` / `w2` stacked over
the experts, sliced for tensor parallelism like the weight:

  block  `weight_scale_inv` `[E, rows, ceil(cols / bk)]`: the checkpoint's block rows repeated over
         their rows (as `fp8_ops` lays dense block scales out), so gate and up parts, and rank
         slices, need not fall on row blocks; w2's rank slice of the inputs must fall on bk blocks.
  rows   `weight_scale` `[E, rows, 1]` (per channel; per tensor: `[E, parts]` at load, spread over
         each part's rows after).

The experts compute weight-only on CUDA: the fused MoE kernels read the FP8 weights and multiply
them by their scales in registers; activations stay in the model's dtype, so a checkpoint's static
`input_scale` (read, as its tensors must all load) is not used. On other devices the experts are
dequantized at load and run as dense experts.
"""

from __future__ import annotations

import torch
from torch import nn

from rxf.plugins.models.layers.linear import TensorLayout
from rxf.plugins.models.layers.moe import ExpertScales, FusedExperts, StackedExpertWeight
from rxf.plugins.quantization import fp8_ops

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_WEIGHT = TensorLayout(dtypes=(fp8_ops.FP8,))


def _projections(experts: FusedExperts) -> tuple[StackedExpertWeight, StackedExpertWeight]:
    return experts.w13, experts.w2


def keeps_fp8(weight: torch.Tensor) -> bool:
    """Whether experts whose weight lives where `weight` does run the FP8 kernels (CUDA), rather
    than being dequantized at load."""
    return weight.is_cuda


def _add_fp8_weight(proj: StackedExpertWeight) -> None:
    proj.add_param("weight", torch.empty(proj.num_experts, proj.rows, proj.cols, dtype=fp8_ops.FP8), _FP8_WEIGHT)


def create_block(experts: FusedExperts, block_n: int, block_k: int) -> None:
    """FP8 weights with `[block_n, block_k]` block scales (Hugging Face `fp8`)."""
    for proj in _projections(experts):
        _add_fp8_weight(proj)
        scale = proj.add_param(
            "weight_scale_inv", torch.empty(proj.num_experts, proj.rows, -(-proj.cols // block_k)),
            TensorLayout(in_pack=block_k, dtypes=SCALE_DTYPES),
        )
        rows = proj.checkpoint_rows()

        def load_block_rows(param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int],
                            load=scale.weight_loader, rows=rows) -> None:
            # One row of block scales per weight row: then they slice like the weight.
            load(param, loaded.repeat_interleave(block_n, dim=0)[:rows] if loaded.dim() == 2 else loaded, shard)

        scale.weight_loader = load_block_rows


def create_rows(experts: FusedExperts, per_channel: bool, static_input: bool) -> None:
    """FP8 weights with a scale per output row or per tensor (compressed-tensors)."""
    for proj in _projections(experts):
        _add_fp8_weight(proj)
        if per_channel:
            proj.add_param("weight_scale", torch.empty(proj.num_experts, proj.rows, 1),
                           TensorLayout(in_dim=None, dtypes=SCALE_DTYPES))
        else:
            proj.add_param("weight_scale", torch.empty(proj.num_experts, proj.parts),
                           TensorLayout(per_shard=True, dtypes=SCALE_DTYPES))
        if static_input:
            proj.add_param("input_scale", torch.empty(proj.num_experts, proj.parts),
                           TensorLayout(per_shard=True, dtypes=SCALE_DTYPES))


def _per_row(proj: StackedExpertWeight, scale: torch.Tensor) -> torch.Tensor:
    """`[E, rows, 1]` float32 from per-row `[E, rows, 1]` or per-tensor `[E, parts]` scales."""
    scale = scale.float()
    if scale.dim() == 2:  # one value per part: over that part's rows
        scale = scale.repeat_interleave(proj.rows // proj.parts, dim=1)[..., None]
    return scale.contiguous()


def _become_dense(experts: FusedExperts, dense: list[torch.Tensor]) -> None:
    for proj, weight in zip(_projections(experts), dense, strict=True):
        for name in ("weight_scale_inv", "weight_scale", "input_scale"):
            if hasattr(proj, name):
                delattr(proj, name)
        proj.add_param("weight", weight.to(experts.dtype).contiguous())
    experts.quant = None


def process_block(experts: FusedExperts, block_k: int) -> None:
    w13, w2 = _projections(experts)
    if not keeps_fp8(w13.weight):
        _become_dense(experts, [fp8_ops.dequantize_blocks(p.weight.data, p.weight_scale_inv.data, block_k, experts.dtype)
                                for p in (w13, w2)])
        return
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"fp8: weight_block_size columns {block_k}: FP8 experts on CUDA take powers of two >= 16")
    for proj in (w13, w2):
        proj.add_param("weight_scale_inv", proj.weight_scale_inv.data.float().contiguous())
    experts.fp8_scales = ExpertScales(w13.weight_scale_inv, w2.weight_scale_inv, block_k)


def process_rows(experts: FusedExperts) -> None:
    """Checkpoint FP8 with row or tensor scales, or (`online`) the dense weights just loaded."""
    w13, w2 = _projections(experts)
    scales = [_per_row(p, p.weight_scale.data) for p in (w13, w2)]
    if not keeps_fp8(w13.weight):
        _become_dense(experts, [fp8_ops.dequantize_rows(p.weight.data, s, experts.dtype)
                                for p, s in zip((w13, w2), scales, strict=True)])
        return
    for proj, scale in zip((w13, w2), scales, strict=True):
        proj.add_param("weight_scale", scale)
        if hasattr(proj, "input_scale"):  # weight-only experts need no activation scale
            delattr(proj, "input_scale")
    experts.fp8_scales = ExpertScales(w13.weight_scale, w2.weight_scale)


def quantize_online(experts: FusedExperts) -> None:
    """The dense experts just loaded, quantized per output row (on CUDA: kept in FP8; elsewhere the
    weights rounded through FP8, so the CPU computes what a GPU's FP8 experts hold)."""
    for proj in _projections(experts):
        q, scale = fp8_ops.quantize_rows(proj.weight.data)
        proj.add_param("weight", q)
        proj.add_param("weight_scale", scale[..., None])
    process_rows(experts)


def apply(experts: FusedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' forward over their FP8 weights (CUDA: the CPU dequantized them at load)."""
    from rxf.plugins.models.layers.fused_moe import fused_experts

    return fused_experts(x, experts.w13.weight, experts.w2.weight, topk_weights, topk_ids, b13=experts.w13.bias,
                         b2=experts.w2.bias, activation=experts.activation, scales=experts.fp8_scales)
