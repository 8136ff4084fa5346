"""Intake: the consumer group on the request topic.

The fetch loop takes only as many records as the waiting pool has room for
(`getmany(max_records=room)`). With no room it pauses every assigned partition but keeps
calling `getmany`: aiokafka measures `max_poll_interval_ms` from the last getmany, so a loop
that stopped fetching would silently fall out of the group. Pauses are forgotten on every
rebalance, so `on_partitions_assigned` pauses again when the pool is full.

Each record is decoded here (bounded by max_message_bytes, so a 100 MB message costs a len())
and then handed to the sink (the Worker) as exactly one of: dead letter, rejection, admission.
Offsets are committed from the OffsetTracker only: never `commit()` without arguments, which
would commit every record fetched, finished or not.
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from producer.schema import InvalidRequest, Request, UndecodableMessage, decode_request
from worker.cancels import RecentCancels
from worker.offsets import OffsetTracker
from worker.publisher import client_kwargs
from worker.ratelimit import RateLimiter

log = structlog.get_logger(__name__)
POLL_MS = 100  # how soon a freed slot in the pool is noticed
COMMIT_EVERY_S = 0.2  # commits batch the acks of this window
REVOKE_COMMIT_RETRIES = 4
OVERLOAD_BATCH = 64


class Sink(Protocol):
    def room(self) -> int: ...
    def pool_full(self) -> bool: ...
    def dead_letter(self, record, reason: str) -> None: ...
    def reject(self, tp, offset, route: InvalidRequest, code: str, message: str,
               finish_reason: str = "rejected", metadata: dict | None = None) -> None: ...
    def admit(self, tp, offset, request: Request, received: float) -> None: ...
    async def requeue(self, tps: set[TopicPartition]) -> None: ...


def route_of(req: Request) -> InvalidRequest:
    """The reply address of a decoded request, in the shape a rejection needs."""
    return InvalidRequest("", "", request_id=req.id, reply_topic=req.reply_topic,
                          reply_partition=req.reply_partition)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, intake: "Intake") -> None:
        self._intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        await self._intake.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        self._intake.on_assigned(set(assigned))


class Intake:
    def __init__(self, settings, sink: Sink, tracker: OffsetTracker, limiter: RateLimiter, metrics,
                 cancels: RecentCancels) -> None:
        self._s = settings
        self._sink, self._tracker, self._limiter, self._m = sink, tracker, limiter, metrics
        self._cancels = cancels
        self._consumer: AIOKafkaConsumer | None = None
        self.joined = False
        self.fetching = True  # False once draining: the loop keeps polling, takes nothing
        self._full_since: float | None = None
        self._overloading = False  # this batch was fetched past the pool's room, to reject
        self._revoking: set[TopicPartition] = set()
        self._commit_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        k = self._s.kafka
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(k), group_id=k.group_id, group_instance_id=k.group_instance_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=k.session_timeout_ms, heartbeat_interval_ms=k.session_timeout_ms // 4,
            max_partition_fetch_bytes=k.max_message_bytes + 64 * 1024,
        )
        self._consumer.subscribe([k.request_topic], listener=_Rebalance(self))
        await self._consumer.start()
        self._tasks = [asyncio.create_task(self._fetch_loop(), name="intake-fetch"),
                       asyncio.create_task(self._commit_loop(), name="intake-commit")]

    async def close(self) -> None:
        """Final commit, then leave the group (on_partitions_revoked is not called by stop())."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.commit(), 5.0)
        except asyncio.TimeoutError:
            log.warning("intake.final_commit_timeout")
        if self._consumer:
            await self._consumer.stop()

    # -- fetching -------------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        # This loop must outlive anything: if it stopped, the worker would sit in the group
        # taking nothing (and, past max_poll_interval_ms, drop out of it).
        while True:
            try:
                batch = await self._fetch_once()
            except Exception as exc:  # noqa: BLE001 - broker hiccups, coordinator errors
                log.warning("intake.fetch_error", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            for tp, records in batch.items():
                for record in records:
                    self._handle_safely(tp, record)
            self._update_lag()

    def _handle_safely(self, tp: TopicPartition, record) -> None:
        try:
            self._handle(tp, record)
        except Exception as exc:  # noqa: BLE001 - a bug must not wedge the partition's watermark
            log.exception("intake.handle_failed", partition=tp.partition, offset=record.offset)
            self._sink.dead_letter(record, f"internal error: {exc!r}"[:300])

    async def _fetch_once(self) -> dict:
        room = self._sink.room() if self.fetching else 0
        self._overloading = self.fetching and room <= 0 and self._overloaded()
        take = room > 0 or self._overloading
        self._set_paused(not take)
        max_records = room if room > 0 else OVERLOAD_BATCH
        return await self._consumer.getmany(timeout_ms=POLL_MS, max_records=max_records)

    def _overloaded(self) -> bool:
        after = self._s.limits.overload_reject_after_s
        if after is None or not self._sink.pool_full():
            self._full_since = None
            return False
        now = time.monotonic()
        self._full_since = self._full_since or now
        return now - self._full_since >= after

    def _set_paused(self, paused: bool) -> None:
        assigned = self._consumer.assignment()
        if paused:
            todo = assigned - self._consumer.paused()
            if todo:
                self._consumer.pause(*todo)
        elif self._consumer.paused() - self._revoking:
            self._consumer.resume(*(self._consumer.paused() - self._revoking))
        self._m.intake_paused.set(1 if paused and assigned else 0)

    def _handle(self, tp: TopicPartition, record) -> None:
        if tp in self._revoking or tp not in self._consumer.assignment():
            return  # being revoked: untracked and uncommitted, so its new owner reads it
        self._tracker.add(tp, record.offset)
        received = time.time()
        try:
            req = decode_request(record.value, self._s.kafka.max_message_bytes, self._s.model.max_model_len)
        except UndecodableMessage as exc:
            log.warning("intake.dead_letter", partition=tp.partition, offset=record.offset, reason=exc.reason)
            self._sink.dead_letter(record, exc.reason)
            return
        except InvalidRequest as exc:
            log.info("intake.invalid", request_id=exc.request_id, partition=tp.partition,
                     offset=record.offset, field=exc.field)
            self._sink.reject(tp, record.offset, exc, exc.code, exc.message)
            return
        self._triage(tp, record.offset, req, received)

    def _triage(self, tp, offset: int, req: Request, received: float) -> None:
        """A valid request: cancelled already, expired, overloaded, over its limit, or admitted."""
        route, meta = route_of(req), req.metadata
        if self._cancels.seen(req.id):
            self._sink.reject(tp, offset, route, "cancelled", "cancelled before it started",
                              finish_reason="cancelled", metadata=meta)
        elif deadline_of(req, received, self._s.limits.default_timeout_s) <= time.time():
            self._sink.reject(tp, offset, route, "timeout", "deadline passed before it was read",
                              finish_reason="timeout", metadata=meta)
        elif self._overloading and self._sink.room() <= 0:
            self._sink.reject(tp, offset, route, "overloaded", "the worker's waiting pool is full",
                              metadata=meta)
        elif not self._limiter.admit(req.tenant, capped_max_tokens(req, self._s)):
            self._sink.reject(tp, offset, route, "rate_limited", f"tenant {req.tenant!r} is over its rate limit",
                              metadata=meta)
        else:
            self._sink.admit(tp, offset, req, received)

    # -- rebalance --------------------------------------------------------------------------------

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Requeue what runs from these partitions, commit their watermark, forget them."""
        if revoked:
            log.info("intake.revoked", partitions=sorted(tp.partition for tp in revoked))
            # The fetch loop runs on while we wait: it must not start new work on these.
            self._revoking = set(revoked)
            self._consumer.pause(*revoked)
            await self._sink.requeue(revoked)
            await self._commit_before_forgetting(revoked)
        self._tracker.forget(revoked)
        for tp in revoked:  # its new owner reports it now; a stale value would win the max()
            try:
                self._m.consumer_lag.remove(str(tp.partition))
            except KeyError:
                pass

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.joined = True
        self._revoking = set()
        log.info("intake.assigned", partitions=sorted(tp.partition for tp in assigned))
        # The new assignment starts unpaused: pause before the fetcher races ahead of the pool.
        if assigned and (not self.fetching or self._sink.room() <= 0):
            self._consumer.pause(*assigned)

    # -- commits ----------------------------------------------------------------------------------

    def request_commit(self) -> None:
        self._commit_wanted.set()

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            try:
                await self.commit()
            except Exception:  # noqa: BLE001 - retried below
                log.exception("intake.commit_error")
            await asyncio.sleep(COMMIT_EVERY_S)
            if self._tracker.to_commit():
                self._commit_wanted.set()  # a failed commit is retried, not left for the next finish

    async def commit(self, tps=None) -> bool:
        """Commit the watermarks that moved; False if the broker refused (try again later)."""
        marks = self._tracker.to_commit(tps)
        if not marks or self._consumer is None:
            return True
        try:
            await self._consumer.commit(marks)
        except KafkaError as exc:  # rebalancing or coordinator moved: retried
            log.warning("intake.commit_failed", error=repr(exc), partitions=len(marks))
            return False
        self._tracker.committed(marks)
        return True

    async def _commit_before_forgetting(self, tps) -> None:
        # A watermark lost here means the partition's next owner reruns finished requests
        # (duplicate `done`s): worth a few retries while the coordinator comes back.
        for attempt in range(REVOKE_COMMIT_RETRIES):
            if await self.commit(tps):
                return
            await asyncio.sleep(0.5 * (attempt + 1))
        log.error("intake.revoke_commit_lost", partitions=sorted(tp.partition for tp in tps))

    def _update_lag(self) -> None:
        for tp in self._consumer.assignment():
            high = self._consumer.highwater(tp)
            mark = self._tracker.to_commit([tp]).get(tp)
            if high is not None and mark is not None:
                self._m.consumer_lag.labels(str(tp.partition)).set(max(0, high - mark))


def deadline_of(req: Request, received: float, default_timeout_s: float) -> float:
    """Unix time by which the request must be done: from created_at, else from receipt."""
    start = req.created_at if req.created_at is not None else received
    return start + (req.timeout_s if req.timeout_s is not None else default_timeout_s)


def capped_max_tokens(req: Request, settings) -> int:
    return min(req.max_tokens, settings.limits.max_tokens_cap)
