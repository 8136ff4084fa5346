"""A compacted Kafka topic read into a dict, for the Batch API's files and batches; `get` reads to
the topic's end before it answers "not there".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import KafkaSettings
from inferline.producer.gateway.errors import OpenAIError
from inferline.producer.topics import create_topics

log = structlog.get_logger(__name__)

MAX_VALUE_BYTES = 900_000  # under the broker's default message.max.bytes
CATCH_UP_TIMEOUT_S = 10.0


class TopicTable:
    """key -> latest value of a one-partition compacted topic; ``on_change(key, value)`` hears every
    value read."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topic: str,
        on_change: Callable[[str, bytes], None] | None = None,
    ):
        self.kafka, self.topic, self.on_change = kafka, topic, on_change
        self.data: dict[str, bytes] = {}
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None
        self._tp = TopicPartition(topic, 0)

    async def start(self) -> None:
        """Create the topic if missing, read it to its end, then follow it."""
        opts = self.kafka.connection_options()
        admin = AIOKafkaAdminClient(**opts)
        await admin.start()
        try:
            await create_topics(
                admin,
                [(self.topic, 1)],
                replication_factor=self.kafka.replication_factor,
                min_insync_replicas=self.kafka.min_insync_replicas,
                configs={"cleanup.policy": "compact"},
            )
        finally:
            await admin.close()
        self._producer = AIOKafkaProducer(
            **opts, enable_idempotence=True, max_request_size=MAX_VALUE_BYTES + 65_536
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(**opts, group_id=None, enable_auto_commit=False)
        await self._consumer.start()
        self._consumer.assign([self._tp])
        await self._consumer.seek_to_beginning(self._tp)
        end = await self._end()
        while await self._consumer.position(self._tp) < end:
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
        for records in (
            await self._consumer.getmany(timeout_ms=timeout_ms, max_records=1000)
        ).values():
            for r in records:
                if r.key is None:
                    continue
                key = r.key.decode()
                if r.value is None:  # a tombstone: deleted
                    self.data.pop(key, None)
                    continue
                self.data[key] = r.value
                if self.on_change:
                    self.on_change(key, r.value)

    async def get(self, key: str, fresh: bool = False) -> bytes | None:
        """The key's value; on a miss (or always, when `fresh`: another replica may have changed
        or deleted it), first follow the topic up to its end."""
        if fresh or key not in self.data:
            try:
                await self.caught_up()
            except TimeoutError:
                raise OpenAIError(
                    503,
                    f"could not read {self.topic} to its end in {CATCH_UP_TIMEOUT_S:g} s: retry",
                    type="server_error",
                    code="unavailable",
                    headers={"Retry-After": "1"},
                ) from None
        return self.data.get(key)

    async def caught_up(self, timeout_s: float = CATCH_UP_TIMEOUT_S) -> None:
        """Wait until the follower has read what the topic held when called; TimeoutError past
        `timeout_s`."""
        assert self._consumer is not None, "table not started"
        async with asyncio.timeout(timeout_s):
            end = await self._end()
            while await self._consumer.position(self._tp) < end:
                await asyncio.sleep(0.01)

    async def _end(self) -> int:
        return (await self._consumer.end_offsets([self._tp]))[self._tp]

    async def put(self, key: str, value: bytes) -> None:
        assert self._producer is not None, "table not started"
        assert len(value) <= MAX_VALUE_BYTES, f"{len(value)} bytes: split it"
        await self._producer.send_and_wait(self.topic, value, key=key.encode())
        self.data[key] = value

    async def delete(self, key: str) -> None:
        """A tombstone: every replica forgets the key."""
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
