"""Topic tenancy on the real broker: a running worker with two tenants, each answered only under
its own prefix. Offline rules: tests/unit/test_tenancy.py; the ACLs that keep each tenant to its
own topics: tests/kafka/test_acl_tenancy.py."""

from __future__ import annotations

import uuid

import msgpack
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from tests.kafka_fixtures import consume_until, create_named_topics, produce_raw
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
)


@pytest.mark.kafka
async def test_two_tenants_on_a_running_worker(kafka_bootstrap, topics, start_worker):
    """acme and globex each write their own request topic: globex cannot pose as acme, answer
    into acme's replies, cancel acme's request or escape its rate limit by renaming itself."""
    base, cancel = topics.requests, topics.cancel
    names = [
        f"{base}.acme",
        f"{base}.globex",
        f"{cancel}.acme",
        f"{cancel}.globex",
        "inferline.reply.acme.t-" + uuid.uuid4().hex[:6],
        "inferline.reply.globex.t-" + uuid.uuid4().hex[:6],
    ]
    await create_named_topics({n: 1 for n in names}, bootstrap_servers=kafka_bootstrap)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        acme_replies, globex_replies = names[4], names[5]
        worker = await start_worker(
            topics,
            kafka={"tenancy": "topic"},
            limits={"tenants": {"globex": {"requests_per_s": 0.01, "burst_requests": 1}}},
        )
        long = request(acme_replies, max_tokens=40, ignore_eos=True)
        await submit(kafka_bootstrap, names[0], [long])
        posing = request(globex_replies, max_tokens=2, tenant="acme")
        into_acme = request(acme_replies, max_tokens=2)
        first, second = request(globex_replies, max_tokens=2), request(globex_replies, max_tokens=2)
        await submit(kafka_bootstrap, names[1], [posing, into_acme, first, second])
        # globex cancels acme's request on its own cancel topic
        await produce_raw(
            kafka_bootstrap,
            names[3],
            [msgpack.packb({"v": 1, "id": long["id"]})],
            key=long["id"].encode(),
        )
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
    assert (
        done.finish_reason == "length" and done.usage.completion_tokens == 40
    )  # globex's cancel ignored
    assert worker.metrics.cancels._value.get() >= 1  # ... though it was read
    assert {r.key for r in on_acme} == {
        long["id"].encode()
    }  # nothing of globex's in acme's replies
    dead = await consume_until(
        kafka_bootstrap,
        topics.dlq,
        lambda rs: any(r.key == into_acme["id"].encode() for r in rs),
        timeout=30,
    )
    assert any(r.key == into_acme["id"].encode() for r in dead)
