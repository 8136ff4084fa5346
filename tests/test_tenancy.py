"""Topic tenancy (worker/tenancy.py, INFERLINE_KAFKA__TENANCY=topic): the tenant is the request
topic's, never the body's. Offline through the intake harness, then a running worker on the real
broker with two tenants. The ACLs that keep each tenant to its own topics: tests/test_acl_tenancy.py."""
from __future__ import annotations

import uuid

import msgpack
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from config.settings import KafkaSettings, Settings
from tests.chaos_fixtures import FakeConsumer, IntakeHarness
from tests.kafka_fixtures import consume_until, create_named_topics, produce_raw
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts, collect, final_done, request, start_worker, submit, topics,
)
from worker.reply_topics import refusal
from worker.tenancy import clamp_priority, tenant_of, tenant_pattern

TOPIC_MODE = KafkaSettings(request_topic="reqs", cancel_topic="cancels", dlq_topic="reqs.dlq", tenancy="topic")


def test_tenant_topics_and_the_pattern():
    import re

    pattern = re.compile(tenant_pattern("reqs", ("reqs.dlq", "cancels")))
    assert pattern.match("reqs.acme") and pattern.match("reqs.a-b_9")
    assert not pattern.match("reqs.dlq") and not pattern.match("reqs") and not pattern.match("reqs.a.b")
    assert not pattern.match("reqsX.acme") and not pattern.match("xreqs.acme")
    assert tenant_of("reqs.acme", "reqs") == "acme" and tenant_of("reqs.a.b", "reqs") is None
    assert tenant_of("other.acme", "reqs") is None


def test_replies_only_under_the_tenants_own_prefix():
    assert refusal("inferline.reply.acme.c1", TOPIC_MODE, "acme") is None
    assert "inferline.reply.acme." in refusal("inferline.reply.globex.c1", TOPIC_MODE, "acme")
    assert "inferline.reply.acme." in refusal("inferline.reply.acmeX.c1", TOPIC_MODE, "acme")
    assert "own topics" in refusal("reqs.globex", TOPIC_MODE, "acme")
    assert "own topics" in refusal("cancels.acme", TOPIC_MODE, "acme")


def test_priority_clamp():
    limit = Settings(limits={"tenants": {"t": {"min_priority": 0, "max_priority": 5}}}).limits.tenants["t"]
    assert [clamp_priority(p, limit) for p in (-1000, 0, 3, 5, 1000)] == [0, 0, 3, 5, 5]
    assert clamp_priority(-7, Settings().limits.default_tenant) == -7


def harness(**limits) -> tuple[IntakeHarness, TopicPartition]:
    settings = Settings(kafka={"request_topic": "reqs", "cancel_topic": "cancels", "dlq_topic": "reqs.dlq",
                               "tenancy": "topic"}, limits=limits)
    h = IntakeHarness(settings)
    h.tp = TopicPartition("reqs.globex", 0)
    h.worker.intake._consumer = FakeConsumer([h.tp])
    return h, h.tp


def body(**fields) -> bytes:
    return msgpack.packb({"v": 1, "id": f"r-{uuid.uuid4().hex[:8]}", "reply_topic": "inferline.reply.globex.c",
                          "prompt": "Hi.", "max_tokens": 2, **fields})


def test_the_topic_names_the_tenant_and_a_body_that_disagrees_is_rejected():
    h, _ = harness(tenants={"globex": {"min_priority": 0}})
    _, (admitted,) = h.feed(body())
    assert h.worker.jobs[admitted.request_id].request.tenant == "globex"
    _, (admitted,) = h.feed(body(tenant="globex", priority=-1000))
    assert admitted.priority == 0  # clamped into globex's range
    _, (admitted,) = h.feed(body(tenant="default"))  # what clients send unasked: no claim
    assert h.worker.jobs[admitted.request_id].request.tenant == "globex"
    (reply,), added = h.feed(body(tenant="acme"))
    assert not added and reply.topic == "inferline.reply.globex.c"
    assert msgpack.unpackb(reply.value)["error"]["message"].startswith("tenant:")
    (dead,), added = h.feed(body(reply_topic="inferline.reply.acme.c"))  # another tenant's replies
    assert not added and dead.topic == "reqs.dlq" and b"inferline.reply.globex." in dict(dead.headers)["error"]


def test_a_cancel_counts_only_for_its_own_tenant():
    h, _ = harness()
    _, (admitted,) = h.feed(body(id="shared-id"))
    h.worker.cancel("shared-id", tenant="acme")  # another tenant's cancel topic
    assert h.worker.engine_loop.aborted == []
    h.worker.cancel("shared-id", tenant="globex")
    assert h.worker.engine_loop.aborted == [(admitted.request_id, "cancelled")]
    h.worker.cancel("early", tenant="acme")  # read before its request: remembered per tenant
    sent, added = h.feed(body(id="early"))
    assert added and not sent  # globex's "early" runs
    h.worker.cancel("early2", tenant="globex")
    (reply,), added = h.feed(body(id="early2"))
    assert not added and msgpack.unpackb(reply.value)["finish_reason"] == "cancelled"


@pytest.mark.kafka
async def test_two_tenants_on_a_running_worker(kafka_bootstrap, topics, start_worker):
    """acme and globex each write their own request topic: globex cannot pose as acme, answer
    into acme's replies, cancel acme's request or escape its rate limit by renaming itself."""
    base, cancel = topics.requests, topics.cancel
    names = [f"{base}.acme", f"{base}.globex", f"{cancel}.acme", f"{cancel}.globex",
             "inferline.reply.acme.t-" + uuid.uuid4().hex[:6], "inferline.reply.globex.t-" + uuid.uuid4().hex[:6]]
    await create_named_topics({n: 1 for n in names}, bootstrap_servers=kafka_bootstrap)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        acme_replies, globex_replies = names[4], names[5]
        worker = await start_worker(topics, kafka={"tenancy": "topic"},
                                    limits={"tenants": {"globex": {"requests_per_s": 0.01, "burst_requests": 1}}})
        long = request(acme_replies, max_tokens=40, ignore_eos=True)
        await submit(kafka_bootstrap, names[0], [long])
        posing = request(globex_replies, max_tokens=2, tenant="acme")
        into_acme = request(acme_replies, max_tokens=2)
        first, second = request(globex_replies, max_tokens=2), request(globex_replies, max_tokens=2)
        await submit(kafka_bootstrap, names[1], [posing, into_acme, first, second])
        # globex cancels acme's request on its own cancel topic
        await produce_raw(kafka_bootstrap, names[3], [msgpack.packb({"v": 1, "id": long["id"]})],
                          key=long["id"].encode())
        ids = [posing["id"], first["id"], second["id"]]
        replies = await collect(kafka_bootstrap, globex_replies, ids, timeout=120)
        acme = await collect(kafka_bootstrap, acme_replies, [long["id"]], timeout=180)
        on_acme = await consume_until(kafka_bootstrap, acme_replies, timeout=10)
    finally:
        await admin.delete_topics(names)
        await admin.close()
    assert final_done(replies[posing["id"]]).error.message.startswith("tenant:")
    outcomes = sorted(final_done(replies[i]).finish_reason for i in (first["id"], second["id"]))
    assert outcomes == ["length", "rejected"]  # one bucket for globex, whatever the body says
    check_attempts(acme[long["id"]])
    done = final_done(acme[long["id"]])
    assert done.finish_reason == "length" and done.usage.completion_tokens == 40  # globex's cancel ignored
    assert worker.metrics.cancels._value.get() >= 1  # ... though it was read
    assert {r.key for r in on_acme} == {long["id"].encode()}  # nothing of globex's in acme's replies
    dead = await consume_until(kafka_bootstrap, topics.dlq, lambda rs: any(r.key == into_acme["id"].encode()
                                                                           for r in rs), timeout=30)
    assert any(r.key == into_acme["id"].encode() for r in dead)
