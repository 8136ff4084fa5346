"""Triton kernel: scatter new K/V tokens into the paged cache (slot < 0: skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.triton.checks import check_cache, check_ranges
from inferline.kernels.triton.launch import LaunchPlan, launch


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, DIM_P2)
    # slot < 0 masks every lane (a bound, not `& (slot >= 0)`: the interpreter turns bool tensor
    # & bool scalar into int32).
    dim_limit = tl.where(slot >= 0, HEAD_DIM, 0)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < dim_limit)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.shape == v.shape and k.shape[1:] == k_cache.shape[2:], (
        k.shape,
        v.shape,
        k_cache.shape,
    )
    assert k.dtype == v.dtype == k_cache.dtype, (
        f"K/V dtype {k.dtype} must match the cache's {k_cache.dtype}"
    )
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous in k and v"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,), (
        slot_mapping.dtype,
        slot_mapping.shape,
    )
    assert slot_mapping.is_contiguous() and k.device == k_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    if check_ranges(k_cache):
        assert int(slot_mapping.max()) < k_cache.shape[0] * k_cache.shape[1], "slot out of range"
    plan = plan_store(num_tokens, num_kv_heads, head_dim, k_cache.shape[1])
    launch(
        _store_kv_kernel, plan, k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    )  # fmt: skip


def plan_store(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int) -> LaunchPlan:
    """One program per token; the same on every target."""
    return LaunchPlan(
        "_store_kv_kernel",
        (num_tokens,),
        (
            ("NUM_KV_HEADS", num_kv_heads),
            ("HEAD_DIM", head_dim),
            ("HEADS_P2", triton.next_power_of_2(num_kv_heads)),
            ("DIM_P2", triton.next_power_of_2(head_dim)),
            ("BLOCK_SIZE", block_size),
        ),
        num_warps=4,
        num_stages=1,
    )
