"""Paged-KV attention ops: Triton kernels on CUDA, plain PyTorch (reference.py) elsewhere, and
for fp32 decode on the CPU a compiled C kernel (cpu.py) when a C compiler is there (the engine
also sends it prompt rows, each as a decode over its own causal context: ModelRunner._token_tables;
the C side goes through a prompt chunk's blocks once for up to 16 of its rows).
The layer's elementwise ops are in fused.py.

Cache layout per layer, K and V alike: [num_blocks, block_size, num_kv_heads, head_dim];
slot = block * block_size + offset. Every op takes backend="auto" | "triton" | "cpu" | "torch";
"auto" is Triton for CUDA tensors, the C kernel for fp32 CPU decode (if it built), and torch
otherwise. "triton" on CPU tensors needs TRITON_INTERPRET=1 set before triton is first
imported (the tests do this).
"""

from __future__ import annotations

import torch

from kernels import cpu, reference

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "decode_backend"]

_BACKENDS = ("auto", "triton", "cpu", "torch")


def _use_triton(backend: str, t: torch.Tensor) -> bool:
    assert backend in _BACKENDS, f"backend must be one of {_BACKENDS}, got {backend!r}"
    return backend == "triton" or (backend == "auto" and t.is_cuda)


def decode_backend(device: torch.device, dtype: torch.dtype, backend: str = "auto",
                   shape: tuple[int, int, int] | None = None, kv_dtype: torch.dtype | None = None) -> str:
    """What paged_decode_attention runs for tensors on `device` of `dtype`: triton, cpu or torch.
    `shape` = (head_dim, num_heads, block_size), where known: the C kernel takes only some;
    `kv_dtype`, the cache's element type when it is not `dtype` (fp16 caches for fp32 models)."""
    assert backend in _BACKENDS, f"backend must be one of {_BACKENDS}, got {backend!r}"
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    fits = shape is None or cpu.supports(*shape)
    if kv_dtype is not None and kv_dtype != dtype:
        fits = fits and kv_dtype == torch.float16 and shape is not None and cpu.supports_kv_half(shape[0])
    return "cpu" if device.type == "cpu" and dtype == torch.float32 and fits and cpu.available() else "torch"


def store_kv(k, v, k_cache, v_cache, slot_mapping, backend: str = "auto") -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping
    (int64 [num_tokens], slot = block * block_size + offset; a negative slot is skipped)."""
    if _use_triton(backend, k_cache):
        from kernels.store_kv import store_kv_triton

        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, backend: str = "auto",
                           plan=None, cu_seqlens_q=None):
    """q [num_seqs, num_heads, head_dim], one token per sequence (its K/V already stored);
    block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs], including the
    current token. Returns [num_seqs, num_heads, head_dim]. `plan` (reference.plan_decode) is
    the torch path's index math, made once per step for all layers; the kernels need none.
    With cu_seqlens_q (int32 [num_seqs + 1]) q holds rows of several tokens per sequence, each a
    decode over its own context (context_lens [num_rows]): sequence i owns rows cu_seqlens_q[i] ..
    cu_seqlens_q[i + 1] - 1 and block_tables has a row per sequence (prompt chunks on the CPU,
    ModelRunner._token_tables)."""
    chosen = decode_backend(q.device, q.dtype, backend, (q.shape[2], q.shape[1], k_cache.shape[1]), k_cache.dtype)
    if cu_seqlens_q is not None:
        if chosen == "cpu":
            return cpu.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, cu_seqlens_q)
        rows = torch.repeat_interleave(torch.arange(block_tables.shape[0], device=q.device), cu_seqlens_q.diff())
        block_tables, plan = block_tables.index_select(0, rows).contiguous(), None
    if chosen == "triton":
        from kernels.paged_decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    if chosen == "cpu":
        return cpu.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, plan=plan)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, backend: str = "auto"
):
    """q [total_query_tokens, num_heads, head_dim]; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] (int32), the last tokens of its context_lens[i] tokens,
    all already stored; causal. Returns [total_query_tokens, num_heads, head_dim]."""
    if _use_triton(backend, q):
        from kernels.paged_prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
        )
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
    )
