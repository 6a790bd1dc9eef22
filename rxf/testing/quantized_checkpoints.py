"""Quantized twins of a checkpoint, written from each format's documentation, for tests and benchmarks.

    quantize_checkpoint(src, dst, "awq", group_size=128, twin=twin_dir)

writes `dst`: `src` with every decoder-layer projection (`*_proj.weight` of attention and MLP, and
of each MoE expert: Qwen3-MoE's `mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`;
routers stay dense, as quantizers leave them) stored in the format (the tensors and `quantization_config` a real quantizer writes), and with
`twin`: an unquantized float32 checkpoint holding exactly the values the quantized one encodes, for
`transformers` to serve as the reference. The packing here is written from the formats' own
descriptions (AutoAWQ's packer order, AutoGPTQ's zero-minus-one) independently of rxf's readers in
`rxf.plugins.quantization`, so a test that compares the two checks both.

Formats: `fp8` (block-wise, `block=[128, 128]`), `ct-channel` / `ct-tensor` (compressed-tensors
FP8, dynamic per-token activations, `static=True` with an `input_scale`, or `weight_only=True`), `awq`, `gptq`
(`sym`, `desc_act`, `group_size`, `checkpoint_format`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
PROJECTION = re.compile(r"\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.(experts\.\d+\.)?(\w+_proj|w[123])\.weight$")
ROUTERS = ["re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"]  # llm-compressor's ignore entries for them
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: nibble i holds output 8c + order[i]


def _pack(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words of eight 4-bit codes along `dim`: nibble i holds code `order[i]` of the eight."""
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    word = torch.zeros(c.shape[:-1], dtype=torch.int64, device=codes.device)
    for i, j in enumerate(order):
        word |= c[..., j] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word)  # the bits as a signed int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def _fp8_block(w: torch.Tensor, bn: int, bk: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n)).view(rows, bn, cols, bk)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # one per block
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).to(FP8)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def fp8_experts(w: torch.Tensor, block_k: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked expert weights `w` `[E, N, K]` as the fused MoE kernels take them: (FP8 `w`, float32
    scales `[E, N, ceil(K / block_k)]`, or `[E, N, 1]` per row for block_k None, the float32 weight
    they encode): each row's (or row's block of block_k inputs') absmax mapped to 448, rounded by
    torch (the Triton interpreter's float-to-FP8 cast is wrong; it reads FP8 correctly)."""
    e, n, k = w.shape
    g = block_k or k
    blocks = torch.nn.functional.pad(w.float(), (0, (-k) % g)).view(e, n, -1, g)
    scale = blocks.abs().amax(dim=3).clamp(min=1e-12) / 448.0
    q = (blocks / scale[..., None]).view(e, n, -1)[..., :k].to(FP8)
    return q, scale.contiguous(), q.float() * scale.repeat_interleave(g, dim=2)[..., :k]


def _fp8_rows(w: torch.Tensor, per_channel: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1, 1)
    scale = amax.clamp(min=1e-12) / 448.0
    q = (w / scale).to(FP8)
    return {"weight": q, "weight_scale": scale if per_channel else scale.reshape(1)}, q.float() * scale


def _int4_groups(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [K, N], zeros [G, N], fp16 scales [G, N]) for the input-major weight `w` [K, N], rows
    grouped in runs of `group`."""
    k, n = w.shape
    wg = w.reshape(k // group, group, n)
    if sym:
        scale = (2 * wg.abs().amax(dim=1) / 15).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half()
    codes = torch.clamp(torch.round(wg / scale.float()[:, None]) + zero[:, None], 0, 15)
    return codes.reshape(k, n).to(torch.uint8), zero, scale


def _awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    wt = w.t().contiguous()  # [K, N]
    codes, zero, scale = _int4_groups(wt, group, sym=False)
    deq = (codes.float() - zero.repeat_interleave(group, 0)) * scale.float().repeat_interleave(group, 0)
    tensors = {"qweight": _pack(codes, 1, AWQ_PACK_ORDER), "qzeros": _pack(zero, 1, AWQ_PACK_ORDER), "scales": scale}
    return tensors, deq.t()


def _gptq(w: torch.Tensor, group: int, sym: bool, desc_act: bool, v2: bool, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    wt = w.t().contiguous()  # [K, N]
    k = wt.shape[0]
    group = k if group == -1 else group
    # Act order: the quantizer visits inputs in a permuted order and numbers groups in that order.
    perm = (torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)).to(w.device)
    codes_p, zero, scale = _int4_groups(wt[perm], group, sym)
    codes = torch.empty_like(codes_p)
    codes[perm] = codes_p
    g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
    g_idx[perm] = (torch.arange(k, device=w.device) // group).to(torch.int32)
    deq = (codes.float() - zero[g_idx.long()]) * scale.float()[g_idx.long()]
    stored_zero = zero if v2 else zero - 1  # AutoGPTQ's packer stores zero - 1
    tensors = {"qweight": _pack(codes, 0), "qzeros": _pack(stored_zero.clamp(min=0), 1), "scales": scale, "g_idx": g_idx}
    if not v2 and bool((zero == 0).any()):
        raise ValueError("a zero point of 0 cannot be stored as zero - 1; quantize symmetrically")
    return tensors, deq.t()


def _input_seed(name: str) -> int:
    """One act order per layer input: projections that read the same input (q, k, v; gate, up) get
    the same permutation from a real quantizer, whose order comes from that input's statistics."""
    key = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name))
    return sum(map(ord, key))


def quantization_config(fmt: str, **opts: Any) -> dict[str, Any]:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(opts.get("block", (128, 128)))}
    if fmt in ("ct-channel", "ct-tensor"):
        static = opts.get("static", False)
        acts = ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False} if static
                else {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True})
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "channel" if fmt == "ct-channel" else "tensor"}
        group = {"targets": ["Linear"], "weights": weights}
        if not opts.get("weight_only", False):  # weight_only: W8A16, activations stay in the model's dtype
            group["input_activations"] = acts
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head", *ROUTERS], "config_groups": {"group_0": group}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": opts.get("group_size", 128), "zero_point": True,
                "version": "gemm"}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": opts.get("group_size", 128),
                "desc_act": opts.get("desc_act", False), "sym": opts.get("sym", True),
                "checkpoint_format": opts.get("checkpoint_format", "gptq")}
    raise ValueError(f"unknown format {fmt!r}")


def quantize_tensor(name: str, w: torch.Tensor, fmt: str, **opts: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors (by suffix: `weight`, `weight_scale`, `qweight`, ...) that store the
    projection weight `w` `[N, K]` in `fmt`, and the float32 weight they encode."""
    w = w.float()
    if fmt == "fp8":
        return _fp8_block(w, *opts.get("block", (128, 128)))
    if fmt in ("ct-channel", "ct-tensor"):
        tensors, deq = _fp8_rows(w, fmt == "ct-channel")
        if opts.get("static", False):
            tensors["input_scale"] = torch.tensor([opts.get("input_scale", 0.05)], device=w.device)
        return tensors, deq
    if fmt == "awq":
        return _awq(w, opts.get("group_size", 128))
    if fmt == "gptq":
        return _gptq(w, opts.get("group_size", 128), opts.get("sym", True), opts.get("desc_act", False),
                     opts.get("checkpoint_format", "gptq") == "gptq_v2", seed=_input_seed(name))
    raise ValueError(f"unknown format {fmt!r}")


def quantize_checkpoint(
    src: str | Path, dst: str | Path, fmt: str, *, twin: str | Path | None = None, device: str = "cpu", **opts: Any
) -> Path:
    """Write `src` quantized in `fmt` into `dst` (and its dequantized float32 `twin`); see the module.
    `device`: where the projections are quantized (a GPU does an 8B checkpoint in seconds)."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"), dirs_exist_ok=True)
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if PROJECTION.search(name):
                    stored, deq = quantize_tensor(name, tensor.to(device), fmt, **opts)
                    prefix = name.removesuffix("weight")
                    quantized.update({prefix + suffix: t.cpu() for suffix, t in stored.items()})
                    if twin is not None:
                        dense[name] = deq.contiguous().cpu()
                else:
                    quantized[name] = tensor
                    dense[name] = tensor.float() if tensor.is_floating_point() else tensor
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config(fmt, **opts)}, indent=2))
    if twin is not None:
        write_twin(src, twin, dense)
    return dst


def write_twin(src: Path, twin: str | Path, dense: dict[str, torch.Tensor]) -> None:
    """`src`'s config and tokenizer with the float32 tensors `dense`: a quantized checkpoint's twin."""
    twin = Path(twin)
    shutil.copytree(src, twin, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"), dirs_exist_ok=True)
    save_file(dense, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
