"""Joining the request topic's consumer group with hold's two assignors (sticky, round robin):
one JoinGroup request per join (worker/intake/group_join.py), so each member that joins costs the
group one generation. aiokafka alone sends one request per assignor: two generations a join, and
members out of step rebalanced each other for minutes (the CI failure of the scaling step)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer

from inferline.worker.intake import group_join
from inferline.worker.intake.group import assignors

pytestmark = pytest.mark.kafka


async def _member(bootstrap: str, topic: str, group: str) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        partition_assignment_strategy=assignors("hold"),
        session_timeout_ms=20_000,
        heartbeat_interval_ms=500,
    )
    consumer.subscribe([topic])
    await consumer.start()
    return consumer


async def _poll(consumers: list[AIOKafkaConsumer], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.gather(
            *(c.getmany(timeout_ms=50) for c in list(consumers)), asyncio.sleep(0.05)
        )


async def _settled(
    consumers: list[AIOKafkaConsumer], partitions: int, timeout: float = 60.0
) -> set[int]:
    """The members' generations once every partition is assigned to exactly one of them."""
    deadline = time.monotonic() + timeout
    while True:
        owned = [tp.partition for c in consumers for tp in c.assignment()]
        gens = {c._coordinator.generation for c in consumers}
        if (
            sorted(owned) == list(range(partitions))
            and all(c.assignment() for c in consumers)
            and len(gens) == 1
        ):
            return gens
        assert time.monotonic() < deadline, (
            f"no stable assignment: generations {gens}, owned {owned}"
        )
        await asyncio.sleep(0.1)


async def test_each_member_joining_costs_the_group_one_generation(kafka_bootstrap, new_topic):
    group_join.install()
    topic = await new_topic(4)
    group = f"join-{uuid.uuid4().hex[:8]}"
    consumers: list[AIOKafkaConsumer] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll(consumers, stop))  # polls whoever has joined so far
    try:
        for n in range(1, 4):
            consumers.append(await _member(kafka_bootstrap, topic, group))
            assert await _settled(consumers, 4) == {n}
        await asyncio.sleep(3.0)  # heartbeats go on: nothing starts another rebalance
        assert {c._coordinator.generation for c in consumers} == {3}
    finally:
        stop.set()
        await poller
        await asyncio.gather(*(c.stop() for c in consumers))
