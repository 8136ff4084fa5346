"""The input partitions this worker holds, one `Partition` each: its assignment epoch, whether
it is being revoked, and its offsets in flight, whose ledger (the committed offset, the lowest
unfinished, and the finished offsets above it) goes in the commit's metadata.
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


@dataclass(eq=False)
class Partition:
    """One input partition as this worker holds it. `epoch` is the assignment its work is taken
    under (0: not owned; work of another epoch is stale); `revoking`: it is being given up, so
    nothing more is taken from it; `held`: its records whose outcome is not final, `unacked`: its
    outcomes not on the broker yet. Its offsets in flight: the heap may hold finished offsets (lazy
    deletion), compacted once they outnumber the open ones; `done` and `ahead` hold only offsets
    above the watermark, sorted: a commit costs O(log n) amortised, plus the ledger it writes."""

    epoch: int = 0
    revoking: bool = False
    held: dict[int, object] = field(default_factory=dict)  # offset -> record
    unacked: int = 0
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
    """The registry of partitions this worker holds: who owns what (and since which epoch), what
    was taken and finished, and what a commit may say."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, Partition] = {}
        self._next_epoch = 1

    def resume(self, tp: TopicPartition, committed: int | None, metadata: str | None) -> Partition:
        """A newly assigned partition, in a new epoch, starts from its last commit and ledger."""
        old = self._parts.get(tp)
        p = self._parts[tp] = Partition(self._next_epoch, unacked=old.unacked if old else 0)
        self._next_epoch += 1
        if committed is not None:
            p.last_seen, p.committed = committed - 1, committed
            p.ahead = sorted(decode_ledger(committed, metadata))
        return p

    def get(self, tp: TopicPartition) -> Partition | None:
        return self._parts.get(tp)

    def partition(self, tp: TopicPartition) -> Partition:
        """`tp`'s state; one never assigned (share mode) is made, not owned."""
        return self._parts.setdefault(tp, Partition())

    def epoch(self, tp: TopicPartition) -> int:
        """The epoch `tp` is owned in; 0 if it is not."""
        p = self._parts.get(tp)
        return 0 if p is None else p.epoch

    def owns(self, tp: TopicPartition, generation: int) -> bool:
        """Whether work taken in epoch `generation` is still this worker's to finish."""
        return generation != 0 and self.epoch(tp) == generation

    def taking(self, tp: TopicPartition, generation: int | None = None) -> bool:
        """Whether records of `tp` (taken in `generation`, if given) are this worker's to run:
        owned, and not being revoked."""
        p = self._parts.get(tp)
        return p is not None and p.epoch != 0 and not p.revoking and generation in (None, p.epoch)

    def owned(self) -> list[TopicPartition]:
        return [tp for tp, p in self._parts.items() if p.epoch]

    def add(self, tp: TopicPartition, offset: int) -> bool:
        """An offset was taken: it blocks the watermark until finished. False: read or final."""
        p = self.partition(tp)
        # A redelivery after a seek can repeat offsets: tracking one twice would wedge it.
        if offset <= p.last_seen:
            return False
        p.last_seen = offset
        i = bisect.bisect_left(p.ahead, offset)
        if i < len(p.ahead) and p.ahead[i] == offset:  # stays listed until the mark passes it
            return False
        heapq.heappush(p.heap, offset)
        p.open.add(offset)
        return True

    def finish(self, tp: TopicPartition, offset: int) -> None:
        """`offset` is final; an offset not in flight here (revoked, never taken) is ignored."""
        if (p := self._parts.get(tp)) is not None:
            p.finish(offset)

    def pending(self, tp: TopicPartition) -> int:
        """Offsets taken and not finished."""
        p = self._parts.get(tp)
        return 0 if p is None else len(p.open)

    def backlog(self, tp: TopicPartition, start: int, end: int) -> int:
        """Records of `tp` not finished: unread up to `end` (from `start`, the log's start, if
        none was read) plus taken and unfinished. Unlike Kafka's lag (`end` minus the committed
        watermark), what finished above a slow request does not count."""
        p = self._parts.get(tp)
        if p is None:
            return 0
        return max(0, end - max(start, p.last_seen + 1)) + len(p.open)

    def watermark(self, tp: TopicPartition) -> int | None:
        """The next unfinished offset (what a commit now would say), if any was seen."""
        p = self._parts.get(tp)
        return None if p is None else p.watermark()

    def ledger(self, tp: TopicPartition, finishing: Iterable[int] = ()) -> tuple[int, str] | None:
        """(offset, metadata) a commit would carry once `finishing` are finished too."""
        p = self._parts.get(tp)
        if p is None or p.last_seen < 0 and p.committed is None:
            return None
        finishing = set(finishing)
        p.watermark()  # drops what no ledger lists any more
        mark = p.mark_without(finishing)
        done = {*_above(p.done, mark), *_above(p.ahead, mark)}
        done.update(o for o in finishing if o > mark)
        return mark, encode_ledger(mark, done)

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        """These marks are committed: the ledger forgets what they passed."""
        for tp, mark in offsets.items():
            if (p := self._parts.get(tp)) is not None:
                p.committed = mark
                _drop_through(p.ahead, mark)

    def forget(self, tps) -> None:
        """Partitions that moved: their state goes, but for the count of outcomes still due."""
        for tp in tps:
            p = self._parts.pop(tp, None)
            if p is not None and p.unacked:
                self._parts[tp] = Partition(unacked=p.unacked)

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)
