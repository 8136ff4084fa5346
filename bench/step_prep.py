"""Decode-step preparation: the runner's host work before the forward pass, per step.

    python -m bench.step_prep                      # 64 sequences at 2,048 and 32,768 tokens of context
    python -m bench.step_prep --seqs 16 --context 4096

Sequences decode one token a step (a new block every block_size steps); each timed step builds
the batch's token ids, positions, slot mapping, context lengths, cu_seqlens and the decode block
tables, then the attention metadata (the C kernel's, for the CPU; Triton's is the same gather):

    now  worker/engine/step_inputs.StepBuilder: persistent block-table rows written as they
         grow, one index_select a step, positions and slots vectorized
    v0   the runner before issue 39 (kept below): every table padded from Python lists, one
         slot per token from a Python loop

Both run in one process, interleaved step by step; medians in microseconds, and their ratio.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.scheduler import ScheduledSequence
from inferline.worker.engine.sequence import Sequence

BLOCK = 16


def make_batch(num_seqs: int, context: int, seed: int = 0) -> list[ScheduledSequence]:
    """Decodes at about `context` tokens (a little spread), block tables of distinct random ids."""
    rng = random.Random(seed)
    lengths = [context - rng.randrange(0, BLOCK * 2) for _ in range(num_seqs)]
    pool = list(range(sum(-(-n // BLOCK) + 64 for n in lengths)))
    rng.shuffle(pool)
    batch = []
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{i}", [rng.randrange(1000) for _ in range(n - 8)], SamplingParams(max_tokens=10**6))
        seq.output_token_ids = [rng.randrange(1000) for _ in range(8)]
        seq.num_computed_tokens = n - 1
        seq.block_table = [pool.pop() for _ in range(-(-n // BLOCK))]
        batch.append(ScheduledSequence(seq, 1))
    return batch


def advance(batch: list[ScheduledSequence], fresh_block) -> None:
    """What the engine does after a decode step: a token appended, a block where one fills."""
    for s in batch:
        seq = s.seq
        seq.output_token_ids.append(7)
        seq.num_computed_tokens += 1
        if seq.num_tokens > len(seq.block_table) * BLOCK:
            seq.block_table.append(fresh_block())


# ---- v0: the runner's prepare before issue 39, kept here as the baseline ----------------------------

def prepare_v0(scheduled: list[ScheduledSequence]):
    decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens)
    ordered = decodes
    input_ids, positions, slots, logits_indices = [], [], [], []
    for s in ordered:
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        table, bs = seq.block_table, BLOCK
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        if s.samples:
            logits_indices += range(len(input_ids) - 1, len(input_ids))
    width = max(len(s.seq.block_table) for s in decodes)
    rows = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes]
    return (torch.tensor(input_ids), torch.tensor(positions), torch.tensor(slots),
            torch.tensor(rows, dtype=torch.int32),
            torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes], dtype=torch.int32),
            torch.tensor(logits_indices))


def prepare_now(builder, attention, scheduled):
    step = builder.build(scheduled)
    return step, attention.prepare(step.tables)


def measure(num_seqs: int, context: int, steps: int = 60, warmup: int = 5) -> dict:
    from inferline.kernels.attention import CpuAttention
    from inferline.worker.engine.step_inputs import StepBuilder

    batch = make_batch(num_seqs, context)
    counter = iter(range(10**7, 2 * 10**7))
    builder = StepBuilder(BLOCK, -(-(context + 4 * steps) // BLOCK) + 4, lambda t: t)
    attention = CpuAttention(BLOCK, 8)
    times: dict[str, list[float]] = {"now": [], "v0": []}
    for i in range(warmup + steps):
        order = ("now", "v0") if i % 2 else ("v0", "now")  # alternate: drift cancels
        for name in order:
            start = time.perf_counter()
            if name == "now":
                prepare_now(builder, attention, batch)
            else:
                prepare_v0(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
        advance(batch, lambda: next(counter))
    now, v0 = (statistics.median(times[k]) * 1e6 for k in ("now", "v0"))
    return {"num_seqs": num_seqs, "context": context, "now_us": now, "v0_us": v0, "v0_over_now": v0 / now,
            "threads": torch.get_num_threads()}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.step_prep", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, nargs="*", default=[2048, 32768])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    rows = []
    for context in args.context:
        r = measure(args.seqs, context, args.steps)
        rows.append(r)
        print(f"{r['num_seqs']} seqs x {r['context']:>6} context: now {r['now_us']:7.0f} us, v0 {r['v0_us']:7.0f} us "
              f"(v0 / now {r['v0_over_now']:.1f}x; median of {args.steps} steps)")
    return rows


if __name__ == "__main__":
    main()
