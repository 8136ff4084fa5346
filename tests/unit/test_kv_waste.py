"""KV waste (BlockManager.waste): slots in use that hold no token, checked by hand and, at every
block size from 8 to 128, under random traffic with shared prefixes and speculative drafts against
an oracle that counts each physical block's filled slots over all of its owners."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import FakeKV, check, fits, seq
from tests.unit.test_spec_decode import greedy, spec_step
from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.engine import EngineStats
from inferline.worker.engine.scheduler import Scheduler
from inferline.worker.engine.sequence import Sequence
from inferline.worker.engine.spec_decode import NgramProposer
from inferline.worker.service.metrics import Metrics

BLOCK_SIZES = (8, 16, 32, 64, 128)


def oracle_wasted_slots(bm: BlockManager, seqs: list[Sequence]) -> int:
    """Allocated slots minus the slots some owner's known token sits in, block by block."""
    filled: dict[int, int] = {}
    for s in seqs:
        for index, block_id in enumerate(s.block_table):
            mine = max(0, min(bm.block_size, s.num_tokens - index * bm.block_size))
            if bm.ref_counts[block_id] > 1:
                assert mine == bm.block_size, f"block {block_id} is shared but not full"
            filled[block_id] = max(filled.get(block_id, 0), mine)
    assert len(filled) == bm.num_blocks - bm.num_free_blocks
    return bm.num_allocated_slots - sum(filled.values())


def test_the_last_block_is_what_is_wasted():
    bm = BlockManager(num_blocks=10, block_size=16)
    a, b = seq("a", 17, 4), seq("b", 32, 4)
    bm.allocate(a, [])
    bm.allocate(b, [])
    assert bm.num_allocated_slots == 4 * 16
    assert bm.num_wasted_slots([a, b]) == 15  # a: 17 tokens in 2 blocks; b: 2 full blocks
    assert bm.waste([a, b]) == pytest.approx(15 / 64)
    a.output_token_ids.append(5)
    assert bm.num_wasted_slots([a, b]) == 14


def test_a_sampled_token_without_its_block_yet_is_not_negative_waste():
    bm = BlockManager(num_blocks=4, block_size=8)
    s = seq("s", 8, 4)
    bm.allocate(s, [])
    s.num_computed_tokens = 8
    s.output_token_ids.append(1)  # token 9: its block comes with the next step's append
    assert bm.num_wasted_slots([s]) == 0 and bm.waste([s]) == 0.0


def test_blocks_taken_for_rejected_drafts_are_waste():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("s", 4, 10)
    bm.allocate(s, [])
    s.num_computed_tokens = 4
    s.output_token_ids.append(1)
    bm.append(s, 1 + 4)  # the new token and four drafts: slots up to position 8, a third block
    assert len(s.block_table) == 3
    s.num_computed_tokens = 5  # every draft rejected: 5 known tokens + the model's one
    s.output_token_ids.append(2)
    assert bm.num_wasted_slots([s]) == 12 - 6


def test_an_empty_pool_wastes_nothing():
    assert BlockManager(num_blocks=4, block_size=16).waste([]) == 0.0


def test_shared_prefix_blocks_count_once_and_hold_tokens():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], greedy(2))
    bm.allocate(first, [])
    first.num_computed_tokens = 9
    bm.cache_computed_blocks(first)
    second = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 40, 41], greedy(2))
    cached = bm.cached_prefix(second)
    assert len(cached) == 2
    bm.allocate(second, cached)
    assert bm.num_allocated_slots == 4 * 4  # two shared blocks and one last block each
    assert bm.num_wasted_slots([first, second]) == 3 + 2 == oracle_wasted_slots(bm, [first, second])


traffic = (
    st.lists(  # (shared prefix id, prefix blocks, own tail fraction, max_tokens, priority, arrival)
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 3),
            st.floats(0.01, 1.5),
            st.integers(1, 40),
            st.integers(0, 2),
            st.integers(0, 10),
        ),
        min_size=1,
        max_size=10,
    )
)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@settings(max_examples=15, deadline=None)
@given(
    reqs=traffic,
    pool_blocks=st.integers(4, 24),
    budget=st.sampled_from([16, 64, 512]),
    max_seqs=st.integers(1, 6),
    k=st.integers(0, 4),
)
def test_waste_under_random_traffic_at_every_block_size(
    block_size, reqs, pool_blocks, budget, max_seqs, k
):
    """Prompts are measured in blocks, so every size sees sequences spanning several blocks,
    prefixes shared across whole blocks, and drafts (k > 0) that cross block boundaries."""
    bm = BlockManager(pool_blocks, block_size, enable_prefix_caching=True)
    proposer = NgramProposer(k, 3, 1) if k else None
    sched = Scheduler(bm, max_seqs, budget, "continuous", proposer=proposer)
    kv, outputs = FakeKV(block_size), {}
    prefixes = {p: [(p * 7 + j) % 3 for j in range(3 * block_size)] for p in range(3)}
    pending = sorted((t, i, p, n, tail, m, pr) for i, (p, n, tail, m, pr, t) in enumerate(reqs))
    for step in range(2000):
        while pending and pending[0][0] <= step:
            _, i, p, n, tail, m, pr = pending.pop(0)
            ids = prefixes[p][: n * block_size] + [i % 3] * max(1, int(tail * block_size))
            s = Sequence(f"r{i}", ids, greedy(m), priority=pr, arrival_time=float(step))
            if fits(sched, s):
                sched.add(s)
        spec_step(sched, kv, outputs)
        check(sched)
        seqs = sched.running + sched.waiting
        wasted = bm.num_wasted_slots(seqs)
        assert wasted == oracle_wasted_slots(bm, seqs)
        # At most a block less one slot per sequence, plus the slots its k drafts may have taken.
        assert wasted <= sum(block_size - 1 + k for s in seqs if s.block_table)
        assert 0.0 <= bm.waste(seqs) <= 1.0
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == pool_blocks and bm.waste([]) == 0.0


def test_engine_stats_reach_the_metrics_page():
    stats = EngineStats(kv_cache_waste=0.25, prefix_cache_queries=40, prefix_cache_hits=10)
    assert stats.prefix_cache_hit_rate == 0.25 and EngineStats().prefix_cache_hit_rate == 0.0
    metrics = Metrics()
    metrics.observe_engine(stats, EngineStats(), num_waiting=0)
    text = metrics.render().decode()
    assert "inferline_kv_cache_waste 0.25" in text
    assert (
        "inferline_prefix_cache_hits_total 10.0" in text
        and "inferline_prefix_cache_queries_total 40.0" in text
    )
