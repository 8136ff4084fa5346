"""Where the worker may write (worker/intake/reply_topics.py): the policy and its cache, offline. On the
real broker: tests/kafka/test_reply_topics.py."""
from __future__ import annotations


import pytest

from config.settings import KafkaSettings
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts, collect, final_done, request, start_worker, submit, topics,
)
from worker.intake.reply_topics import ReplyTopics, refusal

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


