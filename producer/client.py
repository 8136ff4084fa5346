"""Async client for inferline workers: submit requests, stream their events, cancel them.

    async with InferenceClient() as client:          # settings from INFERLINE_* like the worker
        handle = await client.submit("Explain Kafka in one sentence", max_tokens=64)
        async for delta in handle.text():
            if delta.restart:                        # a new attempt: what was shown is void
                ...
            print(delta, end="")
        result = await handle.result()               # text, finish_reason, usage, timing

Reply topics: by default one topic per client instance (created with short retention, deleted
on close); ``reply_topic="per-request"`` makes a topic per request and deletes it after ``done``;
any other string names an existing or new topic shared with others (events are matched by id).

One consumer task reads every reply topic and feeds each event to its handle by id; handles
reassemble synchronously (no task per event or per request), so one client can keep many
thousands of requests in flight. Delivery is at least once: a handle drops a superseded
attempt, ignores duplicates by (attempt, seq) and counts gaps.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from config.settings import KafkaSettings, Settings, load_settings
from producer.schema import (
    Cancel,
    ChatMessage,
    DoneEvent,
    ErrorCode,
    ErrorInfo,
    Request,
    StartedEvent,
    Timing,
    TokensEvent,
    UndecodableMessage,
    Usage,
    decode_event,
    encode_cancel,
    encode_request,
)

log = structlog.get_logger(__name__)

Event = StartedEvent | TokensEvent | DoneEvent
PER_REQUEST = "per-request"
REPLY_TOPIC_PREFIX = "inferline.reply."
# The worker's deadline counts from created_at; past it plus this grace, `done` is overdue.
DEADLINE_GRACE_S = 30.0
TOPIC_ALREADY_EXISTS = 36
UNKNOWN_TOPIC = 3


# ---------------------------------------------------------------------------------------------
# Errors, by the contract's error codes


class InferenceError(Exception):
    """A request that did not end in ``stop`` or ``length``. ``code`` is the contract's error
    code; ``result`` the partial Result (text so far, usage, timing) when there is one."""

    code: ErrorCode = "internal"

    def __init__(self, message: str, *, request_id: str | None = None, result: Result | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.result = result


class RequestRejected(InferenceError):
    """The worker never ran the request (finish_reason ``rejected``)."""

    code: ErrorCode = "invalid_request"


class InvalidRequestError(RequestRejected):
    code: ErrorCode = "invalid_request"


class PromptTooLong(RequestRejected):
    code: ErrorCode = "prompt_too_long"


class RateLimited(RequestRejected):
    code: ErrorCode = "rate_limited"


class Overloaded(RequestRejected):
    code: ErrorCode = "overloaded"


class RequestTimeout(InferenceError):
    """The worker's deadline passed, or (``client_side``) no ``done`` came in time."""

    code: ErrorCode = "timeout"
    client_side = False


class ClientTimeout(RequestTimeout):
    client_side = True


class RequestCancelled(InferenceError):
    code: ErrorCode = "cancelled"


class WorkerError(InferenceError):
    code: ErrorCode = "internal"


class IncompleteStream(InferenceError):
    """Events went missing (a gap in ``seq``) and ``done`` carried no whole text to repair it."""


class ClientClosed(InferenceError):
    """The client was closed before the request finished."""


ERRORS_BY_CODE: dict[str, type[InferenceError]] = {
    "invalid_request": InvalidRequestError,
    "prompt_too_long": PromptTooLong,
    "rate_limited": RateLimited,
    "overloaded": Overloaded,
    "timeout": RequestTimeout,
    "cancelled": RequestCancelled,
    "internal": WorkerError,
}
# When a done carries no error, its finish_reason decides.
_CODE_BY_REASON = {"rejected": "invalid_request", "timeout": "timeout", "cancelled": "cancelled", "error": "internal"}


def error_for(done: DoneEvent) -> InferenceError | None:
    """The exception a final ``done`` stands for, or None when it succeeded."""
    if done.finish_reason in ("stop", "length"):
        return None
    code = done.error.code if done.error else _CODE_BY_REASON.get(done.finish_reason, "internal")
    # The code decides, not the reason: a request rejected because its deadline passed in the
    # queue is a RequestTimeout to its caller.
    cls = ERRORS_BY_CODE.get(code, WorkerError)
    message = done.error.message if done.error else f"finished with {done.finish_reason}"
    return cls(f"{code}: {message}", request_id=done.id)


# ---------------------------------------------------------------------------------------------
# Reassembly


class TextDelta(str):
    """New text of a request. ``restart`` is True on the first delta of a new attempt (a worker
    died and another started over): discard the text shown so far."""

    attempt: str
    restart: bool

    def __new__(cls, text: str, attempt: str, restart: bool = False) -> TextDelta:
        obj = super().__new__(cls, text)
        obj.attempt, obj.restart = attempt, restart
        return obj


@dataclass
class Result:
    """The outcome of one request: the final attempt's text and the worker's accounting, plus
    what this client measured (``client_*``, seconds since submit, monotonic clock)."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None = None
    timing: Timing | None = None
    error: ErrorInfo | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    attempt: str | None = None
    attempts: int = 0
    duplicates: int = 0
    gaps: int = 0
    client_ttft_s: float | None = None
    client_total_s: float | None = None


class RequestHandle:
    """One submitted request. Events are fed by the client's consumer task; any number of
    readers (``events()``, ``text()``, ``result()``) may follow along, each from the start."""

    def __init__(self, request: Request, client: InferenceClient | None = None):
        self.request = request
        self.id = request.id
        self._client = client
        self.log: list[Event] = []  # accepted events, in order, all attempts
        self.attempt: str | None = None
        self.attempts = 0
        self.duplicates = 0
        self.gaps = 0
        self._next_seq = 0
        self._dead: set[str] = set()  # superseded or requeued attempts
        self._parts: list[str] = []
        self.token_ids: list[int] = []
        self.done_event: DoneEvent | None = None
        self.failure: InferenceError | None = None
        self.finished = False
        self.t_submit = time.monotonic()
        self.t_first_token: float | None = None
        self.t_done: float | None = None
        # (monotonic time, tokens) of each tokens event of the current attempt: for ITL stats.
        self.token_times: list[tuple[float, int]] = []
        self._changed = asyncio.Event()
        self._on_finish: Callable[[RequestHandle], None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    # --- fed by the consumer task (synchronous: no await, so no reader sees half a state) ----

    def feed(self, ev: Event) -> bool:
        """Take one event; False when it was stale, a duplicate, or came after the end."""
        if self.finished or ev.attempt in self._dead:
            return False
        if ev.attempt != self.attempt:
            self._new_attempt(ev.attempt)
        if ev.seq < self._next_seq:
            self.duplicates += 1
            return False
        if ev.seq > self._next_seq:
            self.gaps += 1
            log.warning("event gap", request_id=self.id, attempt=ev.attempt, expected=self._next_seq, got=ev.seq)
        self._next_seq = ev.seq + 1
        self.log.append(ev)
        self._apply(ev)
        self._wake()
        return True

    def _new_attempt(self, attempt: str) -> None:
        # At least once: the old attempt's worker is gone (or a zombie); its text is void.
        if self.attempt is not None:
            self._dead.add(self.attempt)
            log.info("new attempt", request_id=self.id, old=self.attempt, new=attempt)
        self.attempt, self.attempts, self._next_seq = attempt, self.attempts + 1, 0
        self._parts, self.token_ids, self.token_times, self.t_first_token = [], [], [], None

    def _apply(self, ev: Event) -> None:
        if isinstance(ev, TokensEvent):
            now = time.monotonic()
            if self.t_first_token is None and ev.token_ids:
                self.t_first_token = now
            self.token_times.append((now, len(ev.token_ids)))
            self._parts.append(ev.text)
            self.token_ids.extend(ev.token_ids)
        elif isinstance(ev, DoneEvent):
            if ev.finish_reason == "requeued":
                self._dead.add(ev.attempt)  # another attempt follows
            else:
                self._finish(ev, error_for(ev))

    def _finish(self, done: DoneEvent | None, failure: InferenceError | None) -> None:
        self.done_event, self.failure, self.finished = done, failure, True
        self.t_done = time.monotonic()
        if self._timer:
            self._timer.cancel()
        if failure is not None:
            failure.result = self.partial_result()
        if self._on_finish:
            self._on_finish(self)
        self._wake()

    def fail(self, failure: InferenceError) -> None:
        """End the request on the client side (client timeout, client closed)."""
        if not self.finished:
            failure.request_id = self.id
            self._finish(None, failure)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # --- readers ---------------------------------------------------------------------------

    @property
    def text_so_far(self) -> str:
        """The current attempt's text (the whole text once done)."""
        done = self.done_event
        if done is not None and done.text is not None:
            return done.text  # the worker's whole text also repairs a gap
        return "".join(self._parts)

    def partial_result(self) -> Result:
        """What is known now, finished or not."""
        done = self.done_event
        since = self.t_submit
        return Result(
            id=self.id, text=self.text_so_far, token_ids=list(self.token_ids),
            finish_reason=done.finish_reason if done else ("timeout" if isinstance(self.failure, ClientTimeout) else "none"),
            usage=done.usage if done else None, timing=done.timing if done else None,
            error=done.error if done else None, metadata=dict(done.metadata) if done else {},
            attempt=self.attempt, attempts=self.attempts, duplicates=self.duplicates, gaps=self.gaps,
            client_ttft_s=self.t_first_token - since if self.t_first_token else None,
            client_total_s=self.t_done - since if self.t_done else None,
        )

    async def events(self) -> AsyncIterator[Event]:
        """Every accepted event (all attempts, in order) until the final ``done``. Raises only
        for client-side endings (ClientTimeout, ClientClosed); a worker's error arrives as a
        ``done`` event like any other."""
        i = 0
        while True:
            while i < len(self.log):
                yield self.log[i]
                i += 1
            if self.finished:
                break
            await self._changed.wait()
        if self.done_event is None and self.failure is not None:
            raise self.failure

    async def text(self) -> AsyncIterator[TextDelta]:
        """Text deltas as they arrive; see TextDelta.restart. Raises the request's
        InferenceError at the end when it did not finish with ``stop`` or ``length``."""
        attempt = None
        streamed = False
        async for ev in self.events():
            if ev.attempt != attempt:
                if attempt is not None:
                    yield TextDelta("", ev.attempt, restart=True)
                attempt, streamed = ev.attempt, False
            if isinstance(ev, TokensEvent) and ev.text:
                streamed = True
                yield TextDelta(ev.text, ev.attempt)
            elif isinstance(ev, DoneEvent) and not streamed and ev.text:
                yield TextDelta(ev.text, ev.attempt)  # stream=false: the whole text comes in done
        if self.failure is not None:
            raise self.failure

    async def wait(self) -> None:
        """Until the request has finished, one way or another."""
        while not self.finished:
            await self._changed.wait()

    async def result(self, check: bool = True) -> Result:
        """The final Result. With ``check`` (default), raise the InferenceError for anything but
        ``stop``/``length``, and IncompleteStream when a gap left the text unrepairable."""
        await self.wait()
        result = self.partial_result()
        if check and self.failure is not None:
            raise self.failure
        if check and self.gaps and (self.done_event is None or self.done_event.text is None):
            raise IncompleteStream(f"{self.gaps} gap(s) in the event stream", request_id=self.id, result=result)
        return result

    async def cancel(self) -> None:
        """Ask the workers to stop this request; its ``done`` (``cancelled``) still arrives."""
        assert self._client is not None, "handle is not attached to a client"
        await self._client.cancel(self.id)


# ---------------------------------------------------------------------------------------------
# Kafka plumbing


def kafka_options(kafka: KafkaSettings) -> dict[str, Any]:
    """aiokafka connection options (servers, security) from the settings tree."""
    return kafka.connection_options()


def topic_configs(retention_ms: int | None) -> dict[str, str]:
    """Retention settings for a topic; data expires per closed segment, so segments roll too."""
    if retention_ms is None:
        return {}
    return {"retention.ms": str(retention_ms), "segment.ms": str(max(60_000, retention_ms // 4))}


async def create_topics(
    admin: AIOKafkaAdminClient,
    topics: Iterable[tuple[str, int]],
    *,
    replication_factor: int = 1,
    configs: dict[str, str] | None = None,
    wait_s: float = 10.0,
) -> list[str]:
    """Create each (name, partitions) that does not exist yet and wait until every one has
    leaders (a just-created topic answers UnknownTopicOrPartition for a moment). Returns the
    names actually created."""
    wanted = list(topics)
    new = [NewTopic(name, n, replication_factor, topic_configs=dict(configs or {})) for name, n in wanted]
    response = await admin.create_topics(new)
    created = []
    for name, code, *rest in response.topic_errors:
        if code == 0:
            created.append(name)
        elif code != TOPIC_ALREADY_EXISTS:
            raise RuntimeError(f"cannot create topic {name}: error {code} {rest[0] if rest else ''}")
    await wait_for_topics(admin, [name for name, _ in wanted], wait_s)
    return created


async def topic_partitions(admin: AIOKafkaAdminClient, topic: str) -> list[int] | None:
    """Partition ids of a topic whose partitions all have leaders, or None."""
    (meta,) = await admin.describe_topics([topic])
    parts = meta["partitions"]
    if meta["error_code"] or not parts or any(p["leader"] < 0 for p in parts):
        return None
    return sorted(p["partition"] for p in parts)


async def wait_for_topics(admin: AIOKafkaAdminClient, topics: list[str], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for topic in topics:
        while await topic_partitions(admin, topic) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {topic} has no leader after {wait_s} s")
            await asyncio.sleep(0.05)


def per_request_topic(request_id: str) -> str:
    # ':' is legal in ids but not in topic names; 16 + 128 chars stays under 249.
    return REPLY_TOPIC_PREFIX + request_id.replace(":", "_")


# ---------------------------------------------------------------------------------------------
# The client


class InferenceClient:
    """Submit requests to inferline workers and follow their replies (see module docstring).

    Connection settings, topic names and the message size limit come from ``settings`` (by
    default ``load_settings()``, i.e. the same ``INFERLINE_`` environment as the worker);
    keyword arguments override them. ``timeout_s`` is the client-side limit per request; None
    waits until the worker's own deadline (request ``timeout_s`` or the worker default, from
    ``created_at``) plus a grace period, after which a ``done`` is overdue."""

    def __init__(
        self,
        bootstrap_servers: str | None = None,
        *,
        reply_topic: str | None = None,
        request_topic: str | None = None,
        cancel_topic: str | None = None,
        timeout_s: float | None = None,
        reply_partitions: int = 4,
        reply_retention_ms: int = 3_600_000,
        replication_factor: int = 1,
        settings: Settings | None = None,
        producer_options: dict[str, Any] | None = None,
    ):
        self.settings = settings or load_settings()
        kafka = self.settings.kafka
        if bootstrap_servers:
            kafka = kafka.model_copy(update={"bootstrap_servers": bootstrap_servers})
        self.kafka = kafka
        self.request_topic = request_topic or kafka.request_topic
        self.cancel_topic = cancel_topic or kafka.cancel_topic
        self.client_uid = uuid.uuid4().hex[:12]
        self._own_reply_topic = reply_topic is None
        self.reply_topic = REPLY_TOPIC_PREFIX + self.client_uid if reply_topic is None else reply_topic
        self.timeout_s = timeout_s
        self.reply_partitions = reply_partitions
        self.reply_retention_ms = reply_retention_ms
        self.replication_factor = replication_factor
        self._producer_options = producer_options or {}
        self._handles: dict[str, RequestHandle] = {}
        self._watched: set[str] = set()  # reply topics the consumer is assigned
        self._assign_lock = asyncio.Lock()
        self._retiring: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._consumer_task: asyncio.Task | None = None
        self.undecodable = 0
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None

    async def __aenter__(self) -> InferenceClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    async def start(self) -> None:
        """Connect, make the reply topic exist and start reading it."""
        opts = kafka_options(self.kafka)
        self._admin = AIOKafkaAdminClient(**opts, client_id=f"{self.kafka.client_id}-admin")
        await self._admin.start()
        # Idempotent (acks=all): a retried send cannot duplicate a request on the log.
        self._producer = AIOKafkaProducer(
            **opts, client_id=f"{self.kafka.client_id}-producer", enable_idempotence=True, linger_ms=2,
            max_request_size=max(self.kafka.max_message_bytes + 4096, 1_048_576), **self._producer_options,
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            **opts, client_id=f"{self.kafka.client_id}-replies", group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await self._consumer.start()
        if self.reply_topic != PER_REQUEST:
            await self._watch_shared(self.reply_topic, fresh=self._own_reply_topic)
        self._consumer_task = asyncio.create_task(self._consume(), name="inferline-replies")

    async def close(self) -> None:
        """Fail what is still in flight (ClientClosed), drop the topics this client made, disconnect."""
        for handle in list(self._handles.values()):
            handle.fail(ClientClosed("client closed"))
        if self._consumer_task:
            self._consumer_task.cancel()
            await asyncio.gather(self._consumer_task, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        drop = [t for t in self._watched if t.startswith(REPLY_TOPIC_PREFIX) and (self._own_reply_topic or t != self.reply_topic)]
        if drop and self._admin:
            with contextlib.suppress(Exception):
                await self._admin.delete_topics(drop)
        for stop in (self._consumer and self._consumer.stop, self._producer and self._producer.stop,
                     self._admin and self._admin.close):
            if stop:
                with contextlib.suppress(Exception):
                    await stop()
        self._consumer = self._producer = self._admin = None

    # --- submit and cancel -------------------------------------------------------------------

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str] | ChatMessage] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        reply_topic: str | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> RequestHandle:
        """Publish one request and return its handle once the broker has it (acks=all).

        ``params`` are the request's other fields (max_tokens, temperature, seed, stop, stream,
        metadata, timeout_s, ...). ``reply_topic`` overrides the client's for this request
        ("per-request" or a topic name). ``timeout`` is the client-side limit in seconds.
        Raises pydantic's ValidationError for a request the contract forbids."""
        assert self._producer is not None, "client not started"
        rid = request_id or uuid.uuid4().hex
        per_request = (reply_topic or self.reply_topic) == PER_REQUEST
        topic = per_request_topic(rid) if per_request else reply_topic or self.reply_topic
        req = Request(
            id=rid, reply_topic=topic, prompt=prompt, prompt_token_ids=prompt_token_ids,
            messages=[m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages] if messages else None,
            created_at=time.time(), **params,
        )
        payload = encode_request(req)
        if len(payload) > self.kafka.max_message_bytes:
            raise ValueError(f"request is {len(payload)} bytes, over the {self.kafka.max_message_bytes}-byte limit")
        await self._prepare_reply_topic(topic, per_request)
        return await self._send(req, payload, timeout)

    async def _prepare_reply_topic(self, topic: str, per_request: bool) -> None:
        if per_request:
            await self._add_fresh_topic(topic)
        elif topic not in self._watched:
            await self._watch_shared(topic, fresh=False)

    async def _send(self, req: Request, payload: bytes, timeout: float | None) -> RequestHandle:
        handle = RequestHandle(req, self)
        handle._on_finish = self._finished
        # Registered before sending: the first event can beat send()'s acknowledgement.
        self._handles[req.id] = handle
        try:
            await self._producer.send_and_wait(self.request_topic, payload, key=req.id.encode())
        except BaseException:
            self._handles.pop(req.id, None)
            raise
        self._arm_timer(handle, timeout)
        return handle

    def _arm_timer(self, handle: RequestHandle, timeout: float | None) -> None:
        limit = timeout if timeout is not None else self.timeout_s
        if limit is None:
            limit = (handle.request.timeout_s or self.settings.limits.default_timeout_s) + DEADLINE_GRACE_S
        # A timer, not a task: thousands of requests cost thousands of heap entries, nothing more.
        handle._timer = asyncio.get_running_loop().call_later(limit, self._expire, handle, limit)

    def _expire(self, handle: RequestHandle, limit: float) -> None:
        if handle.finished:
            return
        handle.fail(ClientTimeout(f"timeout: no done within {limit:g} s (client side)"))
        self._spawn(self.cancel(handle.id))  # the worker need not keep generating for nobody

    async def cancel(self, request_id: str) -> None:
        """Publish a cancel for ``request_id`` to every worker (the cancel topic)."""
        assert self._producer is not None, "client not started"
        await self._producer.send_and_wait(self.cancel_topic, encode_cancel(Cancel(id=request_id)), key=request_id.encode())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finished(self, handle: RequestHandle) -> None:
        self._handles.pop(handle.id, None)
        topic = handle.request.reply_topic
        if topic == per_request_topic(handle.id) and topic in self._watched:
            self._retiring.add(topic)
            if len(self._retiring) == 1:
                self._spawn(self._retire_topics())

    # --- reply topics ------------------------------------------------------------------------

    async def _watch_shared(self, topic: str, fresh: bool) -> None:
        """Create the topic if missing and read it: from the start when this client created it,
        else from its end (older events are someone else's)."""
        created = await create_topics(
            self._admin, [(topic, self.reply_partitions)], replication_factor=self.replication_factor,
            configs=self._reply_configs(),
        )
        parts = await topic_partitions(self._admin, topic)
        tps = [TopicPartition(topic, p) for p in parts]
        await self._reassign(add=tps, from_start=fresh or topic in created)

    async def _add_fresh_topic(self, topic: str) -> None:
        await create_topics(self._admin, [(topic, 1)], replication_factor=self.replication_factor,
                            configs=self._reply_configs())
        await self._reassign(add=[TopicPartition(topic, 0)], from_start=True)

    def _reply_configs(self) -> dict[str, str]:
        # Reply topics are short-lived and may have fewer replicas than the cluster's
        # min.insync.replicas: the worker's acks=all must not fail on them.
        return {**topic_configs(self.reply_retention_ms), "min.insync.replicas": "1"}

    async def _reassign(self, add: list[TopicPartition] = (), remove: set[str] = frozenset(), from_start: bool = True) -> None:
        """Change the consumer's assignment keeping every kept partition's position
        (aiokafka's assign() replaces the assignment and forgets positions)."""
        consumer = self._consumer
        async with self._assign_lock:
            keep = [tp for tp in consumer.assignment() if tp.topic not in remove]
            positions = {tp: await consumer.position(tp) for tp in keep}
            consumer.assign(keep + [tp for tp in add if tp not in positions])
            for tp, offset in positions.items():
                consumer.seek(tp, offset)
            if add and not from_start:
                await consumer.seek_to_end(*add)
            for tp in add:
                if from_start:
                    consumer.seek(tp, 0)
                await consumer.position(tp)  # resolve now: events sent after this are seen
            self._watched = {tp.topic for tp in consumer.assignment()}

    async def _retire_topics(self) -> None:
        # Batched: many per-request topics finishing together cost one reassign, one delete.
        await asyncio.sleep(0.2)
        topics, self._retiring = set(self._retiring), set()
        await self._reassign(remove=topics)
        with contextlib.suppress(Exception):
            await self._admin.delete_topics(sorted(topics))

    # --- the one consumer task ---------------------------------------------------------------

    async def _consume(self) -> None:
        consumer = self._consumer
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broker hiccup must not strand every handle
                log.warning("reply consumer error", error=repr(exc))
                await asyncio.sleep(0.2)
                continue
            for records in batches.values():
                for record in records:
                    self._route(record.key, record.value)

    def _route(self, key: bytes | None, value: bytes) -> None:
        # The key is the request id: skip other clients' events on a shared topic undecoded.
        if key is not None and key.decode("utf-8", "replace") not in self._handles:
            return
        try:
            ev = decode_event(value, max_bytes=max(self.kafka.max_message_bytes, 4 * 1_048_576))
        except UndecodableMessage as exc:
            self.undecodable += 1
            log.warning("undecodable reply event", reason=exc.reason)
            return
        handle = self._handles.get(ev.id)
        if handle is not None:
            handle.feed(ev)
