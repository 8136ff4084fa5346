"""Triton kernel: RMSNorm, optionally fused with the residual add (vLLM's rms_norm and
fused_add_rms_norm), with HF's LlamaRMSNorm arithmetic. design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.triton.checks import FLOAT_DTYPES
from inferline.kernels.triton.launch import LaunchPlan, launch
from inferline.kernels.triton.numerics import rounded


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
    COLS: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < COLS
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptr = residual_ptr + row * stride_r + cols
        summed = rounded(
            x + tl.load(r_ptr, mask=mask, other=0.0).to(tl.float32), residual_ptr.dtype.element_ty
        )
        tl.store(r_ptr, summed, mask=mask)
        x = summed.to(tl.float32)  # as rounded: what the next layer's add reads back
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / COLS + eps)
    normed = rounded(x * inv_rms, out_ptr.dtype.element_ty).to(
        tl.float32
    )  # HF rounds before the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, rounded(normed * w, out_ptr.dtype.element_ty), mask=mask
    )


def plan_rms_norm(rows: int, cols: int, residual: bool) -> LaunchPlan:
    """One program per row; warps grow with the row (at most 16 elements a thread)."""
    block = triton.next_power_of_2(cols)
    return LaunchPlan(
        "_rms_norm_kernel",
        (rows,),
        (("COLS", cols), ("BLOCK", block), ("HAS_RESIDUAL", residual)),
        num_warps=min(16, max(4, block // 512)),
        num_stages=1,
    )


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x), or rms_norm(x + residual) with the sum written into `residual`."""
    assert x.dim() == 2 and x.stride(1) == 1, (
        f"rows must be packed: shape {tuple(x.shape)}, strides {x.stride()}"
    )
    rows, cols = x.shape
    assert x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype and weight.shape == (cols,), (
        x.dtype,
        weight.shape,
    )
    assert weight.is_contiguous() and weight.device == x.device
    if residual is not None:
        assert (
            residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        ), residual.shape
        assert residual.device == x.device
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    plan = plan_rms_norm(rows, cols, residual is not None)
    r = residual if residual is not None else x  # unread without HAS_RESIDUAL
    launch(_rms_norm_kernel, plan, x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), eps)
    return out
