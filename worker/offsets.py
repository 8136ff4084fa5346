"""Per-partition commit watermarks: commit only the contiguous run of finished requests.

A request's offset may be committed only after its `done` is acknowledged by the broker, and
only once every earlier offset of the partition is finished too; otherwise a crash would lose
the unfinished ones. Offsets need not be consecutive (compaction, transaction markers), so the
tracker works on the offsets it has actually seen:

    seen:      100 101 102 103 105        (104 was a transaction marker)
    finished:   x   x       x
    commit ->  102  (the lowest unfinished offset: Kafka's "next offset to read")

When every seen offset is finished the watermark is last_seen + 1.

The Committer sends those watermarks, batched over a short window and retried: never
`consumer.commit()` without arguments, which would commit every record fetched, finished or not.
"""
from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

log = structlog.get_logger(__name__)
COMMIT_EVERY_S = 0.2  # commits batch the acks of this window
REVOKE_COMMIT_RETRIES = 4
LAG_EVERY_S = 5.0  # how often the lag of paused partitions is refreshed


@dataclass
class _PartitionState:
    unfinished: list[int] = field(default_factory=list)  # min-heap, may hold finished offsets
    finished: set[int] = field(default_factory=set)  # finished but still inside the heap
    last_seen: int = -1
    committed: int | None = None  # the last watermark handed to commit()

    def watermark(self) -> int | None:
        # Lazily drop finished offsets from the top of the heap: O(log n) amortised per offset.
        while self.unfinished and self.unfinished[0] in self.finished:
            self.finished.discard(heapq.heappop(self.unfinished))
        if self.unfinished:
            return self.unfinished[0]
        return self.last_seen + 1 if self.last_seen >= 0 else None


class OffsetTracker:
    """Tracks taken and finished offsets; says what may be committed."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}

    def add(self, tp: TopicPartition, offset: int) -> None:
        """An offset was taken from the consumer; it blocks the watermark until finished."""
        st = self._parts.setdefault(tp, _PartitionState())
        # A redelivery after a seek can repeat offsets: tracking one twice would wedge it.
        if offset <= st.last_seen:
            return
        heapq.heappush(st.unfinished, offset)
        st.last_seen = offset

    def finish(self, tp: TopicPartition, offset: int) -> None:
        """The offset's outcome is durable (done acked, or dead-lettered)."""
        st = self._parts.get(tp)
        if st is None:  # the partition was revoked and forgotten meanwhile
            return
        st.finished.add(offset)

    def pending(self, tp: TopicPartition) -> int:
        """How many taken offsets of `tp` are not finished."""
        st = self._parts.get(tp)
        return 0 if st is None else len(st.unfinished) - len(st.finished)

    def watermark(self, tp: TopicPartition) -> int | None:
        """The next offset not yet finished (what a commit now would say), if any was seen."""
        st = self._parts.get(tp)
        return None if st is None else st.watermark()

    def to_commit(self, tps=None) -> dict[TopicPartition, int]:
        """Watermarks that moved since the last call (all partitions, or only `tps`)."""
        out = {}
        for tp in self._parts if tps is None else tps:
            st = self._parts.get(tp)
            if st is None:
                continue
            mark = st.watermark()
            if mark is not None and mark != st.committed:
                out[tp] = mark
        return out

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        """The broker accepted these watermarks."""
        for tp, mark in offsets.items():
            if tp in self._parts:
                self._parts[tp].committed = mark

    def forget(self, tps) -> None:
        """Drop partitions that moved to another worker."""
        for tp in tps:
            self._parts.pop(tp, None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)


class Committer:
    """Commits the tracker's watermarks through the group consumer (set once it exists)."""

    def __init__(self, tracker: OffsetTracker) -> None:
        self._tracker = tracker
        self.consumer = None
        self._wanted = asyncio.Event()

    def request(self) -> None:
        self._wanted.set()

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            try:
                await self.commit()
            except Exception:  # noqa: BLE001 - retried below
                log.exception("intake.commit_error")
            await asyncio.sleep(COMMIT_EVERY_S)
            if self._tracker.to_commit():
                self._wanted.set()  # a failed commit is retried, not left for the next finish

    async def commit(self, tps=None) -> bool:
        """Commit the watermarks that moved; False if the broker refused (try again later)."""
        marks = self._tracker.to_commit(tps)
        if not marks or self.consumer is None:
            return True
        try:
            await self.consumer.commit(marks)
        except KafkaError as exc:  # rebalancing or coordinator moved: retried
            log.warning("intake.commit_failed", error=repr(exc), partitions=len(marks))
            return False
        self._tracker.committed(marks)
        return True

    async def commit_before_forgetting(self, tps) -> None:
        # A watermark lost here means the partition's next owner reads finished requests again
        # (the redelivery check then has to find their `done`s): worth a few retries.
        for attempt in range(REVOKE_COMMIT_RETRIES):
            if await self.commit(tps):
                return
            await asyncio.sleep(0.5 * (attempt + 1))
        log.error("intake.revoke_commit_lost", partitions=sorted(tp.partition for tp in tps))


class LagGauge:
    """Consumer lag per partition: records behind the end offset, counted from the watermark."""

    def __init__(self, tracker: OffsetTracker, gauge) -> None:
        self._tracker, self._gauge = tracker, gauge
        self.consumer = None

    def update(self) -> None:
        """After a fetch: the high watermarks it brought (a paused partition's is stale: run())."""
        for tp in self.consumer.assignment() - self.consumer.paused():
            high = self.consumer.highwater(tp)
            if high is not None:
                self._set(tp, high, self._tracker.watermark(tp))

    async def run(self) -> None:
        # A paused partition is not fetched, so its high watermark (from fetch responses) stops
        # moving exactly when the lag matters most: ask for the end offsets now and then.
        while True:
            await asyncio.sleep(LAG_EVERY_S)
            try:
                await self._update_paused()
            except Exception as exc:  # noqa: BLE001 - a gauge is not worth more than a log line
                log.debug("intake.lag_error", error=repr(exc))

    def remove(self, tps) -> None:
        """Partitions that moved: their new owner reports them (a stale value would win a max())."""
        for tp in tps:
            try:
                self._gauge.remove(str(tp.partition))
            except KeyError:
                pass

    async def _update_paused(self) -> None:
        paused = self.consumer.paused() & self.consumer.assignment()
        if not paused:
            return
        ends = await self.consumer.end_offsets(list(paused))
        for tp, end in ends.items():
            if tp in self.consumer.assignment():  # nothing taken yet: from where we would start
                start = self._tracker.watermark(tp)
                self._set(tp, end, start if start is not None else await self.consumer.position(tp))

    def _set(self, tp: TopicPartition, end: int, mark: int | None) -> None:
        if mark is not None:
            self._gauge.labels(str(tp.partition)).set(max(0, end - mark))
