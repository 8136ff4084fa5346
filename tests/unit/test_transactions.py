"""Exactly one final result per request: final results and their input offsets commit in Kafka
transactions of the worker's one transactional producer (worker/delivery/commit.py), with the offset
ledger of worker/delivery/offsets.py in the commit's metadata. Offline: the ledger's encoding, the
tracker resuming from it, and the Committer's batching, retries and recovery over a recording
producer. Against the broker: tests/kafka/test_transactions.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given, strategies as st

from inferline.config.settings import Settings
from inferline.worker.delivery import commit
from inferline.worker.delivery.commit import Committer, Final, Outcome
from inferline.worker.delivery.offsets import OffsetTracker, decode_ledger, encode_ledger
from inferline.worker.service.metrics import Metrics
from tests.kafka_fixtures import wait_until

TP, TP1 = TopicPartition("requests", 0), TopicPartition("requests", 1)


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


# ------------------------------------------------------------------------- Committer, offline


class RecordingProducer:
    """confluent-kafka's transactional Producer, recorded: `refuse` maps a topic to the error its
    records' deliveries fail with (`refuse_now`: produce() raises it)."""

    def __init__(self) -> None:
        self.transactions: list[dict] = []
        self.refuse: dict[str, int] = {}
        self.refuse_now: dict[str, int] = {}
        self._open: dict | None = None
        self._acks: list = []

    def begin_transaction(self) -> None:
        self._open = {"records": [], "offsets": {}}

    def produce(self, topic, value, key, on_delivery, **kwargs) -> None:
        if topic in self.refuse_now:
            raise KafkaException(KafkaError(self.refuse_now[topic]))
        self._open["records"].append((topic, value))
        error = KafkaError(self.refuse[topic]) if topic in self.refuse else None
        self._acks.append((on_delivery, error))

    def flush(self, timeout) -> int:
        for on_delivery, error in self._acks:
            on_delivery(error, None)
        self._acks = []
        return 0

    def send_offsets_to_transaction(self, offsets, group_metadata, timeout) -> None:
        for o in offsets:
            self._open["offsets"][TopicPartition(o.topic, o.partition)] = (o.offset, o.metadata)

    def commit_transaction(self, timeout) -> None:
        self.transactions.append(self._open)
        self._open = None

    def abort_transaction(self, timeout) -> None:
        if self._open is None:  # as librdkafka: no transaction in progress
            raise KafkaException(KafkaError(KafkaError._STATE))
        self._open = None


class FakeOwner:
    """The group intake as the committer asks it; `committed` reads the recorded transactions."""

    def __init__(self, producer: RecordingProducer) -> None:
        self.producer, self.gone = producer, set()

    def owns(self, tp, generation) -> bool:
        return tp not in self.gone

    def group_metadata(self):
        return None

    def committed(self, tps):
        out = {}
        for txn in self.producer.transactions:
            out.update({tp: ledger for tp, ledger in txn["offsets"].items() if tp in tps})
        return out


async def _committer(tracker, offsets, **kafka) -> tuple[Committer, RecordingProducer]:
    producer = RecordingProducer()
    settings = Settings(kafka={"transaction_interval_ms": 0, **kafka})
    committer = Committer(settings, tracker, Metrics())
    committer._new_producer = lambda: producer
    committer.owner = FakeOwner(producer)
    for tp in (TP, TP1):
        tracker.resume(tp, None, None)
        for o in offsets:
            tracker.add(tp, o)
    await committer.start()
    return committer, producer


def _final(offset, outcomes, topic="replies", tp=TP, dead_letter=False) -> Final:
    def done(outcome, error=None) -> None:
        outcomes[(tp.partition, offset)] = outcome

    return Final(tp, offset, 1, [(topic, None, b"k", b"done", None)], done, dead_letter)


async def test_finals_of_every_partition_share_one_transaction_with_their_ledgers():
    tracker, outcomes = OffsetTracker(), {}
    committer, producer = await _committer(tracker, range(4))
    for o in (0, 2, 3):
        committer.submit(_final(o, outcomes))
    committer.submit(_final(0, outcomes, tp=TP1))
    await wait_until(lambda: len(outcomes) == 4)
    await committer.close()
    assert set(outcomes.values()) == {Outcome.COMMITTED}
    (txn,) = producer.transactions
    assert len(txn["records"]) == 4
    assert txn["offsets"] == {TP: (1, "1:1+2"), TP1: (1, "1:")}


async def test_a_refused_record_costs_only_its_own_final_and_a_retried_one_never_starves():
    """Before issue 48 a final that failed once went alone behind every fresh one (`_take`) and its
    deadline never fired; now each record's refusal is charged to it and it goes with the rest."""
    tracker, outcomes = OffsetTracker(), {}
    committer, producer = await _committer(tracker, range(4), final_retry_s=60)
    producer.refuse["flaky"] = KafkaError.NOT_ENOUGH_REPLICAS  # passing
    committer.submit(_final(0, outcomes, topic="flaky"))
    committer.submit(_final(1, outcomes))
    await wait_until(lambda: (0, 1) in outcomes)
    assert (0, 0) not in outcomes and committer._queue[0].tries == 1
    del producer.refuse["flaky"]
    committer.submit(_final(2, outcomes))  # fresh ones keep coming: the retried one goes with them
    await wait_until(lambda: len(outcomes) == 3)
    await committer.close()
    assert set(outcomes.values()) == {Outcome.COMMITTED}
    assert producer.transactions[-1]["offsets"][TP] == (3, "1:")


@pytest.mark.parametrize("when", ["delivery", "produce"])
async def test_a_permanent_refusal_is_never_retried_and_a_dead_letter_still_ends(when):
    """A reply too large fails its final at once; a dead letter the DLQ refuses for good is logged
    and counted, and its offset commits without it (before issue 48 it was retried forever, and
    the partition's offsets never moved again)."""
    tracker, outcomes = OffsetTracker(), {}
    committer, producer = await _committer(tracker, range(3))
    refuse = producer.refuse if when == "delivery" else producer.refuse_now
    refuse["replies"] = refuse["dlq"] = KafkaError.MSG_SIZE_TOO_LARGE
    committer.submit(_final(0, outcomes))
    committer.submit(_final(1, outcomes, topic="dlq", dead_letter=True))
    await wait_until(lambda: len(outcomes) == 2)
    await committer.close()
    assert outcomes == {(0, 0): Outcome.FAILED, (0, 1): Outcome.COMMITTED}
    assert committer._m.dead_letters_lost._value.get() == 1
    assert producer.transactions[-1]["records"] == []  # the offset alone
    assert producer.transactions[-1]["offsets"][TP] == (0, "1:1")


async def test_a_passing_cause_is_retried_for_final_retry_s_then_fails():
    tracker, outcomes = OffsetTracker(), {}
    committer, producer = await _committer(tracker, range(1), final_retry_s=1.0)
    producer.refuse["replies"] = KafkaError.NOT_ENOUGH_REPLICAS
    committer.submit(_final(0, outcomes))
    await wait_until(lambda: outcomes)
    await committer.close()
    assert outcomes == {(0, 0): Outcome.FAILED} and not producer.transactions


async def test_a_commit_whose_answer_was_lost_is_resolved_not_sent_again(monkeypatch):
    """The commit happened, its answer did not come: a new producer takes the id, then the
    group's committed offsets say the finals are committed; nothing is sent twice."""
    tracker, outcomes = OffsetTracker(), {}
    committer, producer = await _committer(tracker, range(2))
    lost = []

    def lose_the_answer() -> None:
        if not lost:
            lost.append(True)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    monkeypatch.setattr(commit, "after_commit", lose_the_answer)
    committer.submit(_final(0, outcomes))
    committer.submit(_final(1, outcomes))
    await wait_until(lambda: len(outcomes) == 2)
    await committer.close()
    assert set(outcomes.values()) == {Outcome.COMMITTED} and len(producer.transactions) == 1
    assert committer._m.transactions.labels("lost")._value.get() == 1


async def test_a_replacement_producer_that_fails_to_start_is_tried_again(monkeypatch):
    """Before issue 48 a replacement that failed to start was never replaced."""
    monkeypatch.setattr(commit, "_FAILED_STARTS", 2)
    tracker, outcomes = OffsetTracker(), {}
    producer = RecordingProducer()
    committer = Committer(Settings(kafka={"transaction_interval_ms": 0}), tracker, Metrics())
    made = []
    real = committer._new_producer
    committer._new_producer = lambda: made.append(1) or (real() if False else _starting(producer))
    committer.owner = FakeOwner(producer)
    tracker.resume(TP, None, None)
    tracker.add(TP, 0)
    await committer.start()
    assert committer.ready and committer._m.producer_start_failures._value.get() == 2
    committer.submit(_final(0, outcomes))
    await wait_until(lambda: outcomes)
    await committer.close()
    assert outcomes == {(0, 0): Outcome.COMMITTED}


def _starting(producer):
    """As Committer._new_producer with the fault hook: the first _FAILED_STARTS tries raise."""
    if commit._FAILED_STARTS > 0:
        commit._FAILED_STARTS -= 1
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))
    return producer


async def test_a_final_of_a_partition_no_longer_owned_is_never_committed():
    tracker, outcomes = OffsetTracker(), {}
    committer, producer = await _committer(tracker, range(1))
    committer.owner.gone.add(TP)
    committer.submit(_final(0, outcomes))
    await committer.close()
    assert outcomes == {(0, 0): Outcome.MOVED} and not producer.transactions


async def test_a_transaction_stuck_past_its_timeouts_is_given_up_and_its_producer_replaced(
    monkeypatch,
):
    """Seen in the chaos run after a broker restart: send_offsets_to_transaction blocked for
    minutes past its own 30 s timeout, and with it every final of the worker. Now the committer
    leaves the stuck call to its thread, a new producer takes the id, and the finals go again."""
    import threading

    monkeypatch.setattr(commit, "STUCK_S", 0.5, raising=False)
    tracker, outcomes, release = OffsetTracker(), {}, threading.Event()
    committer, stuck = await _committer(tracker, range(1))
    healthy = RecordingProducer()
    stuck.send_offsets_to_transaction = lambda *args: release.wait(30)
    committer._new_producer = lambda: healthy
    try:
        committer.submit(_final(0, outcomes))
        await wait_until(lambda: outcomes)
    finally:
        release.set()
    await committer.close()
    assert outcomes == {(0, 0): Outcome.COMMITTED} and len(healthy.transactions) == 1
    assert committer._m.transactions.labels("lost")._value.get() == 1


async def test_finals_past_the_ledger_limit_go_in_offset_order_and_each_ends_once():
    """Finals queued out of offset order, more than one ledger can list: the lowest go first and
    the rest wait. The rest was once cut from the unsorted queue: some finals were committed
    twice, others never."""
    tracker, ended = OffsetTracker(), []
    committer, producer = await _committer(tracker, range(200), offset_metadata_max_bytes=64)
    record = ("replies", None, b"k", b"done", None)
    for o in range(199, 0, -2):  # every other offset: each leaves a gap in the ledger
        committer.submit(Final(TP, o, 1, [record], lambda *outcome, o=o: ended.append(o)))
    await wait_until(lambda: len(ended) >= 100)
    await committer.close()
    assert sorted(ended) == list(range(1, 200, 2)) and len(producer.transactions) > 1
