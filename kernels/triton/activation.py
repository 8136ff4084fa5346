"""Triton kernels: SiLU-and-mul, x [rows, 2 * INTER] = [gate | up] -> silu(gate) * up [rows, INTER];
gpt-oss's clamped SwiGLU of the same layout (kernels.moe.swiglu_oai).
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


@triton.jit
def _swiglu_oai_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """(clamp(up, -LIMIT, LIMIT) + 1) * g * sigmoid(ALPHA * g), g = min(gate, LIMIT), in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    # g / (1 + e^(-ALPHA g)): the clamp keeps ALPHA g <= ALPHA LIMIT; e^+large = inf gives -0
    glu = gate / (1.0 + tl.exp(-ALPHA * gate))
    tl.store(out_ptr + row * stride_o + cols, rounded((up + 1.0) * glu, out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def plan_swiglu_oai(rows: int, inter: int, alpha: float, limit: float) -> LaunchPlan:
    block = min(BLOCK, triton.next_power_of_2(inter))
    return LaunchPlan(
        "_swiglu_oai_kernel",
        (rows, triton.cdiv(inter, block)),
        (("INTER", inter), ("BLOCK", block), ("ALPHA", float(alpha)), ("LIMIT", float(limit))),
        num_warps=4,
        num_stages=1,
    )


def swiglu_oai_triton(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """kernels.moe.swiglu_oai of x [rows, 2 * INTER] = [gate | up] -> [rows, INTER]."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, (tuple(x.shape), x.stride())
    assert x.dtype in FLOAT_DTYPES, x.dtype
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    launch(_swiglu_oai_kernel, plan_swiglu_oai(rows, inter, alpha, limit), x, out, x.stride(0),
           out.stride(0))  # fmt: skip
    return out
