"""Launcher-side checks shared by the Triton kernels; index ranges only on CPU tensors or with
INFERLINE_KERNEL_CHECKS=1 (docs/gpu.md#the-triton-kernels).
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_ranges(t: torch.Tensor) -> bool:
    setting = os.environ.get("INFERLINE_KERNEL_CHECKS")
    return not t.is_cuda if setting is None else setting == "1"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, (
        f"cache must be [num_blocks, block_size, kv_heads, head_dim], got {k_cache.shape}"
    )
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in FLOAT_DTYPES, (
        k_cache.dtype,
        v_cache.dtype,
    )
    assert k_cache.device == v_cache.device
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share strides"
    assert k_cache.stride(3) == 1, "head_dim must be contiguous in the cache"
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two, got {block_size}"
    )


def check_tables(block_tables, context_lens, num_seqs: int, k_cache) -> None:
    """Shapes, dtypes and (when check_ranges) that every used table entry is a valid block."""
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, (
        block_tables.dtype,
        block_tables.shape,
    )
    assert block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1, block_tables.shape
    assert context_lens.dtype == torch.int32 and context_lens.shape == (num_seqs,), (
        context_lens.dtype,
        context_lens.shape,
    )
    assert context_lens.is_contiguous()
    assert block_tables.device == context_lens.device == k_cache.device
    if num_seqs == 0 or not check_ranges(k_cache):
        return
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    lens = context_lens.long()
    assert int(lens.min()) >= 0, "negative context length"
    assert int(lens.max()) <= block_tables.shape[1] * block_size, (
        "context longer than its block table"
    )
    used = (
        torch.arange(block_tables.shape[1], device=lens.device)[None, :]
        < (lens[:, None] + block_size - 1) // block_size
    )
    entries = block_tables[used]
    if entries.numel():
        assert int(entries.min()) >= 0 and int(entries.max()) < num_blocks, (
            "block table entry out of range"
        )


def check_out(out, q) -> torch.Tensor:
    """A fresh output like q, or the caller's (asserted to match q)."""
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, (
        out.shape,
        out.dtype,
    )
    assert out.stride(2) == 1, "head_dim must be contiguous in out"
    return out
