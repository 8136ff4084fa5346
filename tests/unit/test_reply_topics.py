"""Where the worker may write (worker/intake/reply_topics.py): the policy and its cache, offline.
On the real broker: tests/kafka/test_reply_topics.py."""

from __future__ import annotations


import pytest

from inferline.config.settings import KafkaSettings
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
)
from inferline.worker.intake.reply_topics import ReplyTopics, refusal, unsafe_limits

KAFKA = KafkaSettings(request_topic="reqs", cancel_topic="cancels", dlq_topic="inferline.reply.dlq")


@pytest.mark.parametrize(
    "topic, why",
    [
        ("reqs", "own topics"),
        ("cancels", "own topics"),
        ("inferline.reply.dlq", "own topics"),
        ("__consumer_offsets", "internal"),
        ("__transaction_state", "internal"),
        ("replies", "not under the reply prefix"),
        ("inferline.replyX", "not under the reply prefix"),
    ],
)
def test_forbidden_topics_are_refused_with_the_reason(topic, why):
    assert why in refusal(topic, KAFKA)


def test_topics_under_the_prefix_are_allowed_and_an_empty_prefix_allows_all_but_the_workers_own():
    assert refusal("inferline.reply.client-1", KAFKA) is None
    anything = KAFKA.model_copy(update={"reply_topic_prefix": ""})
    assert (
        refusal("replies", anything) is None
        and refusal("cancels", anything)
        and refusal("__x", anything)
    )


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


@pytest.mark.parametrize(
    "configs, replicas, why",
    [
        ({"max.message.bytes": "1"}, 1, "max.message.bytes=1 is below"),
        ({"max.message.bytes": "65535"}, 1, "is below the 65536"),
        ({"min.insync.replicas": "2"}, 1, "min.insync.replicas=2 exceeds its 1 replicas"),
    ],
)
def test_limits_that_would_wedge_a_transaction_are_named(configs, replicas, why):
    assert why in unsafe_limits(configs, replicas, 65_536)


def test_limits_a_transaction_can_live_with():
    assert (
        unsafe_limits({"max.message.bytes": "1048588", "min.insync.replicas": "1"}, 1, 65_536)
        is None
    )
    assert (
        unsafe_limits({"max.message.bytes": "65536", "min.insync.replicas": "2"}, 3, 65_536) is None
    )


async def test_an_existing_topic_is_refused_when_its_limits_would_wedge_transactions():
    broker = FakeBroker({"inferline.reply.ok", "inferline.reply.tiny"})
    checked = []

    async def check(topics):
        checked.append(list(topics))
        return {t: ("max.message.bytes=1 is below" if t.endswith("tiny") else None) for t in topics}

    rt = ReplyTopics(KAFKA, broker.list_topics, clock=lambda: broker.now, check_topics=check)
    assert rt.verdict("inferline.reply.tiny") is None
    await rt.refresh()
    await rt.check({"inferline.reply.ok", "inferline.reply.tiny"})
    assert rt.verdict("inferline.reply.ok") == "ok"
    assert "would wedge transactions: max.message.bytes=1" in rt.verdict("inferline.reply.tiny")
    await rt.check({"inferline.reply.ok"})  # checked lately: not asked again
    assert checked == [["inferline.reply.ok", "inferline.reply.tiny"]]
    broker.now += 61  # a producer may alter a topic's limits: they are read again
    assert rt.verdict("inferline.reply.ok") is None


class SlowBroker(FakeBroker):
    """A broker whose topic list takes until `gate` opens (a cluster with very many topics)."""

    def __init__(self, topics):
        super().__init__(topics)
        import asyncio

        self.gate = asyncio.Event()
        self.gate.set()

    async def list_topics(self):
        await self.gate.wait()
        return await super().list_topics()


async def test_lookups_are_coalesced_and_a_missing_topic_is_remembered_for_its_ttl():
    """Issue 38: any number of unknown reply topics cost one list in flight at a time, and a
    topic found missing is refused without another lookup for missing_reply_topic_ttl_s."""
    import asyncio

    broker = SlowBroker({"inferline.reply.a"})
    rt = ReplyTopics(
        KAFKA.model_copy(update={"missing_reply_topic_ttl_s": 10.0}),
        broker.list_topics,
        clock=lambda: broker.now,
    )
    broker.gate.clear()
    waiters = [asyncio.create_task(rt.refresh_after(broker.now)) for _ in range(1000)]
    await asyncio.sleep(0)
    broker.gate.set()
    await asyncio.gather(*waiters)
    assert broker.calls == 1
    missing = [f"inferline.reply.x{i}" for i in range(1000)]
    assert all("does not exist" in rt.verdict(t, listed_after=True) for t in missing)
    broker.now += 5
    assert (
        all("does not exist" in rt.verdict(t) for t in missing) and broker.calls == 1
    )  # no lookup
    broker.now += 6  # past the TTL: asked again
    assert rt.verdict(missing[0]) is None
    broker.topics.add(missing[1])  # made since: the next list clears it at once
    broker.now -= 6
    await rt.refresh_after(broker.now)
    assert rt.verdict(missing[1]) == "ok" and "does not exist" in rt.verdict(missing[2])


async def test_reply_topic_lookups_run_off_the_fetch_loop():
    """While the broker's topic list is slow to come, requests naming known reply topics are
    still read and admitted (before issue 38 the fetch loop awaited every lookup)."""
    import asyncio
    import time

    import msgpack

    from inferline.config.settings import Settings
    from inferline.worker.intake.triage import Record
    from tests.chaos_fixtures import IntakeHarness

    h = IntakeHarness(Settings())
    broker = SlowBroker({"inferline.reply.honest"})
    intake = h.worker.intake
    intake.reply_topics = ReplyTopics(h.worker.settings.kafka, broker.list_topics)
    await intake.reply_topics.refresh()

    def record(offset: int, reply_topic: str) -> Record:
        value = msgpack.packb(
            {
                "v": 1,
                "id": f"r{offset}",
                "reply_topic": reply_topic,
                "prompt": "Hi.",
                "max_tokens": 2,
            }
        )
        return Record(h.tp.topic, 0, offset, b"k", value, [], sent_at=time.time())

    broker.gate.clear()
    # As the poll thread hands batches over: the first one's lookup must not hold up the second.
    await intake._take([record(0, "inferline.reply.missing")])
    await intake._take([record(1, "inferline.reply.honest")])
    assert [r.request_id for r in h.worker.engine_loop.added]  # honest admitted, lookup pending
    assert intake._verifying and intake._num_verifying == 1
    broker.gate.set()
    for _ in range(2000):
        await asyncio.sleep(0.001)
        if not intake._verifying:
            break
    dead = [o for o in h.sent if o.topic == h.worker.settings.kafka.dlq_topic]
    assert len(dead) == 1 and b"does not exist" in dict(dead[0].headers)["error"]
