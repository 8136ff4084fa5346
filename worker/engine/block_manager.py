"""The paged KV block pool: block tables, reference counts for shared prefix blocks, placement.
design: docs/architecture.md#kv-cache
"""

from __future__ import annotations

from collections import OrderedDict

from inferline.worker.engine.prefix_cache import PrefixCache
from inferline.worker.engine.sequence import Sequence


RUN_BLOCKS = 4  # blocks kept free after a sequence's newest one, for its next ones
# A block-table entry whose block was freed behind a sliding window (Sequence.num_freed_blocks):
# the device tables hold block 0 there, which no attention kernel reads (docs/architecture.md).
NULL_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_window(windows: list[int | None] | None) -> int | None:
    """The window blocks are freed behind: the widest of the layers' when every layer has one;
    None when any layer attends to every key (it still reads every block) or none is known."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        window: int | None = None,
    ):
        """`window`: the widest sliding window when every layer has one (see `sliding_window`):
        blocks wholly behind it are freed as sequences move on; None keeps every block."""
        assert num_blocks > 0 and block_size > 0 and (window is None or window > 0)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.ref_counts = [0] * num_blocks
        # Insertion order = order freed; the front is handed out first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache = PrefixCache(num_blocks, block_size) if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (free blocks holding cached K/V count as free)."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    @property
    def num_allocated_slots(self) -> int:
        """Token slots of the blocks in use (a shared block counts once)."""
        return (self.num_blocks - self.num_free_blocks) * self.block_size

    def num_wasted_slots(self, seqs: list[Sequence]) -> int:
        """Slots in `seqs`' blocks that hold none of their known tokens (last blocks' empty ends,
        blocks taken for rejected drafts)."""
        return sum(
            len(s.block_table) * self.block_size
            - min(s.num_tokens, len(s.block_table) * self.block_size)
            for s in seqs
        )

    def waste(self, seqs: list[Sequence]) -> float:
        """Fraction of allocated slots that hold no token (`seqs`: every owner of a block)."""
        allocated = self.num_allocated_slots
        return self.num_wasted_slots(seqs) / allocated if allocated else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.can_allocate(self.num_new_blocks(seq, num_new_tokens))

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            seq.block_table.append(
                self._allocate_block(seq.block_table[-1] if seq.block_table else None)
            )

    # ---- admission with cached prefixes -------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks an unadmitted `seq` can start from; [] for a fork (it holds them)."""
        assert seq.num_computed_tokens == len(seq.block_table) * self.block_size, (
            "only an unadmitted sequence"
        )
        return self.prefix_cache.match(seq) if self.prefix_cache and not seq.block_table else []

    def num_blocks_to_admit(self, seq: Sequence, cached: list[int]) -> int:
        """Free blocks admitting `seq` over `cached` takes: new ones and unowned cached ones."""
        fresh = self.num_blocks_for(seq.num_tokens) - len(cached) - len(seq.block_table)
        return fresh + sum(self.ref_counts[b] == 0 for b in cached)

    def allocate(self, seq: Sequence, cached: list[int]) -> None:
        """Admit `seq`: share the `cached` blocks, then reserve blocks for the remaining tokens.
        A fork holds its shared prefix already (fork()): it was no lookup, and nothing is cached."""
        if not seq.block_table:
            if self.prefix_cache:
                self.prefix_cache.record_lookup(seq.num_tokens, len(cached) * self.block_size)
            self._share(cached, seq)
        else:
            assert not cached, "a fork's prefix is its parent's"
        self.append(seq, seq.num_uncomputed_tokens)

    def fork(self, blocks: list[int], seq: Sequence) -> None:
        """Start `seq` on `blocks`, another sequence's full computed blocks with the same leading
        tokens: shared, never written. Where that sequence freed a block `seq`'s window still
        reads, `seq` shares none and computes its prompt itself."""
        num_freed = blocks.count(NULL_BLOCK)
        if num_freed and self.window is not None:
            first_seen = len(blocks) * self.block_size - self.window + 1
            if num_freed > max(first_seen, 0) // self.block_size:
                blocks = []
        assert not seq.block_table and all(self.ref_counts[b] > 0 for b in blocks[num_freed:])
        self._share(blocks, seq)

    def _share(self, blocks: list[int], seq: Sequence) -> None:
        """`blocks` may start with NULL_BLOCK entries (a fork of a sequence that freed them)."""
        num_freed = sum(b == NULL_BLOCK for b in blocks)
        assert blocks[:num_freed] == [NULL_BLOCK] * num_freed and not seq.block_table
        seq.num_freed_blocks = num_freed
        for block_id in blocks[num_freed:]:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table += blocks
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: enter the blocks `seq` has now fully computed."""
        if not self.prefix_cache:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for index in range(max(seq.num_cached_blocks, seq.num_freed_blocks), num_full):
            self.prefix_cache.insert(seq, index, seq.block_table[index])
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    # ---- freeing --------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        # Reverse: the tail blocks (least likely shared later) are handed out first.
        for block_id in reversed(seq.block_table[seq.num_freed_blocks :]):
            self._release_block(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_freed_blocks = 0

    def num_blocks_behind_window(self, seq: Sequence) -> int:
        """Leading blocks of `seq` no query from its next token on reads: every token of them
        lies at or before (next position - window); 0 without a window on every layer."""
        if self.window is None:
            return 0
        # The next query, at position num_computed_tokens, sees keys j > position - window.
        first_seen = seq.num_computed_tokens - self.window + 1
        return min(max(first_seen, 0) // self.block_size, len(seq.block_table))

    def free_behind_window(self, seq: Sequence) -> int:
        """Return `seq`'s blocks wholly behind the sliding window to the free pool (a shared one
        loses this owner; a cached one stays findable until reused); their entries become
        NULL_BLOCK. Returns how many were freed."""
        end = self.num_blocks_behind_window(seq)
        table, start = seq.block_table, seq.num_freed_blocks
        # Oldest last: the free list hands out the front first, so recent blocks stay cached.
        for index in range(end - 1, start - 1, -1):
            self._release_block(table[index])
            table[index] = NULL_BLOCK
        seq.num_freed_blocks = max(start, end)
        return max(0, end - start)

    def _allocate_block(self, after: int | None = None) -> int:
        """The block right after `after` where it can be taken, else the least recently freed."""
        if after is not None and self._takes_next(after + 1):
            block_id = after + 1
            del self.free_block_ids[block_id]
        else:
            block_id, _ = self.free_block_ids.popitem(last=False)
            for later in range(block_id + 1, min(block_id + RUN_BLOCKS, self.num_blocks)):
                if not self._takes_next(later):
                    break
                self.free_block_ids.move_to_end(later)
        assert self.ref_counts[block_id] == 0, f"block {block_id} on the free list but owned"
        if self.prefix_cache:
            self.prefix_cache.evict(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def _takes_next(self, block_id: int) -> bool:
        """Free, and not a cached prefix whose place in the eviction order it would jump."""
        if block_id >= self.num_blocks or block_id not in self.free_block_ids:
            return False
        return not (self.prefix_cache and self.prefix_cache.holds(block_id))

    def _release_block(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None

    def check_integrity(self, seqs: list[Sequence]) -> None:
        """No block lost or double-booked; reference counts equal owners."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            freed, held = (
                seq.block_table[: seq.num_freed_blocks],
                seq.block_table[seq.num_freed_blocks :],
            )
            assert freed == [NULL_BLOCK] * len(freed) and NULL_BLOCK not in held, (
                f"{seq.request_id}: freed entries not leading"
            )
            assert len(held) == len(set(held)), f"{seq.request_id} repeats a block"
            assert len(seq.block_table) >= self.num_blocks_for(seq.num_computed_tokens)
            assert seq.num_freed_blocks <= self.num_blocks_behind_window(seq), (
                f"{seq.request_id}: a block its window still reads was freed"
            )
            for block_id in held:
                owners[block_id] += 1
        for block_id in range(self.num_blocks):
            assert owners[block_id] == self.ref_counts[block_id], (
                f"block {block_id}: ref count drift"
            )
            assert (block_id in self.free_block_ids) == (owners[block_id] == 0), (
                f"block {block_id} lost or double-booked"
            )
        if self.prefix_cache:
            self.prefix_cache.check_integrity()
