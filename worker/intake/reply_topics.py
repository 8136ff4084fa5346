"""Where the worker may write a request's replies: the reply topic a producer names is untrusted.

A reply topic is allowed when it is under `kafka.reply_topic_prefix` (default `inferline.reply.`),
is none of the worker's own topics (request, cancel, dead-letter) nor an internal `__` topic, and
exists. A request that names any other topic is dead-lettered with the reason, never answered
there and never waited on; the worker never creates topics.

Existence comes from the broker's metadata for all topics (asking for one topic by name could
auto-create it on a broker that allows that), cached: a topic seen once is known for `KNOWN_FOR_S`;
a fetched batch with a request naming an unknown topic reads the list again, once for the whole
batch, and only a topic missing from a list read after the request was fetched (so after its
producer made the topic) is missing.

An existing topic is also checked for what would wedge a transaction: the broker writes each
transaction's commit or abort marker into every partition the transaction wrote, and a marker the
partition refuses (`max.message.bytes` below a marker's size, or `min.insync.replicas` above the
partition's replicas) leaves the transaction unfinished for good, its transactional id unusable
and every read_committed reader of the partitions it touched stuck. A producer may create such a
topic under the reply prefix; its requests are dead-lettered here, before any transaction.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import structlog

from worker.service.tenancy import reply_prefix, tenant_of

log = structlog.get_logger(__name__)
KNOWN_FOR_S = 300.0  # a deleted topic is noticed by the publisher's sends meanwhile
CHECKED_FOR_S = 60.0  # a topic's limits are read again after this (a producer may alter them)


def refusal(topic: str, kafka, tenant: str | None = None) -> str | None:
    """Why the worker must not write to `topic` (policy only, no broker), or None. In topic
    tenancy a request of `tenant` may be answered only under that tenant's own prefix."""
    if topic in (kafka.request_topic, kafka.cancel_topic, kafka.dlq_topic) or _per_tenant_topic(topic, kafka):
        return f"reply_topic {topic!r} is one of the worker's own topics"
    if topic.startswith("__"):
        return f"reply_topic {topic!r} is an internal topic"
    prefix = reply_prefix(kafka, tenant)
    if not topic.startswith(prefix):
        return f"reply_topic {topic!r} is not under the reply prefix {prefix!r}"
    return None


def _per_tenant_topic(topic: str, kafka) -> bool:
    return kafka.tenancy == "topic" and any(tenant_of(topic, base) for base in (kafka.request_topic, kafka.cancel_topic))


def unsafe_limits(configs: dict[str, str], replicas: int, min_message_bytes: int) -> str | None:
    """Why a topic with these configs (`max.message.bytes`, `min.insync.replicas`) and this many
    replicas per partition cannot take a transaction's replies, or None."""
    max_bytes = configs.get("max.message.bytes")
    if max_bytes is not None and int(max_bytes) < min_message_bytes:
        return f"max.message.bytes={max_bytes} is below the {min_message_bytes} a reply topic must accept"
    min_isr = configs.get("min.insync.replicas")
    if min_isr is not None and replicas and int(min_isr) > replicas:
        return f"min.insync.replicas={min_isr} exceeds its {replicas} replicas: no write can succeed"
    return None


class ReplyTopics:
    """The allowed-and-existing check, with the broker's topic list cached; with `check_topics`,
    existing topics' limits too (unsafe_limits)."""

    def __init__(self, kafka, list_topics: Callable, clock: Callable[[], float] = time.monotonic,
                 check_topics: Callable | None = None) -> None:
        self._kafka = kafka
        self._list_topics = list_topics  # async () -> iterable of every topic name
        self._check_topics = check_topics  # async (topics) -> {topic: reason or None}
        self._clock = clock
        self._seen: dict[str, float] = {}  # topic -> when the broker last listed it
        self._checked: dict[str, tuple[float, str | None]] = {}  # topic -> (when, reason or None)

    def verdict(self, topic: str, tenant: str | None = None, listed_after: bool = False) -> str | None:
        """"ok", a reason to refuse, or None when the broker must be asked (refresh()).
        `listed_after`: the last listing was taken after the request was read, so after its
        producer made its reply topic: a topic missing from it does not exist."""
        reason = refusal(topic, self._kafka, tenant)
        if reason:
            return reason
        now = self._clock()
        if now - self._seen.get(topic, float("-inf")) < KNOWN_FOR_S:
            if self._check_topics is None:
                return "ok"
            when, unsafe = self._checked.get(topic, (float("-inf"), None))
            if now - when < CHECKED_FOR_S:
                return f"reply_topic {topic!r} would wedge transactions: {unsafe}" if unsafe else "ok"
            return None
        return f"reply_topic {topic!r} does not exist (the worker never creates topics)" if listed_after else None

    async def refresh(self, wanted: Iterable[str] = ()) -> None:
        """Re-read the broker's topic list, and the limits of the `wanted` topics that exist
        (raises what the broker lookup raised)."""
        now = self._clock()
        topics: Iterable[str] = await self._list_topics()
        self._seen = {t: now for t in topics if not refusal(t, self._kafka)}
        log.debug("reply_topics.refreshed", allowed=len(self._seen))
        if self._check_topics is not None:
            stale = sorted({t for t in wanted if t in self._seen
                            and now - self._checked.get(t, (float("-inf"), None))[0] >= CHECKED_FOR_S})
            if stale:
                reasons = await self._check_topics(stale)
                self._checked.update({t: (now, reasons.get(t)) for t in stale})
                for t in stale:
                    if reasons.get(t):
                        log.warning("reply_topics.unsafe", topic=t, reason=reasons[t])
            if len(self._checked) > 4 * len(self._seen) + 1024:  # deleted topics' entries
                self._checked = {t: c for t, c in self._checked.items() if t in self._seen}

    def forget(self, topic: str) -> None:
        """The publisher found `topic` gone: the next request naming it asks the broker again."""
        self._seen.pop(topic, None)
        self._checked.pop(topic, None)
