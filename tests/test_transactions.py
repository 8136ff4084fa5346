"""Exactly one final result per request: final results and their input offsets commit in one
Kafka transaction per owned partition (worker/transactions.py), with the offset ledger of
worker/offsets.py in the commit's metadata.

Offline: the ledger's encoding, the tracker resuming from it, and PartitionTxn's batching,
retries and fencing over a recording producer. Against the broker: a zombie is fenced, a new
owner skips what the ledger lists, and a worker SIGKILLed between a `done`'s send and its commit
(a test hook, not luck) leaves a `done` that read_committed readers never see; the request's
rerun is its only final result.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import ProducerFenced
from hypothesis import given, strategies as st

from config.settings import Settings
from producer.schema import DoneEvent, Timing, Usage, decode_event, encode_event
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - topics is a fixture
    Topics, collect, final_dones, request, spawn_worker, submit, topics, wait_ready, worker_config)
from worker import transactions
from worker.app import Worker, engine_settings
from worker.engine.engine import LLMEngine
from worker.metrics import Metrics
from worker.offsets import OffsetTracker, decode_ledger, encode_ledger
from worker.transactions import Final, PartitionTxn, Transactions

TP = TopicPartition("requests", 0)


# ------------------------------------------------------------------------------------ the ledger

@given(st.integers(0, 10**12), st.sets(st.integers(1, 5000), max_size=400))
def test_the_ledger_lists_exactly_the_finished_offsets_above_the_mark(mark, above):
    done = {mark + o for o in above}
    text = encode_ledger(mark, done | {mark - 1, mark})  # at or below the mark: not listed
    assert decode_ledger(mark, text) == done


def test_a_long_ledger_is_packed_and_foreign_metadata_lists_nothing():
    every_other = set(range(1, 4000, 2))
    text = encode_ledger(0, every_other)
    assert text.startswith("2:") and len(text) < 200 and decode_ledger(0, text) == every_other
    assert decode_ledger(5, "") == set() and decode_ledger(5, "written by another tool") == set()


def test_a_new_owner_resumes_from_the_commit_and_skips_what_the_ledger_lists():
    tracker = OffsetTracker()
    tracker.resume(TP, 10, encode_ledger(10, {12, 13}))
    assert tracker.add(TP, 9) is False  # below the commit: finished long ago
    assert [tracker.add(TP, o) for o in (10, 11, 12, 13, 14)] == [True, True, False, False, True]
    assert tracker.ledger(TP, [14]) == (10, encode_ledger(10, {12, 13, 14}))
    tracker.finish(TP, 10)
    tracker.finish(TP, 14)
    assert tracker.ledger(TP, [11]) == (15, encode_ledger(15, set()))


def test_a_partition_never_committed_starts_with_an_empty_ledger():
    tracker = OffsetTracker()
    tracker.resume(TP, None, None)
    assert tracker.ledger(TP) is None
    assert tracker.add(TP, 0) and tracker.ledger(TP, [0]) == (1, "1:")


# ----------------------------------------------------------------------- PartitionTxn, offline

class RecordingProducer:
    """The transactional producer's calls, recorded; `fail_topics` fail their sends, `fenced`
    fails the next commit as a newer owner's producer would make it fail."""

    def __init__(self) -> None:
        self.transactions: list[dict] = []
        self.fail_topics: set[str] = set()
        self.fenced = False
        self.client = type("Client", (), {"_topics": set(), "set_topics": lambda s, t: None,
                                          "add_topic": lambda s, t: s._topics.add(t)})()
        self._open: dict | None = None

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def flush(self) -> None: ...

    async def partitions_for(self, topic):
        return {0}

    async def begin_transaction(self) -> None:
        self._open = {"records": [], "offsets": None}

    async def abort_transaction(self) -> None:
        self._open = None

    async def send(self, topic, value, key=None, partition=None, headers=None):
        if topic in self.fail_topics:
            raise RuntimeError(f"{topic} refuses")
        self._open["records"].append((topic, value))
        acked = asyncio.get_running_loop().create_future()
        acked.set_result(None)
        return acked

    async def send_offsets_to_transaction(self, offsets, group_id) -> None:
        self._open["offsets"] = offsets

    async def commit_transaction(self) -> None:
        if self.fenced:
            raise ProducerFenced()
        self.transactions.append(self._open)
        self._open = None


async def _partition(tracker: OffsetTracker, offsets) -> tuple[PartitionTxn, RecordingProducer]:
    producer = RecordingProducer()
    part = PartitionTxn(TP, lambda tp: producer, tracker, "group", Metrics(), 4096)
    for o in offsets:
        tracker.add(TP, o)
    await part.start()
    return part, producer


def _final(offset: int, outcomes: dict, topic: str = "replies", forever: bool = False) -> Final:
    return Final(offset, [(topic, None, b"k", f"done {offset}".encode(), None)],
                 lambda outcome: outcomes.__setitem__(offset, outcome), forever=forever)


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_finals_queued_together_commit_in_one_transaction_with_the_ledger():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(4))
    for o in (0, 2, 3):
        part.submit(_final(o, outcomes))
    await _until(lambda: len(outcomes) == 3)
    await part.stop()
    assert outcomes == {0: "ok", 2: "ok", 3: "ok"}
    (txn,) = producer.transactions
    assert [v for _, v in txn["records"]] == [b"done 0", b"done 2", b"done 3"]
    assert txn["offsets"] == {TP: (1, encode_ledger(1, {2, 3}))}  # 1 runs on: the ledger skips 2, 3
    assert tracker.watermark(TP) == 1


async def test_a_final_that_keeps_failing_is_given_up_alone_and_a_dead_letter_never(monkeypatch):
    monkeypatch.setattr(transactions, "RETRY_BACKOFF_S", 0.01)
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(3))
    producer.fail_topics = {"deleted", "dlq"}
    part.submit(_final(0, outcomes, topic="deleted"))
    part.submit(_final(1, outcomes))
    part.submit(_final(2, outcomes, topic="dlq", forever=True))
    await _until(lambda: 0 in outcomes and 1 in outcomes)
    assert outcomes == {0: "failed", 1: "ok"}  # 1 retried on its own after the shared abort
    assert all(len(t["records"]) == 1 for t in producer.transactions)
    producer.fail_topics = {"deleted"}  # the dead-letter topic comes back
    await _until(lambda: 2 in outcomes)
    await part.stop()
    assert outcomes[2] == "ok" and tracker.watermark(TP) == 0  # 0 is for the dead letter of worker/app.py


async def test_a_fenced_partition_commits_nothing_and_says_so():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(2))
    producer.fenced = True
    part.submit(_final(0, outcomes))
    await _until(lambda: 0 in outcomes)
    part.submit(_final(1, outcomes))  # after the fence: refused at once
    await part.stop()
    assert outcomes == {0: "fenced", 1: "fenced"}
    assert producer.transactions == [] and tracker.watermark(TP) == 0


# ----------------------------------------------------------------------------- with the broker

def _settings(bootstrap: str, topics: Topics, group: str) -> Settings:
    return Settings(**worker_config(bootstrap, topics, kafka={"group_id": group}))


@pytest.mark.kafka
async def test_a_new_owner_fences_the_old_one(kafka_bootstrap, topics):
    settings = _settings(kafka_bootstrap, topics, f"g-{uuid.uuid4().hex[:8]}")
    tp = TopicPartition(topics.requests, 0)
    old_tracker, new_tracker, outcomes = OffsetTracker(), OffsetTracker(), {}
    old, new = (Transactions(settings, t, Metrics()) for t in (old_tracker, new_tracker))
    for t in (old_tracker, new_tracker):
        t.add(tp, 0)
    await old.open([tp])
    await new.open([tp])  # same transactional id: the old owner is fenced now
    try:
        old.submit(tp, _final(0, outcomes, topic=topics.replies))
        await _until(lambda: 0 in outcomes, 30)
        assert outcomes[0] == "fenced" and old.fenced(tp)
        new.submit(tp, Final(0, [(topics.replies, None, b"k", b"from the new owner", None)],
                             lambda outcome: outcomes.__setitem__("new", outcome)))
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
        committed = await admin.list_consumer_group_offsets(settings.kafka.group_id, partitions=[tp])
    finally:
        await admin.close()
    assert committed[tp].offset == 1


@pytest.mark.kafka
async def test_a_worker_skips_what_the_previous_owners_ledger_lists(kafka_bootstrap, new_topic, model_runner):
    """The previous owner committed the results of offsets 0, 2 and 3 (not 1): the next worker
    runs request 1 only."""
    t = Topics(requests=await new_topic(1, prefix="req"), cancel=await new_topic(1, prefix="cancel"),
               dlq=await new_topic(1, prefix="dlq"), replies=await new_topic(1, prefix="reply", reply=True))
    settings = _settings(kafka_bootstrap, t, f"g-{uuid.uuid4().hex[:8]}")
    reqs = [request(t.replies, f"Say the number {n}.", max_tokens=2) for n in range(4)]
    await submit(kafka_bootstrap, t.requests, reqs)
    tp, tracker, outcomes = TopicPartition(t.requests, 0), OffsetTracker(), {}
    previous = Transactions(settings, tracker, Metrics())
    await previous.open([tp])
    for o in range(4):
        tracker.add(tp, o)
    for o in (0, 2, 3):
        done = encode_event(DoneEvent(id=reqs[o]["id"], attempt="previous", seq=0, finish_reason="length",
                                      usage=Usage(prompt_tokens=1, completion_tokens=2),
                                      timing=Timing(queue_s=0, ttft_s=0, total_s=0), text="x"))
        previous.submit(tp, Final(o, [(t.replies, None, reqs[o]["id"].encode(), done, None)],
                                  lambda outcome, o=o: outcomes.__setitem__(o, outcome)))
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
    assert sum(1 for r in await consume_until(kafka_bootstrap, t.replies)
               if decode_event(r.value).type == "done") == 4  # 3 by the previous owner, 1 rerun


@pytest.mark.kafka
async def test_sigkill_between_a_dones_send_and_its_commit(kafka_bootstrap, topics, model_runner, tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    reqs = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(3)]
    killed = spawn_worker(kafka_bootstrap, topics, tmp_path / "killed.log",
                          {"INFERLINE_FAULT_KILL_BEFORE_COMMIT": "1"}, kafka={"group_id": group})
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
        events = await collect(kafka_bootstrap, topics.replies, [r["id"] for r in reqs], timeout=120)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    for r in reqs:
        finals = final_dones(events[r["id"]])
        assert len(finals) == 1, finals  # read_committed: the killed worker's done never counts
        assert finals[0].attempt not in orphans


async def _read_uncommitted(bootstrap: str, topic: str) -> list:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                isolation_level="read_uncommitted")
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
