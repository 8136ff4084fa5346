"""What fails for one request costs that request only, against the broker: a reply topic that
refuses every write (a producer created it under the reply prefix with max.message.bytes=1) beside
honest traffic on the same request partitions. The honest requests get their one final `done`;
the poisoned ones go to the dead-letter topic with the reason."""

from __future__ import annotations

import pytest

from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - topics, start_worker are fixtures
    collect,
    final_dones,
    request,
    start_worker,
    submit,
    topics,
)


@pytest.mark.kafka
async def test_a_reply_topic_that_refuses_writes_costs_only_its_own_requests(
    kafka_bootstrap, topics, new_topic, start_worker
):
    poisoned = await new_topic(1, prefix="poison", reply=True, config={"max.message.bytes": "1"})
    bad = [request(poisoned, f"Say the number {n}.", max_tokens=2) for n in range(12)]
    good = [request(topics.replies, f"Name the colour {n}.", max_tokens=2) for n in range(6)]
    mixed = [r for pair in zip(bad[::2], bad[1::2], good) for r in pair]  # two bad, one good, ...
    await start_worker(topics)
    await submit(kafka_bootstrap, topics.requests, mixed)

    events = await collect(kafka_bootstrap, topics.replies, [r["id"] for r in good], timeout=120)
    assert all(len(final_dones(events[r["id"]])) == 1 for r in good)
    dead = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= len(bad), timeout=120
    )
    assert sorted(r.key.decode() for r in dead) == sorted(r["id"] for r in bad)
    for r in dead:
        reason = dict(r.headers)["error"].decode()
        assert poisoned in reason, reason
