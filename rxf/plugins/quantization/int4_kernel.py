"""The dequantizing int4 GEMM (AWQ, GPTQ on CUDA), in Triton.

`int4_linear(x, qweight, scales, zeros, group_size, bias)`: `x @ W.T + bias` with `W[n, k] =
(q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]`, `qweight` int32 `[K / 8, N]`
holding inputs 8r..8r+7 of output n in nibbles 0..7 of word `[r, n]` (`int4.py`'s layout). Each
program unpacks a `[BLOCK_K, BLOCK_N]` tile of codes to `x`'s dtype and runs one `tl.dot`; BLOCK_K
divides the group size, so a tile needs one row of scales and zeros. Decode batches (few rows) split
K over programs (`SPLIT_K`) so that enough programs read the weight, adding into a float32 output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, group_size,
                    k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        words = tl.load(q_ptr + (k[:, None] // 8) * N + rn[None, :], mask=(k[:, None] < K) & (rn[None, :] < N), other=0)
        codes = (words >> ((k[:, None] % 8) * 4)) & 0xF
        g = k0 // group_size
        s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0)
        z = tl.load(z_ptr + g * N + rn, mask=rn < N, other=0.0)
        w = ((codes.to(tl.float32) - z[None, :].to(tl.float32)) * s[None, :].to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, out_dtype=tl.float32)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=mask)


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(m: int, n_blocks: int, k: int, block_k: int, device: torch.device) -> int:
    """Programs along K: decode-sized batches fill about two programs per SM."""
    if m > 16 or device.type != "cuda":
        return 1
    sms = _sm_count(device.index)
    split = max(1, min(2 * sms // max(n_blocks, 1), k // block_k))
    while (k // block_k) % split:
        split -= 1
    return split


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None, split_k: int | None = None,
) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[1]
    block_k = min(64, group_size)
    block_m, block_n = (16, 64) if m <= 16 else (64, 64)
    n_blocks = triton.cdiv(n, block_n)
    split = split_k or _split_k(m, n_blocks, k, block_k, x.device)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    if m:
        k_per_split = k // split
        _int4_mm_kernel[(triton.cdiv(m, block_m), n_blocks, split)](
            x2, qweight, scales, zeros, out, m, n, k, x2.stride(0), out.stride(0), group_size, k_per_split,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        )
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], n)
