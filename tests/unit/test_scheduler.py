"""Block manager and scheduler under random arrivals, aborts and finishes (no model: the
"runner" here appends a fake token whenever a chunk samples)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.request import SamplingParams
from inferline.worker.engine.scheduler import BackgroundLimit, Scheduler
from inferline.worker.engine.sequence import Sequence


def seq(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    priority: int = 0,
    arrival: float = 0.0,
    tenant: str = "default",
) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=[1] * prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
        tenant=tenant,
    )


def fits(sched: Scheduler, s: Sequence) -> bool:
    """Can `s` ever finish in this pool? The engine rejects the rest (prompt_too_long) before the
    scheduler sees them."""
    bm = sched.block_manager
    return bm.num_blocks_for(s.num_prompt_tokens + s.sampling.max_tokens) <= bm.num_blocks


def fake_step(sched: Scheduler) -> list[Sequence]:
    """One step: advance the counters, sample a token where due, retire what is done."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    finished = []
    for chunk in out.scheduled:
        samples = chunk.samples
        s = chunk.seq
        assert (
            len(s.block_table) * sched.block_manager.block_size
            >= s.num_computed_tokens + chunk.num_new_tokens
        )
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
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
# Found by this test: a waiting background request that memory kept out took the one background
# seat of every step, and nothing ran again.
@example(
    reqs=[(6, 1, 0, 0), *[(1, 1, 0, 0)] * 16, (35, 21, 0, 0), (27, 40, 3, 0), (28, 39, 1, 0)],
    num_blocks=11,
    budget=16,
    max_seqs=3,
    aborts=[],
    policy="continuous",
    background=BackgroundLimit(1, 2, alone_max_tokens=1),
)
@given(
    reqs=requests,
    num_blocks=st.integers(8, 40),
    budget=st.sampled_from([16, 32, 100]),
    max_seqs=st.integers(1, 8),
    aborts=st.lists(st.integers(0, 24), max_size=5),
    policy=st.sampled_from(["continuous", "static"]),
    background=st.sampled_from(
        [
            None,
            BackgroundLimit(2, 1),
            BackgroundLimit(1, 2),
            BackgroundLimit(1, 5),
            BackgroundLimit(1, 2, alone_max_tokens=1),
        ]
    ),
)
def test_random_traffic_completes_and_never_leaks_blocks(
    reqs, num_blocks, budget, max_seqs, aborts, policy, background
):
    bm = BlockManager(num_blocks, block_size=8)
    sched = Scheduler(
        bm,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        background=background,
    )
    pending = sorted(((t, i, p, m, pr) for i, (p, m, pr, t) in enumerate(reqs)), key=lambda r: r[0])
    alive, done = {}, set()
    for step in range(5000):
        while pending and pending[0][0] <= step:
            _, i, p, m, pr = pending.pop(0)
            s = seq(f"r{i}", p, m, pr, arrival=float(step))
            if not fits(sched, s):
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


def test_growing_sequences_get_their_blocks_side_by_side():
    """Two sequences growing in turn: each gets runs of adjacent blocks (the decode kernel reads
    them faster), not every other block as a plain free-list order would give."""
    bm = BlockManager(num_blocks=64, block_size=4)
    a, b = seq("a", 4, 1), seq("b", 4, 1)
    for s in (a, b):
        bm.append(s, 4)
    for _ in range(7):
        for s in (a, b):
            s.num_computed_tokens = 4 * len(s.block_table)
            bm.append(s, 1)
    assert a.block_table == [0, 1, 2, 3, 8, 9, 10, 11] and b.block_table == [
        4,
        5,
        6,
        7,
        12,
        13,
        14,
        15,
    ]
    bm.check_integrity([a, b])


def test_placement_never_jumps_a_cached_block_ahead_of_its_eviction_turn():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    old = Sequence("old", [1, 2, 3], SamplingParams(max_tokens=1))
    bm.allocate(old, bm.cached_prefix(old))
    old.num_computed_tokens = 3
    bm.cache_computed_blocks(old)  # its first block now holds a cached prefix
    first = old.block_table[0]
    bm.free(old)
    assert bm.prefix_cache.holds(first) and not bm._takes_next(first), (
        "a cached block is not taken out of turn"
    )
    assert not bm._takes_next(8), "past the last block"
    grow = Sequence("g", [9, 9], SamplingParams(max_tokens=4))
    bm.allocate(grow, [])
    assert grow.block_table[0] != first and bm.prefix_cache.holds(first)
    bm.check_integrity([grow])


# ---- prefix caching ------------------------------------------------------------------------------


class FakeKV:
    """What each cache slot holds, as the token prefix whose K/V it is: a slot written for
    position p of a sequence holds tuple(token_ids[:p + 1]). Checks that every computed position
    of every sequence reads its own prefix — a shared block with the wrong tokens, or one
    overwritten while shared, fails."""

    def __init__(self, block_size: int):
        self.block_size, self.slots = block_size, {}

    def slot(self, s: Sequence, pos: int) -> int:
        return s.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def compute(self, s: Sequence, num_new: int) -> None:
        ids = s.token_ids
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + num_new):
            self.slots[self.slot(s, pos)] = tuple(ids[: pos + 1])

    def check(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            ids = s.token_ids
            for pos in range(s.num_computed_tokens):
                assert self.slots.get(self.slot(s, pos)) == tuple(ids[: pos + 1]), (
                    f"{s.request_id} pos {pos}"
                )


def cached_step(sched: Scheduler, kv: FakeKV, rng_token) -> list[Sequence]:
    """fake_step with K/V tracked and computed blocks offered to the prefix cache, as the engine
    does."""
    out = sched.schedule()
    finished = []
    for chunk in out.scheduled:
        s, samples = chunk.seq, chunk.samples
        kv.compute(s, chunk.num_new_tokens)
        s.num_computed_tokens += chunk.num_new_tokens
        sched.block_manager.cache_computed_blocks(s)
        if samples:
            s.output_token_ids.append(rng_token(s))
            if s.num_output_tokens >= s.sampling.max_tokens:
                sched.remove(s)
                s.finish("length")
                finished.append(s)
    return finished


prefixed = (
    st.lists(  # (shared prefix id, prefix length, own tail length, max_tokens, priority, arrival)
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 40),
            st.integers(1, 20),
            st.integers(1, 12),
            st.integers(0, 2),
            st.integers(0, 20),
        ),
        min_size=1,
        max_size=20,
    )
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=prefixed,
    num_blocks=st.integers(10, 40),
    budget=st.sampled_from([8, 24, 100]),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["continuous", "static"]),
)
def test_prefix_cache_under_random_traffic_reads_only_the_right_kv(
    reqs, num_blocks, budget, max_seqs, policy
):
    bm = BlockManager(num_blocks, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)
    kv = FakeKV(4)
    prefixes = {k: [100 + k] + list(range(k * 50, k * 50 + 40)) for k in range(3)}
    pending = sorted(((t, i, k, n, tail, m, pr) for i, (k, n, tail, m, pr, t) in enumerate(reqs)))
    alive = {}
    for step in range(3000):
        while pending and pending[0][0] <= step:
            _, i, k, n, tail, m, pr = pending.pop(0)
            s = Sequence(
                request_id=f"r{i}",
                prompt_token_ids=prefixes[k][:n] + [i] * tail,
                sampling=SamplingParams(max_tokens=m),
                priority=pr,
                arrival_time=float(step),
            )
            if fits(sched, s):
                alive[s.request_id] = s
                sched.add(s)
        for s in cached_step(sched, kv, rng_token=lambda s: len(s.output_token_ids) % 3):
            alive.pop(s.request_id)
        check(sched)
        kv.check(sched.running)
        if not pending and not sched.has_unfinished():
            break
    assert not alive, f"stuck: {sorted(alive)}"
    assert bm.num_free_blocks == num_blocks


def test_second_request_with_a_cached_prefix_starts_after_it():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    kv = FakeKV(4)
    shared = list(range(10))  # 2 full blocks + 2 tokens
    first = Sequence("first", shared + [50, 51], SamplingParams(max_tokens=2))
    sched.add(first)
    cached_step(
        sched, kv, lambda s: 9
    )  # first's prompt computed: blocks 0-1 (and 2) enter the cache
    second = Sequence("second", shared + [60], SamplingParams(max_tokens=2))
    sched.add(second)
    out = sched.schedule()
    (chunk,) = [c for c in out.scheduled if c.seq is second]
    assert second.num_computed_tokens == 8 and chunk.num_new_tokens == 3, "2 cached blocks skipped"
    assert second.block_table[:2] == first.block_table[:2]
    assert bm.ref_counts[first.block_table[0]] == 2
    assert bm.prefix_cache.num_hit_tokens == 8 and bm.prefix_cache.num_queried_tokens == 12 + 11
    check(sched)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    kv = FakeKV(4)
    prompt = list(range(8))  # exactly 2 blocks
    a = Sequence("a", prompt, SamplingParams(max_tokens=1))
    sched.add(a)
    cached_step(sched, kv, lambda s: 1)  # a finishes: its blocks are free but cached
    assert bm.num_free_blocks == 8 and len(bm.prefix_cache.block_of) == 2
    b = Sequence("b", prompt, SamplingParams(max_tokens=1))
    sched.add(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 4 and out.scheduled[0].num_new_tokens == 4, (
        "only the first block is reused: the block with the last token is computed again"
    )
    check(sched)


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old, new = (
        Sequence("old", [1, 2, 3], SamplingParams(max_tokens=1)),
        Sequence("new", [7, 8, 9], SamplingParams(max_tokens=1)),
    )
    for s in (old, new):
        bm.allocate(s, bm.cached_prefix(s))
        s.num_computed_tokens = 3
        bm.cache_computed_blocks(s)
    bm.free(old)
    bm.free(new)
    fresh = Sequence("fresh", [5, 5, 5], SamplingParams(max_tokens=1))
    bm.allocate(fresh, bm.cached_prefix(fresh))  # 2 blocks: old's two go first
    again_new = Sequence("n2", [7, 8, 9], SamplingParams(max_tokens=1))
    again_old = Sequence("o2", [1, 2, 3], SamplingParams(max_tokens=1))
    assert len(bm.cached_prefix(again_new)) == 1 and bm.cached_prefix(again_old) == []
    bm.check_integrity([fresh])


def test_prefix_cache_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = (
        Sequence("a", list(range(9)), SamplingParams(max_tokens=1)),
        Sequence("b", list(range(9)), SamplingParams(max_tokens=1)),
    )
    bm.allocate(a, bm.cached_prefix(a))
    a.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    assert bm.cached_prefix(b) == [] and bm.prefix_cache is None


# ---- background work (a batch) beside foreground work --------------------------------------------


def background_sched(max_tokens: int = 2) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks=64, block_size=8),
        max_num_seqs=16,
        max_num_batched_tokens=256,
        background=BackgroundLimit(priority=100, max_tokens=max_tokens),
    )


def run_until_decoding(sched: Scheduler, seqs: list[Sequence]) -> None:
    for s in seqs:
        sched.add(s)
    while any(s.num_uncomputed_tokens > 1 or s in sched.waiting for s in seqs):
        fake_step(sched)


def test_alone_a_batch_runs_at_full_width():
    sched = background_sched()
    batch = [seq(f"b{i}", 4, 50, priority=100, arrival=i) for i in range(6)]
    run_until_decoding(sched, batch)
    assert {c.seq for c in sched.schedule().scheduled} == set(batch)


def test_a_foreground_prompt_runs_without_background_then_background_runs_in_turns():
    sched = background_sched(max_tokens=2)
    batch = [seq(f"b{i}", 4, 50, priority=100, arrival=i) for i in range(6)]
    run_until_decoding(sched, batch)
    chat = seq("chat", 12, 50, priority=0, arrival=10)
    sched.add(chat)
    first = fake_step_scheduled(sched)
    assert first == {"chat"}, "the interactive prompt's step carries no batch sequence"
    turns = [fake_step_scheduled(sched) for _ in range(3)]
    for t in turns:
        assert "chat" in t and len(t - {"chat"}) == 2, t
    assert set().union(*turns) - {"chat"} == {b.request_id for b in batch}, (
        "every batch sequence got a turn"
    )
    assert all(s.status.value == "running" for s in batch), (
        "resting is not preemption: their KV stays"
    )


def test_background_admissions_wait_for_a_seat_beside_foreground_work():
    sched = background_sched(max_tokens=4)
    chat = seq("chat", 4, 50, priority=0)
    run_until_decoding(sched, [chat])
    for i in range(3):
        sched.add(seq(f"b{i}", 4, 50, priority=100, arrival=1 + i))
    steps = [fake_step_scheduled(sched) for _ in range(3)]
    assert [s - {"chat"} for s in steps] == [{"b0"}, {"b1"}, {"b2"}], (
        "admitted one a step, in arrival order"
    )


def test_a_background_prompt_beside_foreground_work_is_chunked_to_the_token_limit():
    """A prompt counts every token it computes: a 10-token batch prompt beside an interactive
    request takes three steps of at most 4 tokens, and the step's background tokens never pass 4."""
    sched = background_sched(max_tokens=4)
    chat = seq("chat", 4, 50, priority=0)
    run_until_decoding(sched, [chat])
    batch = [seq("b0", 10, 50, priority=100, arrival=1), seq("b1", 3, 50, priority=100, arrival=2)]
    for b in batch:
        sched.add(b)
    chunks = []
    for _ in range(6):
        out = sched.schedule()
        chunks.append(
            {c.seq.request_id: c.num_new_tokens for c in out.scheduled if c.seq.priority == 100}
        )
        for c in out.scheduled:
            samples = c.samples
            c.seq.num_computed_tokens += c.num_new_tokens
            if samples:
                c.seq.output_token_ids.append(7)
    assert all(sum(c.values()) <= 4 for c in chunks), chunks
    assert chunks[:3] == [{"b0": 4}, {"b0": 4}, {"b0": 2, "b1": 2}], chunks
    assert batch[0].num_output_tokens >= 1 and batch[1].num_output_tokens >= 1, (
        "both prompts finished"
    )


def test_background_sequences_that_cannot_be_admitted_leave_the_seats_to_running_ones():
    """The batch is full (max_num_seqs): waiting batch sequences cannot run this step, so the
    seats go to running ones (before, they sat on the seats and the batch got no token)."""
    sched = Scheduler(
        BlockManager(num_blocks=64, block_size=8),
        max_num_seqs=4,
        max_num_batched_tokens=256,
        background=BackgroundLimit(priority=100, max_tokens=2),
    )
    chat = seq("chat", 4, 50, priority=0)
    batch = [seq(f"b{i}", 4, 50, priority=100, arrival=1 + i) for i in range(3)]
    run_until_decoding(sched, [chat, *batch])
    for i in range(3, 5):
        sched.add(seq(f"b{i}", 4, 50, priority=100, arrival=1 + i))
    steps = [fake_step_scheduled(sched) - {"chat"} for _ in range(3)]
    assert all(len(s) == 2 and s <= {"b0", "b1", "b2"} for s in steps), steps


def test_between_foreground_requests_the_batch_runs_bounded_until_quiet_s_pass():
    """alone_max_tokens: with no foreground work but some within quiet_s, background steps hold
    at most that many tokens; past quiet_s (or before any foreground work) full width again."""
    now = [0.0]
    sched = Scheduler(
        BlockManager(num_blocks=64, block_size=8),
        max_num_seqs=16,
        max_num_batched_tokens=256,
        background=BackgroundLimit(priority=100, max_tokens=2, alone_max_tokens=3, quiet_s=10.0),
        clock=lambda: now[0],
    )
    batch = [seq(f"b{i}", 4, 200, priority=100, arrival=i) for i in range(6)]
    run_until_decoding(sched, batch)
    assert len(fake_step_scheduled(sched)) == 6, "no foreground work seen yet: full width"
    chat = seq("chat", 4, 2, priority=0, arrival=10)
    sched.add(chat)
    while not chat.is_finished:
        fake_step_scheduled(sched)
        if chat.num_output_tokens >= chat.sampling.max_tokens:
            sched.remove(chat)
            chat.finish("length")
    now[0] = 9.0
    assert len(fake_step_scheduled(sched)) == 3, "foreground work 9 s ago: 3 tokens a step"
    now[0] = 10.5
    assert len(fake_step_scheduled(sched)) == 6, "quiet for 10 s: full width"


def test_a_limit_past_every_priority_leaves_steps_shared_alike():
    sched = Scheduler(
        BlockManager(num_blocks=64, block_size=8),
        max_num_seqs=16,
        max_num_batched_tokens=256,
        background=BackgroundLimit(priority=1001, max_tokens=1),
    )
    batch = [seq(f"b{i}", 4, 50, priority=100, arrival=i) for i in range(4)]
    run_until_decoding(sched, batch)
    sched.add(seq("chat", 4, 50, priority=0, arrival=10))
    assert fake_step_scheduled(sched) == {"chat", "b0", "b1", "b2", "b3"}


def fake_step_scheduled(sched: Scheduler) -> set[str]:
    """One fake step; the ids it scheduled."""
    before = {s.request_id: s.num_computed_tokens for s in sched.running + sched.waiting}
    fake_step(sched)
    return {
        rid
        for rid, n in before.items()
        if any(
            s.request_id == rid and s.num_computed_tokens != n
            for s in sched.running + sched.waiting
        )
    }
