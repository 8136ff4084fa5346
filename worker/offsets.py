"""Per-partition commit watermarks: commit only the contiguous run of finished requests.

A request's offset may be committed only after its `done` is acknowledged by the broker, and
only once every earlier offset of the partition is finished too; otherwise a crash would lose
the unfinished ones. Offsets need not be consecutive (compaction, transaction markers), so the
tracker works on the offsets it has actually seen:

    seen:      100 101 102 103 105        (104 was a transaction marker)
    finished:   x   x       x
    commit ->  102  (the lowest unfinished offset: Kafka's "next offset to read")

When every seen offset is finished the watermark is last_seen + 1.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from aiokafka import TopicPartition


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
