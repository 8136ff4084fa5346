"""Paged decode attention in C on the CPU (csrc/paged_decode_attention.c), fp32 queries over fp32
or fp16 K/V caches, prompt rows included (each row a decode over its own causal context).

Why C and not PyTorch on the CPU: paged decode attention in PyTorch must first gather every
sequence's K/V into a dense copy (reference.py), more bytes written and read again per step than
the attention's own reads. The C kernel reads the blocks in place.
"""
from __future__ import annotations

import torch

from inferline.kernels.cpu import build

_ERRORS = {-1: "could not allocate its work lists", -2: "a block table entry or cu_seqlens_q is out of range",
           -3: "a shape or K/V dtype it does not take (see supports() and supports_kv_half())"}
# Element types of the K/V caches the C kernels read and write: fp32, or fp16 (INFERLINE_CACHE__DTYPE).
KV_DTYPES = (torch.float32, torch.float16)


def supports(head_dim: int, num_heads: int, block_size: int) -> bool:
    """The C kernel's shapes: head_dim a multiple of 16 up to 256 (its vectors are 16 floats), and
    one block's scores for every head on its stack (16384 floats)."""
    return head_dim % 16 == 0 and head_dim <= 256 and num_heads * -(-block_size // 16) * 16 <= 16384


def supports_kv_half(head_dim: int) -> bool:
    """The kernels read and write fp16 K/V caches of this head size: a build whose compiler has
    the fp16 conversions (x86 F16C/AVX-512, or _Float16), head_dim a multiple of 16."""
    return head_dim % 16 == 0 and build.available() and build.lib().kv_half


def paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale,
                               cu_seqlens_q=None) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention; fp32 CPU q, fp32 or fp16 caches
    (contiguous), contiguous tables, q with packed heads (its rows may be apart).
    With cu_seqlens_q (int32 [num_seqs + 1]) rows share their sequence's table row: sequence i
    owns rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 (a prompt chunk, each row with its own
    context length in context_lens [num_rows]); the C side then goes through a chunk's blocks once
    for up to 16 rows, with the bits a row gets alone."""
    num_rows, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = num_rows if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert supports(head_dim, num_heads, block_size), f"shape the C kernel does not take: {q.shape}, {k_cache.shape}"
    assert q.dtype == torch.float32 and q.device.type == "cpu", (q.dtype, q.device)
    for t in (k_cache, v_cache):
        assert t.dtype in KV_DTYPES and t.dtype == k_cache.dtype and t.device.type == "cpu", (t.dtype, t.device)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    # q may be a view of the fused qkv projection: rows apart, heads and dims packed.
    assert q.stride(2) == 1 and q.stride(1) == head_dim, f"q's heads must be packed, strides {q.stride()}"
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous() and block_tables.shape[0] == num_seqs
    assert context_lens.dtype == torch.int32 and context_lens.is_contiguous() and context_lens.shape == (num_rows,)
    if cu_seqlens_q is not None:
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous(), cu_seqlens_q.dtype
    out = torch.empty_like(q)
    # The C side checks the tables and cu_seqlens_q before it reads (a bad one is an error, not a wild read).
    rc = build.call("paged_attention_f32",
              q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
              None if cu_seqlens_q is None else cu_seqlens_q.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
              num_rows, num_seqs, q.stride(0), num_heads, num_kv_heads, head_dim, num_blocks, block_size,
              block_tables.shape[1], float(scale), torch.get_num_threads(), int(k_cache.dtype == torch.float16))
    if rc != 0:
        raise RuntimeError(f"paged_attention_f32: {_ERRORS.get(rc, rc)}")
    return out
