"""Exactly one final result per request: final results and their input offsets commit in one
Kafka transaction per owned partition (worker/delivery/transactions.py), with the offset ledger of
worker/delivery/offsets.py in the commit's metadata. Offline: the ledger's encoding, the tracker
resuming from it, and PartitionTxn's batching, retries and fencing over a recording producer.
Against the broker: tests/kafka/test_transactions.py."""

from __future__ import annotations

import asyncio
import time

from aiokafka import TopicPartition
from aiokafka.errors import MessageSizeTooLargeError, ProducerFenced
from hypothesis import given, strategies as st

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
from inferline.worker.delivery import transactions
from inferline.worker.service.metrics import Metrics
from inferline.worker.delivery.offsets import OffsetTracker, decode_ledger, encode_ledger
from inferline.worker.delivery.transactions import Final, PartitionTxn

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
        self.fail_topics: dict[str, type] = {}  # topic -> the exception its sends fail with
        self.fenced = False
        self.lose_commit_answer = False  # the commit happens, its answer is lost (a timeout)
        self.client = type(
            "Client",
            (),
            {
                "_topics": set(),
                "set_topics": lambda s, t: None,
                "add_topic": lambda s, t: s._topics.add(t),
            },
        )()
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
            raise self.fail_topics[topic](f"{topic} refuses")
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
        if self.lose_commit_answer:
            self.lose_commit_answer = False
            raise asyncio.TimeoutError()


class FakeOwner:
    """Ownership as the intake answers it: `owner` is what the coordinator says; `committed`
    what the group's offsets say (from the recording producer's transactions)."""

    def __init__(self, producer: RecordingProducer, owner: bool = True) -> None:
        self.producer, self.owner, self.given_up = producer, owner, []

    def owns(self, tp, generation) -> bool:
        return True

    async def confirm(self, tp) -> bool:
        return self.owner

    async def committed(self, tp):
        offsets = [t["offsets"][tp] for t in self.producer.transactions if t["offsets"]]
        return offsets[-1] if offsets else None

    async def gone(self, topic) -> bool:
        return topic == "deleted"

    def give_up(self, tp) -> None:
        self.given_up.append(tp)


async def _partition(
    tracker: OffsetTracker,
    offsets,
    owner: bool = True,
    retry_s: float = 300.0,
    interval_s: float = 0.0,
) -> tuple[PartitionTxn, RecordingProducer]:
    producer = RecordingProducer()
    part = PartitionTxn(
        TP,
        lambda tp: producer,
        tracker,
        "group",
        Metrics(),
        4096,
        owner=FakeOwner(producer, owner),
        retry_s=retry_s,
        interval_s=interval_s,
    )
    for o in offsets:
        tracker.add(TP, o)
    await part.start()
    return part, producer


def _final(offset: int, outcomes: dict, topic: str = "replies", forever: bool = False) -> Final:
    return Final(
        offset,
        [(topic, None, b"k", f"done {offset}".encode(), None)],
        lambda outcome, error=None: outcomes.__setitem__(offset, outcome),
        forever=forever,
    )


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


async def test_finals_of_several_cycles_share_one_transaction_within_the_interval_each_once():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(5), interval_s=0.5)
    part.submit(_final(0, outcomes))  # an idle partition: at once
    await _until(lambda: 0 in outcomes)
    for o in (1, 3, 2, 4):  # the partition's task runs between them: each would have been a cycle
        part.submit(_final(o, outcomes))
        await asyncio.sleep(0)
    await _until(lambda: len(outcomes) == 5)
    await part.stop()
    assert outcomes == dict.fromkeys(range(5), "ok")
    assert [[v for _, v in t["records"]] for t in producer.transactions] == [
        [b"done 0"],
        [b"done 1", b"done 3", b"done 2", b"done 4"],
    ]
    assert producer.transactions[1]["offsets"] == {TP: (5, encode_ledger(5, set()))}
    assert tracker.watermark(TP) == 5


async def test_within_the_interval_a_refused_record_still_costs_only_its_own_final():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(4), interval_s=0.5)
    producer.fail_topics = {"tiny": MessageSizeTooLargeError}
    part.submit(_final(0, outcomes))
    await _until(lambda: 0 in outcomes)
    for final in (_final(1, outcomes), _final(2, outcomes, topic="tiny"), _final(3, outcomes)):
        part.submit(final)
    await _until(lambda: len(outcomes) == 4)
    await part.stop()
    assert outcomes == {0: "ok", 1: "ok", 2: "failed", 3: "ok"}
    committed = [v for t in producer.transactions for _, v in t["records"]]
    assert sorted(committed) == [b"done 0", b"done 1", b"done 3"]  # each once
    assert tracker.watermark(TP) == 2  # 2 waits for its dead letter (the Publisher's part)


async def test_a_refused_record_costs_only_its_own_final_and_a_dead_letter_is_never_given_up(
    monkeypatch,
):
    monkeypatch.setattr(transactions, "RETRY_BACKOFF_S", 0.01)
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(3))
    producer.fail_topics = {"tiny": MessageSizeTooLargeError, "dlq": RuntimeError}
    for final in (
        _final(0, outcomes, topic="tiny"),
        _final(1, outcomes),
        _final(2, outcomes, topic="dlq", forever=True),
    ):
        part.submit(final)
    await _until(lambda: 0 in outcomes and 1 in outcomes)
    # A permanent refusal is not retried; 1 went again at once, as if it had never failed.
    assert outcomes == {0: "failed", 1: "ok"} and part._queue and part._queue[0].offset == 2
    producer.fail_topics = {}  # the dead-letter topic comes back
    await _until(lambda: 2 in outcomes)
    await part.stop()
    assert outcomes[2] == "ok" and tracker.watermark(TP) == 0  # 0 waits for its dead letter


async def test_a_passing_cause_is_retried_for_retry_s_and_a_gone_topic_not_at_all(monkeypatch):
    monkeypatch.setattr(transactions, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.setattr(transactions, "METADATA_WAIT_S", 0.01)
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(2), retry_s=0.5)
    producer.fail_topics = {"flaky": RuntimeError}
    producer.partitions_for = lambda topic: _never() if topic == "deleted" else _partitions()
    started = time.monotonic()
    part.submit(_final(0, outcomes, topic="flaky"))
    part.submit(_final(1, outcomes, topic="deleted"))
    await _until(lambda: 1 in outcomes)
    assert outcomes == {1: "failed"}  # the broker lists no such topic: at once
    await _until(lambda: 0 in outcomes)
    await part.stop()
    assert outcomes[0] == "failed" and time.monotonic() - started >= 0.5


async def _never():
    await asyncio.sleep(3600)


async def _partitions():
    return {0}


async def test_a_fence_of_a_partition_still_owned_takes_the_id_back_and_commits():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(2))
    producer.fenced = True  # the broker fenced it (a timed-out transaction), nobody else owns it

    async def unfence():
        producer.fenced = False

    producer.start = unfence  # the new InitProducerId takes the id back
    part.submit(_final(0, outcomes))
    await _until(lambda: 0 in outcomes)
    part.submit(_final(1, outcomes))
    await _until(lambda: 1 in outcomes)
    await part.stop()
    assert outcomes == {0: "ok", 1: "ok"} and not part._owner.given_up


async def test_a_fenced_partition_owned_elsewhere_is_given_up_and_commits_nothing():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(2), owner=False)
    producer.fenced = True
    part.submit(_final(0, outcomes))
    await _until(lambda: 0 in outcomes)
    part.submit(_final(1, outcomes))  # after the fence: refused at once
    await part.stop()
    assert outcomes == {0: "fenced", 1: "fenced"} and part._owner.given_up == [TP]
    assert producer.transactions == [] and tracker.watermark(TP) == 0


async def test_a_final_of_another_assignment_is_never_committed_in_this_one():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(1))
    part.generation = 2  # the partition came back to this worker
    stale = _final(0, outcomes)
    stale.generation = 1
    part.submit(stale)
    await part.stop()
    assert outcomes == {0: "fenced"} and producer.transactions == []


async def test_a_commit_whose_answer_was_lost_is_resolved_not_sent_again():
    tracker, outcomes = OffsetTracker(), {}
    part, producer = await _partition(tracker, range(2))
    producer.lose_commit_answer = True
    part.submit(_final(0, outcomes))
    await _until(lambda: 0 in outcomes)
    part.submit(_final(1, outcomes))
    await _until(lambda: 1 in outcomes)
    await part.stop()
    assert outcomes == {0: "ok", 1: "ok"}
    assert [[v for _, v in t["records"]] for t in producer.transactions] == [
        [b"done 0"],
        [b"done 1"],
    ]


# ----------------------------------------------------------------------------- with the broker
