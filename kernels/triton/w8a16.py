"""Triton kernel: a linear layer on FP8 weights (W8A16). out[m, n] = sum_k x[m, k] * w[n, k] *
scale, with w held as float8 e4m3 codes (read as bytes) and fp32 scales [N, groups]: one per
output row (per tensor and per channel checkpoints), or one per row and GROUP_K-column block
(128 x 128 block checkpoints, expanded to rows at load); or w as a GGUF's uint8 levels with a
scale and an offset per GROUP_K (32) columns (AFFINE). x and out are fp16/bf16/fp32; the sum is
fp32. The e4m3 codes are decoded with integer ops (exact on every arch, sm_80 included, and under
the interpreter, which has no fp8 loads).
design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.fp8 import DECODE_ROWS
from inferline.kernels.triton.checks import FLOAT_DTYPES
from inferline.kernels.triton.launch import (
    LaunchPlan,
    Target,
    dot_in_fp32,
    dot_precision,
    launch,
    target_of,
)
from inferline.kernels.triton.numerics import rounded


@triton.jit
def e4m3_to_fp16(codes):
    """float8 e4m3fn bytes -> fp16, exactly: the byte's exponent and mantissa shifted into fp16's
    (bias 15 instead of 7, so times 2^8); e4m3's subnormals land on fp16 normals the same way."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit(do_not_specialize=["M"])  # the token count changes every step: one binary for all
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
    stride_sn, stride_om,
    GROUP_K: tl.constexpr, AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N tile of out; GROUP_K 0: one scale per row, applied once at the end;
    else each BLOCK_K step (inside one group: BLOCK_K divides GROUP_K) scales its partial sum.
    AFFINE: the codes are uint8 levels, w = scale * code + offset per group (GGUF's blocks):
    the offset times the step's sum of x joins the partial sum."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_base = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_base + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        codes = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        b = codes.to(tl.float16) if AFFINE else e4m3_to_fp16(codes)  # levels 0..255: exact
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        else:
            b = b.to(a.dtype)  # exact: e4m3 values fit bf16 and fp16
        if GROUP_K:
            s = tl.load(scale_ptr + cols * stride_sn + k0 // GROUP_K, mask=col_mask, other=0.0)
            part = tl.dot(a, b, input_precision=PRECISION) * s[None, :]
            if AFFINE:
                o = tl.load(offset_ptr + cols * stride_sn + k0 // GROUP_K, mask=col_mask, other=0.0)
                part += tl.sum(a.to(tl.float32), axis=1)[:, None] * o[None, :]
            acc += part
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if not GROUP_K:
        acc = acc * tl.load(scale_ptr + cols * stride_sn, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = rounded(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out,
             mask=row_mask[:, None] & col_mask[None, :])  # fmt: skip


def block_m_for(m: int) -> int:
    """Rows per program: 16 for decode-sized steps, 64 for prefill chunks."""
    return 16 if m <= DECODE_ROWS else 64


def plan_w8a16(
    m: int,
    n: int,
    group_k: int,
    has_bias: bool,
    dtype: torch.dtype,
    target: Target,
    affine: bool = False,
) -> LaunchPlan:
    """The launch of an [m, K] x [n, K]^T product; `group_k` 0 (a scale per row) or the scale
    blocks' width (a power of two from 16); `affine`: uint8 codes with an offset per group."""
    block_m, block_n = block_m_for(m), 64
    block_k = 32 if dtype == torch.float32 else 64
    if group_k:
        assert group_k >= 16 and group_k & (group_k - 1) == 0, f"group_k {group_k}"
        block_k = min(block_k, group_k)
    return LaunchPlan(
        "_w8a16_kernel",
        (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        (
            ("GROUP_K", group_k),
            ("AFFINE", affine),
            ("HAS_BIAS", has_bias),
            ("BLOCK_M", block_m),
            ("BLOCK_N", block_n),
            ("BLOCK_K", block_k),
            ("DOT_F32", dot_in_fp32(dtype, target)),
            ("PRECISION", dot_precision(dtype)),
        ),
        num_warps=4,
        num_stages=1 if target.interpreter else 3,
    )


def w8a16_linear_triton(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_k: int = 0,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequantized(codes [N, K], scale fp32 [N, groups]).T (+ bias), in x's dtype;
    codes e4m3, or uint8 levels with `offset` fp32 [N, groups] (then group_k is required)."""
    n, k = codes.shape
    assert x.dtype in FLOAT_DTYPES and x.shape[-1] == k, (x.dtype, tuple(x.shape), (n, k))
    affine = codes.dtype == torch.uint8
    assert codes.dtype == torch.float8_e4m3fn or affine, codes.dtype
    assert codes.stride(1) == 1
    groups = -(-k // group_k) if group_k else 1
    assert scale.dtype == torch.float32 and scale.shape == (n, groups), (scale.shape, groups)
    assert scale.stride(1) == 1
    assert (offset is not None) == affine and (not affine or group_k), "uint8 codes: offsets"
    assert offset is None or (offset.shape == scale.shape and offset.stride() == scale.stride())
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), bias
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        plan = plan_w8a16(m, n, group_k, bias is not None, x.dtype, target_of(x.device), affine)
        launch(_w8a16_kernel, plan, x2, codes.view(torch.uint8), scale,
               offset if affine else scale, bias if bias is not None else scale, out, m, n, k,
               x2.stride(0), codes.stride(0), scale.stride(0), out.stride(0))  # fmt: skip
    return out.view(*x.shape[:-1], n)
