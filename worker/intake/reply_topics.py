"""Where the worker may write a request's replies: the reply topic a producer names is untrusted
(docs/security.md); anything not allowed is dead-lettered.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Iterable

import structlog

from inferline.contract.topics import TENANT_SEGMENT
from inferline.worker.service.tenancy import reply_prefix

log = structlog.get_logger(__name__)
CHECKED_FOR_S = 60.0  # limits are read again after this (a producer may alter them)
KNOWN_FOR_S = 300.0  # meanwhile the publisher's sends notice a deleted topic


def refusal(topic: str, kafka, tenant: str | None = None) -> str | None:
    """Why the worker must not write to `topic` (policy only), or None."""
    own = topic in (kafka.request_topic, kafka.cancel_topic, kafka.dlq_topic)
    if own or _per_tenant_topic(topic, kafka):
        return f"reply_topic {topic!r} is one of the worker's own topics"
    if topic.startswith("__"):
        return f"reply_topic {topic!r} is an internal topic"
    prefix = reply_prefix(kafka, tenant)
    if not topic.startswith(prefix):
        return f"reply_topic {topic!r} is not under the reply prefix {prefix!r}"
    return None


def _per_tenant_topic(topic: str, kafka) -> bool:
    # Any `<base>.<segment>`, reserved tenant names included.
    return kafka.tenancy == "topic" and any(
        re.fullmatch(f"{re.escape(base)}\\.{TENANT_SEGMENT}", topic)
        for base in (kafka.request_topic, kafka.cancel_topic)
    )


def unsafe_limits(configs: dict[str, str], replicas: int, min_message_bytes: int) -> str | None:
    """Why a topic with these configs and replicas cannot take a transaction's replies, or None."""
    max_bytes = configs.get("max.message.bytes")
    if max_bytes is not None and int(max_bytes) < min_message_bytes:
        return (
            f"max.message.bytes={max_bytes} is below the {min_message_bytes} "
            "a reply topic must accept"
        )
    min_isr = configs.get("min.insync.replicas")
    if min_isr is not None and replicas and int(min_isr) > replicas:
        return (
            f"min.insync.replicas={min_isr} exceeds its {replicas} replicas: no write can succeed"
        )
    return None


class ReplyTopics:
    """The allowed-and-existing check, with the broker's topic list cached."""

    def __init__(
        self, kafka, list_topics, clock=time.monotonic, missing_ttl_s=None, check_topics=None
    ) -> None:
        """`list_topics`: async () -> every topic name; `check_topics`: async (topics) ->
        {topic: reason or None}; `clock`: monotonic seconds."""
        self._kafka, self._list_topics, self._check_topics = kafka, list_topics, check_topics
        self._checked: dict[str, tuple[float, str | None]] = {}  # topic -> (when, reason or None)
        self.clock = clock
        self._seen: dict[str, float] = {}  # topic -> when last listed
        self._missing: dict[str, float] = {}  # topic -> when a list after its request lacked it
        ttl = getattr(kafka, "missing_reply_topic_ttl_s", 10.0)
        self.missing_ttl_s = ttl if missing_ttl_s is None else missing_ttl_s
        self._listed_at = float("-inf")
        self._inflight: asyncio.Future | None = None

    def verdict(self, topic: str, tenant=None, listed_after=False, last_known=False) -> str | None:
        """ "ok", a reason to refuse, or None when the broker must be asked. `listed_after`: the
        last listing was read after the request, so a topic missing from it does not exist.
        `last_known`: the broker was just asked (maybe in vain): a topic listed and checked before
        keeps its last verdict, however old (a failed re-check is no reason to refuse)."""
        reason = refusal(topic, self._kafka, tenant)
        if reason:
            return reason
        now = self.clock()
        if now - self._seen.get(topic, float("-inf")) < KNOWN_FOR_S or (
            last_known and topic in self._seen
        ):
            if self._check_topics is None:
                return "ok"
            if topic not in self._checked:
                return None
            when, unsafe = self._checked[topic]
            if now - when >= CHECKED_FOR_S and not last_known:
                return None
            return f"reply_topic {topic!r} would wedge transactions: {unsafe}" if unsafe else "ok"
        if listed_after:
            self._missing[topic] = now
        elif now - self._missing.get(topic, float("-inf")) >= self.missing_ttl_s:
            return None
        return f"reply_topic {topic!r} does not exist (the worker never creates topics)"

    async def refresh_after(self, since: float) -> None:
        """Return once a list read no earlier than `since` is in: the one in flight if late
        enough, else the next (never two at once)."""
        while self._listed_at < since:
            if self._inflight is None or self._inflight.done():
                self._inflight = asyncio.ensure_future(self.refresh())
            await asyncio.shield(self._inflight)

    async def refresh(self) -> None:
        asked = self.clock()
        topics: Iterable[str] = await self._list_topics()
        now = self.clock()
        self._seen = {t: now for t in topics if not refusal(t, self._kafka)}
        self._missing = {
            t: at
            for t, at in self._missing.items()
            if t not in self._seen and now - at < self.missing_ttl_s
        }
        self._listed_at = max(self._listed_at, asked)
        log.debug("reply_topics.refreshed", allowed=len(self._seen), missing=len(self._missing))

    async def check(self, wanted) -> None:
        """Read the limits of the `wanted` topics that exist and were not read lately; a topic the
        answer leaves out (its configs could not be read just now) keeps its last verdict."""
        if self._check_topics is None:
            return
        now, never = self.clock(), (float("-inf"), None)
        last = {t: self._checked.get(t, never)[0] for t in wanted if t in self._seen}
        stale = sorted(t for t, at in last.items() if now - at >= CHECKED_FOR_S)
        if stale:
            reasons = await self._check_topics(stale)
            self._checked.update({t: (now, reasons[t]) for t in stale if t in reasons})
            for t in [t for t in stale if reasons.get(t)]:
                log.warning("reply_topics.unsafe", topic=t, reason=reasons[t])
        if len(self._checked) > 4 * len(self._seen) + 1024:  # deleted topics' entries
            self._checked = {t: c for t, c in self._checked.items() if t in self._seen}

    def forget(self, topic: str) -> None:
        """The publisher found `topic` gone: ask the broker again next time."""
        self._seen.pop(topic, None)
        self._checked.pop(topic, None)
