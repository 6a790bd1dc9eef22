"""FP8 experts' tensor-parallel slices: each rank of tp 2 loads the full per-expert checkpoint
tensors (`rxf.testing.quantized_checkpoints`' packing) into its stacked parameters, and once
dequantized (the CPU path) holds exactly its rows of gate / up and its columns of down of the
float32 weights they encode; a rank slice off the FP8 column blocks is refused naming the features."""

from __future__ import annotations

import pytest
import torch

from rxf.core import quantization
from rxf.plugins.models.layers.moe import FusedExperts
from rxf.plugins.quantization.compressed_tensors import CompressedTensorsMethod
from rxf.plugins.quantization.fp8 import Fp8Method
from rxf.testing.quantized_checkpoints import quantization_config, quantize_tensor

EXPERTS, HIDDEN = 3, 256


def build(method, inter: int, tp_rank: int) -> FusedExperts:
    with quantization.building(method):
        experts = FusedExperts(EXPERTS, HIDDEN, inter, tp_size=2, tp_rank=tp_rank, dtype=torch.float32)
    holder = torch.nn.Module()
    holder.experts = experts
    quantization.materialize(holder, method, torch.device("cpu"))
    return experts


def checkpoint(inter: int, fmt: str, **opts) -> dict[tuple[int, str], tuple[dict[str, torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(inter)
    shapes = {"gate": (inter, HIDDEN), "up": (inter, HIDDEN), "down": (HIDDEN, inter)}
    return {(e, proj): quantize_tensor(proj, torch.randn(*shape, generator=gen) * 0.1, fmt, **opts)
            for e in range(EXPERTS) for proj, shape in shapes.items()}


def load(experts: FusedExperts, tensors) -> None:
    for (e, proj), (stored, _) in tensors.items():
        target, j = (experts.w2, 0) if proj == "down" else (experts.w13, 0 if proj == "gate" else 1)
        for suffix, t in stored.items():
            param = getattr(target, suffix)
            param.weight_loader(param, t, (e, j))
    quantization.finish_loading(experts)


@pytest.mark.parametrize(("fmt", "opts", "cls"), [
    ("fp8", {"block": (128, 128)}, Fp8Method),
    ("ct-channel", {}, CompressedTensorsMethod),
    ("ct-tensor", {"static": True}, CompressedTensorsMethod),
])
def test_each_rank_holds_its_slice_of_the_encoded_weights(fmt, opts, cls):
    inter = 512  # 256 per rank: whole 128-column blocks of down
    tensors = checkpoint(inter, fmt, **opts)
    method = cls(quantization_config(fmt, **opts), torch.float32)
    for rank in range(2):
        experts = build(method, inter, rank)
        load(experts, tensors)
        assert experts.quant is None and experts.w13.weight.dtype == torch.float32  # dequantized on the CPU
        rows = slice(rank * 256, (rank + 1) * 256)
        for e in range(EXPERTS):
            gate, up, down = (tensors[(e, p)][1] for p in ("gate", "up", "down"))
            assert torch.equal(experts.w13.weight[e], torch.cat((gate[rows], up[rows])))
            assert torch.equal(experts.w2.weight[e], down[:, rows])


def test_a_rank_slice_off_the_column_blocks_is_refused():
    inter = 384  # 192 per rank: down's rank-1 columns start inside a 128-column block
    tensors = checkpoint(inter, "fp8")
    experts = build(Fp8Method(quantization_config("fp8"), torch.float32), inter, 1)
    with pytest.raises(ValueError, match=r"features \[192, 384\) do not fall on its 128-feature blocks"):
        load(experts, tensors)

