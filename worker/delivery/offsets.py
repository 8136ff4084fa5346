"""Per-partition offset ledgers: the committed offset (lowest unfinished) and the finished
offsets above it, in the commit's metadata.
design: docs/reliability.md#exactly-one-final-result-transactions
"""

from __future__ import annotations

import base64
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
    unfinished: list[int] = field(default_factory=list)  # min-heap, may hold finished offsets
    finished: set[int] = field(default_factory=set)  # finished but still in the heap
    ahead: set[int] = field(default_factory=set)  # final before this owner read them (ledger)
    last_seen: int = -1
    committed: int | None = None  # the last watermark committed

    def watermark(self) -> int | None:
        # Lazily drop finished offsets from the top of the heap.
        while self.unfinished and self.unfinished[0] in self.finished:
            self.finished.discard(heapq.heappop(self.unfinished))
        if self.unfinished:
            return self.unfinished[0]
        return self.last_seen + 1 if self.last_seen >= 0 else None


class OffsetTracker:
    """Tracks taken and finished offsets; says what a commit may say."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}

    def resume(self, tp: TopicPartition, committed: int | None, metadata: str | None) -> None:
        """A newly assigned partition starts from its last commit and its ledger."""
        st = self._parts[tp] = _PartitionState()
        if committed is not None:
            st.last_seen, st.committed = committed - 1, committed
            st.ahead = decode_ledger(committed, metadata)

    def add(self, tp: TopicPartition, offset: int) -> bool:
        """An offset was taken; it blocks the watermark until finished. False if read before or
        final."""
        st = self._parts.setdefault(tp, _PartitionState())
        # A redelivery after a seek can repeat offsets: tracking one twice would wedge it.
        if offset <= st.last_seen:
            return False
        st.last_seen = offset
        if offset in st.ahead:  # stays listed until the watermark passes it
            return False
        heapq.heappush(st.unfinished, offset)
        return True

    def finish(self, tp: TopicPartition, offset: int) -> None:
        st = self._parts.get(tp)
        if st is None:  # revoked and forgotten meanwhile
            return
        st.finished.add(offset)

    def next_offset(self, tp: TopicPartition) -> int | None:
        """The first offset not taken yet (where a kept partition reads on)."""
        st = self._parts.get(tp)
        return None if st is None or st.last_seen < 0 else st.last_seen + 1

    def pending(self, tp: TopicPartition) -> int:
        st = self._parts.get(tp)
        return 0 if st is None else len(st.unfinished) - len(st.finished)

    def watermark(self, tp: TopicPartition) -> int | None:
        """The next unfinished offset (what a commit now would say), if any was seen."""
        st = self._parts.get(tp)
        return None if st is None else st.watermark()

    def ledger(self, tp: TopicPartition, finishing: Iterable[int] = ()) -> tuple[int, str] | None:
        """(offset, metadata) a commit would carry once `finishing` are finished too."""
        st = self._parts.get(tp)
        if st is None:
            return None
        finishing = set(finishing)
        open_ = [o for o in st.unfinished if o not in st.finished and o not in finishing]
        mark = min(open_, default=st.last_seen + 1)
        if st.last_seen < 0 and st.committed is None:
            return None
        done = {o for o in st.finished | finishing | st.ahead if o > mark}
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
        for tp, mark in offsets.items():
            if tp in self._parts:
                st = self._parts[tp]
                st.committed = mark
                st.ahead = {o for o in st.ahead if o > mark}

    def forget(self, tps) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)
