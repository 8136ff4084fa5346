"""Where the worker may write (worker/reply_topics.py): the policy and its cache offline, then a
running worker on the real broker given requests that name forbidden or missing reply topics."""
from __future__ import annotations

import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from config.settings import KafkaSettings
from producer.schema import decode_event
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts, collect, final_done, request, start_worker, submit, topics,
)
from worker.reply_topics import ReplyTopics, refusal

KAFKA = KafkaSettings(request_topic="reqs", cancel_topic="cancels", dlq_topic="inferline.reply.dlq")


@pytest.mark.parametrize("topic, why", [
    ("reqs", "own topics"), ("cancels", "own topics"), ("inferline.reply.dlq", "own topics"),
    ("__consumer_offsets", "internal"), ("__transaction_state", "internal"),
    ("replies", "not under the reply prefix"), ("inferline.replyX", "not under the reply prefix"),
])
def test_forbidden_topics_are_refused_with_the_reason(topic, why):
    assert why in refusal(topic, KAFKA)


def test_topics_under_the_prefix_are_allowed_and_an_empty_prefix_allows_all_but_the_workers_own():
    assert refusal("inferline.reply.client-1", KAFKA) is None
    anything = KAFKA.model_copy(update={"reply_topic_prefix": ""})
    assert refusal("replies", anything) is None and refusal("cancels", anything) and refusal("__x", anything)


class FakeBroker:
    def __init__(self, topics):
        self.topics, self.calls, self.now = set(topics), 0, 0.0

    async def list_topics(self):
        self.calls += 1
        return sorted(self.topics)


async def test_a_topic_is_missing_only_from_a_list_read_after_the_request():
    broker = FakeBroker({"inferline.reply.a", "reqs"})
    rt = ReplyTopics(KAFKA, broker.list_topics, clock=lambda: broker.now)
    assert rt.verdict("inferline.reply.a") is None  # unknown: ask
    await rt.refresh()
    assert rt.verdict("inferline.reply.a") == "ok" and broker.calls == 1
    # b is not in a list read before its request was fetched: ask again, not "missing"
    assert rt.verdict("inferline.reply.b") is None
    broker.topics.add("inferline.reply.b")  # its producer made it before sending the request
    await rt.refresh()
    assert rt.verdict("inferline.reply.b", listed_after=True) == "ok"
    assert "does not exist" in rt.verdict("inferline.reply.c", listed_after=True)
    assert "own topics" in rt.verdict("reqs")  # policy first: never looked up
    broker.now += 301  # known topics are listed again after a while
    assert rt.verdict("inferline.reply.a") is None
    await rt.refresh()
    rt.forget("inferline.reply.a")  # the publisher found it gone
    assert rt.verdict("inferline.reply.a") is None


async def list_topics(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_forbidden_and_missing_reply_topics_are_dead_lettered_and_left_untouched(
        kafka_bootstrap, topics, start_worker, new_topic):
    outside = await new_topic(1, prefix="outside")  # exists, but not under the reply prefix
    missing = f"inferline.reply.missing-{uuid.uuid4().hex[:8]}"
    await start_worker(topics)
    bad = {topic: request(topic, max_tokens=2) for topic in
           (topics.cancel, topics.requests, topics.dlq, "__consumer_offsets", outside, missing)}
    invalid = request(topics.cancel, max_tokens=-1)  # a rejection would go to the reply topic too
    good = request(topics.replies, max_tokens=2)
    await submit(kafka_bootstrap, topics.requests, [*bad.values(), invalid, good])

    events = await collect(kafka_bootstrap, topics.replies, [good["id"]], timeout=120)
    check_attempts(events[good["id"]])
    assert final_done(events[good["id"]]).finish_reason == "length"
    dead = await consume_until(kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= len(bad) + 1, timeout=60)
    reasons = {r.key.decode(): dict(r.headers)["error"].decode() for r in dead}
    for topic, req in bad.items():
        assert req["id"] in reasons, f"a request replying to {topic} was not dead-lettered"
        assert ("does not exist" if topic == missing else "reply_topic") in reasons[req["id"]], reasons[req["id"]]
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
