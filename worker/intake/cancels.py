"""Cancels: every worker reads the whole cancel topic, without a group, from `cancel_lookback_s`
ago at start-up (docs/architecture.md#delivery-guarantees).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from inferline.contract.schema import UndecodableMessage, decode_cancel
from inferline.worker.service.tenancy import tenant_of

log = structlog.get_logger(__name__)

CATCH_UP_WAIT_S = 15.0  # past this the worker starts anyway


class RecentCancels:
    """Ids cancelled lately, bounded (the stalest go first)."""

    def __init__(self, ttl_s: float = 600.0, max_ids: int = 50_000) -> None:
        self._ids: OrderedDict[str, float] = OrderedDict()
        self._ttl, self._max = ttl_s, max_ids

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)  # oldest first
        while len(self._ids) > self._max:
            self._ids.popitem(last=False)

    def seen(self, request_id: str) -> bool:
        stamp = self._ids.get(request_id)
        return stamp is not None and time.monotonic() - stamp < self._ttl


class CancelListener:
    """Reads every partition of the cancel topic, without a group."""

    def __init__(self, settings, on_cancel, metrics) -> None:
        self._s, self._on_cancel, self._m = settings, on_cancel, metrics
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None
        self.ready = False

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            **self._s.kafka.client_options(), group_id=None, enable_auto_commit=False
        )
        await self._consumer.start()
        await self._assign_all(at_start=True)
        await self._catch_up()
        self.ready = True
        self._task = asyncio.create_task(self._loop(), name="cancel-listener")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer:
            await self._consumer.stop()

    def _cancel_topics(self, cluster) -> list[str]:
        """The cancel topic, or in topic tenancy every tenant's."""
        k = self._s.kafka
        if k.tenancy != "topic":
            return [k.cancel_topic]
        return [t for t in cluster.topics() if tenant_of(t, k.cancel_topic)]

    async def _assign_all(self, at_start: bool = False) -> None:
        """(Re)assign every partition: from the end at start-up, from the start if found later."""
        # consumer.topics() drops its fresh metadata: read partitions from the fetched cluster.
        cluster = await self._consumer._client.fetch_all_metadata()
        topics = self._cancel_topics(cluster)
        tps = {TopicPartition(t, p) for t in topics for p in cluster.partitions_for_topic(t) or ()}
        old = self._consumer.assignment()
        new = tps - old
        if not new:
            return
        # assign() forgets positions: carry the old ones over.
        positions = {tp: await self._consumer.position(tp) for tp in old}
        self._consumer.assign(list(tps))
        for tp, offset in positions.items():
            self._consumer.seek(tp, offset)
        if at_start:
            await self._seek_to_lookback(new)
        else:
            await self._consumer.seek_to_beginning(*new)
        for tp in new:  # resolve end offsets now: a cancel sent after start() is seen
            await self._consumer.position(tp)
        log.info("cancels.assigned", topics=len(topics), partitions=len(tps))

    async def _seek_to_lookback(self, tps: set[TopicPartition]) -> None:
        since_ms = int((time.time() - self._s.kafka.cancel_lookback_s) * 1000)
        found = await self._consumer.offsets_for_times({tp: max(since_ms, 0) for tp in tps})
        for tp in tps:
            if found.get(tp) is None:  # nothing that recent: only new cancels
                await self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek(tp, found[tp].offset)

    async def _catch_up(self) -> None:
        """Read the backlog up to now's end offsets before the worker takes requests."""
        tps = list(self._consumer.assignment())
        if not tps:
            return
        ends = await self._consumer.end_offsets(tps)
        until = time.monotonic() + CATCH_UP_WAIT_S
        while time.monotonic() < until:
            positions = {tp: await self._consumer.position(tp) for tp in tps}
            if all(positions[tp] >= ends[tp] for tp in tps):
                return
            self._handle(await self._consumer.getmany(timeout_ms=200))
        log.warning("cancels.catch_up_incomplete", wait_s=CATCH_UP_WAIT_S)

    async def _loop(self) -> None:
        last_refresh = time.monotonic()
        while True:
            try:
                if not self._consumer.assignment():  # no cancel topic yet
                    await asyncio.sleep(0.5)
                    batch = {}
                else:
                    batch = await self._consumer.getmany(timeout_ms=500)
                if time.monotonic() - last_refresh > (30.0 if self._consumer.assignment() else 5.0):
                    last_refresh = time.monotonic()
                    await self._assign_all()
            except Exception as exc:  # noqa: BLE001 - the listener must outlive broker hiccups
                log.warning("cancels.fetch_error", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            self._handle(batch)

    def _handle(self, batch: dict) -> None:
        k = self._s.kafka
        for record in (r for records in batch.values() for r in records):
            try:
                cancel = decode_cancel(record.value)
            except UndecodableMessage as exc:
                log.warning("cancels.undecodable", offset=record.offset, reason=exc.reason)
                continue
            self._m.cancels.inc()
            tenant = tenant_of(record.topic, k.cancel_topic) if k.tenancy == "topic" else None
            self._on_cancel(cancel.id, tenant)
