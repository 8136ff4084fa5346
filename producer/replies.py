"""Reply topics: their names, and the client's one consumer that routes each event to its
handle by id. Shared topics are read from their end, unless this client made them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from inferline.producer.reassembly import RequestHandle
from inferline.contract.schema import UndecodableMessage, decode_event
from inferline.producer.topics import create_topics, topic_configs, topic_partitions

log = structlog.get_logger(__name__)

PER_REQUEST = "per-request"
NEW_TOPIC_WAIT_S = 10.0  # a topic just made, unknown yet to some broker of the cluster
REPLY_TOPIC_PREFIX = "inferline.reply."


class ReplyTopicError(RuntimeError):
    """A reply topic that is missing, or would have to be made, where topics are made ahead."""


def missing_reply_topic(topic: str) -> ReplyTopicError:
    return ReplyTopicError(
        f"reply topic {topic!r} does not exist: make it ahead (inferline topics create "
        "--reply-topic), or let clients make theirs (INFERLINE_KAFKA__CREATE_REPLY_TOPICS)"
    )


def per_request_topic(request_id: str, prefix: str = REPLY_TOPIC_PREFIX) -> str:
    # ':' is legal in ids, not in topic names; a 16-char prefix + 128 chars stays under 249.
    return prefix + request_id.replace(":", "_")


class ReplyRouter:
    """Which reply topics the client's consumer reads, from where, and which handle gets each
    event; ``spawn`` starts a task the client awaits on close."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        admin: AIOKafkaAdminClient,
        handles: dict[str, RequestHandle],
        spawn: Callable[[Coroutine], None],
        *,
        partitions: int,
        retention_ms: int,
        replication_factor: int | None,
        min_insync_replicas: int | None,
        max_event_bytes: int,
        create: bool = True,
    ):
        self.consumer, self.admin, self.handles, self._spawn = consumer, admin, handles, spawn
        self.partitions, self.retention_ms = partitions, retention_ms
        # Unset: the broker's defaults.
        self.replicas = {
            "replication_factor": replication_factor,
            "min_insync_replicas": min_insync_replicas,
        }
        self.max_event_bytes = max_event_bytes
        self.create = create  # may make (and delete) reply topics at run time
        self.watched: set[str] = set()
        self.undecodable = 0
        self._assign_lock = asyncio.Lock()
        self._retiring: set[str] = set()

    # --- which topics, from where -------------------------------------------------------------

    async def prepare(self, topic: str, per_request: bool) -> None:
        """Make the consumer read ``topic`` before a request names it."""
        if per_request:
            await self._add_fresh_topic(topic)
        elif topic not in self.watched:
            await self.watch_shared(topic, fresh=False)

    async def watch_shared(self, topic: str, fresh: bool) -> None:
        """Read the topic (created first if missing, where topics may be made at run time): from
        the start when this client created it, else from its end."""
        created = []
        if self.create:
            created = await create_topics(
                self.admin,
                [(topic, self.partitions)],
                **self.replicas,
                configs=topic_configs(self.retention_ms),
            )
        # Made just now, it may be unknown yet to the broker asked (a cluster's metadata spreads).
        deadline = time.monotonic() + (NEW_TOPIC_WAIT_S if self.create else 0.0)
        while (parts := await topic_partitions(self.admin, topic)) is None:
            if time.monotonic() >= deadline:
                raise missing_reply_topic(topic)
            await asyncio.sleep(0.1)
        tps = [TopicPartition(topic, p) for p in parts]
        await self._reassign(add=tps, from_start=fresh or topic in created)

    async def _add_fresh_topic(self, topic: str) -> None:
        if not self.create:
            raise ReplyTopicError(
                "per-request reply topics are made at run time, and "
                "INFERLINE_KAFKA__CREATE_REPLY_TOPICS is false: name a reply topic made ahead"
            )
        await create_topics(
            self.admin,
            [(topic, 1)],
            **self.replicas,
            configs=topic_configs(self.retention_ms),
        )
        await self._reassign(add=[TopicPartition(topic, 0)], from_start=True)

    async def _reassign(
        self,
        add: list[TopicPartition] = (),
        remove: set[str] = frozenset(),
        from_start: bool = True,
    ) -> None:
        """Change the assignment keeping kept partitions' positions (assign() forgets them)."""
        consumer = self.consumer
        async with self._assign_lock:
            keep = [tp for tp in consumer.assignment() if tp.topic not in remove]
            positions = {tp: await consumer.position(tp) for tp in keep}
            consumer.assign(keep + [tp for tp in add if tp not in positions])
            for tp, offset in positions.items():
                consumer.seek(tp, offset)
            if add and not from_start:
                await consumer.seek_to_end(*add)
            for tp in add:
                if from_start:
                    consumer.seek(tp, 0)
                await consumer.position(tp)  # resolve now: later events are seen
            self.watched = {tp.topic for tp in consumer.assignment()}

    def retire(self, topic: str) -> None:
        """Stop reading a finished request's own topic and delete it."""
        if topic in self.watched:
            self._retiring.add(topic)
            if len(self._retiring) == 1:
                self._spawn(self._retire_topics())

    async def _retire_topics(self) -> None:
        # Batched: topics finishing together cost one reassign, one delete.
        await asyncio.sleep(0.2)
        topics, self._retiring = set(self._retiring), set()
        await self._reassign(remove=topics)
        with contextlib.suppress(Exception):  # retire() is reached only where topics are made
            await self.admin.delete_topics(sorted(topics))

    # --- the one consumer task ----------------------------------------------------------------

    async def run(self) -> None:
        """Read every watched topic until cancelled, feeding each event to its handle."""
        consumer = self.consumer
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broker hiccup must not strand every handle
                log.warning("reply consumer error", error=repr(exc))
                await asyncio.sleep(0.2)
                continue
            for records in batches.values():
                for record in records:
                    self.route(record.key, record.value)

    def route(self, key: bytes | None, value: bytes) -> None:
        # The key is the request id: skip other clients' events undecoded.
        if key is not None and key.decode("utf-8", "replace") not in self.handles:
            return
        try:
            ev = decode_event(value, max_bytes=self.max_event_bytes)
        except UndecodableMessage as exc:
            self.undecodable += 1
            log.warning("undecodable reply event", reason=exc.reason)
            return
        handle = self.handles.get(ev.id)
        if handle is not None:
            handle.feed(ev)
