"""Triton kernel: SiLU-and-mul, x [rows, 2 * INTER] = [gate | up] -> silu(gate) * up [rows, INTER].
design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.triton.checks import FLOAT_DTYPES
from inferline.kernels.triton.launch import LaunchPlan, launch
from inferline.kernels.triton.numerics import rounded

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # gate / (1 + e^-gate): -inf-safe at both ends (e^1000 = inf gives -0, e^-1000 = 0 gives gate)
    act = rounded(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, rounded(act * up, out_ptr.dtype.element_ty), mask=mask
    )


def plan_silu_and_mul(rows: int, inter: int) -> LaunchPlan:
    block = min(BLOCK, triton.next_power_of_2(inter))
    return LaunchPlan(
        "_silu_and_mul_kernel",
        (rows, triton.cdiv(inter, block)),
        (("INTER", inter), ("BLOCK", block)),
        num_warps=4,
        num_stages=1,
    )


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, (tuple(x.shape), x.stride())
    assert x.dtype in FLOAT_DTYPES, x.dtype
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    plan = plan_silu_and_mul(rows, inter)
    launch(_silu_and_mul_kernel, plan, x, out, x.stride(0), out.stride(0))
    return out
