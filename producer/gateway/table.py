"""A compacted Kafka topic read into a dict: the Batch API's files and batches live there, so they
survive a gateway restart and every replica sees them, without a database.

Each instance reads the whole topic at start (until its end), then follows it; a write is
acknowledged by every in-sync replica (acks=all) before it counts, and shows in the writer's own
dict at once. Compaction keeps the latest value of every key.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from config.settings import KafkaSettings
from producer.topics import create_topics

log = structlog.get_logger(__name__)

MAX_VALUE_BYTES = 900_000  # under the broker's default message.max.bytes (1 MiB)


class TopicTable:
    """key -> latest value of a one-partition compacted topic; ``on_change(key, value)`` hears
    every value read from the topic (its own writes included, when they come back)."""

    def __init__(self, kafka: KafkaSettings, topic: str, on_change: Callable[[str, bytes], None] | None = None):
        self.kafka, self.topic, self.on_change = kafka, topic, on_change
        self.data: dict[str, bytes] = {}
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Create the topic if missing, read it to its end, then follow it."""
        opts = self.kafka.connection_options()
        admin = AIOKafkaAdminClient(**opts)
        await admin.start()
        try:
            await create_topics(admin, [(self.topic, 1)], configs={"cleanup.policy": "compact"})
        finally:
            await admin.close()
        self._producer = AIOKafkaProducer(**opts, enable_idempotence=True, max_request_size=MAX_VALUE_BYTES + 65_536)
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(**opts, group_id=None, enable_auto_commit=False)
        await self._consumer.start()
        tp = TopicPartition(self.topic, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_beginning(tp)
        end = (await self._consumer.end_offsets([tp]))[tp]
        while await self._consumer.position(tp) < end:
            await self._read(timeout_ms=500)
        self._task = asyncio.create_task(self._follow(), name=f"table-{self.topic}")

    async def _follow(self) -> None:
        while True:
            try:
                await self._read(timeout_ms=500)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broker hiccup: keep following
                log.warning("table read failed", topic=self.topic, error=repr(exc))
                await asyncio.sleep(0.5)

    async def _read(self, timeout_ms: int) -> None:
        for records in (await self._consumer.getmany(timeout_ms=timeout_ms, max_records=1000)).values():
            for r in records:
                if r.key is None:
                    continue
                key = r.key.decode()
                if r.value is None:  # a tombstone: deleted (by this replica or another)
                    self.data.pop(key, None)
                    continue
                self.data[key] = r.value
                if self.on_change:
                    self.on_change(key, r.value)

    async def put(self, key: str, value: bytes) -> None:
        assert self._producer is not None, "table not started"
        assert len(value) <= MAX_VALUE_BYTES, f"{len(value)} bytes: split it"
        await self._producer.send_and_wait(self.topic, value, key=key.encode())
        self.data[key] = value

    async def delete(self, key: str) -> None:
        """A tombstone: compaction drops the key's records, and every replica forgets it."""
        assert self._producer is not None, "table not started"
        await self._producer.send_and_wait(self.topic, None, key=key.encode())
        self.data.pop(key, None)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for part in (self._consumer, self._producer):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.stop()
