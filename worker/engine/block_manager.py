"""The paged KV block pool.

KV memory is `num_blocks` blocks of `block_size` token slots. A sequence owns the blocks listed
in its block table, in order: token i of the sequence lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Nothing else owns KV memory.
Blocks carry reference counts so that a later prefix cache can share them; today every block
has exactly one owner.
"""
from __future__ import annotations

from collections import deque

from worker.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain so that its next `num_new_tokens` tokens have slots."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.can_allocate(self.num_new_blocks(seq, num_new_tokens))

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks for its next `num_new_tokens` tokens."""
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            seq.block_table.append(self._allocate_block())

    def free(self, seq: Sequence) -> None:
        # Free in reverse so the tail blocks (least likely to be shared later) return first.
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table = []

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0, f"block {block_id} on the free list but owned"
        self.ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    def check_integrity(self, seqs: list[Sequence]) -> None:
        """No block lost, none owned twice, reference counts equal to owners."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq.request_id} repeats a block"
            assert len(seq.block_table) >= self.num_blocks_for(seq.num_computed_tokens)
            for block_id in seq.block_table:
                owners[block_id] += 1
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        for block_id in range(self.num_blocks):
            assert owners[block_id] == self.ref_counts[block_id], f"block {block_id}: ref count drift"
            assert (block_id in free) == (owners[block_id] == 0), f"block {block_id} lost or double-booked"
