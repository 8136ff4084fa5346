"""A passing fault of the broker dead-letters no honest request (worker/intake/triage.py,
Triage._verify_reply_topics; worker/intake/reply_topics.py): a reply topic the broker lists as
missing is refused, but one it cannot be asked about keeps its request waiting, asked again with
backoff for up to final_retry_s, and a topic known good keeps its last verdict while a re-check
fails. Offline through the intake harness with a stand-in topic list: a real broker cannot be made
to fail a listing on demand while staying up for the rest of the test."""

from __future__ import annotations

import asyncio

import pytest

from inferline.worker.intake import triage
from inferline.worker.intake.reply_topics import ReplyTopics
from tests.unit.test_delivery import DLQ, REPLY, body, harness


class Broker:
    """A topic list and config reads that fail while `failing` counts down (or for ever)."""

    def __init__(self, topics=(REPLY,)) -> None:
        self.topics, self.now = set(topics), 0.0
        self.list_failures, self.check_failures = 0, 0

    async def list_topics(self):
        if self.list_failures:
            self.list_failures -= 1
            raise TimeoutError("no answer")
        return sorted(self.topics)

    async def check_topics(self, topics):
        if self.check_failures:
            self.check_failures -= 1
            raise TimeoutError("no answer")
        return {t: None for t in topics}


def with_broker(broker: Broker, **kafka):
    h = harness()
    if kafka:
        h.worker.settings.kafka.__dict__.update(kafka)
    intake = h.worker.intake
    intake.reply_topics = ReplyTopics(
        h.worker.settings.kafka,
        broker.list_topics,
        clock=lambda: broker.now,
        check_topics=broker.check_topics,
    )
    return h


async def feed(h, value: bytes) -> None:
    """One record through the intake as the fetch loop hands it over; its lookup awaited."""
    record = triage.Record(h.tp.topic, 0, h.offset, b"k", value, [])
    h.offset += 1
    unverified = []
    h.worker.intake._handle(h.tp, record, unverified)
    if unverified:
        await asyncio.wait_for(h.worker.intake._verify_reply_topics(unverified), 30)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(triage, "LOOKUP_BACKOFF_S", 0.01, raising=False)


async def test_a_request_waits_out_a_topic_list_failing_for_a_while():
    broker = Broker()
    broker.list_failures = 6  # more than the old three tries
    h = with_broker(broker)
    await feed(h, body())
    assert not [o for o in h.sent if o.topic == DLQ]
    assert len(h.worker.engine_loop.added) == 1


async def test_a_known_good_topic_keeps_its_verdict_while_its_recheck_fails():
    broker = Broker()
    h = with_broker(broker)
    await feed(h, body())
    assert len(h.worker.engine_loop.added) == 1
    broker.now += 61  # its config check expired: read again, and the broker does not answer
    broker.check_failures = 100
    await feed(h, body())
    assert not [o for o in h.sent if o.topic == DLQ]
    assert len(h.worker.engine_loop.added) == 2


async def test_a_topic_the_broker_lists_as_missing_is_refused_at_once():
    broker = Broker(topics=())
    h = with_broker(broker)
    await feed(h, body())
    (letter,) = [o for o in h.sent if o.topic == DLQ]
    assert b"does not exist" in dict(letter.headers)["error"]


async def test_a_broker_away_past_final_retry_s_dead_letters_the_request():
    broker = Broker()
    broker.list_failures = 10**9
    h = with_broker(broker, final_retry_s=1.0)
    await feed(h, body())
    (letter,) = [o for o in h.sent if o.topic == DLQ]
    assert b"could not be looked up" in dict(letter.headers)["error"]


class _Described:
    def __init__(self, topic: str, error_code: int) -> None:
        self.resource = {"resource_name": topic, "error_code": error_code, "config_entries": []}

    def to_object(self):
        return {"resources": [self.resource]}


@pytest.mark.parametrize("error_code, refused", [(7, False), (3, True)])
async def test_a_config_read_that_timed_out_for_one_topic_is_no_refusal(error_code, refused):
    # REQUEST_TIMED_OUT (7) is a passing fault: asked again; UNKNOWN_TOPIC_OR_PARTITION (3) is
    # the broker's word.
    broker, h = Broker(), harness()
    intake = h.worker.intake
    answers = iter([error_code, 0])

    class Admin:
        async def describe_configs(self, resources):
            return [_Described(r.name, next(answers)) for r in resources]

    async def admin_client():
        return Admin()

    intake._admin_client = admin_client
    intake._replicas = {REPLY: 1}
    intake.reply_topics = ReplyTopics(
        h.worker.settings.kafka,
        broker.list_topics,
        clock=lambda: broker.now,
        check_topics=intake._check_topics,
    )
    await feed(h, body())
    letters = [o for o in h.sent if o.topic == DLQ]
    assert (len(letters), len(h.worker.engine_loop.added)) == ((1, 0) if refused else (0, 1))
