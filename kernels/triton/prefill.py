"""Triton kernel: paged prefill attention (plain, chunked, or a prompt on cached context).
design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferline.kernels.triton.decode import NO_WINDOW, SINK_SCALE, check_sinks, soft_cap
from inferline.kernels.triton.checks import check_cache, check_out, check_ranges, check_tables
from inferline.kernels.triton.launch import (
    LaunchPlan,
    Target,
    dot_in_fp32,
    dot_precision,
    launch,
    target_of,
)

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, key_start, key_end, key_floor, q_pos, window, softcap, table, k_cache_ptr,
    v_cache_ptr, head_off, dims, dim_mask, stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    keys = key_start + tl.arange(0, BLOCK_N)
    key_mask = keys < key_end
    if CAUSAL:  # keys before the first row's window (<= key_floor) are never read: may be freed
        key_mask &= keys > key_floor
    block = tl.load(table + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    kv_off = block * stride_cb + (keys % BLOCK_SIZE) * stride_cs + head_off
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    # Masked lanes are never read: no NaN of an unused slot enters a sum.
    k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if softcap > 0:  # a run-time value (0: off): one binary with or without
        s = soft_cap(s, softcap)
    if CAUSAL:  # the causal band, or keys where the sliding window starts
        seen = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(seen & key_mask[None, :], s, float("-inf"))
    else:
        s = tl.where(key_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_exp = m_new
    if CAUSAL:  # a row may see none of a tile below its window: keep -inf - -inf (NaN) out
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_exp)
    p = tl.exp2(s - m_exp[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# Per-step values are not specialized: one binary per plan.
@triton.jit(
    do_not_specialize=["num_seqs", "window", "stride_bt"],
    do_not_specialize_on_alignment=["cu_seqlens_ptr", "context_lens_ptr"],
)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    sinks_ptr, qk_scale, num_seqs, window, softcap,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    # Largest seq with cu[seq] // BLOCK_M + seq <= tile, by binary search; the bounds are i32
    # tensors from the start (an int argument equal to 1 arrives as a constant).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    q_block = tile - (q_start // BLOCK_M + seq)
    if q_block * BLOCK_M < q_len:  # tiles past this sequence's rows have nothing to do
        context_len = tl.load(context_lens_ptr + seq)
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = context_len - q_len + rows
        dims = tl.arange(0, DIM_P2)
        dim_mask = dims < HEAD_DIM
        q_off = (
            (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :]
        )
        io_mask = row_mask[:, None] & dim_mask[None, :]
        q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0).to(tl.float32) * qk_scale
        if not DOT_F32:
            q = q.to(q_ptr.dtype.element_ty)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        head_off = (head // GROUP) * stride_ch
        # The tile's rows sit at positions [low_q, key_end). Keys [mid, mid_end) are visible to
        # every row; [window_lo, mid) and [mid_end, key_end) to some (masked, in one loop: a third
        # inlined tile spilled on sm_100a): the sliding window's edge and the diagonal band.
        # Without a window, window_lo = mid = 0: the loops of plain causal attention.
        low_q = context_len - q_len + q_block * BLOCK_M
        key_end = context_len - q_len + tl.minimum(q_block * BLOCK_M + BLOCK_M, q_len)
        full_end = (low_q + 1) // BLOCK_N * BLOCK_N
        window_lo = tl.maximum(low_q - window + 1, 0) // BLOCK_N * BLOCK_N
        full_start = tl.cdiv(tl.maximum(key_end - window, 0), BLOCK_N) * BLOCK_N
        mid = tl.maximum(window_lo, tl.minimum(full_start, full_end))
        mid_end = tl.maximum(mid, full_end)
        for key_start in range(mid, mid_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, key_start, key_end, low_q - window, q_pos, window, softcap,
                table, k_cache_ptr, v_cache_ptr, head_off, dims, dim_mask, stride_cb, stride_cs,
                BLOCK_SIZE, BLOCK_N, False, DOT_F32, PRECISION,
            )  # fmt: skip
        for masked_start in range(window_lo, mid + key_end - mid_end, BLOCK_N):
            key_start = masked_start + (masked_start >= mid).to(tl.int32) * (mid_end - mid)
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, key_start, key_end, low_q - window, q_pos, window, softcap,
                table, k_cache_ptr, v_cache_ptr, head_off, dims, dim_mask, stride_cb, stride_cs,
                BLOCK_SIZE, BLOCK_N, True, DOT_F32, PRECISION,
            )  # fmt: skip
        if HAS_SINKS:  # gpt-oss: the head's sink joins each row's sum (m_i finite: a key seen)
            l_i += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * SINK_SCALE - m_i)
        out = acc / l_i[:, None]  # every row sees at least its own key: l_i > 0
        out_off = (
            (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
        )
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def plan_prefill(
    total_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    target: Target,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    sinks: bool = False,
) -> LaunchPlan:
    """The launch for these shapes on `target` (pure: no tensors); block_m and block_n override
    the tile sizes; `sinks`: the variant with attention sinks (gpt-oss)."""
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    dim_p2 = triton.next_power_of_2(head_dim)
    tile_m, tile_n, num_warps = prefill_tiles(dim_p2, target)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    assert block_m >= 16 and block_n >= 16, (block_m, block_n)
    return LaunchPlan(
        "_prefill_kernel",
        (total_tokens // block_m + num_seqs, num_heads),
        (
            ("GROUP", num_heads // num_kv_heads),
            ("HEAD_DIM", head_dim),
            ("DIM_P2", dim_p2),
            ("BLOCK_SIZE", block_size),
            ("BLOCK_M", block_m),
            ("BLOCK_N", block_n),
            ("DOT_F32", dot_in_fp32(dtype, target)),
            ("PRECISION", dot_precision(dtype)),
            ("HAS_SINKS", sinks),
        ),
        num_warps=num_warps,
        num_stages=2,
    )


def prefill_tiles(dim_p2: int, target: Target) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the largest tiles that compile without register spills on
    sm_80, sm_90a and sm_100a (`make gpu-compile` checks)."""
    if dim_p2 <= 64:  # sm_80 with 4 warps spilled 12 B once soft-capping joined the tile
        return (64, 64, 4) if target.arch >= 90 else (64, 64, 8)
    if dim_p2 <= 128:
        # sm_100 keeps tl.dot accumulators in tensor memory; below it 64 x 64 needs 8 warps.
        return (128, 64, 8) if target.arch >= 100 else (64, 64, 8)
    return 64, 32, 8  # 256-wide rows: a narrow key tile leaves room for 64 query rows


def paged_prefill_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    *,
    plan: LaunchPlan | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    out=None,
    **overrides,
):
    """Launcher: checks the inputs, plans for q's device unless given a plan, launches it. `out`
    is written in place. window: the layer's sliding window (keys p - window < j <= p), None:
    every key. softcap: the scaled scores become cap * tanh(s / cap) (Gemma 2), 0: off.
    sinks: fp32 [num_heads], gpt-oss's attention sinks (the HAS_SINKS variant), None: none."""
    check_cache(k_cache, v_cache)
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert q.dim() == 3 and head_dim == cache_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.dtype == k_cache.dtype and q.device == k_cache.device, (q.dtype, k_cache.dtype)
    assert q.stride(2) == 1, "head_dim must be contiguous in q"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (num_seqs + 1,), (
        cu_seqlens_q.dtype,
        cu_seqlens_q.shape,
    )
    assert cu_seqlens_q.is_contiguous() and cu_seqlens_q.device == q.device
    check_tables(block_tables, context_lens, num_seqs, k_cache)
    if check_ranges(q) and num_seqs:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        assert int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == total, (
            "cu_seqlens_q must span q"
        )
        assert int(q_lens.min()) >= 0, "cu_seqlens_q must be non-decreasing"
        assert bool((q_lens <= context_lens.long()).all()), "q_len > context_len"
    out = check_out(out, q)
    check_sinks(sinks, q)
    if total == 0 or num_seqs == 0:
        return out
    if plan is None:
        plan = plan_prefill(
            total,
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            q.dtype,
            target_of(q.device),
            sinks=sinks is not None,
            **overrides,
        )
    assert plan.constexpr("HAS_SINKS") == (sinks is not None), "plan made for other sinks"
    assert plan.grid == (total // plan.constexpr("BLOCK_M") + num_seqs, num_heads), (
        plan.grid,
        q.shape,
    )
    launch(
        _prefill_kernel, plan, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        out if sinks is None else sinks, scale * LOG2E, num_seqs, window or NO_WINDOW,
        float(softcap or 0.0) * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1),
    )  # fmt: skip
    return out
