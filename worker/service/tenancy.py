"""Who a request is from: the body's word (`tenancy=body`), or the topic Kafka let it onto
(`tenancy=topic`).

In topic mode each tenant has its own request topic `<request_topic>.<tenant>` and cancel topic
`<cancel_topic>.<tenant>`, which Kafka's ACLs let only that tenant write; the worker subscribes
by pattern and takes the tenant from the record's topic, never from the body. A body `tenant`
that disagrees is rejected; the reply topic must be under `<reply_topic_prefix><tenant>.`; a
cancel counts only for the requests of the tenant whose cancel topic carried it; the priority is
clamped to the tenant's range (INFERLINE_LIMITS__TENANTS__<name>__MIN_PRIORITY / __MAX_PRIORITY).
"""
from __future__ import annotations

import re
from functools import lru_cache

from inferline.contract.topics import TENANT_SEGMENT, reserved_words


@lru_cache(maxsize=64)
def tenant_pattern(base_topic: str, exclude: tuple[str, ...] = ()) -> str:
    """The regex of the per-tenant topics `<base_topic>.<tenant>`, never matching `exclude`
    (the dead-letter topic `llm.requests.dlq` would otherwise be tenant `dlq`'s request topic)
    nor a reserved tenant name (contract.topics.reserved_words, any case, or a leading '_')."""
    skip = "".join(f"(?!{re.escape(t[len(base_topic) + 1:])}$)" for t in exclude
                   if t.startswith(base_topic + "."))
    words = "|".join(re.escape(w) for w in sorted(reserved_words(base_topic, *exclude)))
    return f"^{re.escape(base_topic)}\\.{skip}(?!(?i:{words})$)(?!_){TENANT_SEGMENT}$"


def tenant_of(topic: str, base_topic: str, exclude: tuple[str, ...] = ()) -> str | None:
    """The tenant whose per-tenant topic this is (as tenant_pattern matches it), or None."""
    return topic[len(base_topic) + 1:] if re.match(tenant_pattern(base_topic, exclude), topic) else None


def reply_prefix(kafka, tenant: str | None) -> str:
    """Where this tenant's replies may go: its own prefix in topic mode, the shared one otherwise."""
    return kafka.reply_topic_prefix if tenant is None else f"{kafka.reply_topic_prefix}{tenant}."


def priority_range(limits, tenant: str) -> tuple[int, int]:
    """(best, worst) priority `tenant` may claim: its own entry's MIN_PRIORITY / MAX_PRIORITY (or
    default_tenant's), else LimitsSettings.min_priority / max_priority (by default [0, 1000]: no
    producer outranks the default class unless an operator says so)."""
    limit = limits.tenants.get(tenant, limits.default_tenant)
    low = limit.min_priority if limit.min_priority is not None else limits.min_priority
    high = limit.max_priority if limit.max_priority is not None else limits.max_priority
    return low, max(low, high)


def clamp_priority(priority: int, limits, tenant: str) -> int:
    """`priority` clamped into the tenant's range (priority_range), in every tenancy mode."""
    low, high = priority_range(limits, tenant)
    return min(max(priority, low), high)


def cancel_key(request_id: str, tenant: str | None) -> str:
    """How a cancel is remembered: per tenant in topic mode (ids are only unique per tenant there)."""
    return request_id if tenant is None else f"{tenant}/{request_id}"
