"""A random paged KV cache for the kernel tests (no triton import: safe in the pytest process)."""

from __future__ import annotations

import torch

GARBAGE_BLOCK = 1 << 20  # block-table padding: far out of range, must never be dereferenced


class PagedCache:
    """A cache holding `lens[i]` random tokens for each sequence at shuffled blocks."""

    def __init__(self, gen, lens, block_size, num_kv_heads, head_dim, dtype, spare_blocks=3):
        self.lens, self.block_size = lens, block_size
        per_seq = [-(-n // block_size) for n in lens]
        num_blocks = sum(per_seq) + spare_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        width = max(per_seq) + 2  # padding columns past every sequence's blocks
        self.block_tables = torch.full((len(lens), width), GARBAGE_BLOCK, dtype=torch.int32)
        self.block_tables[:, -1] = -1
        order = torch.randperm(num_blocks, generator=gen)
        self.k, self.v, self.slots, start = [], [], [], 0
        for i, n in enumerate(lens):
            self.block_tables[i, : per_seq[i]] = order[start : start + per_seq[i]].int()
            start += per_seq[i]
            pos = torch.arange(n)
            slots = self.block_tables[i, pos // block_size].long() * block_size + pos % block_size
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.k_cache.view(-1, num_kv_heads, head_dim)[slots] = k  # independent of store_kv
            self.v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
            self.k.append(k)
            self.v.append(v)
            self.slots.append(slots)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)
        self.spare = int(order[start]) if spare_blocks else None  # a block left NaN

    def tables_freed_behind(self, window: int, first_queries) -> torch.Tensor:
        """The block tables with each sequence's blocks wholly behind the window of its first
        query (first_queries[i]: keys <= it - window), the blocks the engine frees
        (BlockManager.free_behind_window), pointing at a NaN block: a kernel that reads one
        writes NaN."""
        tables = self.block_tables.clone()
        for i, first_query in enumerate(first_queries):
            tables[i, : max(first_query - window + 1, 0) // self.block_size] = self.spare
        return tables
