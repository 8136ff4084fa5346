"""Plain PyTorch paged-attention ops: the fallback and the tests' oracle. Unused cache slots may
hold NaN: nothing reads them into a sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def window_start(context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """The first key the last query of each context sees under a sliding window: a query at
    position p sees keys j with p - j < window (transformers' sliding_window_overlay)."""
    return (context_lens - window).clamp_min(0)


# Decode attends in chunks of this many length-sorted sequences: small dense copies that stay in
# cache, with little padding.
_DECODE_CHUNK_SEQS = 8


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] at slot_mapping (int64, <0 = skip)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert k.shape == v.shape and k.shape[1:] == (num_kv_heads, head_dim), (k.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, k, v = slot_mapping[valid], k[valid], v[valid]
    if slots.numel() == 0:
        return
    _flat(k_cache).index_copy_(0, slots.long(), k.to(k_cache.dtype))
    _flat(v_cache).index_copy_(0, slots.long(), v.to(v_cache.dtype))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    # A view, so index_copy_ writes the cache itself.
    return cache.view(cache.shape[0] * cache.shape[1], cache.shape[2], cache.shape[3])


def gather_kv(cache, block_tables, num_tokens: int) -> torch.Tensor:
    """Dense [num_seqs, num_tokens, num_kv_heads, head_dim] copy of the first num_tokens tokens."""
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    table = block_tables[:, :num_blocks].long()
    assert table.shape[1] == num_blocks, "block table shorter than the context"
    # Whole blocks as 2-D rows: index_select copies rows with one memcpy only on 2-D input.
    gathered = torch.index_select(cache.view(cache.shape[0], -1), 0, table.flatten())
    return gathered.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]


@dataclass
class DecodeChunk:
    start: int  # rows start:stop of the length-sorted batch
    stop: int
    max_len: int
    rows: torch.Tensor  # int64: rows of the cache viewed as [slots * KH, D]
    bias: torch.Tensor  # fp32: 0 for a context token, -inf for padding


@dataclass
class DecodePlan:
    """The index math of one decode batch, shared by every layer: the length order, the chunks,
    and each chunk's cache rows."""

    num_seqs: int
    order: torch.Tensor | None  # sorted position -> batch row; None when already sorted
    chunks: list[DecodeChunk]
    empty: torch.Tensor | None  # bool, batch order: context_len 0
    window: int | None = None  # the sliding window it masks to


def plan_decode(
    block_tables,
    context_lens,
    block_size: int,
    num_kv_heads: int,
    chunk_seqs: int | None = None,
    window: int | None = None,
) -> DecodePlan:
    """Sort by length and cut into chunks of `chunk_seqs`; padding re-reads the first token of the
    sequence's window (token 0 without one) under a -inf bias, and a context_len 0 row reads slot
    0, its output set to 0 (`empty`). Keys before a sliding `window` get the -inf bias too and are
    never read: their blocks may be freed."""
    chunk_seqs = chunk_seqs or _DECODE_CHUNK_SEQS
    lens = context_lens.long()
    num_seqs = lens.shape[0]
    order = torch.argsort(lens, stable=True)
    if bool((lens[1:] >= lens[:-1]).all()):
        order = None
    sorted_lens = lens if order is None else lens[order]
    tables = block_tables if order is None else block_tables[order]
    ascending = sorted_lens.tolist()
    chunks = []
    for start in range(0, num_seqs, chunk_seqs):
        stop = min(start + chunk_seqs, num_seqs)
        max_len = max(ascending[stop - 1], 1)
        rows, bias = _chunk_rows(
            tables[start:stop], sorted_lens[start:stop], max_len, block_size, num_kv_heads, window
        )
        chunks.append(DecodeChunk(start, stop, max_len, rows, bias))
    empty = (lens == 0).view(num_seqs, 1, 1, 1)
    return DecodePlan(num_seqs, order, chunks, empty if bool(empty.any()) else None, window)


def _chunk_rows(tables, lens, max_len: int, block_size: int, num_kv_heads: int, window=None):
    pos = torch.arange(max_len, device=lens.device)
    valid = pos[None, :] < lens[:, None]  # [c, L]
    first = torch.zeros_like(lens)
    if window:
        first = window_start(lens, window)
        valid &= pos[None, :] >= first[:, None]
    # Padding re-reads the window's first token: blocks before it may be freed (block_manager).
    tok = torch.where(valid, pos[None, :], first[:, None])
    slots = tables.long().gather(1, tok // block_size) * block_size + tok % block_size
    slots = slots.masked_fill(lens[:, None] == 0, 0)  # no token 0: any in-range slot
    heads = torch.arange(num_kv_heads, device=lens.device)
    # Head-major [c, KH, L]: the layout the GEMMs want, no permute copy.
    rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=lens.device)
    bias.masked_fill_(~valid, float("-inf"))
    return rows, bias[:, None, None, :]


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping, in place: cap * tanh(scores / cap); 0: off."""
    if not softcap:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim; with `sinks` (gpt-oss's attention sinks: one learned logit per
    query head, shaped to broadcast against scores[..., :1]) each row's softmax has one more
    column holding the sink, dropped after: the row's weights sum to less than 1."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    plan=None,
    window=None,
    softcap=0.0,
    sinks=None,
) -> torch.Tensor:
    """One query token per sequence over its paged context -> [num_seqs, num_heads, head_dim].
    `plan`: plan_decode of these tables and this `window`, computed once for all layers.
    `softcap`: the scaled scores soft-capped (cap * tanh(s / cap)) before the mask; 0: off.
    `sinks`: fp32 [num_heads], a logit per head that joins each softmax and is dropped (gpt-oss's
    attention sinks); None: none."""
    num_seqs, num_heads, head_dim = q.shape
    _check_cache(q, k_cache, v_cache)
    assert block_tables.shape[0] == num_seqs and context_lens.shape == (num_seqs,)
    if num_seqs == 0:
        return torch.empty_like(q)
    if plan is None:
        plan = plan_decode(
            block_tables, context_lens, k_cache.shape[1], k_cache.shape[2], window=window
        )
    assert plan.num_seqs == num_seqs, "plan made for another batch"
    assert (plan.window or None) == (window or None), "plan made for another window"
    return decode_with_plan(q, k_cache, v_cache, plan, scale, softcap, sinks)


def decode_with_plan(
    q, k_cache, v_cache, plan: DecodePlan, scale, softcap=0.0, sinks=None
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # 2-D [slots * KH, D] views: index_select's row-memcpy path is 2-D only.
    k_rows, v_rows = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    if plan.order is not None:
        q = q[plan.order]
    # GQA without copies: the `group` query heads of one KV head are `group` query rows.
    qg = (q.float() * scale).view(num_seqs, num_kv_heads, group, head_dim)
    out = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
    if sinks is not None:  # [KH, G, 1]: the chunk's scores are [c, KH, G, L]
        sinks = sinks.float().view(num_kv_heads, group, 1)
    for ch in plan.chunks:
        c = ch.stop - ch.start
        k = k_rows.index_select(0, ch.rows).view(c, num_kv_heads, ch.max_len, head_dim).float()
        v = v_rows.index_select(0, ch.rows).view(c, num_kv_heads, ch.max_len, head_dim).float()
        scores = soft_cap(torch.matmul(qg[ch.start : ch.stop], k.transpose(-1, -2)), softcap)
        scores.add_(ch.bias)  # [c, KH, G, L]
        torch.matmul(softmax_with_sinks(scores, sinks), v, out=out[ch.start : ch.stop])
    out = out.view(num_seqs, num_heads, head_dim)
    if plan.order is not None:
        out = torch.empty_like(out).index_copy_(0, plan.order, out)
    if plan.empty is not None:  # context_len 0: NaN after softmax; defined as 0
        out = out.masked_fill(plan.empty.view(num_seqs, 1, 1), 0.0)
    return out.to(q.dtype)


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    window=None,
    softcap=0.0,
    sinks=None,
) -> torch.Tensor:
    """Causal attention of each sequence's last query tokens over its paged context: rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] are the last q_len of context_lens[i] tokens, so row j sits
    at position context_len - q_len + j; with a sliding `window`, it sees the last `window`
    positions up to its own. `softcap`, `sinks`: as paged_decode_attention's."""
    total, num_heads, head_dim = q.shape
    _check_cache(q, k_cache, v_cache)
    num_seqs = context_lens.shape[0]
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    assert cu[0] == 0 and cu[-1] == total, (cu, total)
    out = torch.empty_like(q)
    for i in range(num_seqs):
        lo, hi, ctx = cu[i], cu[i + 1], lens[i]
        if hi == lo:
            continue
        assert 0 < hi - lo <= ctx, f"seq {i}: q_len {hi - lo} > context_len {ctx}"
        out[lo:hi] = _prefill_one(
            q[lo:hi], k_cache, v_cache, block_tables[i : i + 1], ctx, scale, window, softcap, sinks
        )
    return out


def _prefill_one(
    q, k_cache, v_cache, block_table, ctx, scale, window=None, softcap=0.0, sinks=None
):
    q_len, block_size = q.shape[0], k_cache.shape[1]
    # Blocks wholly before the first row's window are never read: they may be freed.
    skip = max(ctx - q_len - window + 1, 0) // block_size if window else 0
    table, start = block_table[:, skip:], skip * block_size
    # Slicing to ctx tokens drops the last block's unused tail.
    k = gather_kv(k_cache, table, ctx - start)[0].float().transpose(0, 1)  # [KH, ctx, D]
    v = gather_kv(v_cache, table, ctx - start)[0].float().transpose(0, 1)
    qh = q.float().transpose(0, 1)  # [H, q_len, D]
    by_hand = softcap or sinks is not None  # SDPA has neither soft-capping nor sinks
    if q_len == ctx and not window and not by_hand:  # SDPA's own causal mask is cheaper
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(0, 1).to(q.dtype)
    pos_q = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    pos_k = torch.arange(start, ctx, device=q.device)[None, :]
    mask = (pos_k <= pos_q) & (pos_k > pos_q - window if window else True)  # [q_len, ctx]
    if by_hand:  # the scores by hand
        group = qh.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = soft_cap(torch.matmul(qh, k.transpose(-1, -2)).mul_(scale), softcap)
        scores = scores.masked_fill_(~mask, float("-inf"))
        head_sinks = None if sinks is None else sinks.view(-1, 1, 1)
        o = torch.matmul(softmax_with_sinks(scores, head_sinks), v)
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1).to(q.dtype)


def _check_cache(q, k_cache, v_cache):
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert q.dim() == 3 and q.shape[2] == k_cache.shape[3], (q.shape, k_cache.shape)
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


def dense_causal_attention(q, k, v, scale, window=None, softcap=0.0, sinks=None) -> torch.Tensor:
    """Textbook attention for the tests: q [q_len, H, D], k/v [ctx, KH, D], bottom-right causal;
    a sliding `window` hides keys `window` or more positions back; `softcap`: cap * tanh(s / cap)
    of the scaled scores; `sinks` [H]: a logit per head that joins the softmax, then dropped
    (as transformers' gpt-oss eager attention)."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos_q = torch.arange(ctx - q_len, ctx)[:, None]
    pos_k = torch.arange(ctx)[None, :]
    hidden = (pos_k > pos_q) | (pos_k <= pos_q - window if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        column = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat((scores, column), -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
