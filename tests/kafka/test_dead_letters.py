"""A record of any size the request topic accepts ends visibly (docs/reliability.md): a hostile
record just under the request topic's default limit is dead-lettered, cut to the dead-letter
topic's real limit with headers saying so, and its partition's committed offset reaches the end.
Offline: tests/unit/test_dead_letters.py."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from inferline.worker.delivery.dead_letters import BROKER_DEFAULT_MAX_MESSAGE_BYTES
from tests.kafka_fixtures import consume_until, produce_raw
from tests.worker_fixtures import (  # noqa: F401 - topics, start_worker are fixtures
    collect,
    final_dones,
    request,
    start_worker,
    topics,
)

pytestmark = pytest.mark.kafka
# Just fits the request topic's default limit; with a dead letter's headers, not the DLQ's.
HOSTILE_BYTES = 1_048_500


async def _committed(bootstrap: str, group: str, tp: TopicPartition) -> int | None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group, partitions=[tp])
    finally:
        await admin.close()
    meta = offsets.get(tp)
    return None if meta is None or meta.offset < 0 else meta.offset


async def _wait_committed(bootstrap: str, group: str, tp: TopicPartition, end: int) -> int:
    deadline, seen = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        seen = await _committed(bootstrap, group, tp)
        if seen == end:
            break
        await asyncio.sleep(1.0)
    return seen


async def test_a_hostile_record_under_the_request_limit_is_dead_lettered_and_its_offset_commits(
    kafka_bootstrap, topics, start_worker
):
    worker = await start_worker(topics)
    tp = TopicPartition(topics.requests, 0)
    hostile = b"\xc1" * HOSTILE_BYTES  # not msgpack
    honest = [request(topics.replies, f"Say the number {n}.", max_tokens=2) for n in range(5)]
    # A producer allowed to send what the broker takes (aiokafka's own cap is lower).
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=2 << 20)
    await producer.start()
    try:
        await producer.send_and_wait(topics.requests, hostile, key=b"h", partition=0)
    finally:
        await producer.stop()
    await produce_raw(
        kafka_bootstrap,
        topics.requests,
        [(r["id"].encode(), msgpack.packb(r)) for r in honest],
        partition=0,
    )
    events = await collect(kafka_bootstrap, topics.replies, [r["id"] for r in honest], timeout=90)
    assert all(len(final_dones(events[r["id"]])) == 1 for r in honest)
    (letter,) = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= 1, timeout=90
    )
    headers = dict(letter.headers)
    assert headers["truncated"] == b"value"
    assert headers["original-size"] == str(HOSTILE_BYTES).encode()
    assert hostile.startswith(letter.value) and len(letter.value) < HOSTILE_BYTES
    assert worker.delivery.dlq_limit.topic_limit == BROKER_DEFAULT_MAX_MESSAGE_BYTES
    group = worker.settings.kafka.group_id
    assert await _wait_committed(kafka_bootstrap, group, tp, 1 + len(honest)) == 1 + len(honest)


async def test_a_resubmission_whose_reply_topic_was_deleted_is_dead_lettered_and_commits(
    kafka_bootstrap, topics, start_worker
):
    worker = await start_worker(topics)
    tp = TopicPartition(topics.requests, 0)
    req = request(topics.replies, "Say hello.", max_tokens=2)
    record = (req["id"].encode(), msgpack.packb(req))
    await produce_raw(kafka_bootstrap, topics.requests, [record], partition=0)
    events = await collect(kafka_bootstrap, topics.replies, [req["id"]], timeout=60)
    assert len(final_dones(events[req["id"]])) == 1
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topics.replies])
    finally:
        await admin.close()
    await produce_raw(kafka_bootstrap, topics.requests, [record], partition=0)  # sent again
    (letter,) = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= 1, timeout=90
    )
    assert letter.value == record[1] and dict(letter.headers)["source-offset"] == b"1"
    assert worker.delivery.num_resubmitted == 1
    group = worker.settings.kafka.group_id
    assert await _wait_committed(kafka_bootstrap, group, tp, 2) == 2
