"""Triton kernel: the experts' grouped GEMM of a fused MoE layer (vLLM's fused_moe_kernel).
Token slots come sorted by expert and padded per expert to BLOCK_M (kernels.moe.align_block_size):
each program multiplies BLOCK_M rows of one expert by a BLOCK_N slice of that expert's weight, so
one launch covers every expert. A layer is two launches (gate/up, then down) around SiLU-and-mul
(gpt-oss: each projection adds its expert's bias, HAS_BIAS, around the clamped SwiGLU).
The W8A16 variant reads FP8 checkpoints' experts as e4m3 codes with fp32 scales [E, N, groups]
(one per row, or per row and GROUP_K columns), decoded with integer ops as kernels/triton/w8a16.py
does, the sum in fp32.
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
from inferline.kernels.triton.w8a16 import e4m3_to_fp16


@triton.jit(do_not_specialize=["num_slots"])  # changes every step: one binary for all
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, bias_ptr,
    num_slots, stride_am, stride_be, stride_bn, stride_cm,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
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


@triton.jit(do_not_specialize=["num_slots"])  # changes every step: one binary for all
def _fused_moe_w8a16_kernel(
    a_ptr, b_ptr, scale_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_slots, stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """_fused_moe_kernel on e4m3 codes b [E, N, K] (as bytes) with fp32 scales [E, N, groups]:
    GROUP_K 0: one scale per row, applied once at the end; else each BLOCK_K step (inside one
    group: BLOCK_K divides GROUP_K) scales its partial sum."""
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
    s_base = scale_ptr + expert * stride_se + cols * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        codes = tl.load(b_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        b = e4m3_to_fp16(codes)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        else:
            b = b.to(a.dtype)  # exact: e4m3 values fit bf16 and fp16
        if GROUP_K:
            s = tl.load(s_base + k0 // GROUP_K, mask=col_mask, other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if not GROUP_K:
        acc = acc * tl.load(s_base, mask=col_mask, other=0.0)[None, :]
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
    group_k: int | None = None,
    *,
    bias: bool = False,
) -> LaunchPlan:
    """One projection of every expert: `num_blocks` row blocks of `block_m` by N = n columns;
    `group_k` None: weights in `dtype`; else FP8 codes with a scale per row (0) or per row and
    `group_k` columns (a power of two from 16), on the W8A16 variant. `bias`: the variant that
    adds each expert's bias (gpt-oss; weights in `dtype` only)."""
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 32 if dtype == torch.float32 or k < 64 else 64
    assert group_k is None or not bias, "the W8A16 variant has no bias"
    variant = (("HAS_BIAS", bias),) if group_k is None else (("GROUP_K", group_k),)
    if group_k:
        assert group_k >= 16 and group_k & (group_k - 1) == 0, f"group_k {group_k}"
        block_k = min(block_k, group_k)
    return LaunchPlan(
        "_fused_moe_kernel" if group_k is None else "_fused_moe_w8a16_kernel",
        (num_blocks, triton.cdiv(n, block_n)),
        (
            ("N", n),
            ("K", k),
            ("TOP_K", top_k),
            ("A_PER_TOKEN", a_per_token),
            ("MUL_WEIGHTS", mul_weights),
            *variant,
            ("BLOCK_M", block_m),
            ("BLOCK_N", block_n),
            ("BLOCK_K", block_k),
            ("DOT_F32", dot_in_fp32(dtype, target)),
            ("PRECISION", dot_precision(dtype)),
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
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    group_k: int = 0,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """kernels.moe.fused_experts on Triton: two grouped GEMM launches, SiLU-and-mul between them
    (gpt-oss: with the experts' biases b13 [E, 2I] and b2 [E, H] and its clamped SwiGLU of
    `swiglu` = (alpha, limit)), the k rows of each token summed in fp32. With scales: w13 and w2
    are e4m3 codes, their scales fp32 [E, N, groups] (groups 1, or ceil(K / group_k))."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    coded = w13_scale is not None
    want = torch.float8_e4m3fn if coded else x.dtype
    assert x.dtype in FLOAT_DTYPES and w13.dtype == w2.dtype == want, (x.dtype, w13.dtype)
    if coded:
        for w, s in ((w13, w13_scale), (w2, w2_scale)):
            groups = -(-w.shape[2] // group_k) if group_k else 1
            assert s.dtype == torch.float32 and s.shape == (*w.shape[:2], groups), s.shape
            assert s.stride(2) == 1, s.stride()
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_inter // 2), (
        tuple(w13.shape),
        tuple(w2.shape),
    )
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert (b13 is None) == (b2 is None), "both projections have biases or neither"
    if b13 is not None:
        assert not coded, "the W8A16 variant has no bias"
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
    scales = (w13_scale, w2_scale, group_k) if coded else (None, None, None)
    _gemm(x, w13, inter, weights, sorted_ids, expert_ids, num_padded, top_k, True, target,
          scales[0], scales[2], b13)  # fmt: skip
    act = silu_and_mul_triton(inter) if swiglu is None else swiglu_oai_triton(inter, *swiglu)
    out = torch.empty((slots, hidden), dtype=x.dtype, device=x.device)
    _gemm(act, w2, out, weights, sorted_ids, expert_ids, num_padded, top_k, False, target,
          scales[1], scales[2], b2)  # fmt: skip
    return out.view(tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)


def _gemm(a, b, c, weights, sorted_ids, expert_ids, num_padded, top_k, first, target,
          scale=None, group_k=None, bias=None) -> None:  # fmt: skip
    """c = a @ b[expert].T (+ bias[expert]) per block; the first projection reads token rows, the
    second slot rows and applies the routing weight; with `scale`, b holds e4m3 codes."""
    n, k = b.shape[1], b.shape[2]
    plan = plan_fused_moe(expert_ids.numel(), n, k, top_k, first, not first,
                          sorted_ids.numel() // expert_ids.numel(), a.dtype, target,
                          group_k, bias=bias is not None)  # fmt: skip
    if scale is None:
        launch(_fused_moe_kernel, plan, a, b, c, weights, sorted_ids, expert_ids, num_padded,
               weights if bias is None else bias, c.shape[0], a.stride(0), b.stride(0),
               b.stride(1), c.stride(0))  # fmt: skip
        return
    launch(_fused_moe_w8a16_kernel, plan, a, b.view(torch.uint8), scale, c, weights, sorted_ids,
           expert_ids, num_padded, c.shape[0], a.stride(0), b.stride(0), b.stride(1),
           scale.stride(0), scale.stride(1), c.stride(0))  # fmt: skip
