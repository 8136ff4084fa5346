"""Issue 52, intake that reads past a tenant's backlog: records of one tenant placed after another
tenant's flood in the same partition are read and run early (with the intake of old, pausing at a
full pool, they could not be read until the flood drained), and two backlogged tenants of weights
1 and 3 get 25% and 75% of the generated tokens. Both are counted in the worker's own order, not
in seconds. In-process workers over the shallow SmolLM2 (tests/engine_fixtures.py)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from inferline.config.settings import Settings
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine
from tests.kafka_fixtures import produce_raw
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    collect,
    final_done,
    request,
    topics,
    wait_ready,
    worker_config,
)

pytestmark = pytest.mark.kafka

LANES = {"max_records": 256}  # {"max_records": 0}: the intake of old (the tests then fail)
SEATS, POOL = 4, 8


@pytest.fixture
async def lane_worker(kafka_bootstrap, shallow_runner):
    running: list[tuple[Worker, asyncio.Task]] = []

    async def start(topics, **overrides) -> Worker:
        config = worker_config(
            kafka_bootstrap,
            topics,
            scheduler={"max_num_seqs": SEATS, "max_waiting": POOL, **overrides.pop("sched", {})},
            lanes=LANES,
            worker={"drain_timeout_s": 0},  # what is left is handed back at stop
            **overrides,
        )
        settings = Settings(**config)
        worker = Worker(settings, LLMEngine(shallow_runner, engine_settings(settings)))
        task = asyncio.create_task(worker.run())
        running.append((worker, task))
        return worker, task

    yield start
    for worker, task in reversed(running):
        worker.request_stop()
        await asyncio.wait_for(task, 60)


def short(topics, tenant: str, max_tokens: int) -> dict:
    return request(
        topics.replies,
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        max_tokens=max_tokens,
        ignore_eos=True,
        tenant=tenant,
    )


async def produce_to_one_partition(kafka_bootstrap, topics, reqs: list[dict]) -> list[str]:
    """All of `reqs`, in order, to partition 0 of the request topic."""
    values = [(r["id"].encode(), msgpack.packb(r)) for r in reqs]
    await produce_raw(kafka_bootstrap, topics.requests, values, partition=0)
    return [r["id"] for r in reqs]


def record_order(worker) -> list[tuple[str, str, int]]:
    """("start" | "tokens", tenant, tokens) in the order the worker's tracker sees them."""
    order: list[tuple[str, str, int]] = []
    tracker = worker.requests
    started, tokens = tracker._started, tracker._tokens

    def started_(job, out, now) -> None:
        order.append(("start", job.request.tenant, 0))
        started(job, out, now)

    def tokens_(job, out, now) -> None:
        order.append(("tokens", job.request.tenant, len(out.new_token_ids)))
        tokens(job, out, now)

    tracker._started, tracker._tokens = started_, tokens_
    return order


async def test_quiet_records_behind_a_flood_in_their_partition_start_early(
    kafka_bootstrap, topics, lane_worker
):
    """60 records of `noisy`, then 4 of `quiet`, all in partition 0 before the worker starts: the
    quiet ones start while most of the flood still waits (without lanes they are read only once
    all but a pool's worth, 8, of the flood has been admitted)."""
    flood = [short(topics, "noisy", 2) for _ in range(60)]
    quiet = [short(topics, "quiet", 2) for _ in range(4)]
    ids = await produce_to_one_partition(kafka_bootstrap, topics, flood + quiet)
    worker, task = await lane_worker(topics)
    order = record_order(worker)
    await wait_ready(worker, task)
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=240)
    assert all(final_done(events[i]).finish_reason == "length" for i in ids)
    starts = [tenant for kind, tenant, _ in order if kind == "start"]
    last_quiet = max(i for i, t in enumerate(starts) if t == "quiet")
    ahead = starts[:last_quiet].count("noisy")
    print(f"\nflood requests started before the last quiet one: {ahead} of {len(flood)}")
    # Seats and pool full of the flood when the quiet records are read, and a few steps' worth.
    assert ahead <= SEATS + POOL + 8, f"{ahead} flood requests started ahead of the quiet ones"


async def test_two_backlogged_tenants_share_tokens_by_weight(kafka_bootstrap, topics, lane_worker):
    """Tenant `a` (weight 1) then `b` (weight 3), 24 records each, in partition 0: while both have
    requests not yet started, `b` gets 75% of the generated tokens (within 10 points; without
    lanes, `b` is not read before `a` has all but a pool's worth started)."""
    n = 24
    reqs = [short(topics, "a", 6) for _ in range(n)] + [short(topics, "b", 6) for _ in range(n)]
    ids = await produce_to_one_partition(kafka_bootstrap, topics, reqs)
    worker, task = await lane_worker(topics, sched={"tenant_weights": {"a": 1, "b": 3}})
    order = record_order(worker)
    await wait_ready(worker, task)
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=240)
    assert all(final_done(events[i]).finish_reason == "length" for i in ids)
    tokens = tokens_while_both_wait(order, n)
    share_b = tokens["b"] / max(1, tokens["a"] + tokens["b"])
    print(f"\ntokens while both were backlogged: {tokens} (b: {share_b:.1%})")
    assert sum(tokens.values()) >= 100, tokens  # a window long enough to say
    assert abs(share_b - 0.75) <= 0.10, tokens


def tokens_while_both_wait(order: list[tuple[str, str, int]], n: int) -> dict[str, int]:
    """Tokens by tenant from when both have a request started until one tenant's last request
    (of `n`) started."""
    tokens, starts = {"a": 0, "b": 0}, {"a": 0, "b": 0}
    for kind, tenant, num in order:
        if kind == "start":
            starts[tenant] += 1
            if starts[tenant] == n:
                break
        elif min(starts.values()) > 0:
            tokens[tenant] += num
    return tokens
