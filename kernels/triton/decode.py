"""Triton kernels: paged decode attention, split-KV (flash-decoding) with a reduction stage.
design: docs/gpu.md#the-triton-kernels
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
SINK_SCALE = tl.constexpr(LOG2E)  # a sink's logit in the kernels' log2 units (a jit global)
MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16 on NVIDIA GPUs
MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # below this a split's fixed costs outweigh its parallelism
# The window argument of a layer without a sliding window: longer than any context, so every key
# is in it (one binary for every layer: the window is a run-time value, never specialized).
NO_WINDOW = 1 << 30
# BLOCK_N * DIM_P2: a 16 KB K/V tile at every head size, spill-free (`make gpu-compile`).
TILE_ELEMENTS = 8192


@triton.jit
def soft_cap(s, cap):
    """Gemma 2's attention logit soft-capping of log2-scaled scores s (scale * q.k * log2 e):
    cap * tanh(s / cap) with `cap` the soft cap times log2 e; tanh from exp (no libdevice: the
    interpreter runs it too), saturating to +-1 where the exp overflows or underflows."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def sink_term(sinks_ptr, heads, mask, m):
    """What each head's attention sink adds to its softmax sum under the running max m (log2
    units): 2^(sink * log2 e - m); 0 where m is -inf (no key seen)."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * SINK_SCALE
    return tl.where(m == float("-inf"), 0.0, tl.exp2(sink - m))


@triton.jit
def _write_out(
    out_ptr, acc, l_i, m_i, sinks_ptr, seq, heads, dims, out_mask, row_mask, stride_os, stride_oh,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    if HAS_SINKS:  # once per query, where the whole context's sum is known
        l_i += sink_term(sinks_ptr, heads, row_mask, m_i)
    # context_len 0 leaves l_i = 0: define the output as 0, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits", "window", "stride_bt"])
def _decode_stage1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, split_len_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr,
    qk_scale, num_splits, window, softcap,
    stride_qs, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """A split's partial softmax (m, l, acc) per query head of one KV head; the whole context's
    output when one split holds it. HAS_SINKS: gpt-oss's sinks join the sum where the output is
    written (here for a whole context, else in stage 2): once per query, never per split."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # The sliding window's keys [first, context_len): the splits cut that span, not the context.
    first = tl.maximum(context_len - window, 0)
    if DIRECT:  # a grid of one split: it takes every context whole
        start = first
        end = context_len
    else:
        # The step's split length, written by the host (choose_split_len): one grid, any context.
        split_len = tl.load(split_len_ptr)
        start = first + split * split_len
        if (start >= context_len) & (split > 0):  # past the context: nothing to read or write
            return
        end = tl.minimum(start + split_len, context_len)
    # Split 0 ending at the context holds the whole window: stage 2 passes it over. Decided here
    # (a predicate through the loop, not context_len: 4 B spilled at d=256 on sm_80 with both).
    whole = (split == 0) & (end == context_len)
    rows = tl.arange(0, GROUP_P2)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, DIM_P2)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * qk_scale  # softmax scale and log2(e) folded in
    if not DOT_F32:
        q = q.to(q_ptr.dtype.element_ty)
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_ch
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        tok_mask = tokens < end
        block = tl.load(table + tokens // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        kv_off = block * stride_cb + (tokens % BLOCK_SIZE) * stride_cs + head_off
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        # Masked lanes are never read: no NaN of an unused slot enters a sum.
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [GROUP_P2, BLOCK_N]
        if softcap > 0:  # a run-time value (0: off): one binary with or without
            s = soft_cap(s, softcap)
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        _write_out(out_ptr, acc, l_i, m_i, sinks_ptr, seq, heads, dims, out_mask, row_mask,
                   stride_os, stride_oh, HAS_SINKS)  # fmt: skip
    elif whole:
        _write_out(out_ptr, acc, l_i, m_i, sinks_ptr, seq, heads, dims, out_mask, row_mask,
                   stride_os, stride_oh, HAS_SINKS)  # fmt: skip
    else:
        part = (seq * NUM_HEADS + heads) * num_splits + split  # [GROUP_P2], int64
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_stage2_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, context_lens_ptr, split_len_ptr, sinks_ptr,
    num_splits, window, stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    span = tl.minimum(context_len, window)  # the keys of the window, as stage 1 split them
    # The splits stage 1 wrote (capped: a bad split length never reads past the partials).
    num_valid = tl.minimum(tl.cdiv(span, tl.load(split_len_ptr)), num_splits)
    if num_valid < 2:  # one split (or none) held the context: stage 1 wrote the output
        return
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, DIM_P2)
    split_mask = splits < num_valid
    dim_mask = dims < HEAD_DIM
    part = (seq * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=split_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    # At least two splits hold tokens: m_max is finite and total > 0.
    m_max = tl.max(m, 0)
    weight = tl.where(split_mask, tl.exp2(m - m_max), 0.0)
    total = tl.sum(weight * l_part, 0)
    if HAS_SINKS:  # the head's sink, once, under the splits' common max
        total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * SINK_SCALE - m_max)
    out = tl.sum(weight[:, None] * acc, 0) / total
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@dataclass(frozen=True)
class DecodePlan:
    stage1: LaunchPlan
    stage2: LaunchPlan | None  # None: one split, stage 1 writes the output itself
    num_splits: int  # the grid's, for the table's width
    split_len: int  # tokens per split when a context fills the table
    num_sms: int

    def split_len_for(self, max_context: int, num_seqs: int | None = None) -> int:
        """choose_split_len on this plan's grid for a step whose longest context is max_context
        (num_seqs: the real sequences, None: the grid's)."""
        grid_seqs, num_kv_heads, _ = self.stage1.grid
        block_n = self.stage1.constexpr("BLOCK_N")
        seqs = grid_seqs if num_seqs is None else num_seqs
        return choose_split_len(
            max_context, seqs, num_kv_heads, self.num_splits, block_n, self.num_sms
        )


def plan_decode(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    dtype: torch.dtype,
    target: Target,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    sinks: bool = False,
) -> DecodePlan:
    """The launches for these shapes on `target` (pure: no tensors); num_splits and block_n
    override the heuristics; `sinks`: the variant with attention sinks (gpt-oss)."""
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    dim_p2 = triton.next_power_of_2(head_dim)
    max_len = max_blocks * block_size
    num_splits, split_len, block_n = decode_grid(
        num_seqs, num_kv_heads, head_dim, max_len, target.num_sms, num_splits, block_n
    )
    group = num_heads // num_kv_heads
    # 8 warps for rows wider than 128: each thread's share of acc stays as at 128.
    stage1 = LaunchPlan(
        "_decode_stage1_kernel",
        (num_seqs, num_kv_heads, num_splits),
        (
            ("NUM_HEADS", num_heads),
            ("GROUP", group),
            ("GROUP_P2", max(MIN_GROUP_ROWS, triton.next_power_of_2(group))),
            ("HEAD_DIM", head_dim),
            ("DIM_P2", dim_p2),
            ("BLOCK_SIZE", block_size),
            ("BLOCK_N", block_n),
            ("DIRECT", num_splits == 1),
            ("DOT_F32", dot_in_fp32(dtype, target)),
            ("PRECISION", dot_precision(dtype)),
            ("HAS_SINKS", sinks),
        ),
        # 4 warps at every head size: at head_dim 256 with 8, the split plans spilled 4 B on one
        # architecture or another once the soft-cap joined the window (`make gpu-compile`).
        num_warps=4,
        num_stages=2,
    )
    stage2 = (
        None
        if num_splits == 1
        else LaunchPlan(
            "_decode_stage2_kernel",
            (num_seqs, num_heads),
            (
                ("NUM_HEADS", num_heads),
                ("HEAD_DIM", head_dim),
                ("DIM_P2", dim_p2),
                ("SPLITS_P2", triton.next_power_of_2(num_splits)),
                ("HAS_SINKS", sinks),
            ),
            num_warps=4,
            num_stages=1,
        )
    )
    return DecodePlan(stage1, stage2, num_splits, split_len, target.num_sms)


def decode_grid(
    num_seqs: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    num_sms: int,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[int, int, int]:
    """(num_splits, split_len, BLOCK_N) of stage 1's grid on tables of max_len tokens."""
    # Not widened to block_size: registers do not grow with the page size.
    block_n = block_n or max(16, TILE_ELEMENTS // triton.next_power_of_2(head_dim))
    assert block_n >= 16 and block_n & (block_n - 1) == 0, block_n
    max_len = max(max_len, 1)
    if num_splits is None:
        num_splits = choose_splits(num_seqs, num_kv_heads, max_len, num_sms)
    return *split_tokens(max_len, num_splits, block_n), block_n


def split_tokens(max_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(num_splits, split_len): splits of whole BLOCK_N tiles covering max_len."""
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    return triton.cdiv(max_len, split_len), split_len


def choose_splits(num_seqs: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Enough programs to fill the GPU (4 per SM), splits of at least MIN_SPLIT_TOKENS."""
    want = triton.cdiv(4 * num_sms, max(1, num_seqs * num_kv_heads))
    most = max(1, min(MAX_SPLITS, max_len // MIN_SPLIT_TOKENS))
    return max(1, min(want, most))


def choose_split_len(
    max_context: int,
    num_seqs: int,
    num_kv_heads: int,
    num_splits: int,
    block_n: int,
    num_sms: int,
) -> int:
    """Tokens per split for one step whose longest context is max_context, on a grid of
    num_splits splits (fixed per plan: a CUDA graph replays one launch).

    The grid is sized for a context filling the table; cut that way, a 2k context on 4096-token
    tables would leave half the splits idle. So the step's splits are cut from its longest
    context: as many as fill the GPU (num_seqs x num_kv_heads x splits programs, choose_splits),
    none shorter than MIN_SPLIT_TOKENS, never more than the grid holds, each whole BLOCK_N tiles.
    The splits past a context exit at once; with one split stage 1 writes the output."""
    wish = min(num_splits, choose_splits(num_seqs, num_kv_heads, max_context, num_sms))
    return split_tokens(max(max_context, 1), wish, block_n)[1]


def paged_decode_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    *,
    plan: DecodePlan | None = None,
    split_len: torch.Tensor | None = None,
    reduce: bool = True,
    window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    out=None,
    **overrides,
):
    """Launcher: checks the inputs, plans for q's device unless given a plan, launches it. `out`
    is written in place. softcap: the scaled scores become cap * tanh(s / cap), 0: off.
    sinks: fp32 [num_heads] on q's device, gpt-oss's attention sinks (a logit per head that joins
    each softmax once and is dropped; the plan's HAS_SINKS variant), None: none.
    split_len: the step's tokens per split, int32 [1] on q's device, read
    by the kernels (a CUDA graph replays the buffer's new contents; see choose_split_len); None:
    the plan's, for contexts that fill the table. reduce=False: every context fits one split,
    stage 2 is not launched. window: the layer's sliding window (keys p - window < j <= p),
    None: every key; the splits cut each window, so split_len may come from the contexts."""
    check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert q.dim() == 3 and head_dim == cache_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.dtype == k_cache.dtype and q.device == k_cache.device, (q.dtype, k_cache.dtype)
    assert q.stride(2) == 1, "head_dim must be contiguous in q"
    check_tables(block_tables, context_lens, num_seqs, k_cache)
    out = check_out(out, q)
    check_sinks(sinks, q)
    if num_seqs == 0:
        return out
    if plan is None:
        plan = plan_decode(
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.shape[1],
            q.dtype,
            target_of(q.device),
            sinks=sinks is not None,
            **overrides,
        )
    assert plan.stage1.constexpr("HAS_SINKS") == (sinks is not None), "plan made for other sinks"
    assert plan.stage1.grid[:2] == (num_seqs, num_kv_heads), (
        plan.stage1.grid,
        q.shape,
        k_cache.shape,
    )
    if split_len is None:
        split_len = torch.full((1,), plan.split_len, dtype=torch.int32, device=q.device)
    check_split_len(split_len, reduce, plan, context_lens)
    launch_decode(
        plan, q, k_cache, v_cache, block_tables, context_lens, scale, out, split_len, reduce,
        window, softcap, sinks,
    )  # fmt: skip
    return out


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Attention sinks, if any: fp32 [num_heads], contiguous, on q's device."""
    if sinks is None:
        return
    assert sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],), (sinks.dtype, sinks.shape)
    assert sinks.is_contiguous() and sinks.device == q.device, sinks.device


def check_split_len(split_len: torch.Tensor, reduce: bool, plan: DecodePlan, context_lens) -> None:
    """The buffer's form; with range checks on (check_ranges), that the grid's splits of it cover
    every context, and that a context fits one split when stage 2 is left out."""
    assert split_len.dtype == torch.int32 and split_len.shape == (1,), split_len
    assert split_len.device == context_lens.device, (split_len.device, context_lens.device)
    if plan.stage2 is None or not check_ranges(context_lens):
        return
    longest, length = int(context_lens.max()), int(split_len[0])
    assert length > 0 and longest <= plan.num_splits * length, (
        f"{plan.num_splits} splits of {length} tokens do not cover a context of {longest}"
    )
    assert reduce or longest <= length, f"reduce=False but a context of {longest} > {length}"


def launch_decode(
    plan: DecodePlan,
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    out,
    split_len: torch.Tensor,
    reduce: bool = True,
    window: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    num_seqs, num_heads, head_dim = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    direct = plan.stage2 is None
    part_acc = torch.empty(
        (0,) if direct else (num_seqs, num_heads, plan.num_splits, head_dim), **f32
    )
    part_m = torch.empty((0,) if direct else (num_seqs, num_heads, plan.num_splits), **f32)
    part_l = torch.empty_like(part_m)
    window = window or NO_WINDOW
    sinks = part_m if sinks is None else sinks  # never read without HAS_SINKS
    launch(
        _decode_stage1_kernel, plan.stage1, q, k_cache, v_cache, block_tables, context_lens,
        split_len, out, part_acc, part_m, part_l, sinks, scale * LOG2E, plan.num_splits, window,
        float(softcap or 0.0) * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
    )  # fmt: skip
    if not direct and reduce:
        launch(
            _decode_stage2_kernel,
            plan.stage2,
            out,
            part_acc,
            part_m,
            part_l,
            context_lens,
            split_len,
            sinks,
            plan.num_splits,
            window,
            out.stride(0),
            out.stride(1),
        )
