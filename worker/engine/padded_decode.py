"""Decode-only steps on static buffers, the batch padded to a bucket (padding rows: slot -1,
context 0): the step a CUDA graph captures. design: docs/architecture.md#the-engine-step
"""

from __future__ import annotations

import bisect

import torch

from inferline.kernels.attention import AttentionBackend, AttentionMetadata, StepTables
from inferline.worker.engine.device import copy_to_device
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.step_inputs import PaddedDecodeInputs


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every 8 up to max_num_seqs, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """The padded step's persistent tensors, sized for the largest bucket: tokens int64 [3, rows]
    (ids, positions, slots), context_lens, cu_seqlens_q (never written), block_tables, logits,
    split_len (int32 [1]: the decode attention's tokens per split, where the backend has one)."""

    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros((3, max_rows), **i64)
        self.tokens[2] = -1
        self.context_lens = torch.zeros(max_rows, **i32)
        self.cu_seqlens_q = torch.arange(max_rows + 1, **i32)
        self.block_tables = torch.zeros((max_rows, max_blocks), **i32)
        self.logits = torch.zeros((max_rows, vocab_size), dtype=dtype, device=device)
        self.split_len = torch.ones(1, **i32)

    def load(self, step: PaddedDecodeInputs) -> None:
        rows, n = step.tokens.shape[1], step.block_tables.shape[0]
        copy_to_device(self.tokens[:, :rows], step.tokens)
        copy_to_device(self.context_lens[:rows], step.context_lens)
        copy_to_device(self.block_tables[:n, : step.block_tables.shape[1]], step.block_tables)

    def tables(self, rows: int) -> StepTables:
        """The first `rows` rows as the attention sees a step (views)."""
        return StepTables(
            self.tokens[2, :rows],
            self.tokens[1, :rows],
            self.context_lens[:rows],
            self.cu_seqlens_q[: rows + 1],
            rows,
            lambda first, stop: self.block_tables[first:stop],
            decode_split_len=self.split_len,
        )


class PaddedDecode:
    """Decode-only steps padded to a bucket; forward(bucket) touches only the buffers and the real
    rows' K/V: what a graph captures."""

    def __init__(
        self,
        model,
        kv_cache,
        attention: AttentionBackend,
        fused_ops: str,
        sizes: list[int],
        max_blocks: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model, self.kv_cache, self.attention, self.fused_ops = (
            model,
            kv_cache,
            attention,
            fused_ops,
        )
        self.sizes, self.max_blocks = sizes, max_blocks
        self.buffers = DecodeBuffers(max(sizes), max_blocks, vocab_size, dtype, device)

    def bucket(self, scheduled: list[ScheduledSequence]) -> int | None:
        """The bucket of a decode-only step (one new token each, no drafts); None otherwise."""
        if not scheduled or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        return bucket_for(len(scheduled), self.sizes)

    def load(self, step: PaddedDecodeInputs) -> None:
        bucket = step.tokens.shape[1]
        assert bucket in self.sizes, f"{bucket} rows: not a bucket"
        self.buffers.load(step)
        self._set_split_len(bucket, step.max_context, len(step.ordered))

    def load_padding(self, bucket: int) -> None:
        """Every row of `bucket` padding (start-up capture writes no K/V)."""
        b = self.buffers
        b.tokens[:2, :bucket] = 0
        b.tokens[2, :bucket] = -1
        b.context_lens[:bucket] = 0
        self._set_split_len(bucket, 0, 0)

    def _set_split_len(self, bucket: int, max_context: int, num_seqs: int) -> None:
        """The step's split length into its buffer: a graph's kernels read it at replay."""
        split_len = self.attention.decode_split_len(
            bucket, self.max_blocks, max_context, num_seqs, self.buffers.split_len.device
        )
        if split_len is not None:
            self.buffers.split_len.fill_(split_len)  # queued on the stream, no host sync

    def metadata(self, bucket: int) -> AttentionMetadata:
        return self.attention.prepare(self.buffers.tables(bucket), fused_ops=self.fused_ops)

    def forward(self, bucket: int) -> torch.Tensor:
        """The model over the first `bucket` rows; logits [bucket, vocab] (the buffer's rows)."""
        b = self.buffers
        tokens = b.tokens[:, :bucket]
        hidden = self.model(tokens[0], tokens[1], self.kv_cache, self.metadata(bucket))
        b.logits[:bucket].copy_(self.model.compute_logits(hidden))
        return b.logits[:bucket]
