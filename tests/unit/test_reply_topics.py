"""Where the worker may write (worker/intake/reply_topics.py): the policy and its cache, offline. On the
real broker: tests/kafka/test_reply_topics.py."""
from __future__ import annotations


import pytest

from config.settings import KafkaSettings
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts, collect, final_done, request, start_worker, submit, topics,
)
from worker.intake.reply_topics import ReplyTopics, refusal, unsafe_limits

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




@pytest.mark.parametrize("configs, replicas, why", [
    ({"max.message.bytes": "1"}, 1, "max.message.bytes=1 is below"),
    ({"max.message.bytes": "65535"}, 1, "is below the 65536"),
    ({"min.insync.replicas": "2"}, 1, "min.insync.replicas=2 exceeds its 1 replicas"),
])
def test_limits_that_would_wedge_a_transaction_are_named(configs, replicas, why):
    assert why in unsafe_limits(configs, replicas, 65_536)


def test_limits_a_transaction_can_live_with():
    assert unsafe_limits({"max.message.bytes": "1048588", "min.insync.replicas": "1"}, 1, 65_536) is None
    assert unsafe_limits({"max.message.bytes": "65536", "min.insync.replicas": "2"}, 3, 65_536) is None


async def test_an_existing_topic_is_refused_when_its_limits_would_wedge_transactions():
    broker = FakeBroker({"inferline.reply.ok", "inferline.reply.tiny"})
    checked = []

    async def check(topics):
        checked.append(list(topics))
        return {t: ("max.message.bytes=1 is below" if t.endswith("tiny") else None) for t in topics}
    rt = ReplyTopics(KAFKA, broker.list_topics, clock=lambda: broker.now, check_topics=check)
    assert rt.verdict("inferline.reply.tiny") is None
    await rt.refresh({"inferline.reply.ok", "inferline.reply.tiny"})
    assert rt.verdict("inferline.reply.ok") == "ok"
    assert "would wedge transactions: max.message.bytes=1" in rt.verdict("inferline.reply.tiny")
    await rt.refresh({"inferline.reply.ok"})  # checked lately: not asked again
    assert checked == [["inferline.reply.ok", "inferline.reply.tiny"]]
    broker.now += 61  # a producer may alter a topic's limits: they are read again
    assert rt.verdict("inferline.reply.ok") is None
