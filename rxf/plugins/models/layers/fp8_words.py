"""FP8 (E4M3) weights read as int32 words of four, converted in registers: shared by the weight-only row
kernels that multiply FP8 weights by a bf16 / fp16 row without `tl.dot` (the quantized decode GEMV,
`quantization/qgemv_row_kernel.py`, and the MoE decode kernels, `fused_moe_decode.py`).

A float8 tile's `.to(float32)` costs Triton's byte extracts and re-pairs (PRMT, LOP3 and IMAD per
value); a word's four values cost two `cvt.rn.f16x2.e4m3x2` (one instruction each on sm_90) and four
half-to-float conversions. Byte i of a word (lowest first) is the input at the word's offset + i.
"""

from __future__ import annotations

import triton
import triton.language as tl

_E4M3X4 = tl.constexpr("""{
.reg .b16 lo, hi, e0, e1, e2, e3;
.reg .b32 p, q;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {e0, e1}, p;
mov.b32 {e2, e3}, q;
cvt.f32.f16 $0, e0;
cvt.f32.f16 $1, e1;
cvt.f32.f16 $2, e2;
cvt.f32.f16 $3, e3;
}""")


@triton.jit
def e4m3x4(w, ASM: tl.constexpr):
    """The four E4M3 values of each int32 word of `w` as float32 tensors of w's shape (byte 0 first).
    ASM (CUDA): the inline conversion above; else (Triton's interpreter, which has no inline assembly)
    each byte is bitcast and converted."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(_E4M3X4, "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4,
                                                   is_pure=True, pack=1)
    else:
        f0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return f0, f1, f2, f3
