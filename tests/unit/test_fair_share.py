"""Weighted fair share between tenants in the scheduler (issue 52): shares by weight, a quiet
tenant beside a flood, priorities first, fair preemption, state bounded under rotating names. No
model: the scheduler tests' fake step appends a token whenever a chunk samples."""

from __future__ import annotations

import torch

from inferline.worker.engine.block_manager import BlockManager
from inferline.worker.engine.fair_share import FairShare
from inferline.worker.engine.request import EngineRequest, SamplingParams
from inferline.worker.engine.scheduler import Scheduler, SchedulerOutput
from inferline.worker.engine.sequence import Sequence
from inferline.worker.service.metrics import OTHER_TENANTS, TENANT_LABELS, Metrics
from tests.engine_fixtures import (
    greedy,
    greedy_outputs,
    make_engine,
    prompt_ids,
    run_to_completion,
)
from tests.unit.test_scheduler import check, seq


def tseq(
    rid: str, tenant: str, prompt_len: int = 8, max_tokens: int = 16, priority: int = 0, t=0.0
) -> Sequence:
    return seq(rid, prompt_len, max_tokens, priority, t, tenant)


def fair_sched(weights=None, num_blocks=1024, max_seqs=8, budget=64, **fair) -> Scheduler:
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    return Scheduler(bm, max_seqs, budget, fair=FairShare(weights, **fair))


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """One fake step (as the scheduler tests' fake_step), returning its schedule; each tenant's
    sampled tokens are added to `tokens`."""
    out = sched.schedule()
    for seq in out.started:
        seq.first_scheduled_time = 1.0
    for chunk in out.scheduled:
        s, samples = chunk.seq, chunk.samples  # before the counters move
        s.num_computed_tokens += chunk.num_new_tokens
        if not samples:
            continue
        s.output_token_ids.append(7)
        if tokens is not None:
            tokens[s.tenant] = tokens.get(s.tenant, 0) + 1
        if s.num_output_tokens >= s.sampling.max_tokens:
            sched.remove(s)
            s.finish("length")
    check(sched)
    return out


def test_two_backlogged_tenants_get_tokens_by_weight():
    sched = fair_sched({"light": 1, "heavy": 3})
    # The light tenant's whole backlog arrived first: by arrival it would get every token.
    for i in range(150):
        sched.add(tseq(f"l{i}", "light", t=i))
    for i in range(150):
        sched.add(tseq(f"h{i}", "heavy", t=1000 + i))
    tokens: dict[str, int] = {}
    for _ in range(300):
        step(sched, tokens)
    share = tokens.get("heavy", 0) / sum(tokens.values())
    assert 0.65 <= share <= 0.85, tokens
    assert {s.tenant for s in sched.waiting} == {"light", "heavy"}  # both backlogged throughout


def quiet_steps(flood: int) -> tuple[int, int]:
    """Steps until a quiet tenant's 4 short requests end, sent after `flood` long ones of
    another tenant took every seat; and how many of those started meanwhile."""
    sched = fair_sched()
    for i in range(flood):
        sched.add(tseq(f"n{i}", "noisy", max_tokens=48, t=i))
    for _ in range(5):
        step(sched)  # the flood holds every seat
    quiet = [tseq(f"q{i}", "quiet", max_tokens=8, t=200 + i) for i in range(4)]
    for s in quiet:
        sched.add(s)
    steps = noisy_started = 0
    while not all(s.is_finished for s in quiet):
        noisy_started += sum(s.tenant == "noisy" for s in step(sched).started)
        steps += 1
    return steps, noisy_started


def test_a_quiet_tenant_behind_a_flood_runs_within_its_share():
    alone, _ = quiet_steps(0)
    beside, noisy_started = quiet_steps(160)
    # Seats of a tenant over its share are given up (preempted): not after the 152 waiting, nor
    # after the 8 running ones end.
    assert beside <= alone + 2 and noisy_started <= 8, (alone, beside, noisy_started)


def test_priority_classes_come_before_shares():
    sched = fair_sched({"favoured": 100}, max_seqs=2)
    for i in range(6):
        sched.add(tseq(f"f{i}", "favoured", priority=5, t=i))
        sched.add(tseq(f"o{i}", "other", priority=0, t=10 + i))
    order = []
    while sched.has_unfinished():
        order += [s.request_id[0] for s in step(sched).started]
    # Every better-priority request started before any worse one, whatever the weights.
    assert order == ["o"] * 6 + ["f"] * 6


def test_preemption_takes_the_tenant_most_over_its_share():
    # 6 blocks of 4 tokens: three 4-token prompts growing to 12 tokens cannot all fit.
    sched = fair_sched(num_blocks=6, max_seqs=4)
    hog1, hog2 = tseq("hog1", "hog", 4, 8, t=0), tseq("hog2", "hog", 4, 8, t=1)
    late = tseq("late", "light", 4, 8, t=2)  # the latest arrival: the victim by arrival
    for s in (hog1, hog2, late):
        sched.add(s)
    preempted = []
    for _ in range(8):
        preempted += [s.request_id for s in step(sched).preempted]
    # The hog computed twice the light tenant's tokens: its latest sequence goes first.
    assert preempted and preempted[0] == "hog2", preempted
    assert late.num_preemptions == 0


def test_state_stays_bounded_under_rotating_tenant_names():
    sched = fair_sched(num_blocks=64, max_seqs=4)
    fair = sched.fair
    for i in range(40):
        sched.add(tseq(f"h{i}", "honest", t=i))
    for i in range(200):
        sched.add(tseq(f"r{i}", f"name-{i}", t=100 + i))  # a new tenant name every step
        step(sched)
        tenants = {s.tenant for s in sched.running + sched.waiting}
        assert set(fair.counters) == set(fair.members) == tenants
        assert set(fair.waiting) == {s.tenant for s in sched.waiting}
    # A new name starts at the lowest counter that waits: no credit for being new.
    floor = min(fair.counters[t] for t in fair.waiting)
    sched.add(tseq("fresh", "fresh-name", t=1000))
    assert floor > 0 and fair.counters["fresh-name"] == floor
    while sched.has_unfinished():
        step(sched)
    assert not fair.counters and not fair.members and not fair.waiting


def test_greedy_outputs_are_unchanged_by_shares_and_their_preemptions(
    shallow_runner, shallow_hf_model
):
    """Weights, seat-share preemptions and a tight KV pool reorder the work, never the tokens."""
    prompts = [prompt_ids(shallow_runner.tokenizer, i) for i in range(5)]
    expected = greedy_outputs(shallow_hf_model, prompts, 16)  # shorter: the suite's budget
    engine = make_engine(
        shallow_runner,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        num_blocks=24,
        tenant_weights={"b": 3.0},
    )
    arrivals = {0: [], 2: []}
    for i, ids in enumerate(prompts):  # tenant a's requests first, b's two steps later
        tenant = "a" if i < 3 else "b"
        arrivals[0 if tenant == "a" else 2].append(
            EngineRequest(f"r{i}", greedy(16), prompt_token_ids=ids, tenant=tenant)
        )
    tokens: dict[str, int] = {}
    step = engine.step

    def counted_step():
        outputs = step()
        for tenant, num in engine.stats().tenant_tokens.items():
            tokens[tenant] = tokens.get(tenant, 0) + num
        return outputs

    engine.step = counted_step  # an instance attribute over the method
    results = run_to_completion(engine, arrivals)
    assert engine.stats().num_preemptions > 0  # b took seats from a, over its share
    assert tokens == {"a": 3 * 16, "b": 2 * 16} and engine.stats().tenant_load == {}
    for i, want in enumerate(expected):
        assert results[f"r{i}"]["tokens"] == want, f"prompt {i} diverged from HF generate"


def series(metrics: Metrics, family: str) -> dict[str, float]:
    """`family`'s samples by tenant label."""
    return {
        s.labels["tenant"]: s.value
        for fam in metrics.registry.collect()
        for s in fam.samples
        if s.name == family
    }


def test_tenant_metrics_name_the_heaviest_and_stay_bounded_under_rotating_names():
    m = Metrics()
    steady = {f"t{j}": (2, 1) for j in range(12)} | {"big": (30, 4)}
    for i in range(300):
        # A new name every step, each with one request and one token.
        m.observe_tenants(steady | {f"r{i}": (1, 0)}, {"big": 4, f"r{i}": 1})
        waiting = series(m, "inferline_tenant_waiting_requests")
        assert len(waiting) <= TENANT_LABELS + 1
        assert len(series(m, "inferline_tenant_tokens_generated_total")) <= TENANT_LABELS + 1
    assert waiting["big"] == 30 and sum(waiting.values()) == 30 + 24 + 1  # nothing lost
    assert series(m, "inferline_tenant_running_requests")["big"] == 4
    tokens = series(m, "inferline_tenant_tokens_generated_total")
    assert tokens["big"] == 4 * 300 and tokens[OTHER_TENANTS] == 300  # every rotating name
    m.observe_tenants({}, {})  # all idle: the labels stay, at zero; the counters keep counting
    assert set(series(m, "inferline_tenant_waiting_requests").values()) == {0}
    assert series(m, "inferline_tenant_tokens_generated_total")["big"] == 4 * 300


def test_a_tenant_idle_between_requests_keeps_its_series():
    """A counter series that vanished whenever its tenant had nothing in the pool left rate()
    without data for a tenant whose requests were short (seen in the dashboard's Prometheus
    test); it goes only when a tenant with work needs its label."""
    m = Metrics()
    m.observe_tenants({"acme": (0, 1)}, {"acme": 5})
    m.observe_tenants({}, {})  # acme's request has ended
    assert series(m, "inferline_tenant_tokens_generated_total") == {"acme": 5}
    busy = {f"t{j}": (1, 0) for j in range(TENANT_LABELS)}
    m.observe_tenants(busy, {})  # ten tenants with work: the idle one gives way
    assert "acme" not in series(m, "inferline_tenant_tokens_generated_total")
    assert len(series(m, "inferline_tenant_waiting_requests")) <= TENANT_LABELS + 1
