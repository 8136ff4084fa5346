"""Async client for inferline workers: submit requests, stream their events, cancel them.

    async with InferenceClient() as client:          # settings from INFERLINE_* like the worker
        handle = await client.submit("Explain Kafka in one sentence", max_tokens=64)
        async for delta in handle.text():
            if delta.restart:                        # a new attempt: what was shown is void
                ...
            print(delta, end="")
        result = await handle.result()               # text, finish_reason, usage, timing

Reply topics: one per client by default, one per request with ``reply_topic="per-request"``, or a
named shared one. Handles drop stale attempts and duplicates (delivery is at least once).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import Settings, load_settings
from inferline.config.tracing import producer_span
from inferline.producer.errors import (
    ERRORS_BY_CODE,
    ClientClosed,
    ClientTimeout,
    IncompleteStream,
    InferenceError,
    InvalidRequestError,
    Overloaded,
    PromptTooLong,
    RateLimited,
    RequestCancelled,
    RequestRejected,
    RequestTimeout,
    WorkerError,
    error_for,
)
from inferline.producer.reassembly import Event, RequestHandle, Result, TextDelta
from inferline.producer.replies import (
    PER_REQUEST,
    REPLY_TOPIC_PREFIX,
    ReplyRouter,
    ReplyTopicError,
    missing_reply_topic,
    per_request_topic,
)
from inferline.contract.schema import MSGPACK, Cancel, ChatMessage, Request, content_headers
from inferline.contract.schema import encode_cancel, encode_request
from inferline.producer.topics import (
    TOPIC_ALREADY_EXISTS,
    UNKNOWN_TOPIC,
    create_topics,
    topic_configs,
    topic_partitions,
    wait_for_topics,
)

__all__ = [
    "InferenceClient",
    "RequestHandle",
    "Result",
    "TextDelta",
    "Event",
    "DEADLINE_GRACE_S",
    # producer.errors
    "InferenceError",
    "RequestRejected",
    "InvalidRequestError",
    "PromptTooLong",
    "RateLimited",
    "Overloaded",
    "RequestTimeout",
    "ClientTimeout",
    "RequestCancelled",
    "WorkerError",
    "IncompleteStream",
    "ClientClosed",
    "ERRORS_BY_CODE",
    "error_for",
    # producer.replies, producer.topics
    "PER_REQUEST",
    "REPLY_TOPIC_PREFIX",
    "per_request_topic",
    "TOPIC_ALREADY_EXISTS",
    "UNKNOWN_TOPIC",
    "topic_configs",
    "create_topics",
    "topic_partitions",
    "wait_for_topics",
]

# The worker's deadline counts from created_at; past it plus this grace, `done` is overdue.
DEADLINE_GRACE_S = 30.0


class InferenceClient:
    """Submit requests to inferline workers and follow their replies (see module docstring).

    ``settings`` default to the worker's ``INFERLINE_`` environment; keyword arguments override
    them. ``timeout_s``: the client-side limit per request (None: the worker's deadline plus a
    grace period). ``content_type``: how requests are encoded (contract MSGPACK, the default, or
    JSON; the worker answers in the same); events are read in either."""

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
        replication_factor: int | None = None,
        settings: Settings | None = None,
        producer_options: dict[str, Any] | None = None,
        content_type: str = MSGPACK,
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
        self.reply_prefix = kafka.reply_topic_prefix
        self.reply_topic = (
            self.reply_prefix + self.client_uid if reply_topic is None else reply_topic
        )
        self.timeout_s = timeout_s
        self.reply_partitions = reply_partitions
        self.reply_retention_ms = reply_retention_ms
        self.replication_factor = replication_factor or kafka.replication_factor
        self._producer_options = producer_options or {}
        self.content_type = content_type
        self._handles: dict[str, RequestHandle] = {}
        self._replies: ReplyRouter | None = None
        self._background: set[asyncio.Task] = set()
        self._consumer_task: asyncio.Task | None = None
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

    @property
    def undecodable(self) -> int:
        """Reply events for this client's requests that could not be decoded (skipped)."""
        return self._replies.undecodable if self._replies else 0

    async def start(self) -> None:
        """Connect, make the reply topic exist and start reading it."""
        opts = self.kafka.connection_options()
        self._admin = AIOKafkaAdminClient(**opts, client_id=f"{self.kafka.client_id}-admin")
        await self._admin.start()
        if not self.kafka.create_reply_topics:
            await self._check_made_ahead()
        # Idempotent (acks=all): a retried send cannot duplicate a request on the log.
        self._producer = AIOKafkaProducer(
            **opts,
            client_id=f"{self.kafka.client_id}-producer",
            enable_idempotence=True,
            linger_ms=2,
            max_request_size=max(self.kafka.max_message_bytes + 4096, 1_048_576),
            **self._producer_options,
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            **opts,
            client_id=f"{self.kafka.client_id}-replies",
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",  # a `done` counts once its worker committed it
        )
        await self._consumer.start()
        self._replies = ReplyRouter(
            self._consumer,
            self._admin,
            self._handles,
            self._spawn,
            partitions=self.reply_partitions,
            retention_ms=self.reply_retention_ms,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.kafka.min_insync_replicas,
            max_event_bytes=max(self.kafka.max_message_bytes, 4 * 1_048_576),
            create=self.kafka.create_reply_topics,
        )
        if self.reply_topic != PER_REQUEST:
            await self._replies.watch_shared(self.reply_topic, fresh=self._own_reply_topic)
        self._consumer_task = asyncio.create_task(self._replies.run(), name="inferline-replies")

    async def _check_made_ahead(self) -> None:
        """Where clients make no topics: the reply topic is named, and exists."""
        if self._own_reply_topic or self.reply_topic == PER_REQUEST:
            raise ReplyTopicError(
                "INFERLINE_KAFKA__CREATE_REPLY_TOPICS is false: name a reply topic made ahead "
                "(InferenceClient(reply_topic=...), inferline topics create --reply-topic)"
            )
        if await topic_partitions(self._admin, self.reply_topic) is None:
            raise missing_reply_topic(self.reply_topic)

    async def close(self) -> None:
        """Fail what is in flight (ClientClosed), drop the topics this client made, disconnect."""
        for handle in list(self._handles.values()):
            handle.fail(ClientClosed("client closed"))
        if self._consumer_task:
            self._consumer_task.cancel()
            await asyncio.gather(self._consumer_task, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        watched = self._replies.watched if self._replies else set()
        drop = [
            t
            for t in watched
            if t.startswith(self.reply_prefix) and (self._own_reply_topic or t != self.reply_topic)
        ]
        if drop and self._admin and self.kafka.create_reply_topics:
            with contextlib.suppress(Exception):
                await self._admin.delete_topics(drop)
        for stop in (
            self._consumer and self._consumer.stop,
            self._producer and self._producer.stop,
            self._admin and self._admin.close,
        ):
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

        ``params`` are the request's other fields; ``timeout`` is the client-side limit in seconds.
        Raises ValidationError for a request the contract forbids."""
        assert self._producer is not None, "client not started"
        rid = request_id or uuid.uuid4().hex
        per_request = (reply_topic or self.reply_topic) == PER_REQUEST
        topic = (
            per_request_topic(rid, self.reply_prefix)
            if per_request
            else reply_topic or self.reply_topic
        )
        req = Request(
            id=rid,
            reply_topic=topic,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=[m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
            if messages
            else None,
            created_at=time.time(),
            **params,
        )
        payload = encode_request(req, self.content_type)
        if len(payload) > self.kafka.max_message_bytes:
            raise ValueError(
                f"request is {len(payload)} bytes, "
                f"over the {self.kafka.max_message_bytes}-byte limit"
            )
        await self._replies.prepare(topic, per_request)
        return await self._send(req, payload, timeout)

    async def _send(self, req: Request, payload: bytes, timeout: float | None) -> RequestHandle:
        handle = RequestHandle(req, self)
        handle._on_finish = self._finished
        # Registered before sending: the first event can beat send()'s acknowledgement.
        self._handles[req.id] = handle
        span = {"gen_ai.request.id": req.id, "messaging.system": "kafka"}
        span["messaging.destination.name"] = self.request_topic
        try:
            with producer_span("inferline.submit", span) as trace:
                headers = content_headers(self.content_type) + (trace or [])
                await self._producer.send_and_wait(
                    self.request_topic, payload, key=req.id.encode(), headers=headers
                )
        except BaseException:
            self._handles.pop(req.id, None)
            raise
        self._arm_timer(handle, timeout)
        return handle

    async def partitions_of(self, topic: str) -> list[int] | None:
        """Partition ids of ``topic``, or None when it does not exist or lacks leaders."""
        assert self._admin is not None, "client not started"
        return await topic_partitions(self._admin, topic)

    def follow(self, request: Request, *, timeout: float | None = None) -> RequestHandle:
        """A handle for a request sent before (a batch resuming); nothing is sent."""
        handle = RequestHandle(request, self)
        handle._on_finish = self._finished
        self._handles[request.id] = handle
        self._arm_timer(handle, timeout)
        return handle

    def forget(self, request_id: str) -> None:
        """Stop following a request; nothing is cancelled."""
        handle = self._handles.pop(request_id, None)
        if handle is not None and handle._timer:
            handle._timer.cancel()

    def _arm_timer(self, handle: RequestHandle, timeout: float | None) -> None:
        limit = timeout if timeout is not None else self.timeout_s
        if limit is None:
            limit = (
                handle.request.timeout_s or self.settings.limits.default_timeout_s
            ) + DEADLINE_GRACE_S
        # A timer, not a task: thousands of requests cost thousands of heap entries.
        handle._timer = asyncio.get_running_loop().call_later(limit, self._expire, handle, limit)

    def _expire(self, handle: RequestHandle, limit: float) -> None:
        if handle.finished:
            return
        handle.fail(ClientTimeout(f"timeout: no done within {limit:g} s (client side)"))
        self._spawn(self.cancel(handle.id))  # the worker need not generate for nobody

    async def cancel(self, request_id: str) -> None:
        """Publish a cancel for ``request_id`` to every worker."""
        assert self._producer is not None, "client not started"
        await self._producer.send_and_wait(
            self.cancel_topic, encode_cancel(Cancel(id=request_id)), key=request_id.encode()
        )

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finished(self, handle: RequestHandle) -> None:
        self._handles.pop(handle.id, None)
        topic = handle.request.reply_topic
        if topic == per_request_topic(handle.id, self.reply_prefix):
            self._replies.retire(topic)
