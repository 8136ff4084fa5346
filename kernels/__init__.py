"""Paged-KV attention ops as functions dispatched on `backend`, for tests and benchmarks.
No submodule is named like an exported function: importing it would replace the attribute.
"""

from __future__ import annotations

import torch

from inferline.kernels import reference
from inferline.kernels.backends import ModelShape, select_attention
from inferline.kernels.cpu import attention as cpu_attention

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention"]


def _resolve(backend: str, q: torch.Tensor, k_cache: torch.Tensor) -> str:
    if backend != "auto":
        assert backend in ("triton", "cpu", "torch"), (
            f"backend must be auto, triton, cpu or torch, got {backend!r}"
        )
        return backend
    shape = ModelShape(q.shape[-1], q.shape[-2], k_cache.shape[2], k_cache.shape[1])
    return select_attention(q.device, q.dtype, k_cache.dtype, shape)


def _on_triton(backend: str, t: torch.Tensor) -> bool:
    """For ops the C kernels leave to PyTorch (store, prefill): only Triton or the reference."""
    assert backend in ("auto", "triton", "cpu", "torch"), (
        f"backend must be auto, triton, cpu or torch, got {backend!r}"
    )
    return backend == "triton" or (backend == "auto" and t.is_cuda)


def store_kv(k, v, k_cache, v_cache, slot_mapping, backend: str = "auto") -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (int64,
    slot = block * block_size + offset; negative: skipped)."""
    if _on_triton(backend, k_cache):
        from inferline.kernels.triton.store import store_kv_triton

        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    backend: str = "auto",
    plan=None,
    cu_seqlens_q=None,
    window=None,
    softcap=0.0,
    sinks=None,
):
    """q [num_seqs, num_heads, head_dim], one token per sequence (K/V stored); block_tables int32
    [num_seqs, max_blocks]; context_lens int32 [num_seqs], including the current token. Returns
    [num_seqs, num_heads, head_dim]. `plan`: the torch path's index math (reference.plan_decode).
    With cu_seqlens_q, q holds several rows per sequence, each a decode over its own context
    (context_lens [num_rows]). `window`: a sliding window (keys p - window < j <= p).
    `softcap`: the scaled scores soft-capped, cap * tanh(s / cap) (Gemma 2); 0: off.
    `sinks`: fp32 [num_heads], gpt-oss's attention sinks (a logit per head in each softmax,
    dropped after); None: none."""
    chosen = _resolve(backend, q, k_cache)
    if cu_seqlens_q is not None:
        if chosen == "cpu":
            return cpu_attention.paged_decode_attention_cpu(
                q,
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                scale,
                cu_seqlens_q,
                window,
                softcap,
                sinks,
            )
        rows = torch.repeat_interleave(
            torch.arange(block_tables.shape[0], device=q.device), cu_seqlens_q.diff()
        )
        block_tables, plan = block_tables.index_select(0, rows).contiguous(), None
    if chosen == "triton":
        from inferline.kernels.triton.decode import paged_decode_attention_triton

        return paged_decode_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    if chosen == "cpu":
        return cpu_attention.paged_decode_attention_cpu(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    return reference.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, plan, window, softcap, sinks
    )


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    backend: str = "auto",
    window=None,
    softcap=0.0,
    sinks=None,
):
    """q [total_query_tokens, num_heads, head_dim]; sequence i owns rows cu_seqlens_q[i]:
    cu_seqlens_q[i+1], the last tokens of its context_lens[i], all stored; causal. Returns the
    same shape. `cpu` computes prompts on the reference path."""
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    if _on_triton(backend, q):
        from inferline.kernels.triton.prefill import paged_prefill_attention_triton

        return paged_prefill_attention_triton(*args, window=window, softcap=softcap, sinks=sinks)
    return reference.paged_prefill_attention(*args, window=window, softcap=softcap, sinks=sinks)
