"""Automatic prefix caching: a full KV block found again by a sha256 key chained over every token
up to its end. design: docs/architecture.md#kv-cache
"""

from __future__ import annotations

import hashlib
from array import array

from inferline.worker.engine.sequence import Sequence


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}  # key -> block holding those tokens
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.num_queried_tokens = 0  # prompt tokens looked up at admission, total
        self.num_hit_tokens = 0  # of which found in the cache

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Keys of `seq`'s first `num_blocks` full blocks (memoized: its tokens only grow)."""
        keys, bs = seq.block_keys, self.block_size
        if len(keys) < num_blocks:
            tokens = seq.token_ids
            while len(keys) < num_blocks:
                i = len(keys)
                chunk = array("q", tokens[i * bs : (i + 1) * bs]).tobytes()
                keys.append(hashlib.sha256((keys[-1] if keys else b"") + chunk).digest())
        return keys[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached run of `seq`'s leading blocks, before its last token."""
        hits = []
        for key in self.keys(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.block_of.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def insert(self, seq: Sequence, index: int, block_id: int) -> None:
        """Enter `seq`'s computed full block `index`; an existing copy of the same tokens stays."""
        (key,) = self.keys(seq, index + 1)[index:]
        if key not in self.block_of and self.key_of[block_id] is None:
            self.block_of[key] = block_id
            self.key_of[block_id] = key

    def holds(self, block_id: int) -> bool:
        """The block holds a cached prefix's K/V."""
        return self.key_of[block_id] is not None

    def evict(self, block_id: int) -> None:
        """The block is handed out for new tokens: forget what it held."""
        key = self.key_of[block_id]
        if key is not None:
            del self.block_of[key]
            self.key_of[block_id] = None

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def check_integrity(self) -> None:
        for key, block_id in self.block_of.items():
            assert self.key_of[block_id] == key, f"block {block_id}: cache maps disagree"
        assert sum(k is not None for k in self.key_of) == len(self.block_of), (
            "a block keeps a stale key"
        )
