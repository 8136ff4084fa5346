"""Reply events through one idempotent producer, in `seq` order per attempt, tokens coalesced;
final results through the transactions. design: docs/architecture.md#delivery-guarantees
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition

from inferline.contract.schema import MSGPACK, DoneEvent, ErrorInfo, InvalidRequest, Request
from inferline.contract.schema import StartedEvent, Timing, TokensEvent, Usage, encode_event
from inferline.contract.schema import content_headers
from inferline.worker.delivery.commit import MAX_BACKOFF_S, RETRY_BACKOFF_S, permanent
from inferline.worker.delivery.commit import MAX_PRODUCER_TOPICS, Committer, Final, Outcome

log = structlog.get_logger(__name__)
FAILING_FOR_S = 30.0
Source = tuple[TopicPartition, int, int]  # a final's input: (partition, offset, generation)


@dataclass(frozen=True)
class ReplyRoute:
    """Where a request's reply goes: all a rejection needs."""

    request_id: str
    topic: str
    partition: int | None
    content_type: str = MSGPACK  # the request's encoding: its events take it
    headers: list[tuple[str, bytes]] | None = None  # on its events: trace context

    @classmethod
    def of(cls, req: Request | InvalidRequest, headers=None) -> "ReplyRoute":
        rid = req.request_id if isinstance(req, InvalidRequest) else req.id
        return cls(rid, req.reply_topic, req.reply_partition, req.content_type, headers)


@dataclass
class ReplyStream:
    """The reply side of one attempt: where its events go and its seq so far."""

    request_id: str
    attempt: str
    topic: str
    partition: int | None
    stream: bool = True
    content_type: str = MSGPACK  # the request's encoding (contract MSGPACK or JSON)
    seq: int = 0
    pending: dict[int, "_Pending"] = field(default_factory=dict)  # by sample: not in an event yet
    closed: bool = False
    final_event: bytes | None = None  # the `done` as sent (a resubmitted id gets it again)
    in_flight: int = 0
    headers: list[tuple[str, bytes]] | None = None  # on each of its events: trace context
    _drained: asyncio.Event | None = field(default=None, repr=False)

    async def drained(self) -> None:
        """Every event queued so far is acked (or given up)."""
        if self.in_flight:
            self._drained = self._drained or asyncio.Event()
            self._drained.clear()
            await self._drained.wait()

    def settled_one(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._drained is not None:
            self._drained.set()


@dataclass
class _Pending:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] | None = None


@dataclass
class _Outgoing:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] | None = None
    on_acked: Callable[[Outcome], None] | None = None  # must-deliver when set
    tries: int = 0
    first_failed: float | None = None
    forever: bool = False  # retried until the broker takes it (dead letters)
    stream: ReplyStream | None = None  # streamed: its attempt's `done` waits for its ack
    source: Source | None = None  # final: committed with its input


class Publisher:
    """Sends reply events; hands finals to the committer (group mode) or sends them as events that
    must be delivered (share mode, `on_acked` saying how it went)."""

    def __init__(self, settings, metrics, worker_name: str, committer, on_send_failed=None) -> None:
        """`committer`: None in share mode; `on_send_failed(topic)`: a reply topic is failing."""
        self._kafka, self._metrics = settings.kafka, metrics
        self._committer: Committer | None = committer
        self.worker_name = worker_name
        self._producer: AIOKafkaProducer | None = None
        self._lanes: dict[str, asyncio.Queue[_Outgoing]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._dirty: dict[str, ReplyStream] = {}
        self._flusher: asyncio.Task | None = None
        self.backlog = 0  # queued or in flight, not acked
        self._topic_backlog: Counter[str] = Counter()
        self._failing: dict[str, float] = {}
        self._on_send_failed = on_send_failed or (lambda topic: None)
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        self._producer = AIOKafkaProducer(
            **self._kafka.client_options(),
            enable_idempotence=True,  # forces acks=all; one batch in flight per partition
            acks="all",
            linger_ms=5,  # batch many small events into few requests
            max_request_size=self._kafka.max_message_bytes + 64 * 1024,
            max_batch_size=self._kafka.min_reply_message_bytes,  # one every reply topic takes
        )
        await self._producer.start()
        self._flusher = asyncio.create_task(self._flush_loop(), name="publisher-flush")

    async def stop(self, timeout: float = 10.0) -> None:
        """Flush buffered tokens, wait (bounded) for every queued event's ack, close."""
        self.flush_all(force=True)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("publisher.stop_timeout", backlog=self.backlog)
        for task in filter(None, [self._flusher, *self._tasks]):
            task.cancel()
        if self._producer:
            await self._producer.stop()

    def full(self) -> bool:
        """Too many replies wait (failing topics, dead letters aside): intake pauses."""
        now = time.monotonic()
        self._failing = {t: until for t, until in self._failing.items() if until > now}
        stuck = sum(self._topic_backlog[t] for t in [*self._failing, self._kafka.dlq_topic])
        return self.backlog - stuck >= self._kafka.max_pending_replies

    def failing(self, topic: str) -> bool:
        return self._failing.get(topic, 0.0) > time.monotonic()

    def started(self, rs: ReplyStream, queue_s: float) -> None:
        self._emit(rs, _event(StartedEvent, rs, worker=self.worker_name, queue_s=max(0.0, queue_s)))

    def tokens(self, rs: ReplyStream, token_ids: list[int], text: str, logprobs=None, index=0):
        if not rs.stream or not token_ids and not text:
            return
        pending = rs.pending.setdefault(index, _Pending())
        pending.token_ids.extend(token_ids)
        pending.text.append(text)
        if logprobs is not None:
            pending.logprobs = (pending.logprobs or []) + logprobs
        # The first tokens go at once (time to first token); later ones are coalesced.
        if self._kafka.flush_interval_ms <= 0 or rs.seq <= 1:
            self._flush(rs)
        else:
            self._dirty[rs.attempt] = rs

    def done(self, rs, on_acked, source=None, usage=(0, 0), timing=(0.0, None, 0.0), **fields):
        """The attempt's last event: `usage` (prompt, completion tokens), `timing` (queue_s, ttft_s,
        total_s), an `error` (code, message) and DoneEvent's other `fields`. With `source`
        (partition, offset, generation) a final one, committed with that offset,
        `on_acked(outcome, error)` saying how it went."""
        assert not rs.closed, "done twice for one attempt"
        self._flush(rs)
        if error := fields.get("error"):
            fields["error"] = ErrorInfo(code=error[0], message=error[1])
        queue_s, ttft_s, total_s = (None if t is None else max(0.0, t) for t in timing)
        timing = Timing(queue_s=queue_s, ttft_s=ttft_s, total_s=total_s)
        usage = Usage(prompt_tokens=usage[0], completion_tokens=usage[1])
        ev = _event(DoneEvent, rs, usage=usage, timing=timing, worker=self.worker_name, **fields)
        rs.closed = True
        out = self._outgoing(rs, ev, on_acked)
        rs.final_event, out.source = out.value, source
        self._enqueue(out)

    def dead_letter(self, topic: str, key, value, headers: list, source: Source, on_acked) -> None:
        """A dead letter, retried until the broker takes it; an empty value for none."""
        out = _Outgoing(topic, None, key, value or b"", headers, on_acked, forever=True)
        out.source = source
        self._enqueue(out)
        self._metrics.dead_letters.inc()

    def finish_offset(self, source: Source, record: tuple, on_acked) -> None:
        """Finish an input answered before: its remembered `done` (topic, partition, key, value,
        headers) resent, in the same transaction as the offset."""
        self._enqueue(_Outgoing(*record, on_acked, source=source))

    def _flush(self, rs: ReplyStream) -> None:
        self._dirty.pop(rs.attempt, None)
        pending, rs.pending = rs.pending, {}
        for index, p in sorted(pending.items()):
            fields = {"index": index, "token_ids": p.token_ids, "logprobs": p.logprobs}
            self._emit(rs, _event(TokensEvent, rs, text="".join(p.text), **fields))

    def flush_all(self, force: bool = False) -> None:
        """Buffered tokens as one event per stream; one with an event unacked waits, or `force`."""
        for rs in list(self._dirty.values()):
            if force or not rs.in_flight:
                self._flush(rs)

    async def _flush_loop(self) -> None:
        interval = max(self._kafka.flush_interval_ms, 1.0) / 1000
        while True:
            await asyncio.sleep(interval)
            self.flush_all()

    def _emit(self, rs: ReplyStream, ev) -> None:
        self._enqueue(self._outgoing(rs, ev))

    def _outgoing(self, rs: ReplyStream, ev, on_acked=None) -> _Outgoing:
        """`ev` in its request's encoding, with that content-type header, keyed by request id."""
        value = encode_event(ev, rs.content_type)
        headers = content_headers(rs.content_type) + (rs.headers or [])
        key = rs.request_id.encode()
        return _Outgoing(rs.topic, rs.partition, key, value, headers, on_acked, stream=rs)

    def _enqueue(self, out: _Outgoing) -> None:
        """Count `out` and send it; a final (with a `source`) goes to the committer (group mode),
        or (share mode) is sent like any event, final once acked."""
        self.backlog += 1
        self._topic_backlog[out.topic] += 1
        self._idle.clear()
        self._metrics.pending_replies.set(self.backlog)
        if out.source is not None and self._committer is not None:
            self._keep(asyncio.get_running_loop().create_task(self._to_transaction(out)))
            return
        out.source = None  # share mode: sent like any event, final once acked
        if out.stream is not None:
            out.stream.in_flight += 1
        lane = self._lanes.get(out.topic)
        if lane is None:
            lane = self._lanes[out.topic] = asyncio.Queue()
            self._keep(asyncio.create_task(self._lane(out.topic, lane), name=f"lane-{out.topic}"))
        lane.put_nowait(out)

    def _keep(self, task: asyncio.Task) -> None:
        # The loop holds tasks weakly: keep each until it is done.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lane(self, topic: str, lane: asyncio.Queue) -> None:
        # The lane ends when drained: per-request reply topics leave no idle tasks.
        while not lane.empty():
            out = lane.get_nowait()
            if out.on_acked is None and self.failing(topic):  # would only wait out a timeout
                self._failed(out, RuntimeError(f"reply topic {topic} is failing"))
                continue
            try:
                fut = await self._send(out)
            except Exception as exc:  # metadata timeout, message too large, producer closed
                self._failed(out, exc)
                continue
            fut.add_done_callback(lambda f, out=out: self._acked(out, f))
        del self._lanes[topic]
        self._prune_metadata()

    def _prune_metadata(self) -> None:
        # aiokafka refreshes metadata for every topic it ever sent to: past MAX_PRODUCER_TOPICS,
        # keep the ones in use.
        client = self._producer.client
        if len(client._topics) > MAX_PRODUCER_TOPICS:
            client.set_topics(
                {t for t in (*self._lanes, *self._topic_backlog) if t} | {self._kafka.dlq_topic}
            )

    async def _to_transaction(self, out: _Outgoing) -> None:
        if out.stream is not None:
            await out.stream.drained()  # the done must land after the attempt's tokens
        records = [(out.topic, out.partition, out.key, out.value, out.headers)]
        on_done = lambda outcome, error=None: self._settle(out, outcome, error)  # noqa: E731
        self._committer.submit(Final(*out.source, records, on_done, dead_letter=out.forever))

    async def _send(self, out: _Outgoing):
        # aiokafka lists only uncached topics, and a refresh drops unlisted ones: list it first.
        if out.topic not in self._producer.client._topics:
            self._producer.client.add_topic(out.topic)
        try:
            return await self._producer.send(
                out.topic, out.value, key=out.key, partition=out.partition, headers=out.headers
            )
        except AssertionError:  # reply_partition not in the topic
            log.warning("publisher.no_such_partition", topic=out.topic, partition=out.partition)
            out.partition = None  # better a done by key than none
            return await self._producer.send(out.topic, out.value, key=out.key, headers=out.headers)

    def _acked(self, out: _Outgoing, fut: asyncio.Future) -> None:
        exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if exc is None:
            self._settle(out, "ok")
        else:
            self._failed(out, exc)

    def _failed(self, out: _Outgoing, exc: BaseException) -> None:
        out.tries += 1
        self._metrics.send_failures.inc()
        if not self.failing(out.topic):
            self._failing[out.topic] = time.monotonic() + FAILING_FOR_S
            log.warning("publisher.topic_failing", topic=out.topic, error=repr(exc))
            self._on_send_failed(out.topic)
        if out.on_acked is None:  # streamed: counted, not logged (a dead topic would flood)
            self._settle(out, "failed")
            return
        # As for a transaction's final: permanent refusals at once, passing causes after a while.
        out.first_failed = out.first_failed or time.monotonic()
        if permanent(exc) or time.monotonic() - out.first_failed >= self._kafka.final_retry_s:
            if out.forever:  # a dead letter the DLQ will not take: its input ends anyway
                log.error("publisher.dead_letter_lost", key=out.key, error=repr(exc))
                self._metrics.dead_letters_lost.inc()
                self._settle(out, Outcome.COMMITTED)
                return
            log.error("publisher.gave_up", topic=out.topic, key=out.key, error=repr(exc))
            self._settle(out, "failed", repr(exc))
            return
        log.debug("publisher.retry", topic=out.topic, key=out.key, tries=out.tries, error=repr(exc))
        backoff = min(RETRY_BACKOFF_S * out.tries, MAX_BACKOFF_S)
        asyncio.get_running_loop().call_later(backoff, self._requeue, out)

    def _requeue(self, out: _Outgoing) -> None:
        self.backlog -= 1  # _enqueue counts it again
        self._topic_backlog[out.topic] -= 1
        if out.stream is not None:
            out.stream.in_flight -= 1
        self._enqueue(out)

    def _settle(self, out: _Outgoing, outcome: Outcome, error: str | None = None) -> None:
        if out.stream is not None and out.source is None:
            out.stream.settled_one()
        self.backlog -= 1
        self._topic_backlog[out.topic] -= 1
        if not self._topic_backlog[out.topic]:
            del self._topic_backlog[out.topic]
        self._metrics.pending_replies.set(self.backlog)
        if out.on_acked:
            out.on_acked(outcome, error)
        if self.backlog == 0:
            self._idle.set()


def _event(cls, rs: ReplyStream, **fields):
    """Event `cls` of `rs`'s attempt, with its next seq."""
    rs.seq += 1
    return cls(id=rs.request_id, attempt=rs.attempt, seq=rs.seq - 1, **fields)
