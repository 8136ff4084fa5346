"""Exactly one final result per request, against the broker: a zombie is fenced, a new owner skips
what the ledger lists, and a worker SIGKILLed between a `done`'s send and its commit (a test hook,
not luck) leaves a `done` that read_committed readers never see; the request's rerun is its only
final result. The ledger and PartitionTxn offline: tests/unit/test_transactions.py."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import Settings
from inferline.contract.schema import DoneEvent, Timing, Usage, decode_event, encode_event
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - topics is a fixture
    Topics,
    collect,
    final_dones,
    request,
    spawn_worker,
    submit,
    topics,
    wait_ready,
    worker_config,
)
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine
from inferline.worker.service.metrics import Metrics
from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.delivery.transactions import Final, Owner, Transactions
from tests.unit.test_transactions import _final, _until  # noqa: F401


def _settings(bootstrap: str, topics: Topics, group: str) -> Settings:
    return Settings(**worker_config(bootstrap, topics, kafka={"group_id": group}))


class Evicted(Owner):
    async def confirm(self, tp) -> bool:
        return False


@pytest.mark.kafka
async def test_a_new_owner_fences_the_old_one(kafka_bootstrap, topics):
    settings = _settings(kafka_bootstrap, topics, f"g-{uuid.uuid4().hex[:8]}")
    tp = TopicPartition(topics.requests, 0)
    old_tracker, new_tracker, outcomes = OffsetTracker(), OffsetTracker(), {}
    old, new = (Transactions(settings, t, Metrics()) for t in (old_tracker, new_tracker))
    old.owner = (
        Evicted()
    )  # the group moved the partition: the coordinator no longer lists it as old's
    for t in (old_tracker, new_tracker):
        t.add(tp, 0)
    await old.open([tp])
    await new.open([tp])  # same transactional id: the old owner is fenced now
    try:
        old.submit(tp, _final(0, outcomes, topic=topics.replies))
        await _until(lambda: 0 in outcomes, 30)
        assert outcomes[0] == "fenced" and old.fenced(tp)
        new.submit(
            tp,
            Final(
                0,
                [(topics.replies, None, b"k", b"from the new owner", None)],
                lambda outcome, error=None: outcomes.__setitem__("new", outcome),
            ),
        )
        await _until(lambda: "new" in outcomes, 30)
        assert outcomes["new"] == "ok"
    finally:
        await old.close_all()
        await new.close_all()
    records = await consume_until(kafka_bootstrap, topics.replies)
    assert [r.value for r in records] == [b"from the new owner"]
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(
            settings.kafka.group_id, partitions=[tp]
        )
    finally:
        await admin.close()
    assert committed[tp].offset == 1


@pytest.mark.kafka
async def test_finals_sharing_transactions_commit_once_each_and_a_refused_one_costs_only_itself(
    kafka_bootstrap, topics
):
    settings = Settings(
        **worker_config(
            kafka_bootstrap,
            topics,
            kafka={"group_id": f"g-{uuid.uuid4().hex[:8]}", "transaction_interval_ms": 500},
        )
    )
    tps = [TopicPartition(topics.requests, p) for p in (0, 1)]
    tracker, metrics, outcomes = OffsetTracker(), Metrics(), {}
    txns = Transactions(settings, tracker, metrics)
    for tp in tps:
        for o in range(6):
            tracker.add(tp, o)
    await txns.open(tps)
    try:
        for o in range(
            6
        ):  # a burst over both partitions: each partition's finals share transactions
            for tp in tps:
                refused = (tp.partition, o) == (
                    1,
                    3,
                )  # over the producer's max_request_size: refused for good
                value = (
                    b"x" * 2 * settings.kafka.max_message_bytes
                    if refused
                    else f"{tp.partition}:{o}".encode()
                )
                txns.submit(
                    tp,
                    Final(
                        o,
                        [(topics.replies, None, b"k", value, None)],
                        lambda outcome, error=None, k=(tp.partition, o): outcomes.__setitem__(
                            k, outcome
                        ),
                    ),
                )
                await asyncio.sleep(0)
        await _until(lambda: len(outcomes) == 12, 60)
    finally:
        await txns.close_all()
    assert outcomes.pop((1, 3)) == "failed" and set(outcomes.values()) == {"ok"}
    records = await consume_until(kafka_bootstrap, topics.replies)  # read_committed
    assert sorted(r.value for r in records) == sorted(
        f"{p}:{o}".encode() for p, o in outcomes
    )  # each once
    assert (
        metrics.registry.get_sample_value("inferline_transactions_total", {"outcome": "committed"})
        < 11
    )
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(settings.kafka.group_id, partitions=tps)
    finally:
        await admin.close()
    assert (
        committed[tps[0]].offset == 6 and committed[tps[1]].offset == 3
    )  # 3 waits for its dead letter


@pytest.mark.kafka
async def test_a_worker_skips_what_the_previous_owners_ledger_lists(
    kafka_bootstrap, new_topic, model_runner
):
    """The previous owner committed the results of offsets 0, 2 and 3 (not 1): the next worker
    runs request 1 only."""
    t = Topics(
        requests=await new_topic(1, prefix="req"),
        cancel=await new_topic(1, prefix="cancel"),
        dlq=await new_topic(1, prefix="dlq"),
        replies=await new_topic(1, prefix="reply", reply=True),
    )
    settings = _settings(kafka_bootstrap, t, f"g-{uuid.uuid4().hex[:8]}")
    reqs = [request(t.replies, f"Say the number {n}.", max_tokens=2) for n in range(4)]
    await submit(kafka_bootstrap, t.requests, reqs)
    tp, tracker, outcomes = TopicPartition(t.requests, 0), OffsetTracker(), {}
    previous = Transactions(settings, tracker, Metrics())
    await previous.open([tp])
    for o in range(4):
        tracker.add(tp, o)
    for o in (0, 2, 3):
        done = encode_event(
            DoneEvent(
                id=reqs[o]["id"],
                attempt="previous",
                seq=0,
                finish_reason="length",
                usage=Usage(prompt_tokens=1, completion_tokens=2),
                timing=Timing(queue_s=0, ttft_s=0, total_s=0),
                text="x",
            )
        )
        previous.submit(
            tp,
            Final(
                o,
                [(t.replies, None, reqs[o]["id"].encode(), done, None)],
                lambda outcome, error=None, o=o: outcomes.__setitem__(o, outcome),
            ),
        )
    await _until(lambda: len(outcomes) == 3, 30)
    await previous.close_all()

    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task)
        events = await collect(kafka_bootstrap, t.replies, [reqs[1]["id"]], timeout=90)
        await _until(lambda: not worker.jobs and worker.tracker.pending(tp) == 0, 30)
        metrics = worker.metrics.render().decode()
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    assert len(final_dones(events[reqs[1]["id"]])) == 1
    assert 'inferline_redeliveries_total{outcome="already_final"} 2.0' in metrics
    assert (
        sum(
            1
            for r in await consume_until(kafka_bootstrap, t.replies)
            if decode_event(r.value).type == "done"
        )
        == 4
    )  # 3 by the previous owner, 1 rerun


@pytest.mark.kafka
async def test_sigkill_between_a_dones_send_and_its_commit(
    kafka_bootstrap, topics, model_runner, tmp_path
):
    group = f"g-{uuid.uuid4().hex[:8]}"
    reqs = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(3)]
    killed = spawn_worker(
        kafka_bootstrap,
        topics,
        tmp_path / "killed.log",
        {"INFERLINE_FAULT_KILL_BEFORE_COMMIT": "1"},
        kafka={"group_id": group},
    )
    await submit(kafka_bootstrap, topics.requests, reqs)
    try:
        await asyncio.wait_for(asyncio.to_thread(killed.wait), 180)
    finally:
        killed.kill()
    assert killed.returncode == -9, (tmp_path / "killed.log").read_text()[-2000:]
    assert "txn.fault_kill_before_commit" in (tmp_path / "killed.log").read_text()
    uncommitted = await _read_uncommitted(kafka_bootstrap, topics.replies)
    orphans = {e.attempt for e in uncommitted if isinstance(e, DoneEvent)}
    assert orphans, "the killed worker's done was not on the broker: the window was not hit"

    settings = _settings(kafka_bootstrap, topics, group)
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task, timeout=90)
        events = await collect(
            kafka_bootstrap, topics.replies, [r["id"] for r in reqs], timeout=120
        )
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    for r in reqs:
        finals = final_dones(events[r["id"]])
        assert len(finals) == 1, finals  # read_committed: the killed worker's done never counts
        assert finals[0].attempt not in orphans


async def _read_uncommitted(bootstrap: str, topic: str) -> list:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        isolation_level="read_uncommitted",
    )
    await consumer.start()
    try:
        consumer.subscribe([topic])
        events = []
        for _ in range(3):
            batches = await consumer.getmany(timeout_ms=2000)
            events += [decode_event(r.value) for rs in batches.values() for r in rs]
        return events
    finally:
        await consumer.stop()


@pytest.mark.kafka
@pytest.mark.parametrize("lead_s", [0.0, 0.02, 0.1, 0.5])
async def test_a_final_committed_while_its_partition_moves_is_seen_by_the_new_owner_or_never(
    kafka_bootstrap, topics, lead_s
):
    """A worker holding its partitions through a rebalance (#37) commits a final while the partition
    moves: its commit races the new owner's InitProducerId. Either it committed first and the
    new owner's take-over (committed offset + ledger) skips the request, or it is fenced and
    read_committed readers never see it: one final either way, never none, never two."""
    settings = _settings(kafka_bootstrap, topics, f"g-{uuid.uuid4().hex[:8]}")
    tp = TopicPartition(topics.requests, 0)
    old_tracker, new_tracker, outcomes = OffsetTracker(), OffsetTracker(), {}
    old, new = (Transactions(settings, t, Metrics()) for t in (old_tracker, new_tracker))
    old.owner = Evicted()
    for offset in (0, 1):  # 0 still runs: the commit's ledger lists 1 above the mark 0
        old_tracker.add(tp, offset)
    await old.open([tp])
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        old.submit(tp, _final(1, outcomes, topic=topics.replies))
        await asyncio.sleep(lead_s)
        await new.open([tp])  # the new owner's take-over: fence, then read the commit
        committed = (
            await admin.list_consumer_group_offsets(settings.kafka.group_id, partitions=[tp])
        ).get(tp)
        await _until(lambda: 1 in outcomes, 30)
    finally:
        await admin.close()
        await old.close_all()
        await new.close_all()
    has_commit = committed is not None and committed.offset >= 0
    new_tracker.resume(
        tp, committed.offset if has_commit else None, committed.metadata if has_commit else None
    )
    visible = await consume_until(
        kafka_bootstrap,
        topics.replies,
        timeout=2,
        raise_on_timeout=False,
        predicate=lambda rs: bool(rs),
    )
    print(f"lead {lead_s}s: old owner's final {outcomes[1]}")
    assert new_tracker.add(tp, 0)  # the request still running is the new owner's to run
    if outcomes[1] == "ok":
        assert [r.value for r in visible] == [b"done 1"] and not new_tracker.add(tp, 1)
    else:
        assert outcomes[1] == "fenced" and not visible and new_tracker.add(tp, 1)
