"""Plain PyTorch paged-attention ops: the CPU production path and the tests' oracle.

Cache layout (per layer, K and V alike):

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot = block * block_size + offset       (flat index into the first two dims)

A sequence's token t lives at slot  block_tables[s, t // block_size] * block_size + t % block_size.
Entries of a block table past ceil(context_len / block_size) are padding: never read.
Unused cache slots may hold garbage (NaN): everything here masks by selection, never by
multiplication, so garbage cannot reach the output.

GQA: query head h reads KV head h // (num_heads // num_kv_heads), as in Llama's repeat_kv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Decode attends in chunks of this many sequences, sorted by length: small dense copies that
# stay in cache, with little padding (measured ~1.8x faster than one padded batch on CPU).
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
    # A view, so index_copy_ writes the cache itself (view() raises rather than copies).
    return cache.view(cache.shape[0] * cache.shape[1], cache.shape[2], cache.shape[3])


def gather_kv(cache, block_tables, num_tokens: int, lens=None, out=None) -> torch.Tensor:
    """Dense [num_seqs, num_tokens, num_kv_heads, head_dim] copy of the first num_tokens tokens.

    With lens (int64 [num_seqs]), table entries past a sequence's own blocks are padding and
    are read as block 0 (any valid block), so garbage entries cannot index out of range; the
    tokens they yield lie past lens and the caller masks them. out, if given, is a flat buffer
    of at least num_seqs * num_blocks * block_size * kv_heads * head_dim elements to reuse.
    """
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    table = block_tables[:, :num_blocks].long()
    assert table.shape[1] == num_blocks, "block table shorter than the context"
    if lens is not None:
        used = (lens + block_size - 1) // block_size
        cols = torch.arange(num_blocks, device=table.device)
        table = table.masked_fill(cols[None, :] >= used[:, None], 0)
    shape = (num_seqs * num_blocks, *cache.shape[1:])
    if out is not None:
        assert out.numel() >= shape[0] * cache[0].numel(), "gather buffer too small"
        out = out[: shape[0] * cache[0].numel()].view(shape)
    gathered = torch.index_select(cache, 0, table.flatten(), out=out)
    return gathered.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]




def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """One query token per sequence over its paged context; returns [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    _check_cache(q, k_cache, v_cache)
    assert block_tables.shape[0] == num_seqs and context_lens.shape == (num_seqs,)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    lens = context_lens.long()
    # Sequences of similar length go together, so the dense copies carry little padding.
    order = torch.argsort(lens)
    for start in range(0, num_seqs, _DECODE_CHUNK_SEQS):
        idx = order[start : start + _DECODE_CHUNK_SEQS]
        sub_lens = lens[idx]
        out[idx] = _decode_chunk(q[idx], k_cache, v_cache, block_tables[idx], sub_lens, int(sub_lens.max()), scale)
    return out


def _decode_chunk(q, k_cache, v_cache, block_tables, lens, max_len, scale):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = max(max_len, 1)
    valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [S, L]
    k = gather_kv(k_cache, block_tables, max_len, lens)  # [S, L, KH, D]
    v = gather_kv(v_cache, block_tables, max_len, lens)
    # Head-major copies [S, KH, L, D]: batched GEMMs on strided operands take a slow path on
    # CPU (measured ~20x), a contiguous copy is cheap. V's padding is zeroed by selection in
    # the same pass (a NaN there would survive a zero weight); K's cannot reach the output
    # because its scores are replaced by -inf below.
    k = k.permute(0, 2, 1, 3).float().contiguous()
    v = torch.where(valid[:, None, :, None], v.permute(0, 2, 1, 3).float(),
                    torch.zeros((), dtype=torch.float32, device=q.device)).contiguous()
    # GQA without copies: the `group` query heads of one KV head are `group` query rows.
    qg = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [S, KH, G, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).reshape(num_seqs, num_heads, head_dim)
    # context_len 0 has no keys (a fully masked row, NaN after softmax): define its output as 0.
    out = out.masked_fill((lens == 0)[:, None, None], 0.0)
    return out.to(q.dtype)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
) -> torch.Tensor:
    """Causal attention of each sequence's last query tokens over its paged context.

    Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; they are the last
    q_len of its context_lens[i] tokens, so query row j sits at absolute position
    context_len - q_len + j and sees keys 0..that position.
    """
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
        out[lo:hi] = _prefill_one(q[lo:hi], k_cache, v_cache, block_tables[i : i + 1], ctx, scale)
    return out


def _prefill_one(q, k_cache, v_cache, block_table, ctx, scale):
    q_len = q.shape[0]
    # Slicing to ctx tokens drops the unused tail of the last block (and its garbage).
    k = gather_kv(k_cache, block_table, ctx)[0].float().transpose(0, 1)  # [KH, ctx, D]
    v = gather_kv(v_cache, block_table, ctx)[0].float().transpose(0, 1)
    qh = q.float().transpose(0, 1)  # [H, q_len, D]
    if q_len == ctx:  # a whole prompt: SDPA's own (top-left) causal mask is the same and cheaper
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]  # [q_len, ctx]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1).to(q.dtype)


def _check_cache(q, k_cache, v_cache):
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert q.dim() == 3 and q.shape[2] == k_cache.shape[3], (q.shape, k_cache.shape)
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"


def dense_causal_attention(q, k, v, scale) -> torch.Tensor:
    """Textbook attention for the tests: q [q_len, H, D], k/v [ctx, KH, D], bottom-right causal."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    pos_q = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(q.dtype)
