"""Rounding the kernels share (device code only).

`rounded(x, dtype)` is x (fp32) rounded to `dtype` to nearest even, the rounding of a GPU's
`.to(dtype)` and of PyTorch's casts. For bf16 it rounds explicitly in the fp32 bits: the Triton
interpreter truncates fp32 -> bf16, so a plain `.to` would differ from PyTorch there by an ulp;
this way the interpreter and a GPU compute the same bits, and the kernels can be tested for
equality with their PyTorch reference. (NaN stays NaN; a value past bf16's largest becomes inf.)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # ties to even: the kept bit decides
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
