"""Block manager and scheduler under random arrivals, aborts and finishes (no model: the
"runner" here appends a fake token whenever a chunk samples)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.block_manager import BlockManager
from worker.engine.request import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence


def seq(rid: str, prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=[1] * prompt_len,
                    sampling=SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=arrival)


def fake_step(sched: Scheduler) -> list[Sequence]:
    """One step: advance the counters, sample a token where due, retire what is done."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    finished = []
    for chunk in out.scheduled:
        samples = chunk.samples
        s = chunk.seq
        assert len(s.block_table) * sched.block_manager.block_size >= s.num_computed_tokens + chunk.num_new_tokens
        s.num_computed_tokens += chunk.num_new_tokens
        if samples:
            s.output_token_ids.append(7)
            if s.num_output_tokens >= s.sampling.max_tokens:
                sched.remove(s)
                s.finish("length")
                finished.append(s)
    return finished


def check(sched: Scheduler) -> None:
    sched.block_manager.check_integrity(sched.running + sched.waiting)


requests = st.lists(
    st.tuples(st.integers(1, 70), st.integers(1, 40), st.integers(0, 3), st.integers(0, 30)),
    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(reqs=requests, num_blocks=st.integers(8, 40), budget=st.sampled_from([16, 32, 100]),
       max_seqs=st.integers(1, 8), aborts=st.lists(st.integers(0, 24), max_size=5),
       policy=st.sampled_from(["continuous", "static"]))
def test_random_traffic_completes_and_never_leaks_blocks(reqs, num_blocks, budget, max_seqs, aborts, policy):
    bm = BlockManager(num_blocks, block_size=8)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)
    pending = sorted(((t, i, p, m, pr) for i, (p, m, pr, t) in enumerate(reqs)), key=lambda r: r[0])
    alive, done = {}, set()
    for step in range(5000):
        while pending and pending[0][0] <= step:
            _, i, p, m, pr = pending.pop(0)
            s = seq(f"r{i}", p, m, pr, arrival=float(step))
            if sched.blocks_to_finish(s) > num_blocks:
                done.add(s.request_id)  # the engine rejects these at once
                continue
            alive[s.request_id] = s
            sched.add(s)
        if step in aborts and alive:
            victim = alive.pop(sorted(alive)[0])
            sched.remove(victim)
            done.add(victim.request_id)
        for s in fake_step(sched):
            alive.pop(s.request_id)
            done.add(s.request_id)
        check(sched)
        if not pending and not sched.has_unfinished():
            break
    assert not alive, f"stuck: {sorted(alive)}"
    assert len(done) == len(reqs)
    assert bm.num_free_blocks == num_blocks


def test_append_failure_preempts_the_worst_running_never_a_better_one():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    good, bad = seq("good", 4, 20, priority=0, arrival=0), seq("bad", 4, 20, priority=5, arrival=1)
    sched.add(good)
    sched.add(bad)
    for _ in range(12):
        fake_step(sched)
        check(sched)
    assert bad.num_preemptions >= 1
    assert good.num_preemptions == 0


def test_waiting_high_priority_preempts_running_low_priority():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    low = seq("low", 12, 4, priority=10, arrival=0)
    sched.add(low)
    fake_step(sched)
    assert low in sched.running
    urgent = seq("urgent", 8, 4, priority=0, arrival=1)
    sched.add(urgent)
    out = sched.schedule()
    assert low in out.preempted and urgent in sched.running
    check(sched)


def test_waiting_equal_priority_does_not_preempt():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = seq("first", 12, 1, priority=0, arrival=0)
    sched.add(first)
    fake_step(sched)
    sched.add(seq("second", 8, 4, priority=0, arrival=1))
    out = sched.schedule()
    assert not out.preempted


def test_chunked_prefill_shares_the_budget_with_decodes():
    bm = BlockManager(num_blocks=64, block_size=16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
    sched.add(seq("a", 5, 10, arrival=0))
    fake_step(sched)  # a's prompt done, first token sampled
    sched.add(seq("long", 100, 4, arrival=1))
    out = sched.schedule()
    sizes = {c.seq.request_id: c.num_new_tokens for c in out.scheduled}
    assert sizes == {"a": 1, "long": 31}


def test_block_manager_counts_and_integrity():
    bm = BlockManager(num_blocks=10, block_size=16)
    s = seq("x", 33, 1)
    assert bm.num_new_blocks(s, 33) == 3
    bm.append(s, 33)
    assert len(s.block_table) == 3 and bm.usage == 0.3
    s.num_computed_tokens = 33
    assert bm.num_new_blocks(s, 15) == 0 and bm.num_new_blocks(s, 16) == 1
    bm.check_integrity([s])
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []
    bm.check_integrity([])
