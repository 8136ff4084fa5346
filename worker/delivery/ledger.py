"""The job ledger: each request held here (a `Job` per attempt) until its outcome is committed,
and the ids finished here, so a resubmission is answered, not rerun. What is held per partition
lives in its `Partition` (worker/delivery/offsets.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog
from aiokafka import TopicPartition

from inferline.contract.schema import Request
from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.delivery.publisher import ReplyStream
from inferline.worker.tracing import NO_TRACE, NoTrace

# Ids finished here, so a resubmission does not run twice.
MAX_REMEMBERED_DONE = 100_000
# The last final `done`s, resent when their request comes back (bounded bytes).
MAX_REMEMBERED_EVENTS = 10_000
MAX_REMEMBERED_EVENT_BYTES = 64 * 1024
# All of them together: the oldest go first (a `done` not kept is answered `answered_before`).
MAX_REMEMBERED_BYTES = 32 * 1024 * 1024


@dataclass
class Job:
    request: Request
    reply: ReplyStream
    tp: TopicPartition
    offset: int
    received: float  # Unix seconds
    max_tokens: int
    generation: int = 0  # its partition's generation at admission
    state: str = "waiting"  # waiting -> running -> finishing
    first_token_at: float | None = None
    last_token_at: float | None = None
    sent_at: float | None = None  # its record's Kafka timestamp (Unix seconds), if any
    token_at: dict[int, float] = field(default_factory=dict)  # sample -> its last token's time
    trace: NoTrace = NO_TRACE  # its spans (worker/tracing.py), when tracing is on
    log: structlog.BoundLogger = field(default=None, repr=False)

    @property
    def attempt(self) -> str:
        return self.reply.attempt

    @property
    def source(self) -> tuple[TopicPartition, int, int]:
        """Its input: (partition, offset, generation)."""
        return self.tp, self.offset, self.generation


def fingerprint(req: Request) -> str:
    return hashlib.blake2b(req.model_dump_json().encode(), digest_size=16).hexdigest()


class JobLedger:
    """The jobs held here and the requests finished here; per-partition state is in `Partition`."""

    def __init__(self, partitions: OffsetTracker | None = None) -> None:
        self.jobs: dict[str, Job] = {}  # attempt -> job
        self._parts = partitions or OffsetTracker()
        self._completed: OrderedDict[str, str] = OrderedDict()  # id -> fingerprint, committed
        self._final_events: OrderedDict[str, tuple] = OrderedDict()  # id -> (topic, p., done, type)
        self._final_bytes = 0  # of the `done`s in _final_events
        self.settled = asyncio.Event()  # pulses whenever an outcome is acked

    def add(self, job: Job) -> None:
        self.jobs[job.attempt] = job
        self.taken(job.tp)

    def forget(self, job: Job) -> None:
        self.jobs.pop(job.attempt, None)

    def attempts(self, request_id: str) -> list[str]:
        """The attempts held for a wire id (a scan: only a cancel asks, and few jobs are held)."""
        return [a for a, job in self.jobs.items() if job.request.id == request_id]

    def empty(self) -> bool:
        return not self.jobs and not self.unacked()

    def held(self, tp: TopicPartition, offset: int):
        p = self._parts.get(tp)
        return None if p is None else p.held.get(offset)

    def release(self, tp: TopicPartition, offset: int) -> None:
        if (p := self._parts.get(tp)) is not None:
            p.held.pop(offset, None)

    def release_partitions(self, tps) -> None:
        for p in filter(None, map(self._parts.get, tps)):
            p.held.clear()

    def taken(self, tp: TopicPartition) -> None:
        self._parts.partition(tp).unacked += 1

    def acked(self, tp: TopicPartition) -> None:
        if (p := self._parts.get(tp)) is not None:
            p.unacked = max(0, p.unacked - 1)
        self.settled.set()

    def unacked(self, tps=None) -> set[TopicPartition]:
        """Partitions (of `tps`, or all) with outcomes not on the broker yet."""
        tps = self._parts.partitions() if tps is None else tps
        return {tp for tp in tps if (p := self._parts.get(tp)) is not None and p.unacked}

    def remember(self, job: Job) -> None:
        """`job`'s request finished here: its id, and its final `done` within the bounds."""
        req = job.request
        self._completed[req.id] = fingerprint(req)
        if len(self._completed) > MAX_REMEMBERED_DONE:
            self._completed.popitem(last=False)
        self._forget_event(req.id)
        rs, done = job.reply, job.reply.final_event
        if done is not None and len(done) <= MAX_REMEMBERED_EVENT_BYTES:
            self._final_events[req.id] = (rs.topic, rs.partition, done, rs.content_type)
            self._final_bytes += len(done)
        while self._final_events and (
            len(self._final_events) > MAX_REMEMBERED_EVENTS
            or self._final_bytes > MAX_REMEMBERED_BYTES
        ):
            self._forget_event(next(iter(self._final_events)))

    def _forget_event(self, request_id: str) -> None:
        event = self._final_events.pop(request_id, None)
        if event is not None:
            self._final_bytes -= len(event[2])

    def finished(self, req: Request) -> bool:
        """This very request (same id and content) was answered here before."""
        return self._completed.get(req.id) == fingerprint(req)

    def final_event(self, request_id: str) -> tuple | None:
        """(topic, partition, done, its content type) of a request finished here, if kept."""
        return self._final_events.get(request_id)
