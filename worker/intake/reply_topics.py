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
"""
from __future__ import annotations

import re
import time
from typing import Callable, Iterable

import structlog

from contract.topics import TENANT_SEGMENT
from worker.service.tenancy import reply_prefix

log = structlog.get_logger(__name__)
KNOWN_FOR_S = 300.0  # a deleted topic is noticed by the publisher's sends meanwhile


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
    # Any `<base>.<segment>`, reserved tenant names included: never a reply topic.
    return kafka.tenancy == "topic" and any(re.fullmatch(f"{re.escape(base)}\\.{TENANT_SEGMENT}", topic)
                                            for base in (kafka.request_topic, kafka.cancel_topic))


class ReplyTopics:
    """The allowed-and-existing check, with the broker's topic list cached."""

    def __init__(self, kafka, list_topics: Callable, clock: Callable[[], float] = time.monotonic) -> None:
        self._kafka = kafka
        self._list_topics = list_topics  # async () -> iterable of every topic name
        self._clock = clock
        self._seen: dict[str, float] = {}  # topic -> when the broker last listed it

    def verdict(self, topic: str, tenant: str | None = None, listed_after: bool = False) -> str | None:
        """"ok", a reason to refuse, or None when the broker must be asked (refresh()).
        `listed_after`: the last listing was taken after the request was read, so after its
        producer made its reply topic: a topic missing from it does not exist."""
        reason = refusal(topic, self._kafka, tenant)
        if reason:
            return reason
        if self._clock() - self._seen.get(topic, float("-inf")) < KNOWN_FOR_S:
            return "ok"
        return f"reply_topic {topic!r} does not exist (the worker never creates topics)" if listed_after else None

    async def refresh(self) -> None:
        """Re-read the broker's topic list (raises what the broker lookup raised)."""
        now = self._clock()
        topics: Iterable[str] = await self._list_topics()
        self._seen = {t: now for t in topics if not refusal(t, self._kafka)}
        log.debug("reply_topics.refreshed", allowed=len(self._seen))

    def forget(self, topic: str) -> None:
        """The publisher found `topic` gone: the next request naming it asks the broker again."""
        self._seen.pop(topic, None)
