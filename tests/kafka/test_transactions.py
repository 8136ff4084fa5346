"""Exactly one final result per request, against the broker: a stale member's commit is fenced by
its group metadata (KIP-447), finals of every partition share transactions, a new owner skips what
the ledger lists, and a worker SIGKILLed between a `done`'s send and its commit (a test hook, not
luck) leaves a `done` that read_committed readers never see; the request's rerun is its only final
result. The ledger and the Committer offline: tests/unit/test_transactions.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from confluent_kafka import Consumer

from inferline.config.settings import Settings
from inferline.contract.schema import DoneEvent, Timing, Usage, decode_event, encode_event
from inferline.worker.app import Worker, engine_settings
from inferline.worker.delivery.commit import Committer, Final, Outcome
from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.engine.engine import LLMEngine
from inferline.worker.intake.group import Intake, consumer_config, set_session_timeout
from inferline.worker.service.metrics import Metrics
from tests.kafka_fixtures import consume_until, wait_until
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


def _settings(bootstrap: str, topics: Topics, group: str, **kafka) -> Settings:
    return Settings(**worker_config(bootstrap, topics, kafka={"group_id": group, **kafka}))


class Member:
    """A real member of the group (KIP-848) as the committer asks it: its group metadata and the
    stable committed offsets; it believes it owns every partition it was ever given."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.consumer = Consumer(consumer_config(settings.kafka))
        self.consumer.subscribe([settings.kafka.request_topic])
        self.metadata = None
        self.closed = False

    def join(self, timeout: float = 60.0) -> None:
        # As the worker does: a leave the broker missed (seen on a fresh broker) then costs the
        # next member the test's 6 s session, not the broker's default 45 s.
        set_session_timeout(self.settings.kafka)
        deadline = time.monotonic() + timeout
        while not self.consumer.assignment():
            assert time.monotonic() < deadline, "no assignment"
            self.consumer.poll(0.1)
        self.metadata = self.consumer.consumer_group_metadata()

    def close(self) -> None:
        """Once, and always: an unclosed consumer is closed by the garbage collector, on whatever
        thread runs it (the event loop's included), and a KIP-848 close can block."""
        if not self.closed:
            self.closed = True
            self.consumer.close()

    def owns(self, tp, generation) -> bool:
        return True

    def group_metadata(self):
        return self.metadata

    committed = Intake.committed

    @property
    def _consumer(self):
        return self.consumer


@contextlib.asynccontextmanager
async def _joined(settings: Settings):
    member = Member(settings)
    try:
        await asyncio.to_thread(member.join)
        yield member
    finally:
        await asyncio.to_thread(member.close)


async def _committer(settings, tracker, member: Member) -> Committer:
    committer = Committer(settings, tracker, Metrics())
    committer.owner = member
    await committer.start()
    return committer


def _final(tp, offset, outcomes, value: bytes, topic: str) -> Final:
    def done(outcome, error=None) -> None:
        outcomes[(tp.partition, offset)] = outcome

    return Final(tp, offset, 1, [(topic, None, b"k", value, None)], done)


async def _committed(bootstrap: str, group: str, tps) -> dict:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return await admin.list_consumer_group_offsets(group, partitions=list(tps))
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_a_member_that_left_the_group_cannot_commit_a_final(kafka_bootstrap, topics):
    """A zombie (it left, or was evicted, and still believes it owns the partition) commits with
    its stale group metadata: the broker refuses the offsets, the transaction aborts, and
    read_committed readers see only the new owner's final. Before issue 48 this rested on one
    transactional id per partition and ownership round trips (two finals were possible)."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    settings = _settings(kafka_bootstrap, topics, group)
    tp = TopicPartition(topics.requests, 0)
    # One member at a time: a subscribed member that is not polled joins too, and the partitions
    # the broker gives it are never handed on (the zombie waited for them in vain).
    zombie, owner = Member(settings), None
    trackers, outcomes = (OffsetTracker(), OffsetTracker()), {}
    try:
        await asyncio.to_thread(zombie.join)
        await asyncio.to_thread(zombie.close)  # its metadata is stale from here on
        owner = Member(settings)
        await asyncio.to_thread(owner.join)
        for t in trackers:
            t.resume(tp, None, None)
            t.add(tp, 0)
        stale = await _committer(settings, trackers[0], zombie)
        live = await _committer(settings, trackers[1], owner)
        try:
            stale.submit(_final(tp, 0, outcomes, b"from the zombie", topics.replies))
            failed = stale._m.transactions.labels  # refused and aborted, or stuck and given up
            await wait_until(
                lambda: failed("aborted")._value.get() + failed("lost")._value.get(), 90
            )
            assert not outcomes  # refused, and retried: never committed
            live.submit(_final(tp, 0, {}, b"from the owner", topics.replies))
            await wait_until(lambda: not live._queue and not live._committing, 30)
        finally:
            await stale.close(timeout=0)
            await live.close()
    finally:
        await asyncio.to_thread(zombie.close)
        if owner is not None:
            await asyncio.to_thread(owner.close)
    assert outcomes == {(0, 0): Outcome.MOVED}
    records = await consume_until(kafka_bootstrap, topics.replies)
    assert [r.value for r in records] == [b"from the owner"]
    assert (await _committed(kafka_bootstrap, group, [tp]))[tp].offset == 1


@pytest.mark.kafka
async def test_finals_of_both_partitions_share_transactions_and_a_refused_one_costs_only_itself(
    kafka_bootstrap, topics
):
    group = f"g-{uuid.uuid4().hex[:8]}"
    settings = _settings(kafka_bootstrap, topics, group, transaction_interval_ms=500)
    tps = [TopicPartition(topics.requests, p) for p in (0, 1)]
    tracker, outcomes = OffsetTracker(), {}
    async with _joined(settings) as member:
        for tp in tps:
            tracker.resume(tp, None, None)
            for o in range(6):
                tracker.add(tp, o)
        committer = await _committer(settings, tracker, member)
        try:
            for o in range(6):  # a burst over both partitions: their finals share transactions
                for tp in tps:
                    refused = (tp.partition, o) == (1, 3)  # over message.max.bytes: for good
                    value = (
                        b"x" * 2 * settings.kafka.max_message_bytes
                        if refused
                        else b"%d:%d" % (tp.partition, o)
                    )
                    committer.submit(_final(tp, o, outcomes, value, topics.replies))
                    await asyncio.sleep(0)
            await wait_until(lambda: len(outcomes) == 12, 60)
        finally:
            await committer.close()
    assert outcomes.pop((1, 3)) == Outcome.FAILED and set(outcomes.values()) == {"ok"}
    records = await consume_until(kafka_bootstrap, topics.replies)  # read_committed
    assert sorted(r.value for r in records) == sorted(b"%d:%d" % k for k in outcomes)  # each once
    assert committer._m.transactions.labels("committed")._value.get() < 6
    committed = await _committed(kafka_bootstrap, group, tps)
    assert committed[tps[0]].offset == 6 and committed[tps[1]].offset == 3  # 3 awaits its DLQ


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
    async with _joined(settings) as member:
        tracker.resume(tp, None, None)
        for o in range(4):
            tracker.add(tp, o)
        previous = await _committer(settings, tracker, member)
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
            final = _final(tp, o, outcomes, done, t.replies)
            final.records = [(t.replies, None, reqs[o]["id"].encode(), done, None)]
            previous.submit(final)
        await wait_until(lambda: len(outcomes) == 3, 30)
        await previous.close()

    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task)
        events = await collect(kafka_bootstrap, t.replies, [reqs[1]["id"]], timeout=90)
        await wait_until(lambda: not worker.jobs and worker.tracker.pending(tp) == 0, 30)
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
    assert "commit.fault_kill_before_commit" in (tmp_path / "killed.log").read_text()
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
