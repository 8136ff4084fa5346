"""A reply topic the broker refuses: the requests are dead-lettered (a permanent refusal, at once);
the topic is failing and its backlog does not pause intake for the others; nothing wedges."""

import asyncio

import msgpack
import pytest
from aiokafka import TopicPartition

from tests.kafka_fixtures import committed_offsets, consume_until, produce_raw
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
)

pytestmark = pytest.mark.kafka


async def test_refused_replies_do_not_pause_intake_for_other_topics(
    kafka_bootstrap, topics, start_worker, new_topic, monkeypatch
):
    # Every batch of events is larger; a transaction marker is not (below ~80 bytes a topic would
    # refuse the markers too, and the broker could never finish a transaction that touched it).
    refused = await new_topic(1, prefix="refused", config={"max.message.bytes": "100"}, reply=True)
    worker = await start_worker(
        topics, kafka={"max_pending_replies": 10, "min_reply_message_bytes": 100}
    )
    seen = []  # (backlog, full, refused topic failing) while the refused topic's dones are retried

    async def watch():
        while True:
            seen.append(
                (
                    worker.publisher.backlog,
                    worker.publisher.full(),
                    worker.publisher.failing(refused),
                )
            )
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    bad = [request(refused, max_tokens=1) for _ in range(24)]
    await submit(kafka_bootstrap, topics.requests, bad)
    good = request(topics.replies, max_tokens=2)
    await submit(kafka_bootstrap, topics.requests, [good])
    events = await collect(kafka_bootstrap, topics.replies, [good["id"]], timeout=120)
    watcher.cancel()
    check_attempts(events[good["id"]])
    assert final_done(events[good["id"]]).finish_reason == "length"
    assert max(b for b, _, failing in seen if failing) >= 10  # over max_pending_replies, ...
    # ... all of it the failing topic's: once its first send failed, intake is never held back
    assert not any(full for _, full, failing in seen if failing)
    # Refused for good, dead-lettered with the reason, then committed: one unreachable topic does
    # not wedge a partition, and no request ends unseen.
    dead = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= len(bad), timeout=120
    )
    assert {r.key.decode() for r in dead} == {r["id"] for r in bad}
    assert all(
        dict(r.headers)["error"].startswith(b"the reply could not be delivered") for r in dead
    )
    assert all(b"MSG_SIZE_TOO_LARGE" in dict(r.headers)["error"] for r in dead)
    for _ in range(100):
        if not any(map(worker.tracker.pending, worker.tracker.partitions())) and not worker.jobs:
            break
        await asyncio.sleep(0.1)
    assert not worker.jobs and worker.publisher.backlog == 0
    assert worker.metrics.send_failures._value.get() >= 24
    assert all(worker.tracker.pending(tp) == 0 for tp in worker.tracker.partitions())
    assert not await consume_until(
        kafka_bootstrap, refused, timeout=0.5, raise_on_timeout=False, predicate=lambda rs: bool(rs)
    )


def _lag(worker) -> float:
    return sum(s.value for m in worker.metrics.consumer_lag.collect() for s in m.samples)


async def test_consumer_lag_keeps_counting_while_intake_is_paused(
    kafka_bootstrap, topics, start_worker, monkeypatch
):
    """A paused partition is not fetched, so fetch responses no longer bring its high watermark:
    the lag gauge must still grow with the records that pile up (the operator's signal to scale)."""
    import inferline.worker.intake.group as group

    monkeypatch.setattr(group, "LAG_EVERY_S", 0.3)
    # drain_timeout_s 0: the 400-token requests still running at the end are handed back at once
    worker = await start_worker(
        topics,
        scheduler={"max_num_seqs": 1, "max_waiting": 1},
        lanes={"max_records": 0},  # no lanes: a full pool pauses the intake
        worker={"drain_timeout_s": 0},
    )
    first = [request(topics.replies, max_tokens=400, ignore_eos=True) for _ in range(4)]
    await submit(kafka_bootstrap, topics.requests, first)
    while not worker.metrics.intake_paused._value.get():
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    before = _lag(worker)
    await submit(
        kafka_bootstrap, topics.requests, [request(topics.replies, max_tokens=1) for _ in range(30)]
    )
    for _ in range(100):
        if _lag(worker) >= before + 30 - 2:  # the 1-2 taken meanwhile are not lag
            break
        await asyncio.sleep(0.1)
    assert worker.metrics.intake_paused._value.get(), "the test needs intake paused throughout"
    assert _lag(worker) >= before + 28, (before, _lag(worker))


def _gauge(gauge, **labels) -> float:
    return gauge.labels(**labels)._value.get()


async def test_the_backlog_counts_one_unfinished_request_where_kafkas_lag_counts_a_hundred(
    kafka_bootstrap, topics, start_worker, monkeypatch
):
    """The autoscaler's signal (docs/operations.md): one request unfinished below 100 finished
    ones is a backlog of 1, while Kafka's lag (end minus the committed watermark) is 101. The
    request is held unfinished by holding its final, so that the machine's speed decides nothing."""

    import inferline.worker.intake.group as group

    monkeypatch.setattr(group, "LAG_EVERY_S", 0.3)
    worker = await start_worker(topics)
    slow, *short = [request(topics.replies, max_tokens=2) for _ in range(101)]
    held, submit_final = [], worker.committer.submit

    def hold_slow(final) -> None:
        if final.records and final.records[0][2] == slow["id"].encode():
            held.append(final)
        else:
            submit_final(final)

    worker.committer.submit = hold_slow
    await produce_raw(kafka_bootstrap, topics.requests, [_record(slow)], partition=0)
    await produce_raw(kafka_bootstrap, topics.requests, [_record(r) for r in short], partition=0)
    await collect(kafka_bootstrap, topics.replies, [r["id"] for r in short], timeout=120)
    where = {"topic": topics.requests, "partition": "0"}
    for _ in range(100):  # the next report after the last commit
        if _gauge(worker.metrics.partition_backlog, **where) == 1:
            break
        await asyncio.sleep(0.1)
    assert _gauge(worker.metrics.partition_backlog, **where) == 1
    assert _gauge(worker.metrics.consumer_lag, **where) == 101
    offsets = await committed_offsets(kafka_bootstrap, worker.settings.kafka.group_id)
    assert offsets[TopicPartition(topics.requests, 0)].offset == 0  # Kafka's lag: 101 - 0
    submit_final(held.pop())
    events = await collect(kafka_bootstrap, topics.replies, [slow["id"]], timeout=60)
    assert final_done(events[slow["id"]]).finish_reason == "length"


def _record(req: dict) -> tuple[bytes, bytes]:
    return req["id"].encode(), msgpack.packb(req)
