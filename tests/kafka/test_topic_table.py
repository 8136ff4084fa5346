"""The gateway's compacted-topic table against the real broker: what one replica wrote, another
finds at once, even while its follower lags (a loaded machine), and a lagging follower does not
make a missing key wait longer than a broker round trip or two."""

from __future__ import annotations

import asyncio

import pytest

from inferline.config.settings import KafkaSettings
from inferline.producer.gateway.table import TopicTable
from tests.kafka_fixtures import unique_topic_name

pytestmark = pytest.mark.kafka


async def test_a_replica_finds_what_another_just_wrote_though_its_follower_lags(kafka_bootstrap):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = unique_topic_name("table")
    writer, reader = TopicTable(kafka, topic), TopicTable(kafka, topic)
    await writer.start()
    await reader.start()
    read = reader._read

    async def lagging_read(timeout_ms: int) -> None:  # the follower of a machine busy elsewhere
        await asyncio.sleep(1.0)
        await read(timeout_ms)

    reader._read = lagging_read
    try:
        await asyncio.sleep(1.5)  # the follower is in its lagging sleep now
        await writer.put("file-1", b"meta")
        assert "file-1" not in reader.data  # not followed yet: the race a plain dict lookup lost
        assert await reader.get("file-1") == b"meta"
        assert await reader.get("file-never-written") is None
    finally:
        await writer.close()
        await reader.close()
