"""Triage, shared by both intakes: each record becomes a dead letter, a rejection or an
`Admission`, a request with its capped token budget and deadline (decode, reply-topic check,
tenancy, validation, admission); the request tracker hands it to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, KafkaError, KafkaException, admin

from inferline.contract.schema import InvalidRequest, Request, UndecodableMessage, content_type_of
from inferline.contract.schema import decode_request
from inferline.worker.delivery.publisher import ReplyRoute
from inferline.worker.intake.reply_topics import ReplyTopics, unsafe_limits
from inferline.worker.service.ratelimit import RateLimiter
from inferline.worker.service.tenancy import cancel_key, clamp_priority, tenant_of
from inferline.worker.tracing import reply_headers

log = structlog.get_logger(__name__)
# A lookup the broker did not answer is tried again after this, doubling up to the max, until the
# request has waited final_retry_s: a passing fault dead-letters no honest request.
LOOKUP_BACKOFF_S = 0.5
MAX_LOOKUP_BACKOFF_S = 10.0
# Per-topic errors of a config read that are the broker's word on the topic, not a passing fault.
UNKNOWN_TOPIC, TOPIC_AUTHORIZATION_FAILED = 3, 29
REFUSAL_LOG_S = 1.0


@dataclass(frozen=True)
class Admission:
    """A request the intake admitted."""

    tp: TopicPartition
    offset: int
    request: Request
    received: float  # Unix seconds
    max_tokens: int
    deadline: float  # Unix seconds
    sent_at: float | None = None  # the record's Kafka timestamp, Unix seconds, if it has one
    headers: list | None = None  # the record's: its trace context (worker/tracing.py)
    size: int = 0  # the record's key and value bytes (what a lane holding it counts)


def deadline_of(req: Request, received: float, default_timeout_s: float) -> float:
    """Unix time by which the request must be done: from created_at (if past), else receipt."""
    start = min(req.created_at, received) if req.created_at is not None else received
    return start + (req.timeout_s if req.timeout_s is not None else default_timeout_s)


def default_max_tokens(n: int, limits) -> int:
    """max_tokens of a request that left it out, until the engine knows what its prompt leaves:
    the cap, and no more than n samples may take of INFERLINE_LIMITS__MAX_REQUEST_TOKENS."""
    return max(1, min(limits.max_tokens_cap, limits.max_request_tokens // n))


def budget_problem(req: Request, max_tokens: int, limits) -> str | None:
    """Why max_tokens is over the worker's cap, or n x max_tokens over a request's, or None."""
    if max_tokens > limits.max_tokens_cap:
        cap = f"this worker's cap of {limits.max_tokens_cap} (INFERLINE_LIMITS__MAX_TOKENS_CAP)"
        return f"max_tokens: {max_tokens} is over {cap}"
    if req.n * max_tokens > limits.max_request_tokens:
        field = "n" if req.n > 1 else "max_tokens"
        total = f"{req.n} samples x max_tokens {max_tokens} = {req.n * max_tokens} tokens"
        return f"{field}: {total}, at most {limits.max_request_tokens} per request"
    return None


class Sink(Protocol):
    def room(self) -> int: ...
    def pool_full(self) -> bool: ...
    def admit(self, admission: "Admission") -> None: ...
    async def requeue(self, tps: set[TopicPartition]) -> None: ...
    def fatal(self, exc: BaseException) -> None: ...


@dataclass
class _Unverified:
    tp: TopicPartition
    record: object
    decoded: Request | InvalidRequest
    generation: int
    since: float = float("-inf")  # when it was read: a topic list after it decides


@dataclass
class Record:
    """One request record as triage reads it, whichever consumer brought it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list | None
    # Its Kafka timestamp, Unix seconds, if it has one: CreateTime is the producer's clock (or
    # any value it set); LogAppendTime, where the topic asks for it, the broker's.
    sent_at: float | None = field(default=None, kw_only=True)
    delivery_count: int = field(default=1, kw_only=True)  # share groups count them

    @classmethod
    def read(cls, messages) -> list[Record]:
        """confluent-kafka's messages as records; one that carries an error is logged, skipped,
        unless the error is fatal: the consumer is dead, and polling it on would take nothing."""
        records = []
        for m in messages:
            if m.error() is not None:
                if is_fatal(m.error()):
                    raise KafkaException(m.error())
                log.warning("intake.fetch_error", error=str(m.error()))
                continue
            fields = (m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers())
            kind, ms = m.timestamp()
            sent_at = ms / 1000 if kind != TIMESTAMP_NOT_AVAILABLE and ms >= 0 else None
            count = m.delivery_count() or 1
            records.append(cls(*fields, sent_at=sent_at, delivery_count=count))
        return records


def is_fatal(error: KafkaError) -> bool:
    """librdkafka reports a consumer's fatal error as an event of code _FATAL, fatal() false."""
    return error.fatal() or error.code() == KafkaError._FATAL


def set_group_configs(kafka, configs: dict[str, str]) -> None:
    """Blocking: set the group's `configs` one at a time; a refused one (no ALTER_CONFIGS right,
    out of the broker's bounds) leaves the broker's own, logged, and stops no other."""
    client = admin.AdminClient(kafka.librdkafka_config())  # kept: a collected one drops futures
    for name, value in configs.items():
        entry = admin.ConfigEntry(name, value, incremental_operation=admin.AlterConfigOpType.SET)
        group = admin.ConfigResource("group", kafka.group_id, incremental_configs=[entry])
        try:
            for future in client.incremental_alter_configs([group]).values():
                future.result(timeout=30)
        except Exception as exc:  # noqa: BLE001 - the broker's own then applies
            log.warning("intake.group_config_failed", config=name, error=repr(exc))


class Triage:
    """What both intakes do with a record once it is theirs; subclasses bring the records."""

    def __init__(
        self, settings, sink: Sink, tracker, limiter: RateLimiter, metrics, cancels, delivery
    ) -> None:
        self._s = settings
        self._sink, self._tracker, self._limiter, self._m = (sink, tracker, limiter, metrics)
        self._delivery, self._cancels = delivery, cancels
        self.joined = False
        self.fetching = True  # False once draining: the loop keeps polling, takes nothing
        self._overloading = False  # this batch was fetched past the pool's room, to reject
        self._tasks: list[asyncio.Task] = []
        self._verifying: set[asyncio.Task] = set()
        self._num_verifying = 0
        self._refusal_logged_at, self._refusals_unlogged = float("-inf"), 0
        self._admin: AIOKafkaAdminClient | None = None
        self._replicas: dict[str, int] = {}
        self.reply_topics = ReplyTopics(
            settings.kafka, self._list_topics, check_topics=self._check_topics
        )

    def _claim(self, tp: TopicPartition, record) -> bool:
        """Whether this intake takes `record` (group mode: owned, not final already)."""
        return True

    def _still_ours(self, tp: TopicPartition, generation: int) -> bool:
        return True

    async def _close_triage(self) -> None:
        for task in [*self._tasks, *self._verifying]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._verifying, return_exceptions=True)
        if self._admin:
            await self._admin.close()

    async def _admin_client(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            self._admin = AIOKafkaAdminClient(**self._s.kafka.client_options())
            await self._admin.start()
        return self._admin

    async def _list_topics(self) -> list[str]:
        # Every topic's metadata: asking for one by name could auto-create it.
        described = await (await self._admin_client()).describe_topics()
        self._replicas = {
            t["topic"]: min((len(p["replicas"]) for p in t["partitions"]), default=0)
            for t in described
            if t["error_code"] == 0
        }
        return list(self._replicas)

    async def _check_topics(self, topics: list[str]) -> dict[str, str | None]:
        names = {"max.message.bytes": None, "min.insync.replicas": None}
        responses = await (await self._admin_client()).describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t, dict(names)) for t in topics]
        )
        reasons: dict[str, str | None] = {}
        least = self._s.kafka.min_reply_message_bytes  # bytes a reply topic must take
        for response in responses:
            for res in response.to_object()["resources"]:
                topic, error = res["resource_name"], res["error_code"]
                if error in (UNKNOWN_TOPIC, TOPIC_AUTHORIZATION_FAILED):
                    reasons[topic] = f"its configs cannot be read (error {error})"
                    continue
                if error:  # left out: asked again, meanwhile its last verdict holds
                    log.warning("intake.topic_configs_unread", topic=topic, error_code=error)
                    continue
                configs = {e["config_names"]: e["config_value"] for e in res["config_entries"]}
                reasons[topic] = unsafe_limits(configs, self._replicas.get(topic, 0), least)
        return reasons

    @contextlib.contextmanager
    def _dead_letter_on_bug(self, tp: TopicPartition, record):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - a bug must not wedge the partition's watermark
            log.exception("intake.handle_failed", partition=tp.partition, offset=record.offset)
            self._delivery.dead_letter(record, f"internal error: {exc!r}"[:300])

    def _handle_safely(self, tp: TopicPartition, record, unverified: list | None = None) -> None:
        with self._dead_letter_on_bug(tp, record):
            self._handle(tp, record, unverified)

    def _handle(self, tp: TopicPartition, record, unverified: list | None = None) -> None:
        decoded = self._decode(tp, record)
        if decoded is None:
            return
        verdict = self.reply_topics.verdict(decoded.reply_topic, self._tenant_of(tp))
        if verdict is None and unverified is not None:
            epoch, now = self._tracker.epoch(tp), self.reply_topics.clock()
            unverified.append(_Unverified(tp, record, decoded, epoch, now))
            return
        self._dispatch(tp, record, decoded, verdict)

    def _dispatch(self, tp, record, decoded: Request | InvalidRequest, verdict: str | None) -> None:
        if verdict != "ok":
            reason = verdict or f"reply_topic {decoded.reply_topic!r} could not be looked up"
            self._log_refusal(tp, record.offset, reason)
            self._m.reply_topic_refusals.inc()
            self._delivery.dead_letter(record, reason)
            return
        if isinstance(decoded, Request):
            decoded = self._apply_tenancy(tp, decoded)
        if isinstance(decoded, InvalidRequest):
            route = ReplyRoute.of(decoded, reply_headers(record.headers))
            self._delivery.reject(tp, record.offset, route, decoded.code, decoded.message)
        else:
            self._triage(tp, record, decoded)

    def _log_refusal(self, tp, offset: int, reason: str) -> None:
        """At most one line per REFUSAL_LOG_S; the metric counts them all."""
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_S:
            where = {"partition": tp.partition, "offset": offset, "reason": reason}
            log.warning("intake.reply_topic_refused", **where, unlogged=self._refusals_unlogged)
            self._refusal_logged_at, self._refusals_unlogged = now, 0
        else:
            self._refusals_unlogged += 1

    def _verify_in_background(self, unverified: list[_Unverified]) -> None:
        """Look unknown reply topics up in a task; they count against the pool's room meanwhile."""
        self._num_verifying += len(unverified)
        task = asyncio.create_task(self._verify_reply_topics(unverified))
        self._verifying.add(task)

        def done(t: asyncio.Task) -> None:
            self._verifying.discard(t)
            self._num_verifying -= len(unverified)

        task.add_done_callback(done)

    async def _verify_reply_topics(self, unverified: list[_Unverified]) -> None:
        """Look the batch's unknown reply topics up, one shared topic list at a time. A topic the
        broker lists as missing (or unsafe) is refused; one it cannot be asked about keeps its
        requests waiting, asked again with backoff for up to final_retry_s, then dead-lettered."""
        started, backoff = time.monotonic(), LOOKUP_BACKOFF_S
        while True:
            listed = await self._look_up(unverified)
            give_up = time.monotonic() - started >= self._s.kafka.final_retry_s
            unverified = [u for u in unverified if not self._decide(u, listed, give_up)]
            if not unverified:
                return
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_LOOKUP_BACKOFF_S)

    async def _look_up(self, unverified: list[_Unverified]) -> bool:
        """Whether a topic list read after these requests is in; their topics' configs read."""
        try:
            await self.reply_topics.refresh_after(max(u.since for u in unverified))
        except Exception as exc:  # noqa: BLE001 - no answer: the requests wait
            log.warning("intake.list_topics_failed", error=repr(exc))
            return False
        try:
            await self.reply_topics.check({u.decoded.reply_topic for u in unverified})
        except Exception as exc:  # noqa: BLE001 - as above; known topics keep their verdict
            log.warning("intake.check_topics_failed", error=repr(exc))
        return True

    def _decide(self, u: _Unverified, listed: bool, give_up: bool) -> bool:
        """Dispatch `u` if its topic has a verdict (or it waited long enough); False: it waits."""
        if not self._still_ours(u.tp, u.generation):
            return True
        with self._dead_letter_on_bug(u.tp, u.record):
            topic, tenant = u.decoded.reply_topic, self._tenant_of(u.tp)
            verdict = self.reply_topics.verdict(topic, tenant, listed_after=listed, last_known=True)
            if verdict is None and not give_up:
                return False
            self._dispatch(u.tp, u.record, u.decoded, verdict)
        return True

    def _tenant_of(self, tp: TopicPartition) -> str | None:
        k = self._s.kafka
        return tenant_of(tp.topic, k.request_topic) if k.tenancy == "topic" else None

    def _apply_tenancy(self, tp: TopicPartition, req: Request) -> Request | InvalidRequest:
        """The request with the topic's tenant (a body claiming another is rejected) and range."""
        tenant = self._tenant_of(tp)
        # "default" (the contract's default, sent unasked) claims nothing
        if tenant is not None and req.tenant not in (tenant, "default"):
            message = f"tenant: {req.tenant!r} is not the tenant of this request topic"
            return InvalidRequest("tenant", message, **req.route())
        tenant = tenant or req.tenant
        priority = clamp_priority(req.priority, self._s.limits, tenant)
        if tenant == req.tenant and priority == req.priority:
            return req
        return req.model_copy(update={"tenant": tenant, "priority": priority})

    def _decode(self, tp: TopicPartition, record) -> Request | InvalidRequest | None:
        """A valid request, an invalid one (rejected once its reply topic is good), or None."""
        if not self._claim(tp, record):
            return None
        self._tracker.partition(tp).held[record.offset] = record  # to dead-letter it if need be
        try:
            caps = (self._s.kafka.max_message_bytes, self._s.model.max_model_len)
            req = decode_request(record.value, *caps, content_type_of(record.headers))
        except UndecodableMessage as exc:
            where = {"partition": tp.partition, "offset": record.offset}
            log.warning("intake.dead_letter", **where, reason=exc.reason)
            self._delivery.dead_letter(record, exc.reason)
            return None
        except InvalidRequest as exc:
            where = {"partition": tp.partition, "offset": record.offset}
            log.info("intake.invalid", request_id=exc.request_id, **where, field=exc.field)
            return exc
        return req

    def _triage(self, tp, record: Record, req: Request) -> None:
        offset, received, headers = record.offset, time.time(), record.headers
        # First: a resubmission gets its first final again, never a second (other content runs).
        if self._delivery.answered_before(tp, offset, req):
            return
        deadline = deadline_of(req, received, self._s.limits.default_timeout_s)
        max_tokens = req.max_tokens or default_max_tokens(req.n, self._s.limits)
        refused = self._refusal(tp, req, deadline, max_tokens)
        if refused is None:
            size = len(record.value or b"") + len(record.key or b"")
            adm = Admission(
                tp, offset, req, received, max_tokens, deadline, record.sent_at, headers, size
            )
            self._sink.admit(adm)
            return
        code, message, reason = refused
        route, meta = ReplyRoute.of(req, reply_headers(headers)), req.metadata
        self._delivery.reject(tp, offset, route, code, message, finish_reason=reason, metadata=meta)

    def recheck(self, adm: Admission) -> bool:
        """Whether a request that waited in a lane may still run: one cancelled meanwhile is
        answered `cancelled` (the deadline the engine checks)."""
        if not self._cancels.seen(cancel_key(adm.request.id, self._tenant_of(adm.tp))):
            return True
        self._limiter.refund(adm.request.tenant, adm.max_tokens * adm.request.n)  # never ran
        route = ReplyRoute.of(adm.request, reply_headers(adm.headers))
        reason = ("cancelled", "cancelled before it started")
        self._delivery.reject(
            adm.tp,
            adm.offset,
            route,
            *reason,
            finish_reason="cancelled",
            metadata=adm.request.metadata,
        )
        return False

    def _refusal(self, tp, req: Request, deadline: float, max_tokens: int) -> tuple | None:
        """(code, message, finish_reason) why `req` will not run, or None; the rate limiter is
        asked last (it counts what it admits)."""
        if (problem := budget_problem(req, max_tokens, self._s.limits)) is not None:
            return "invalid_request", problem, "rejected"
        if self._cancels.seen(cancel_key(req.id, self._tenant_of(tp))):
            return "cancelled", "cancelled before it started", "cancelled"
        if deadline <= time.time():
            return "timeout", "deadline passed before it was read", "timeout"
        if self._overloading and self._sink.room() <= 0:
            return "overloaded", "the worker's waiting pool is full", "rejected"
        if not self._limiter.admit(req.tenant, max_tokens * req.n):
            return ("rate_limited", f"tenant {req.tenant!r} is over its rate limit", "rejected")
        return None
