"""Faults inside the transactional delivery path, against the broker, each on a partition the
worker still owns: its transactional id fenced from outside (as the broker itself fences a producer
whose transaction timed out), a commit whose answer is lost, a finished request resubmitted.
Every request ends with exactly one final `done`, read with read_committed. Offline, over a
recording producer: tests/unit/test_transactions.py."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from tests.kafka_fixtures import consume_until, produce_raw
from tests.worker_fixtures import (  # noqa: F401 - topics, start_worker are fixtures
    check_attempts,
    collect,
    final_dones,
    request,
    start_worker,
    topics,
)
from inferline.worker.delivery import transactions
from inferline.worker.delivery.transactions import transactional_id

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


async def test_a_fenced_producer_of_an_owned_partition_takes_its_id_back(
    kafka_bootstrap, topics, start_worker
):
    worker = await start_worker(topics)
    tp = TopicPartition(topics.requests, 0)
    first = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(2)]
    await _submit_to(kafka_bootstrap, topics.requests, 0, first)
    await _one_final_each(kafka_bootstrap, topics.replies, first)

    # Another producer takes the partition's transactional id: the worker's producer is fenced,
    # although the group still assigns the partition to the worker.
    intruder = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        transactional_id=transactional_id(worker.settings.kafka.group_id, tp),
    )
    await intruder.start()
    await intruder.begin_transaction()
    await intruder.abort_transaction()
    await intruder.stop()

    after = [request(topics.replies, f"Name the colour {n}.", max_tokens=2) for n in range(3)]
    await _submit_to(kafka_bootstrap, topics.requests, 0, after)
    await _one_final_each(kafka_bootstrap, topics.replies, after)
    metrics = worker.metrics.render().decode()
    assert 'inferline_transactions_total{outcome="fenced"} 1.0' in metrics
    assert tp not in worker.intake._given_up and not await _dead_letters(
        kafka_bootstrap, topics.dlq
    )


async def test_a_commit_whose_answer_is_lost_is_not_committed_twice(
    kafka_bootstrap, topics, start_worker, monkeypatch
):
    lost = []

    async def lose_the_first_answer():
        if not lost:
            lost.append(True)
            raise asyncio.TimeoutError("the commit's answer never came")

    monkeypatch.setattr(transactions, "after_commit", lose_the_first_answer)
    worker = await start_worker(topics)
    reqs = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(3)]
    await _submit_to(kafka_bootstrap, topics.requests, 0, reqs)
    await _one_final_each(kafka_bootstrap, topics.replies, reqs)
    assert lost
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


async def _dead_letters(bootstrap: str, topic: str) -> list:
    return await consume_until(
        bootstrap, topic, timeout=1, raise_on_timeout=False, predicate=lambda rs: bool(rs)
    )


async def test_a_partition_taken_away_and_handed_back_mid_run_answers_each_request_once(
    kafka_bootstrap, new_topic, start_worker
):
    """Another member joins the group and leaves while the worker streams and commits: the
    partition is revoked (and maybe moved) and handed back to the same worker. Finals of the old
    assignment are never committed in the new one; every request ends with one final `done`."""
    from aiokafka import AIOKafkaConsumer

    from tests.worker_fixtures import Topics

    t = Topics(
        requests=await new_topic(1, prefix="req"),
        cancel=await new_topic(1, prefix="cancel"),
        dlq=await new_topic(1, prefix="dlq"),
        replies=await new_topic(1, prefix="reply", reply=True),
    )
    worker = await start_worker(t)
    reqs = [request(t.replies, f"Count to {n}.", max_tokens=24, ignore_eos=True) for n in range(32)]
    await _submit_to(kafka_bootstrap, t.requests, 0, reqs)
    while not any(j.state == "finishing" for j in worker.jobs.values()):  # finals in flight
        await asyncio.sleep(0.01)
    generation = worker.intake.generation
    member = AIOKafkaConsumer(
        t.requests,
        bootstrap_servers=kafka_bootstrap,
        group_id=worker.settings.kafka.group_id,
        enable_auto_commit=False,
        session_timeout_ms=6000,
    )
    await member.start()
    try:
        for _ in range(30):  # joined once the group rebalanced around it
            await member.getmany(timeout_ms=100, max_records=1)
            if worker.intake.generation > generation:
                break
    finally:
        await member.stop()  # leaves: the partition comes back to the worker
    for _ in range(300):
        if worker.intake.generation >= generation + 2:
            break
        await asyncio.sleep(0.1)
    assert worker.intake.generation >= generation + 2
    events = await _one_final_each(kafka_bootstrap, t.replies, reqs)
    assert any(len({e.attempt for e in evs}) > 1 for evs in events.values()), (
        "nothing was running then"
    )
    assert not await _dead_letters(kafka_bootstrap, t.dlq)


@pytest.mark.parametrize("guard", ["paused", "fetched"])
async def test_a_partition_fetched_while_its_assignment_is_checked_loses_nothing(
    kafka_bootstrap, new_topic, start_worker, guard
):
    """A member leaves; the worker is handed its partition, with requests nobody took, while it
    checks which held partitions it keeps (Intake.kept: a broker round trip, slowed here) and
    aiokafka already fetches the new assignment. Nothing may be taken from the new partition
    before its take-over: a request taken then carried the last assignment's generation, its
    final became `requeued`, and the take-over forgot its offset, so it was never answered.
    `paused`: the listener pauses the new partition first; `fetched`: without that pause the
    records are read, refused (not owned yet) and read again from the log's start."""
    from aiokafka import AIOKafkaConsumer

    from tests.worker_fixtures import Topics

    t = Topics(
        requests=await new_topic(2, prefix="req"),
        cancel=await new_topic(1, prefix="cancel"),
        dlq=await new_topic(1, prefix="dlq"),
        replies=await new_topic(1, prefix="reply", reply=True),
    )
    worker = await start_worker(t)
    generation = worker.intake.generation
    refused = []  # records read and not taken
    decode = worker.intake._decode
    worker.intake._decode = lambda tp, record: decode(tp, record) or refused.append(record.offset)
    if guard == "fetched":
        worker.intake.assigning = lambda assigned: None
    member = AIOKafkaConsumer(
        t.requests,
        bootstrap_servers=kafka_bootstrap,
        group_id=worker.settings.kafka.group_id,
        enable_auto_commit=False,
        session_timeout_ms=6000,
    )
    await member.start()
    try:
        for _ in range(300):  # joined, and the worker has taken over its half
            await member.getmany(timeout_ms=100, max_records=1)
            if (
                member.assignment()
                and worker.intake.generation > generation
                and not worker.intake._taking_over
            ):
                break
        (theirs,) = member.assignment()
        reqs = [request(t.replies, f"Say the number {n}.", max_tokens=2) for n in range(4)]
        await _submit_to(kafka_bootstrap, t.requests, theirs.partition, reqs)
        check = worker.intake.kept

        async def slow_check(assigned):
            await asyncio.sleep(2.0)  # long enough for the fetcher to read the new partition
            return await check(assigned)

        worker.intake.kept = slow_check
    finally:
        await member.stop()  # leaves: its partition, requests unread, goes to the worker
    events = await _one_final_each(kafka_bootstrap, t.replies, reqs)
    assert all(final_dones(events[r["id"]])[0].finish_reason == "length" for r in reqs)
    assert not await _dead_letters(kafka_bootstrap, t.dlq)
    if guard == "paused":
        assert not refused, "records were read from the new partition before its take-over"
    else:
        assert refused, "the fetcher read nothing from the new partition during the check"
