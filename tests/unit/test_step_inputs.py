"""A step's inputs from persistent block-table rows (worker/engine/step_inputs.py) equal what the
runner built from Python lists before (the reference below), step after step, through block
growth, a freed and reallocated table (preemption), prompt chunks, drafts and rows reused."""

from __future__ import annotations

import random

from bench import decode_step
from tests.dispatched_ops import DispatchedOps
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.sequence import Sequence
from inferline.worker.engine.step_inputs import BlockTableRows, StepBuilder, token_slice

BS = 4


def reference(scheduled: list[ScheduledSequence], bs: int = BS) -> dict:
    decodes = sorted(
        (s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens
    )
    ordered = decodes + [s for s in scheduled if s.num_new_tokens > 1]
    ids, positions, slots, logits = [], [], [], []
    for s in ordered:
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        ids += (seq.token_ids + s.spec_token_ids)[start:end]
        positions += range(start, end)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        if s.samples:
            logits += range(len(ids) - 1 - len(s.spec_token_ids), len(ids))
    cu = [0]
    for s in ordered:
        cu.append(cu[-1] + s.num_new_tokens)

    def tables(chunks):
        width = max(len(s.seq.block_table) for s in chunks)
        return [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in chunks]

    nd = len(decodes)
    return {
        "ids": ids,
        "positions": positions,
        "slots": slots,
        "logits": logits,
        "cu": cu,
        "context": [s.seq.num_computed_tokens + s.num_new_tokens for s in ordered],
        "nd": nd,
        "decode_tables": tables(ordered[:nd]) if nd else None,
        "prefill_tables": tables(ordered[nd:]) if nd < len(ordered) else None,
        "order": [id(s) for s in ordered],
    }


def built(builder: StepBuilder, scheduled) -> dict:
    step = builder.build(scheduled)
    t, n, nd = step.tables, len(step.ordered), step.tables.num_decodes
    return {
        "ids": step.input_ids.tolist(),
        "positions": t.positions.tolist(),
        "slots": t.slot_mapping.tolist(),
        "logits": step.logits_indices.tolist(),
        "cu": t.cu_seqlens_q.tolist(),
        "context": t.context_lens.tolist(),
        "nd": nd,
        "decode_tables": t.block_tables(0, nd).tolist() if nd else None,
        "prefill_tables": t.block_tables(nd, n).tolist() if nd < n else None,
        "order": [id(s) for s in step.ordered],
    }


class World:
    """Sequences with block tables that grow, get freed (preemption) and come back, as the
    block manager's do: appended in place, replaced by a new list when freed."""

    def __init__(self, rng: random.Random):
        self.rng, self.next_block, self.seqs = rng, 0, []

    def new_seq(self) -> Sequence:
        seq = Sequence(
            f"s{len(self.seqs)}",
            [self.rng.randrange(100) for _ in range(self.rng.randrange(2, 30))],
            SamplingParams(max_tokens=1000),
        )
        self.seqs.append(seq)
        return seq

    def blocks_for(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BS < num_tokens:
            seq.block_table.append(self.next_block)
            self.next_block += 1

    def schedule(self) -> list[ScheduledSequence]:
        out = []
        for seq in self.seqs:
            if self.rng.random() < 0.2:
                continue  # not this step (budget): its row goes back to the pool
            if self.rng.random() < 0.05 and seq.block_table:  # preempted: freed, recomputed from 0
                seq.block_table, seq.num_computed_tokens = [], 0
            left = seq.num_tokens - seq.num_computed_tokens
            new = min(left, self.rng.choice([1, 1, 1, 3, 8]))
            drafts = (
                [self.rng.randrange(100) for _ in range(self.rng.choice([0, 0, 2]))]
                if new == left == 1
                else []
            )
            self.blocks_for(seq, seq.num_computed_tokens + new + len(drafts))
            out.append(ScheduledSequence(seq, new + len(drafts), drafts))
        self.rng.shuffle(out)
        return out

    def update(self, scheduled: list[ScheduledSequence]) -> None:
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            if s.samples:
                s.seq.output_token_ids.append(self.rng.randrange(100))


def test_steps_equal_the_list_built_reference():
    rng = random.Random(3)
    world = World(rng)
    builder = StepBuilder(BS, 64, lambda t: t)
    builder.rows = BlockTableRows(64, rows=2)  # small: the pool grows and reclaims rows
    for step in range(120):
        if step % 10 == 0 and len(world.seqs) < 12:
            world.new_seq()
        scheduled = world.schedule()
        if not scheduled:
            continue
        assert built(builder, scheduled) == reference(scheduled), f"step {step}"
        world.update(scheduled)


def test_token_slice_spans_prompt_and_output():
    seq = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=5))
    seq.output_token_ids = [4, 5]
    for a in range(6):
        for b in range(a, 6):
            assert token_slice(seq, a, b) == seq.token_ids[a:b]


def test_the_decode_step_benchs_batches_build_as_the_reference():
    """bench/decode_step.py --prep times StepBuilder on these batches: they must build right."""
    batch = decode_step.make_batch(8, 100)
    builder = StepBuilder(decode_step.BLOCK, 16, lambda t: t)
    for _ in range(20):
        assert built(builder, batch) == reference(batch, decode_step.BLOCK)
        decode_step.advance(batch, iter(range(1000, 2000)).__next__)


def test_a_decode_step_dispatches_a_few_torch_ops_whatever_the_batch():
    """A torch op costs more than its values at these sizes (docs/benchmarks.md), so a decode
    step's preparation dispatches the same few ops for 4 sequences as for 64, new blocks
    included."""

    def ops(num_seqs: int) -> list[str]:
        batch = decode_step.make_batch(num_seqs, 512)
        builder = StepBuilder(decode_step.BLOCK, 64, lambda t: t)
        builder.build(batch)
        for s in batch:  # every table grows by a block before the counted step
            s.seq.block_table.append(10**6 + len(s.seq.block_table))
        with DispatchedOps() as seen:
            step = builder.build(batch)
            step.tables.block_tables(0, num_seqs)
        return seen.names

    assert ops(4) == ops(64)
    assert len(ops(64)) <= 8, ops(64)
