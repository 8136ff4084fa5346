"""Paged decode attention in C (csrc/paged_decode_attention.c): fp32 queries over fp32 or fp16 K/V,
the blocks read in place (design: docs/architecture.md#kernels).
"""

from __future__ import annotations

import torch

from inferline.kernels.cpu import build

_ERRORS = {
    -1: "could not allocate its work lists",
    -2: "a block table entry or cu_seqlens_q is out of range",
    -3: "a shape or K/V dtype it does not take (see supports() and supports_kv_half())",
}
# K/V cache element types the C kernels read and write: fp32, or fp16.
KV_DTYPES = (torch.float32, torch.float16)


def supports(head_dim: int, num_heads: int, block_size: int) -> bool:
    """The C kernel's shapes: head_dim a multiple of 16 up to 256, and one block's scores for
    every head on its stack (16384 floats)."""
    return head_dim % 16 == 0 and head_dim <= 256 and num_heads * -(-block_size // 16) * 16 <= 16384


def supports_kv_half(head_dim: int) -> bool:
    """fp16 K/V caches of this head size work: the compiler has fp16 conversions, head_dim a
    multiple of 16."""
    return head_dim % 16 == 0 and build.available() and build.lib().kv_half


def paged_decode_attention_cpu(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    cu_seqlens_q=None,
    window=None,
    softcap=0.0,
    sinks=None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention, for fp32 CPU q (rows may be apart) and
    fp32 or fp16 contiguous caches; with cu_seqlens_q, rows share their sequence's table row.
    window: a sliding window (a row of context c sees its last `window` tokens), None: all.
    softcap: the scaled scores become cap * tanh(s / cap) (Gemma 2), 0: off.
    sinks: fp32 [num_heads], a logit per head that joins each row's softmax and is dropped
    (gpt-oss's attention sinks), None: none."""
    num_rows, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = num_rows if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert supports(head_dim, num_heads, block_size), (
        f"shape the C kernel does not take: {q.shape}, {k_cache.shape}"
    )
    assert q.dtype == torch.float32 and q.device.type == "cpu", (q.dtype, q.device)
    for t in (k_cache, v_cache):
        assert t.dtype in KV_DTYPES and t.dtype == k_cache.dtype and t.device.type == "cpu", (
            t.dtype,
            t.device,
        )
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    # q may be a view of the fused qkv projection: rows apart, heads and dims packed.
    assert q.stride(2) == 1 and q.stride(1) == head_dim, (
        f"q's heads must be packed, strides {q.stride()}"
    )
    assert (
        block_tables.dtype == torch.int32
        and block_tables.is_contiguous()
        and block_tables.shape[0] == num_seqs
    )
    assert (
        context_lens.dtype == torch.int32
        and context_lens.is_contiguous()
        and context_lens.shape == (num_rows,)
    )
    if cu_seqlens_q is not None:
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous(), (
            cu_seqlens_q.dtype
        )
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_cpu and sinks.shape == (num_heads,), (
            sinks.dtype,
            sinks.shape,
        )
        sinks = sinks.contiguous()
    out = torch.empty_like(q)
    # The C side checks tables and cu_seqlens_q before reading (an error, not a wild read).
    rc = build.call(
        "paged_attention_f32",
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        None if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_rows,
        num_seqs,
        q.stride(0),
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        block_tables.shape[1],
        float(scale),
        torch.get_num_threads(),
        int(k_cache.dtype == torch.float16),
        int(window or 0),
        float(softcap or 0.0),
        None if sinks is None else sinks.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"paged_attention_f32: {_ERRORS.get(rc, rc)}")
    return out
