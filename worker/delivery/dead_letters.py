"""Dead letters sized to the dead-letter topic's real limit: a record the request topic accepted
may be too big for the DLQ once headers are added, and a refused dead letter would wedge its
partition. design: docs/reliability.md
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import structlog
from confluent_kafka import admin

log = structlog.get_logger(__name__)
# The broker's default message.max.bytes (1 MiB plus the 12-byte log overhead).
BROKER_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
# A record batch's header (base offset, length, CRC, ...), as the broker counts it.
BATCH_OVERHEAD = 61
# A record's own fields at their widest (length, attributes, timestamp and offset deltas).
RECORD_OVERHEAD = 5 + 1 + 10 + 5
PRODUCER_MARGIN = 64 * 1024  # the worker's producers take max_message_bytes plus this
RETRY_READ_S = 60.0  # an unreadable limit is asked again after this


def _varint_len(n: int) -> int:
    """Bytes of `n` as Kafka's zigzag varint."""
    z, size = (n << 1) ^ (n >> 63), 1
    while z >= 0x80:
        z >>= 7
        size += 1
    return size


def _field_len(data: bytes | None) -> int:
    return _varint_len(-1 if data is None else len(data)) + len(data or b"")


def batch_size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Bytes the broker counts for one record alone in a batch (uncompressed), at most."""
    body = RECORD_OVERHEAD + _field_len(key) + _field_len(value) + _varint_len(len(headers))
    body += sum(_field_len(k.encode()) + _field_len(v) for k, v in headers)
    return BATCH_OVERHEAD + body


def fit(
    key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]], limit: int
) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """(key, value, headers) cut to `limit` bytes: the value's head first, then the key's; a
    `truncated` header names what was cut, `original-size`/`original-key-size` its size."""
    if batch_size(key, value, headers) <= limit:
        return key, value, headers
    cut = [("truncated", b"value"), ("original-size", str(len(value or b"")).encode())]
    room = _room(limit - batch_size(key, b"", headers + cut))
    if room >= 0:
        return key, (value or b"")[:room], headers + cut
    key_size = ("original-key-size", str(len(key or b"")).encode())
    cut = [("truncated", b"key,value"), cut[1], key_size]
    room = _room(limit - batch_size(b"", b"", headers + cut))
    if room < 0:  # the headers alone are too big (a tiny limit): the reason goes short
        headers = [(k, v[:64]) for k, v in headers]
        room = max(0, _room(limit - batch_size(b"", b"", headers + cut)))
    return (key or b"")[:room], b"", headers + cut


def _room(spare: int) -> int:
    """Bytes of data that fit in `spare` bytes beyond an empty field: its length's varint grows."""
    return spare - (_varint_len(spare) - 1) if spare > 0 else spare


class DeadLetterLimit:
    """The DLQ topic's `max.message.bytes`, read at start and cached (the broker's default, logged,
    while it cannot be read); capped by what the worker's producers send."""

    def __init__(self, kafka, read: Callable[[object, str], int] | None = None) -> None:
        self._kafka = kafka
        self._read = read or read_topic_max_bytes
        self.topic_limit: int | None = None
        self._failed_at: float | None = None  # the last read failed then
        self._loading: asyncio.Future | None = None

    def bytes(self) -> int:
        """The limit to fit the next dead letter to. One unreadable a while ago is read again in
        the background, for the ones after."""
        if self._failed_at is not None and time.monotonic() - self._failed_at >= RETRY_READ_S:
            self._start_read()
        topic_limit = self.topic_limit or BROKER_DEFAULT_MAX_MESSAGE_BYTES
        return min(topic_limit, self._kafka.max_message_bytes + PRODUCER_MARGIN)

    async def load(self) -> int:
        """Read the limit (or fall back to the broker default); the limit."""
        self._start_read()
        await asyncio.shield(self._loading)
        return self.bytes()

    def _start_read(self) -> None:
        if self._loading is None or self._loading.done():  # one read at a time
            self._loading = asyncio.ensure_future(asyncio.to_thread(self._load))

    def _load(self) -> None:
        topic = self._kafka.dlq_topic
        try:
            self.topic_limit, self._failed_at = self._read(self._kafka, topic), None
        except Exception as exc:  # noqa: BLE001 - unreadable: assume the default, say so
            self._failed_at = time.monotonic()
            self.topic_limit = self.topic_limit or BROKER_DEFAULT_MAX_MESSAGE_BYTES
            assumed = self.topic_limit
            log.warning("dead_letters.limit_unknown", topic=topic, error=repr(exc), assumed=assumed)


def read_topic_max_bytes(kafka, topic: str) -> int:
    """Blocking: the topic's `max.message.bytes` as the broker describes it."""
    resource = admin.ConfigResource("topic", topic)
    client = admin.AdminClient(kafka.librdkafka_config())
    configs = client.describe_configs([resource], request_timeout=10)[resource].result(timeout=15)
    return int(configs["max.message.bytes"].value)
