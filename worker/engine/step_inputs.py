"""A step's inputs from the scheduler's chunks (token ids, positions, slots, context lengths,
cu_seqlens, block tables), with little Python per step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inferline.kernels.attention import StepTables
from inferline.worker.engine.scheduler import ScheduledSequence


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


@dataclass
class _Row:
    index: int  # of the persistent table
    table: list[int]  # the block_table list the row mirrors (kept: its id stays unique)
    written: int  # entries copied into the row
    step: int  # the last step that used it
    cleared: int = 0  # leading entries set to 0: their blocks were freed behind a sliding window


class BlockTableRows:
    """Each scheduled sequence's block table as a row of one persistent int32 tensor."""

    def __init__(self, max_blocks: int, pin_memory: bool = False, rows: int = 64):
        self.max_blocks, self.pin_memory = max_blocks, pin_memory
        self.table = torch.zeros(rows, max_blocks, dtype=torch.int32, pin_memory=pin_memory)
        self.entries = self.table.numpy()  # same memory: numpy writes dispatch no torch op
        self.rows: dict[int, _Row] = {}  # id(seq) -> its row, for the sequences of the last step
        self.free = list(range(rows))[::-1]
        self.extent = [0] * rows  # entries written since each row was last zeroed
        self.step = 0

    def assign(self, seqs) -> list[int]:
        """The row of each sequence, written up to its block table's end; other rows are freed."""
        self.step += 1
        rows, indices = self.rows, []
        for seq in seqs:
            row, table = rows.get(id(seq)), seq.block_table
            if row is None or row.table is not table or row.written > len(table):
                row = rows[id(seq)] = self._fresh(row, table)
            if row.written < len(table):
                assert len(table) <= self.max_blocks, (
                    f"{len(table)} blocks: more than max_model_len holds"
                )
                self.entries[row.index, row.written : len(table)] = table[row.written :]
                row.written = self.extent[row.index] = len(table)
            if row.cleared < seq.num_freed_blocks:  # NULL_BLOCK -> 0, an index never read
                self.entries[row.index, row.cleared : seq.num_freed_blocks] = 0
                row.cleared = seq.num_freed_blocks
            row.step = self.step
            indices.append(row.index)
        if len(rows) > len(seqs):
            for key in [k for k, r in rows.items() if r.step != self.step]:
                self.free.append(rows.pop(key).index)
        return indices

    def _fresh(self, row: _Row | None, table: list[int]) -> _Row:
        """A zeroed row for `table`: the sequence's own again, or one from the pool."""
        index = row.index if row is not None else self._take()
        self.entries[index, : self.extent[index]] = 0
        self.extent[index] = 0
        return _Row(index, table, 0, self.step)

    def _take(self) -> int:
        if not self.free:
            stale = [k for k, r in self.rows.items() if r.step != self.step]
            if stale:  # a row this step does not use: reclaim it now
                return self.rows.pop(stale[0]).index
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        rows = self.table.shape[0]
        grown = torch.zeros(
            2 * rows, self.max_blocks, dtype=torch.int32, pin_memory=self.pin_memory
        )
        grown[:rows] = self.table
        self.table, self.entries = grown, grown.numpy()
        self.extent += [0] * rows
        self.free += list(range(2 * rows - 1, rows - 1, -1))

    def gather(self, indices: torch.Tensor, width: int) -> torch.Tensor:
        """int32 [len(indices), width]: the rows cut to `width` (zeros past a table's end are never
        read)."""
        out = torch.empty((indices.shape[0], width), dtype=torch.int32, pin_memory=self.pin_memory)
        return torch.index_select(self.table[:, :width], 0, indices, out=out)


def token_slice(seq, start: int, end: int) -> list[int]:
    """seq.token_ids[start:end] without building prompt + output."""
    prompt, output = seq.prompt_token_ids, seq.output_token_ids
    n = len(prompt)
    if start >= n:
        return output[start - n : end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[: end - n]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [num_tokens], on the device
    tables: StepTables  # on the device
    logits_indices: torch.Tensor  # int64: rows whose next-token logits are sampled
    ordered: list[ScheduledSequence]  # decodes (shortest context first), then prompt chunks


@dataclass
class PaddedDecodeInputs:
    """A decode-only step on the host, padded to a bucket (padding: slot -1, context length 0)."""

    tokens: torch.Tensor  # int64 [3, num_rows]: input ids, positions, slots
    context_lens: torch.Tensor  # int32 [num_rows]
    block_tables: torch.Tensor  # int32 [num_seqs, widest]: real rows only
    logits_indices: torch.Tensor  # int64, on the device: rows whose logits are sampled
    ordered: list[ScheduledSequence]  # the real rows' sequences, in row order
    max_context: int = 0  # the real rows' longest context


class StepBuilder:
    """Builds StepInputs; `to_device` moves a host tensor to the runner's device."""

    def __init__(self, block_size: int, max_blocks: int, to_device, pin_memory: bool = False):
        self.block_size = block_size
        self.rows = BlockTableRows(max_blocks, pin_memory)
        self.to_device, self.pin_memory = to_device, pin_memory

    def build(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        decodes, ordered = self._order(scheduled)
        (ids, positions, slots), per_seq, widths, logits_indices = self._lists(ordered)
        n, num_tokens, dev = len(ordered), len(ids), self.to_device
        # Two host tensors, cut by one split each: a torch op costs more than its 64 values.
        rows_of = self.rows.assign([s.seq for s in ordered])
        flat = self._host(ids + positions + slots + rows_of + logits_indices, torch.int64)
        ids_t, positions_t, slots_t, rows, logits_rows = flat.split(
            [num_tokens] * 3 + [n, len(logits_indices)]
        )
        context_lens, cu_seqlens_q = self._host(per_seq, torch.int32).split([n, n + 1])

        def block_tables(first: int, stop: int) -> torch.Tensor:
            return dev(self.rows.gather(rows[first:stop], max(widths[first:stop])))

        tables = StepTables(
            dev(slots_t),
            dev(positions_t),
            dev(context_lens),
            dev(cu_seqlens_q),
            len(decodes),
            block_tables,
            max(per_seq[: len(decodes)], default=None),  # decodes first: their context lengths
        )
        return StepInputs(dev(ids_t), tables, dev(logits_rows), ordered)

    def build_decode(self, scheduled: list[ScheduledSequence], num_rows: int) -> PaddedDecodeInputs:
        """A decode-only step on the host, padded to `num_rows` rows for the static buffers."""
        _, ordered = self._order(scheduled)
        assert len(ordered) <= num_rows and all(s.num_new_tokens == 1 for s in ordered), (
            len(ordered),
            num_rows,
        )
        per_token, per_seq, widths, logits_indices = self._lists(ordered)
        pad, n = num_rows - len(ordered), len(ordered)
        padding = ([0] * pad, [0] * pad, [-1] * pad)  # token 0 at position 0, stored nowhere
        tokens = self._host([real + p for real, p in zip(per_token, padding)], torch.int64)
        context_lens = self._host(
            per_seq[:n] + [0] * pad, torch.int32
        )  # 0: attention reads nothing
        rows = self._host(self.rows.assign([s.seq for s in ordered]), torch.int64)
        return PaddedDecodeInputs(
            tokens,
            context_lens,
            self.rows.gather(rows, max(widths)),
            self.to_device(self._host(logits_indices, torch.int64)),
            ordered,
            max(per_seq[:n], default=0),
        )

    @staticmethod
    def _order(scheduled: list[ScheduledSequence]):
        """(decodes, batch order): decodes first, shortest context first."""
        decodes = sorted(
            (s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens
        )
        return decodes, decodes + [s for s in scheduled if s.num_new_tokens > 1]

    def _lists(self, ordered: list[ScheduledSequence]):
        """([input ids, positions, slots], context lens + cu_seqlens_q, block-table widths, logits
        rows) as lists, in one pass."""
        bs = self.block_size
        input_ids, positions, slots, context_lens, cu, widths, logits_indices = (
            [],
            [],
            [],
            [],
            [0],
            [],
            [],
        )
        for s in ordered:
            seq, new, drafts = s.seq, s.num_new_tokens, s.spec_token_ids
            start, table, prompt = seq.num_computed_tokens, seq.block_table, seq.prompt_token_ids
            if new == 1:  # a decode: the most common row, kept short
                num_prompt, output = len(prompt), seq.output_token_ids
                input_ids.append(
                    prompt[start] if start < num_prompt else output[start - num_prompt]
                )
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                context_lens.append(start + 1)
                cu.append(cu[-1] + 1)
                widths.append(len(table))
                if start + 1 == num_prompt + len(output):
                    logits_indices.append(len(input_ids) - 1)
                continue
            end = start + new - len(drafts)  # end of the known tokens; the drafts follow
            input_ids += token_slice(seq, start, end)
            input_ids += drafts
            positions += range(start, start + new)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + new)]
            context_lens.append(start + new)
            cu.append(cu[-1] + new)
            widths.append(len(table))
            if end == len(prompt) + len(seq.output_token_ids):  # s.samples: last row and drafts'
                logits_indices += range(len(input_ids) - 1 - len(drafts), len(input_ids))
        return [input_ids, positions, slots], context_lens + cu, widths, logits_indices

    @staticmethod
    def _host(data: list, dtype: torch.dtype) -> torch.Tensor:
        # numpy converts a list of ints several times faster than torch.tensor does.
        return torch.from_numpy(np.array(data, dtype=_NUMPY[dtype]))
