"""Intake: the consumer group on the request topic.

The fetch loop takes only as many records as the waiting pool has room for
(`getmany(max_records=room)`). With no room it pauses every assigned partition but keeps
calling `getmany`: aiokafka measures `max_poll_interval_ms` from the last getmany, so a loop
that stopped fetching would silently fall out of the group. Pauses are forgotten on every
rebalance, so `on_partitions_assigned` pauses again when the pool is full.

Each record is decoded here (bounded by max_message_bytes, so a 100 MB message costs a len())
and then handed to the sink (the Worker) as exactly one of: dead letter, rejection, admission,
or (a record below the partition's end offset at assignment, which the previous owner may have
finished) skipped because its final `done` is already on the reply topic (worker/redelivery.py).
A request whose reply topic the worker may not write to, or which does not exist, is a dead
letter (worker/reply_topics.py): the broker's topic list is read once for the whole batch.
Offsets are committed by the Committer (worker/offsets.py) from the OffsetTracker only.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from producer.schema import InvalidRequest, Request, UndecodableMessage, decode_request
from worker.cancels import RecentCancels
from worker.offsets import Committer, LagGauge, OffsetTracker
from worker.publisher import client_kwargs
from worker.ratelimit import RateLimiter
from worker.redelivery import RedeliveryCheck, Suspect
from worker.reply_topics import ReplyTopics
from worker.tenancy import cancel_key, clamp_priority, tenant_of, tenant_pattern

log = structlog.get_logger(__name__)
POLL_MS = 100  # how soon a freed slot in the pool is noticed
LIST_TOPICS_TRIES = 3
OVERLOAD_BATCH = 64


class Sink(Protocol):
    def room(self) -> int: ...
    def pool_full(self) -> bool: ...
    def hold(self, tp, record) -> None: ...
    def dead_letter(self, record, reason: str) -> None: ...
    def reject(self, tp, offset, route: InvalidRequest, code: str, message: str,
               finish_reason: str = "rejected", metadata: dict | None = None) -> None: ...
    def admit(self, tp, offset, request: Request, received: float) -> None: ...
    def already_done(self, tp, offset, request: Request) -> None: ...
    async def requeue(self, tps: set[TopicPartition]) -> None: ...


def route_of(req: Request) -> InvalidRequest:
    """The reply address of a decoded request, in the shape a rejection needs."""
    return InvalidRequest("", "", request_id=req.id, reply_topic=req.reply_topic,
                          reply_partition=req.reply_partition)


@dataclass
class _Unverified:
    """A decoded record whose reply topic must be looked up on the broker before it is answered."""

    tp: TopicPartition
    record: object
    decoded: Request | InvalidRequest
    suspect: bool  # goes to the redelivery check once its topic is known good
    generation: int


@dataclass
class _Pending:
    """A decoded request that may have run under the partition's previous owner."""

    tp: TopicPartition
    offset: int
    request: Request
    received: float
    timestamp_ms: int
    generation: int  # the assignment it was read under


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, intake: "Intake") -> None:
        self._intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        await self._intake.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        self._intake.on_assigned(set(assigned))
        await self._intake.learn_boundaries(set(assigned))


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
        self.committer = Committer(tracker)
        self.lag = LagGauge(tracker, metrics.consumer_lag)
        self._tasks: list[asyncio.Task] = []
        # Records below a partition's boundary (its end offset when it was assigned) may have
        # run under the previous owner: see worker/redelivery.py.
        self._redelivery = RedeliveryCheck(settings, metrics) if settings.kafka.redelivery_check else None
        self._boundary: dict[TopicPartition, int] = {}
        self._generation = 0
        self._admin: AIOKafkaAdminClient | None = None
        self.reply_topics = ReplyTopics(settings.kafka, self._list_topics)

    @property
    def generation(self) -> int:
        """Bumped by every assignment: work taken under an older one belongs to no partition here."""
        return self._generation

    async def _list_topics(self) -> list[str]:
        if self._admin is None:
            self._admin = AIOKafkaAdminClient(**client_kwargs(self._s.kafka))
            await self._admin.start()
        return await self._admin.list_topics()

    async def start(self) -> None:
        k = self._s.kafka
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(k), group_id=k.group_id, group_instance_id=k.group_instance_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=k.session_timeout_ms, heartbeat_interval_ms=k.session_timeout_ms // 4,
            max_partition_fetch_bytes=k.max_message_bytes + 64 * 1024,
            metadata_max_age_ms=30_000,  # how soon a new tenant's topic is subscribed (pattern)
        )
        if k.tenancy == "topic":  # every tenant's own request topic, new ones found as they appear
            self._consumer.subscribe(pattern=tenant_pattern(k.request_topic, (k.dlq_topic, k.cancel_topic)),
                                     listener=_Rebalance(self))
        else:
            self._consumer.subscribe([k.request_topic], listener=_Rebalance(self))
        if self._redelivery:
            await self._redelivery.start()
        await self._consumer.start()
        self.committer.consumer = self.lag.consumer = self._consumer
        self._tasks = [asyncio.create_task(self._fetch_loop(), name="intake-fetch"),
                       asyncio.create_task(self.committer.run(), name="intake-commit"),
                       asyncio.create_task(self.lag.run(), name="intake-lag")]

    async def close(self) -> None:
        """Final commit, then leave the group (on_partitions_revoked is not called by stop())."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.committer.commit(), 5.0)
        except asyncio.TimeoutError:
            log.warning("intake.final_commit_timeout")
        if self._consumer:
            await self._consumer.stop()
        if self._redelivery:
            await self._redelivery.close()
        if self._admin:
            await self._admin.close()

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
            suspects: list[_Pending] = []
            unverified: list[_Unverified] = []
            for tp, records in batch.items():
                boundary = self._boundary_of(tp, records)
                for record in records:
                    self._handle_safely(tp, record, suspects if record.offset < boundary else None, unverified)
            if unverified:
                await self._verify_reply_topics(unverified, suspects)
            if suspects:
                await self._triage_suspects(suspects)
            self.lag.update()

    def _boundary_of(self, tp: TopicPartition, records) -> int:
        if self._redelivery is None:
            return -1
        if tp not in self._boundary:  # the high watermark now is at least the one at assignment
            high = self._consumer.highwater(tp)
            self._boundary[tp] = high if high is not None else records[-1].offset + 1
        return self._boundary[tp]

    def _handle_safely(self, tp: TopicPartition, record, suspects: list | None = None,
                       unverified: list | None = None) -> None:
        try:
            self._handle(tp, record, suspects, unverified)
        except Exception as exc:  # noqa: BLE001 - a bug must not wedge the partition's watermark
            log.exception("intake.handle_failed", partition=tp.partition, offset=record.offset)
            self._sink.dead_letter(record, f"internal error: {exc!r}"[:300])

    def _handle(self, tp: TopicPartition, record, suspects: list | None = None,
                unverified: list | None = None) -> None:
        """One record: answered at once, set aside until its reply topic is looked up, or (a
        suspect) set aside for the redelivery check."""
        decoded = self._decode(tp, record)
        if decoded is None:
            return
        verdict = self.reply_topics.verdict(decoded.reply_topic, self._tenant_of(tp))
        if verdict is None and unverified is not None:
            unverified.append(_Unverified(tp, record, decoded, suspects is not None, self._generation))
            return
        self._dispatch(tp, record, decoded, verdict, suspects)

    def _dispatch(self, tp, record, decoded: Request | InvalidRequest, verdict: str | None,
                  suspects: list | None) -> None:
        if verdict != "ok":
            reason = verdict or f"reply_topic {decoded.reply_topic!r} could not be looked up"
            log.warning("intake.reply_topic_refused", partition=tp.partition, offset=record.offset, reason=reason)
            self._m.reply_topic_refusals.inc()
            self._sink.dead_letter(record, reason)
        elif isinstance(decoded, InvalidRequest):
            self._sink.reject(tp, record.offset, decoded, decoded.code, decoded.message)
        elif isinstance(decoded := self._apply_tenancy(tp, decoded), InvalidRequest):
            self._sink.reject(tp, record.offset, decoded, decoded.code, decoded.message)
        elif suspects is None:
            self._triage(tp, record.offset, decoded, time.time())
        else:
            suspects.append(_Pending(tp, record.offset, decoded, time.time(), record.timestamp, self._generation))

    async def _verify_reply_topics(self, unverified: list[_Unverified], suspects: list[_Pending]) -> None:
        """One look at the broker's topic list for every unknown reply topic of the batch (a few
        tries: a request is dead-lettered as unanswerable only when the broker cannot be asked)."""
        listed = False
        for attempt in range(LIST_TOPICS_TRIES):
            try:
                await self.reply_topics.refresh()
                listed = True
                break
            except Exception as exc:  # noqa: BLE001 - the broker did not answer: try again, then refuse
                log.warning("intake.list_topics_failed", error=repr(exc), attempt=attempt + 1)
                await asyncio.sleep(0.5 * (attempt + 1))
        for u in unverified:
            if u.generation != self._generation or u.tp in self._revoking:
                continue  # the partition moved meanwhile: untracked, its new owner reads it
            try:
                verdict = self.reply_topics.verdict(u.decoded.reply_topic, self._tenant_of(u.tp), listed_after=listed)
                self._dispatch(u.tp, u.record, u.decoded, verdict, suspects if u.suspect else None)
            except Exception as exc:  # noqa: BLE001 - as in _handle_safely
                log.exception("intake.handle_failed", partition=u.tp.partition, offset=u.record.offset)
                self._sink.dead_letter(u.record, f"internal error: {exc!r}"[:300])

    async def _triage_suspects(self, pending: list[_Pending]) -> None:
        """Requests that may have run before: skip those whose final `done` exists, triage the rest."""
        found = await self._redelivery.finished(
            [Suspect(p.request.id, p.request.reply_topic, p.request.reply_partition, p.timestamp_ms)
             for p in pending])
        for p in pending:
            if p.generation != self._generation or p.tp in self._revoking:
                continue  # the partition moved meanwhile: untracked, its new owner reads it
            try:
                if p.request.id in found:
                    self._sink.already_done(p.tp, p.offset, p.request)
                else:
                    self._triage(p.tp, p.offset, p.request, p.received)
            except Exception:  # noqa: BLE001 - as in _handle_safely; the request is decoded
                log.exception("intake.triage_failed", partition=p.tp.partition, offset=p.offset)
                self._sink.reject(p.tp, p.offset, route_of(p.request), "internal", "internal error")

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

    def _tenant_of(self, tp: TopicPartition) -> str | None:
        """The tenant Kafka vouches for (topic tenancy: the request topic's suffix), else None."""
        k = self._s.kafka
        return tenant_of(tp.topic, k.request_topic) if k.tenancy == "topic" else None

    def _apply_tenancy(self, tp: TopicPartition, req: Request) -> Request | InvalidRequest:
        """The request as the worker will run it: the topic's tenant (a body that claims another
        is rejected) and the tenant's priority range."""
        tenant = self._tenant_of(tp)
        # "default" (the contract's default, which clients send unasked) claims nothing
        if tenant is not None and req.tenant not in (tenant, "default"):
            return InvalidRequest("tenant", f"tenant: {req.tenant!r} is not the tenant of this request topic",
                                  request_id=req.id, reply_topic=req.reply_topic, reply_partition=req.reply_partition)
        tenant = tenant or req.tenant
        limits = self._s.limits
        priority = clamp_priority(req.priority, limits.tenants.get(tenant, limits.default_tenant))
        if tenant == req.tenant and priority == req.priority:
            return req
        return req.model_copy(update={"tenant": tenant, "priority": priority})

    def _decode(self, tp: TopicPartition, record) -> Request | InvalidRequest | None:
        """Decode a record: a valid request, an invalid one (to reject once its reply topic is
        known good), or None when it was dead-lettered."""
        if tp in self._revoking or tp not in self._consumer.assignment():
            return None  # being revoked: untracked and uncommitted, so its new owner reads it
        self._tracker.add(tp, record.offset)
        self._sink.hold(tp, record)
        try:
            req = decode_request(record.value, self._s.kafka.max_message_bytes, self._s.model.max_model_len)
        except UndecodableMessage as exc:
            log.warning("intake.dead_letter", partition=tp.partition, offset=record.offset, reason=exc.reason)
            self._sink.dead_letter(record, exc.reason)
            return None
        except InvalidRequest as exc:
            log.info("intake.invalid", request_id=exc.request_id, partition=tp.partition,
                     offset=record.offset, field=exc.field)
            return exc
        return req

    def _triage(self, tp, offset: int, req: Request, received: float) -> None:
        """A valid request: cancelled already, expired, overloaded, over its limit, or admitted."""
        route, meta = route_of(req), req.metadata
        if self._cancels.seen(cancel_key(req.id, self._tenant_of(tp))):
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
            await self.committer.commit_before_forgetting(revoked)
        self._tracker.forget(revoked)
        self.lag.remove(revoked)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.joined = True
        self._revoking = set()
        self._generation += 1
        self._boundary = {}
        if self._redelivery:
            self._redelivery.forget()
        log.info("intake.assigned", partitions=sorted(tp.partition for tp in assigned))
        # The new assignment starts unpaused: pause before the fetcher races ahead of the pool.
        if assigned and (not self.fetching or self._sink.room() <= 0):
            self._consumer.pause(*assigned)

    async def learn_boundaries(self, assigned: set[TopicPartition]) -> None:
        """The end offsets now: records below them may have run under the previous owner.
        If the broker does not answer soon, the first fetch's high watermark stands in."""
        if self._redelivery is None or not assigned:
            return
        try:
            ends = await asyncio.wait_for(self._consumer.end_offsets(list(assigned)), 5.0)
        except Exception as exc:  # noqa: BLE001 - the lazy boundary is a safe over-estimate
            log.warning("intake.end_offsets_failed", error=repr(exc))
            return
        self._boundary.update({tp: end for tp, end in ends.items() if tp in assigned})

    def request_commit(self) -> None:
        self.committer.request()


def deadline_of(req: Request, received: float, default_timeout_s: float) -> float:
    """Unix time by which the request must be done: from created_at, else from receipt. A
    created_at in the future counts as receipt: it must not stretch a deadline past timeout_s."""
    start = min(req.created_at, received) if req.created_at is not None else received
    return start + (req.timeout_s if req.timeout_s is not None else default_timeout_s)


def capped_max_tokens(req: Request, settings) -> int:
    return min(req.max_tokens, settings.limits.max_tokens_cap)
