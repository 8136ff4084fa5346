"""Triton kernel: the experts' grouped GEMM of a fused MoE layer (vLLM's fused_moe_kernel).
Token slots come sorted by expert and padded per expert to BLOCK_M (kernels.moe.align_block_size):
each program multiplies BLOCK_M rows of one expert by a BLOCK_N slice of that expert's weight, so
one launch covers every expert. A layer is two launches (gate/up, then down) around SiLU-and-mul
(gpt-oss: each projection adds its expert's bias, HAS_BIAS, around the clamped SwiGLU).
design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.moe import align_block_size
from inferline.kernels.triton.activation import silu_and_mul_triton, swiglu_oai_triton
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


@triton.jit(do_not_specialize=["num_slots"])  # changes every step: one binary for all
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, bias_ptr,
    num_slots, stride_am, stride_be, stride_bn, stride_cm,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """c[slot, n] = sum_k a[row, k] * b[expert, n, k] (plus bias[expert, n] with HAS_BIAS; then
    times the slot's weight), row = the slot's token (A_PER_TOKEN: the layer's input) or the
    slot itself (the activation)."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block the routing did not need
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slots < num_slots  # the padding holds num_slots
    rows = slots // TOP_K if A_PER_TOKEN else slots
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b_base = b_ptr + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:  # bias [E, N], contiguous; before the routing weight (as transformers)
        bias = tl.load(bias_ptr + expert * N + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]
    out = rounded(acc, c_ptr.dtype.element_ty)
    tl.store(c_ptr + slots[:, None] * stride_cm + cols[None, :], out,
             mask=valid[:, None] & col_mask[None, :])  # fmt: skip


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per program: 16 while most experts hold a token or two (decode), else 64."""
    return 16 if num_slots <= 2 * num_experts else 64


def plan_fused_moe(
    num_blocks: int,
    n: int,
    k: int,
    top_k: int,
    a_per_token: bool,
    mul_weights: bool,
    block_m: int,
    dtype: torch.dtype,
    target: Target,
    bias: bool = False,
) -> LaunchPlan:
    """One projection of every expert: `num_blocks` row blocks of `block_m` by N = n columns;
    `bias`: the variant that adds each expert's bias (gpt-oss)."""
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 32 if dtype == torch.float32 or k < 64 else 64
    return LaunchPlan(
        "_fused_moe_kernel",
        (num_blocks, triton.cdiv(n, block_n)),
        (
            ("N", n),
            ("K", k),
            ("TOP_K", top_k),
            ("A_PER_TOKEN", a_per_token),
            ("MUL_WEIGHTS", mul_weights),
            ("BLOCK_M", block_m),
            ("BLOCK_N", block_n),
            ("BLOCK_K", block_k),
            ("DOT_F32", dot_in_fp32(dtype, target)),
            ("PRECISION", dot_precision(dtype)),
            ("HAS_BIAS", bias),
        ),  # fmt: skip
        num_warps=4,
        num_stages=1 if target.interpreter else 3,
    )


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """kernels.moe.fused_experts on Triton: two grouped GEMM launches, SiLU-and-mul between them
    (gpt-oss: with the experts' biases b13 [E, 2I] and b2 [E, H] and its clamped SwiGLU of
    `swiglu` = (alpha, limit)), the k rows of each token summed in fp32."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert x.dtype in FLOAT_DTYPES and w13.dtype == w2.dtype == x.dtype, (x.dtype, w13.dtype)
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_inter // 2), (
        tuple(w13.shape),
        tuple(w2.shape),
    )
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert (b13 is None) == (b2 is None), "both projections have biases or neither"
    if b13 is not None:
        assert b13.shape == (num_experts, two_inter) and b2.shape == (num_experts, hidden)
        assert b13.is_contiguous() and b2.is_contiguous() and b13.dtype == b2.dtype == x.dtype
    if tokens == 0:
        return torch.zeros_like(x)
    slots = tokens * top_k
    block_m = block_m_for(slots, num_experts)
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids, num_experts, block_m)
    weights = topk_weights.float().contiguous()
    target = target_of(x.device)
    inter = torch.empty((slots, two_inter), dtype=x.dtype, device=x.device)
    _gemm(x, w13, inter, weights, sorted_ids, expert_ids, num_padded, top_k, True, target, b13)
    act = silu_and_mul_triton(inter) if swiglu is None else swiglu_oai_triton(inter, *swiglu)
    out = torch.empty((slots, hidden), dtype=x.dtype, device=x.device)
    _gemm(act, w2, out, weights, sorted_ids, expert_ids, num_padded, top_k, False, target, b2)
    return out.view(tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)


def _gemm(
    a, b, c, weights, sorted_ids, expert_ids, num_padded, top_k, first, target, bias=None
) -> None:
    """c = a @ b[expert].T (+ bias[expert]) per block; the first projection reads token rows, the
    second slot rows and applies the routing weight."""
    n, k = b.shape[1], b.shape[2]
    plan = plan_fused_moe(expert_ids.numel(), n, k, top_k, first, not first,
                          sorted_ids.numel() // expert_ids.numel(), a.dtype, target,
                          bias is not None)  # fmt: skip
    launch(_fused_moe_kernel, plan, a, b, c, weights, sorted_ids, expert_ids, num_padded,
           weights if bias is None else bias, c.shape[0], a.stride(0), b.stride(0), b.stride(1),
           c.stride(0))  # fmt: skip
