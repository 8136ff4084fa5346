"""Where the worker may write, on the real broker: a running worker given requests that name
forbidden or missing reply topics dead-letters them and creates nothing. The policy and its
cache offline: tests/unit/test_reply_topics.py."""

from __future__ import annotations

import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from inferline.contract.schema import decode_event
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
)


async def list_topics(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_forbidden_and_missing_reply_topics_are_dead_lettered_and_left_untouched(
    kafka_bootstrap, topics, start_worker, new_topic
):
    outside = await new_topic(1, prefix="outside")  # exists, but not under the reply prefix
    missing = f"inferline.reply.missing-{uuid.uuid4().hex[:8]}"
    await start_worker(topics)
    bad = {
        topic: request(topic, max_tokens=2)
        for topic in (
            topics.cancel,
            topics.requests,
            topics.dlq,
            "__consumer_offsets",
            outside,
            missing,
        )
    }
    invalid = request(topics.cancel, max_tokens=-1)  # a rejection would go to the reply topic too
    good = request(topics.replies, max_tokens=2)
    await submit(kafka_bootstrap, topics.requests, [*bad.values(), invalid, good])

    events = await collect(kafka_bootstrap, topics.replies, [good["id"]], timeout=120)
    check_attempts(events[good["id"]])
    assert final_done(events[good["id"]]).finish_reason == "length"
    dead = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= len(bad) + 1, timeout=60
    )
    reasons = {r.key.decode(): dict(r.headers)["error"].decode() for r in dead}
    for topic, req in bad.items():
        assert req["id"] in reasons, f"a request replying to {topic} was not dead-lettered"
        assert ("does not exist" if topic == missing else "reply_topic") in reasons[req["id"]], (
            reasons[req["id"]]
        )
    assert "own topics" in reasons[invalid["id"]]
    # Nothing was written where it was refused: the cancel topic stays empty, the request topic
    # holds only what was submitted, and the missing topic was not created.
    cancels = await consume_until(kafka_bootstrap, topics.cancel, timeout=5)
    assert cancels == []
    on_requests = await consume_until(kafka_bootstrap, topics.requests, timeout=10)
    assert len(on_requests) == len(bad) + 2
    for record in on_requests:
        with pytest.raises(Exception):
            decode_event(record.value)  # requests, never events
    assert missing not in await list_topics(kafka_bootstrap)
