"""Triton kernel: the rotary embedding fused with the K/V store (rope_store_kv), one read of qkv
and one write of each result. design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.triton.checks import check_cache, check_ranges
from inferline.kernels.triton.launch import LaunchPlan, launch
from inferline.kernels.triton.numerics import rounded

HALF_TILE = 1024  # the same tile at every head size


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_t, stride_cos, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_P2: tl.constexpr, HEADS_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dims = tl.arange(0, HALF_P2)
    HALF: tl.constexpr = HEAD_DIM // 2
    ROTATED: tl.constexpr = NUM_HEADS + NUM_KV_HEADS  # q and k heads; v heads pass through
    mask = (heads[:, None] < ROTATED + NUM_KV_HEADS) & (dims[None, :] < HALF)
    first = qkv_ptr + token * stride_t + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    table = token * stride_cos + dims
    c1 = tl.load(cos_ptr + table, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    rotate = heads[:, None] < ROTATED
    y1 = rounded(tl.where(rotate, x1 * c1 + x2 * s1, x1), qkv_ptr.dtype.element_ty)
    y2 = rounded(tl.where(rotate, x2 * c2 + x1 * s2, x2), qkv_ptr.dtype.element_ty)
    q_mask = mask & (heads[:, None] < NUM_HEADS)
    tl.store(first, y1, mask=q_mask)
    tl.store(first + HALF, y2, mask=q_mask)
    # A negative slot masks every lane: a bound, as in store.py.
    slot = tl.load(slot_ptr + token)
    half_limit = tl.where(slot >= 0, HALF, 0)
    is_v = heads >= ROTATED
    kv_head = tl.where(is_v, heads - ROTATED, heads - NUM_HEADS)
    kv_mask = mask & (heads[:, None] >= NUM_HEADS) & (dims[None, :] < half_limit)
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + kv_head[:, None] * stride_ch
        + dims[None, :]
    )
    k_mask = kv_mask & ~is_v[:, None]
    v_mask = kv_mask & is_v[:, None]
    tl.store(k_cache_ptr + dst, y1, mask=k_mask)
    tl.store(k_cache_ptr + dst + HALF, y2, mask=k_mask)
    tl.store(v_cache_ptr + dst, y1, mask=v_mask)
    tl.store(v_cache_ptr + dst + HALF, y2, mask=v_mask)


def plan_rope_store_kv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> LaunchPlan:
    half_p2 = triton.next_power_of_2(head_dim // 2)
    heads_block = min(
        max(1, HALF_TILE // half_p2), triton.next_power_of_2(num_heads + 2 * num_kv_heads)
    )
    return LaunchPlan(
        "_rope_store_kv_kernel",
        (num_tokens, triton.cdiv(num_heads + 2 * num_kv_heads, heads_block)),
        (
            ("NUM_HEADS", num_heads),
            ("NUM_KV_HEADS", num_kv_heads),
            ("HEAD_DIM", head_dim),
            ("HALF_P2", half_p2),
            ("HEADS_BLOCK", heads_block),
            ("BLOCK_SIZE", block_size),
        ),
        num_warps=4,
        num_stages=1,
    )


def rope_store_kv_triton(
    qkv, num_heads: int, num_kv_heads: int, cos, sin, k_cache, v_cache, slot_mapping
) -> torch.Tensor:
    """Rotates q in place in qkv and returns it as a view [num_tokens, num_heads, head_dim]; k
    (rotated) and v go to the caches at slot_mapping."""
    check_cache(k_cache, v_cache)
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    assert k_cache.shape[2] == num_kv_heads and head_dim % 2 == 0, (k_cache.shape, num_kv_heads)
    assert (
        qkv.dim() == 2
        and qkv.stride(1) == 1
        and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    ), (qkv.shape, num_heads, num_kv_heads, head_dim)
    assert qkv.dtype == k_cache.dtype and qkv.device == k_cache.device, (qkv.dtype, k_cache.dtype)
    # [tokens, 1, head_dim] or [tokens, head_dim]: rows of head_dim, packed
    assert cos.shape[0] == sin.shape[0] == tokens and cos.shape[-1] == sin.shape[-1] == head_dim, (
        cos.shape,
        sin.shape,
    )
    assert cos.is_contiguous() and sin.is_contiguous() and cos.device == qkv.device, (
        "cos/sin rows must be packed"
    )
    assert (
        slot_mapping.dtype == torch.int64
        and slot_mapping.shape == (tokens,)
        and slot_mapping.is_contiguous()
    )
    assert slot_mapping.device == qkv.device
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    if tokens == 0:
        return q
    if check_ranges(k_cache):
        assert int(slot_mapping.max()) < k_cache.shape[0] * k_cache.shape[1], "slot out of range"
    plan = plan_rope_store_kv(tokens, num_heads, num_kv_heads, head_dim, k_cache.shape[1])
    launch(
        _rope_store_kv_kernel,
        plan,
        qkv,
        cos,
        sin,
        slot_mapping,
        k_cache,
        v_cache,
        qkv.stride(0),
        head_dim,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
    )
    return q
