"""The gateway's Kafka side: one InferenceClient for all tenants (body tenancy) or one per tenant
(topic tenancy), the requests in flight, and cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient

from inferline.config.settings import Settings
from inferline.producer.client import InferenceClient, RequestHandle

log = structlog.get_logger(__name__)


class ClientPool:
    def __init__(self, settings: Settings, tenants: set[str]):
        self.settings = settings
        self.topic_tenancy = settings.kafka.tenancy == "topic"
        self.instance = f"gateway-{uuid.uuid4().hex[:12]}"
        # None: no tenant named (the contract's default, body tenancy only).
        names = sorted(tenants) if self.topic_tenancy else [None]
        self.clients = {t: self._client(t) for t in names}
        self.in_flight: dict[str, tuple[InferenceClient, RequestHandle]] = {}
        self._cancels: set[asyncio.Task] = set()
        self.started = False

    def _client(self, tenant: str | None) -> InferenceClient:
        kafka = self.settings.kafka
        request_topic, cancel_topic = kafka.request_topic, kafka.cancel_topic
        if tenant is not None:
            request_topic, cancel_topic = f"{request_topic}.{tenant}", f"{cancel_topic}.{tenant}"
        return InferenceClient(
            request_topic=request_topic,
            cancel_topic=cancel_topic,
            settings=self.settings,
            # Topic tenancy: the worker answers a tenant only under `<prefix><tenant>.`.
            reply_topic=kafka.reply_topic_prefix
            + (f"{tenant}." if tenant else "")
            + (self.settings.gateway.reply_topic or self.instance),
            reply_partitions=self.settings.gateway.reply_partitions,
        )

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.clients.values()))
        self.started = True
        log.info(
            "gateway clients ready", reply_topics=[c.reply_topic for c in self.clients.values()]
        )

    async def submit(self, tenant: str | None, fields: dict[str, Any]) -> RequestHandle:
        """Publish one request for ``tenant``; raises ValidationError for a request the contract
        forbids (nothing is sent then)."""
        client = self.clients[tenant if self.topic_tenancy else None]
        if tenant is not None:
            # The body always carries `tenant`; the worker rejects one that is not the topic's.
            fields = {**fields, "tenant": tenant}
        fields.setdefault("timeout_s", self.settings.gateway.request_timeout_s)
        handle = await client.submit(request_id=uuid.uuid4().hex, **fields)
        self.in_flight[handle.id] = (client, handle)
        return handle

    def release(self, handle: RequestHandle) -> None:
        """The HTTP side is done with ``handle``: cancel it if still running (a hang-up)."""
        self.in_flight.pop(handle.id, None)
        if not handle.finished:
            self._spawn_cancel(handle)

    def _spawn_cancel(self, handle: RequestHandle) -> None:
        # A task: this runs where the HTTP request's own task is being cancelled.
        task = asyncio.get_running_loop().create_task(handle.cancel())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)
        log.info("request cancelled by the gateway", request_id=handle.id)

    async def cancel_all(self) -> None:
        """Cancel every request in flight (shutdown): their `done`s end the HTTP answers."""
        for _client, handle in list(self.in_flight.values()):
            if not handle.finished:
                self._spawn_cancel(handle)
        await asyncio.gather(*self._cancels, return_exceptions=True)

    async def close(self) -> None:
        self.started = False  # /readyz: no new traffic
        await self.cancel_all()
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)
        await self._delete_reply_topics()

    async def _delete_reply_topics(self) -> None:
        # The instance's own; a named one (gateway.reply_topic) is every replica's.
        if self.settings.gateway.reply_topic or not self.settings.kafka.create_reply_topics:
            return
        admin = AIOKafkaAdminClient(**self.settings.kafka.connection_options())
        with contextlib.suppress(Exception):
            await admin.start()
            await admin.delete_topics([c.reply_topic for c in self.clients.values()])
        with contextlib.suppress(Exception):
            await admin.close()
