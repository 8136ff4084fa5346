"""Faults inside the transactional delivery path, against the broker, on partitions the worker
owns: a commit whose answer is lost, a transactional producer that fails to start, a finished
request resubmitted. Every request ends with exactly one final `done`, read with read_committed.
Offline, over a recording producer: tests/unit/test_transactions.py."""

from __future__ import annotations

import asyncio
import signal
import threading
import uuid

import msgpack
import pytest
from confluent_kafka import KafkaError, KafkaException

from tests.kafka_fixtures import consume_until, produce_raw, wait_until
from tests.worker_fixtures import (  # noqa: F401 - topics, start_worker are fixtures
    check_attempts,
    collect,
    final_dones,
    request,
    spawn_worker,
    start_worker,
    topics,
    wait_log,
)
from inferline.worker.delivery import commit
from inferline.worker.intake.group import FLUSH_ON_REVOKE_S

pytestmark = pytest.mark.kafka


async def _submit_to(bootstrap: str, topic: str, partition: int, reqs: list[dict]) -> None:
    await produce_raw(
        bootstrap, topic, [(r["id"].encode(), msgpack.packb(r)) for r in reqs], partition=partition
    )


async def _one_final_each(bootstrap: str, reply_topic: str, reqs: list[dict]) -> dict:
    events = await collect(bootstrap, reply_topic, [r["id"] for r in reqs], timeout=120)
    for r in reqs:
        check_attempts(events[r["id"]])
        assert len(final_dones(events[r["id"]])) == 1, events[r["id"]]
    return events


async def test_a_commit_whose_answer_is_lost_is_not_committed_twice(
    kafka_bootstrap, topics, start_worker, monkeypatch
):
    lost = []

    def lose_the_first_answer() -> None:  # on the committer's thread, after a real commit
        if not lost:
            lost.append(True)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "the answer never came"))

    monkeypatch.setattr(commit, "after_commit", lose_the_first_answer)
    worker = await start_worker(topics)
    reqs = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(3)]
    await _submit_to(kafka_bootstrap, topics.requests, 0, reqs)
    await _one_final_each(kafka_bootstrap, topics.replies, reqs)
    # The finals are readable once the broker has committed them, a moment before the committer's
    # thread hears back: on a loaded machine, before the answer is lost.
    await wait_until(lambda: lost, 30, "the committer to lose the answer")
    for _ in range(100):  # everything settled: nothing retried behind the test's back
        if not worker.jobs and not worker.ledger.unacked():
            break
        await asyncio.sleep(0.1)
    records = await consume_until(kafka_bootstrap, topics.replies)
    dones = [r for r in records if msgpack.unpackb(r.value)["type"] == "done"]
    assert len(dones) == len(reqs)


async def test_a_resubmitted_finished_request_gets_its_final_again_not_a_rerun(
    kafka_bootstrap, topics, start_worker
):
    worker = await start_worker(topics)
    req = request(topics.replies, "Say hello.", max_tokens=2, id=f"r-{uuid.uuid4().hex[:8]}")
    await _submit_to(kafka_bootstrap, topics.requests, 0, [req])
    (first,) = final_dones(
        (await _one_final_each(kafka_bootstrap, topics.replies, [req]))[req["id"]]
    )
    await _submit_to(kafka_bootstrap, topics.requests, 0, [req])  # the client never saw it: again

    def two_dones(records) -> bool:
        return sum(msgpack.unpackb(r.value)["type"] == "done" for r in records) == 2

    records = await consume_until(kafka_bootstrap, topics.replies, two_dones, timeout=60)
    dones = [
        msgpack.unpackb(r.value) for r in records if msgpack.unpackb(r.value)["type"] == "done"
    ]
    assert (
        dones[0] == dones[1] and dones[0]["attempt"] == first.attempt
    )  # the same final, committed again
    assert worker.delivery.num_resubmitted == 1


async def test_a_producer_that_fails_to_start_is_tried_again(
    kafka_bootstrap, topics, start_worker, monkeypatch
):
    """Before issue 48 a replacement producer that failed to start was never replaced: its
    partition's finals waited 300 s, then were dead-lettered."""
    monkeypatch.setattr(commit, "_FAILED_STARTS", 2)
    worker = await start_worker(topics)
    reqs = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(3)]
    await _submit_to(kafka_bootstrap, topics.requests, 0, reqs)
    await _one_final_each(kafka_bootstrap, topics.replies, reqs)
    assert worker.metrics.producer_start_failures._value.get() == 2 and worker.committer.ready


async def test_a_revoke_waits_for_the_transaction_that_carries_its_finals(
    kafka_bootstrap, topics, start_worker, monkeypatch, tmp_path
):
    """A partition moving while a transaction with its finals is in flight (a slow broker): the
    revoke returned after FLUSH_ON_REVOKE_S, so the joiner could read the committed offsets before
    that transaction sent them and run the request again (two finals, seen in CI on a join)."""
    held, revoking, joined = threading.Event(), threading.Event(), threading.Event()
    released_by_join, made = [], []

    class HeldFlush(commit.Producer):
        """Worker A's producer (the first made; B is a process): its first transaction's records
        wait to be flushed until B owns a partition, or well past the revoke's flush bound."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self._hold = not made
            made.append(self)

        def flush(self, *args):
            if self._hold and not held.is_set():
                held.set()
                revoking.wait(60)
                released_by_join.append(joined.wait(FLUSH_ON_REVOKE_S + 5))
            return super().flush(*args)

    monkeypatch.setattr(commit, "Producer", HeldFlush)
    group = {"group_id": f"g-{uuid.uuid4().hex[:8]}"}
    a = await start_worker(topics, kafka=group)
    flush = a.committer.flush

    async def revoke_flush(tps=None, timeout: float = 10.0) -> None:  # the revoke's, first
        revoking.set()
        await flush(tps, timeout)

    a.committer.flush = revoke_flush
    submit, finals = a.committer.submit, []

    def submit_together(final) -> None:  # one transaction: whichever partition moves, it is held
        if len(finals) >= 2:  # the two are out; later ones (a request run again) go as they come
            submit(final)
            return
        finals.append(final)
        if len(finals) == 2:
            for f in finals:
                submit(f)

    a.committer.submit = submit_together
    reqs = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(2)]
    for partition, r in enumerate(reqs):  # one final on each partition
        await _submit_to(kafka_bootstrap, topics.requests, partition, [r])
    assert await asyncio.to_thread(held.wait, 60)
    log = tmp_path / "worker-b.log"
    b = spawn_worker(kafka_bootstrap, topics, log, kafka=group)
    try:
        await wait_log(log, f'"partitions": ["{topics.requests}', b)  # B owns one
        joined.set()
        await wait_until(lambda: not (a.jobs or a.committer.busy()), 60, "worker A to settle")
        b.send_signal(signal.SIGTERM)  # drains: what it runs ends and commits
        assert await asyncio.to_thread(b.wait, 90) == 0
    finally:
        b.kill()
    assert released_by_join == [False], "B owned the partition while its finals were in flight"
    await _one_final_each(kafka_bootstrap, topics.replies, reqs)
