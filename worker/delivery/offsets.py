"""Per-partition offset ledgers: the committed offset (lowest unfinished) and the finished
offsets above it, in the commit's metadata.
design: docs/reliability.md#exactly-one-final-result-transactions
"""

from __future__ import annotations

import base64
import bisect
import heapq
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog
from aiokafka import TopicPartition

log = structlog.get_logger(__name__)
_PLAIN, _PACKED = "1:", "2:"
_PACK_ABOVE = 256  # characters: longer ledgers are zlib-packed


def encode_ledger(mark: int, done: Iterable[int]) -> str:
    """The finished offsets above `mark` as hex runs (gap, length), each relative to the last."""
    runs, prev_end = [], mark
    for o in sorted(o for o in done if o > mark):
        if runs and o == prev_end:
            runs[-1][1] += 1
        else:
            runs.append([o - prev_end, 1])
        prev_end = o + 1
    text = ",".join(f"{gap:x}" if n == 1 else f"{gap:x}+{n:x}" for gap, n in runs)
    if len(text) > _PACK_ABOVE:
        return _PACKED + base64.b64encode(zlib.compress(text.encode(), 9)).decode()
    return _PLAIN + text


def decode_ledger(mark: int, metadata: str | None) -> set[int]:
    """The offsets encode_ledger(mark, ...) listed; none for a commit not made by a ledger."""
    if not metadata or metadata[:2] not in (_PLAIN, _PACKED):
        return set()
    text = metadata[2:]
    if metadata.startswith(_PACKED):
        text = zlib.decompress(base64.b64decode(text)).decode()
    done, prev_end = set(), mark
    for run in filter(None, text.split(",")):
        gap, _, n = run.partition("+")
        start = prev_end + int(gap, 16)
        prev_end = start + (int(n, 16) if n else 1)
        done.update(range(start, prev_end))
    return done


@dataclass
class _PartitionState:
    """One partition's offsets in flight. The heap may hold finished offsets (lazy deletion),
    compacted once they outnumber the open ones; `done` and `ahead` hold only offsets above the
    watermark, sorted: a commit costs O(log n) amortised, plus the ledger it writes."""

    heap: list[int] = field(default_factory=list)  # min-heap of taken offsets, some finished
    open: set[int] = field(default_factory=set)  # taken, not finished
    done: list[int] = field(default_factory=list)  # finished above the watermark, sorted
    ahead: list[int] = field(default_factory=list)  # final before this owner read them, sorted
    last_seen: int = -1
    committed: int | None = None  # the last watermark committed

    def watermark(self) -> int | None:
        self._drop_finished_top()
        if self.heap:
            mark = self.heap[0]
        elif self.last_seen >= 0:
            mark = self.last_seen + 1
        else:
            return None
        _drop_through(self.done, mark)  # no later ledger's mark is lower
        return mark

    def mark_without(self, finishing: set[int]) -> int:
        """The watermark once `finishing` are finished too: those set aside, then put back."""
        self._drop_finished_top()
        aside = []
        while self.heap and self.heap[0] in finishing:
            aside.append(heapq.heappop(self.heap))
            self._drop_finished_top()
        mark = self.heap[0] if self.heap else self.last_seen + 1
        for o in aside:
            heapq.heappush(self.heap, o)
        return mark

    def finish(self, offset: int) -> None:
        if offset not in self.open:  # not in flight here: nothing to remember
            return
        self.open.discard(offset)
        bisect.insort(self.done, offset)
        if len(self.heap) > 2 * len(self.open) + 64:  # mostly finished: rebuild, O(1) amortised
            self.heap = list(self.open)
            heapq.heapify(self.heap)

    def _drop_finished_top(self) -> None:
        while self.heap and self.heap[0] not in self.open:
            heapq.heappop(self.heap)


def _drop_through(offsets: list[int], mark: int) -> None:
    """Remove the sorted `offsets` at or below `mark`."""
    if offsets and offsets[0] <= mark:
        del offsets[: bisect.bisect_right(offsets, mark)]


def _above(offsets: list[int], mark: int) -> list[int]:
    return offsets[bisect.bisect_right(offsets, mark) :]


class OffsetTracker:
    """Tracks taken and finished offsets; says what a commit may say."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}

    def resume(self, tp: TopicPartition, committed: int | None, metadata: str | None) -> None:
        """A newly assigned partition starts from its last commit and its ledger."""
        st = self._parts[tp] = _PartitionState()
        if committed is not None:
            st.last_seen, st.committed = committed - 1, committed
            st.ahead = sorted(decode_ledger(committed, metadata))

    def add(self, tp: TopicPartition, offset: int) -> bool:
        """An offset was taken; it blocks the watermark until finished. False if read before or
        final."""
        st = self._parts.setdefault(tp, _PartitionState())
        # A redelivery after a seek can repeat offsets: tracking one twice would wedge it.
        if offset <= st.last_seen:
            return False
        st.last_seen = offset
        i = bisect.bisect_left(st.ahead, offset)
        if i < len(st.ahead) and st.ahead[i] == offset:  # stays listed until the mark passes it
            return False
        heapq.heappush(st.heap, offset)
        st.open.add(offset)
        return True

    def finish(self, tp: TopicPartition, offset: int) -> None:
        """`offset` is final; an offset not in flight here (revoked, never taken) is ignored."""
        st = self._parts.get(tp)
        if st is not None:
            st.finish(offset)

    def next_offset(self, tp: TopicPartition) -> int | None:
        """The first offset not taken yet (where a kept partition reads on)."""
        st = self._parts.get(tp)
        return None if st is None or st.last_seen < 0 else st.last_seen + 1

    def pending(self, tp: TopicPartition) -> int:
        """Offsets taken and not finished."""
        st = self._parts.get(tp)
        return 0 if st is None else len(st.open)

    def watermark(self, tp: TopicPartition) -> int | None:
        """The next unfinished offset (what a commit now would say), if any was seen."""
        st = self._parts.get(tp)
        return None if st is None else st.watermark()

    def ledger(self, tp: TopicPartition, finishing: Iterable[int] = ()) -> tuple[int, str] | None:
        """(offset, metadata) a commit would carry once `finishing` are finished too."""
        st = self._parts.get(tp)
        if st is None or st.last_seen < 0 and st.committed is None:
            return None
        finishing = set(finishing)
        st.watermark()  # drops what no ledger lists any more
        mark = st.mark_without(finishing)
        done = {*_above(st.done, mark), *_above(st.ahead, mark)}
        done.update(o for o in finishing if o > mark)
        return mark, encode_ledger(mark, done)

    def to_commit(self, tps=None) -> dict[TopicPartition, int]:
        """Watermarks that moved since the last commit (all partitions, or `tps`)."""
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
        """These marks are committed: the ledger forgets what they passed."""
        for tp, mark in offsets.items():
            if tp in self._parts:
                st = self._parts[tp]
                st.committed = mark
                _drop_through(st.ahead, mark)

    def forget(self, tps) -> None:
        """Partitions that moved: their state goes."""
        for tp in tps:
            self._parts.pop(tp, None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)
