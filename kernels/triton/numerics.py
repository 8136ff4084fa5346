"""Rounding the kernels share: `rounded(x, dtype)`, nearest even, done in the fp32 bits for bf16
because the interpreter truncates. NaN stays NaN; past bf16's largest becomes inf.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # ties to even
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
