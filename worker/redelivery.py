"""Redelivery check: before running a request again, look for its final `done` on the reply topic.

Kafka commits a partition's offsets some time after the `done`s are acked (the watermark moves
only over contiguous finished requests, and a commit is one more round trip). A worker killed in
that window, a commit lost to a broker restart, or a partition that moves mid-flight all hand the
next owner requests whose final `done` is already on their reply topic. Running them again would
give the client a second final result.

Which records may have been run before? Only those already in the partition when this worker got
it: everything below the partition's high watermark at the first fetch after an assignment (a
"suspect"). Newer records cannot have had another owner. For each suspect the reply partition is
known (`reply_partition`, else the producer's own murmur2 partitioner over the `id` key), and its
`done` can only have been written after the request itself: the check reads each reply partition
from the suspects' timestamp (less a clock-skew slack) to its end, and collects the ids that have
a `done` whose finish_reason is not `requeued`.

    request partition   ... 96 97 98 [99 100 101] 102 ...    [..] = suspects (below the boundary)
    reply partition 3   ... (ts >= oldest suspect - slack) ─► end: done{id=..., final}?

What was read is cached per reply partition (ids with a final `done`, and how far it was read), so
a backlog of suspects fetched in many batches reads each reply partition once. This is not a
transaction: a `done` whose produce request the broker had not yet received when the previous
owner died is not there to find, and then the request runs again (at least once, as before).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgpack
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from worker.publisher import client_kwargs

log = structlog.get_logger(__name__)
# Reply timestamps come from the worker's clock, request timestamps from the producer's.
CLOCK_SKEW_SLACK_MS = 120_000
# msgpack of the string "done" as the `type` value: a cheap test before unpacking a record.
_DONE_MARK = msgpack.packb("done")
FINAL_EXCLUDED = frozenset({"requeued"})


@dataclass(frozen=True)
class Suspect:
    request_id: str
    reply_topic: str
    reply_partition: int | None
    timestamp_ms: int  # the request record's timestamp


@dataclass
class _Read:
    """How much of one reply partition has been read, and the finished ids found there."""

    from_ms: int
    next_offset: int
    finished: set[str] = field(default_factory=set)


def reply_partition_of(s: Suspect, partitions: list[int]) -> int:
    """The partition the worker's producer sent this request's events to."""
    if s.reply_partition is not None and s.reply_partition in partitions:
        return s.reply_partition
    # The publisher falls back to the key when the named partition does not exist.
    return DefaultPartitioner()(s.request_id.encode(), sorted(partitions), [])


def final_done_id(key: bytes | None, value: bytes | None) -> str | None:
    """The request id if this reply record is a final `done`, else None."""
    if key is None or not value or _DONE_MARK not in value:
        return None
    try:
        event = msgpack.unpackb(value, raw=False)
    except Exception:  # noqa: BLE001 - not ours to judge; it is simply not a done
        return None
    if not isinstance(event, dict) or event.get("type") != "done":
        return None
    if event.get("finish_reason") in FINAL_EXCLUDED:
        return None
    return event.get("id") if isinstance(event.get("id"), str) else None


class RedeliveryCheck:
    """Finds which suspects already have a final `done`. One caller at a time (the fetch loop)."""

    def __init__(self, settings, metrics) -> None:
        self._s, self._m = settings, metrics
        self._consumer: AIOKafkaConsumer | None = None
        self._reads: dict[TopicPartition, _Read] = {}

    async def start(self) -> None:
        k = self._s.kafka
        # Requests on one connection are answered in order: a long-polling fetch would hold a
        # metadata or offsets request behind it for fetch_max_wait_ms. Short polls, and no
        # assignment (so no fetch at all) between checks.
        self._consumer = AIOKafkaConsumer(**client_kwargs(k), group_id=None, enable_auto_commit=False,
                                          fetch_max_wait_ms=50,
                                          max_partition_fetch_bytes=k.max_message_bytes + 64 * 1024)
        await self._consumer.start()

    async def close(self) -> None:
        if self._consumer:
            await self._consumer.stop()

    def forget(self) -> None:
        """A new assignment: suspects start over, and so does what was read for them."""
        self._reads.clear()

    async def finished(self, suspects: list[Suspect]) -> set[str]:
        """Ids among `suspects` whose final `done` is on their reply topic. On a timeout or a
        broker error, what was found so far (the rest run again: at least once)."""
        started, found = time.monotonic(), set()
        try:
            found = await asyncio.wait_for(self._finished(suspects), self._s.kafka.redelivery_check_timeout_s)
        except Exception as exc:  # noqa: BLE001 - timeout, broker gone: fall back to rerunning
            log.warning("redelivery.check_failed", suspects=len(suspects), error=repr(exc))
            self._m.redeliveries.labels("unchecked").inc(len(suspects))
            self._reads.clear()  # a half-read partition must not pass for a read one
            return set()
        self._m.redeliveries.labels("already_done").inc(len(found))
        self._m.redeliveries.labels("rerun").inc(len(suspects) - len(found))
        log.info("redelivery.checked", suspects=len(suspects), already_done=len(found),
                 seconds=round(time.monotonic() - started, 3))
        return found

    async def _finished(self, suspects: list[Suspect]) -> set[str]:
        wanted = await self._group_by_reply_partition(suspects)
        await self._read(wanted)
        return {s.request_id for tp, group in wanted.items() for s in group
                if s.request_id in self._reads[tp].finished}

    async def _group_by_reply_partition(self, suspects) -> dict[TopicPartition, list[Suspect]]:
        # A fresh metadata fetch: reply topics are arbitrary, often not yet known to this client.
        cluster = await self._consumer._client.fetch_all_metadata()
        wanted: dict[TopicPartition, list[Suspect]] = {}
        for s in suspects:
            parts = cluster.partitions_for_topic(s.reply_topic)
            if not parts:  # no such topic: nothing was ever replied there
                continue
            tp = TopicPartition(s.reply_topic, reply_partition_of(s, list(parts)))
            wanted.setdefault(tp, []).append(s)
        return wanted

    async def _read(self, wanted: dict[TopicPartition, list[Suspect]]) -> None:
        """Bring the cache of every wanted reply partition up to its current end."""
        for tp, group in wanted.items():
            from_ms = max(0, min(s.timestamp_ms for s in group) - CLOCK_SKEW_SLACK_MS)
            read = self._reads.get(tp)
            if read is None or from_ms < read.from_ms:  # earlier than read so far: start over
                self._reads[tp] = _Read(from_ms, await self._offset_at(tp, from_ms))
        tps = list(wanted)
        ends = await self._consumer.end_offsets(tps)
        todo = {tp for tp in tps if self._reads[tp].next_offset < ends[tp]}
        if not todo:
            return
        self._consumer.assign(list(todo))
        for tp in todo:
            self._consumer.seek(tp, self._reads[tp].next_offset)
        try:
            while todo:
                batch = await self._consumer.getmany(*todo, timeout_ms=500)
                for tp, records in batch.items():
                    self._reads[tp].finished.update(
                        i for r in records if (i := final_done_id(r.key, r.value)) is not None)
                for tp in list(todo):
                    self._reads[tp].next_offset = await self._consumer.position(tp)
                    if self._reads[tp].next_offset >= ends[tp]:
                        todo.discard(tp)
        finally:
            self._consumer.assign([])

    async def _offset_at(self, tp: TopicPartition, ts_ms: int) -> int:
        found = (await self._consumer.offsets_for_times({tp: ts_ms})).get(tp)
        if found is not None:
            return found.offset
        return (await self._consumer.end_offsets([tp]))[tp]  # nothing that recent: nothing to read
