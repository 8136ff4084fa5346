"""Who a request is from: the body's word (`tenancy=body`) or the topic Kafka let it onto
(`tenancy=topic`), docs/security.md.
"""

from __future__ import annotations

import re
from functools import lru_cache

from inferline.contract.topics import TENANT_SEGMENT, reserved_words


@lru_cache(maxsize=64)
def tenant_pattern(base_topic: str, exclude: tuple[str, ...] = ()) -> str:
    """The regex of the per-tenant topics `<base_topic>.<tenant>`, matching neither `exclude` (the
    dead-letter topic) nor a reserved name."""
    skip = "".join(
        f"(?!{re.escape(t[len(base_topic) + 1 :])}$)"
        for t in exclude
        if t.startswith(base_topic + ".")
    )
    words = "|".join(re.escape(w) for w in sorted(reserved_words(base_topic, *exclude)))
    return f"^{re.escape(base_topic)}\\.{skip}(?!(?i:{words})$)(?!_){TENANT_SEGMENT}$"


def tenant_of(topic: str, base_topic: str, exclude: tuple[str, ...] = ()) -> str | None:
    """The tenant whose per-tenant topic this is, or None."""
    return (
        topic[len(base_topic) + 1 :]
        if re.match(tenant_pattern(base_topic, exclude), topic)
        else None
    )


def reply_prefix(kafka, tenant: str | None) -> str:
    """Where a tenant's replies may go: its own prefix in topic mode, else the shared one."""
    return kafka.reply_topic_prefix if tenant is None else f"{kafka.reply_topic_prefix}{tenant}."


def priority_range(limits, tenant: str) -> tuple[int, int]:
    """(best, worst) priority `tenant` may claim: its entry's range (or default_tenant's), else the
    global one."""
    limit = limits.tenants.get(tenant, limits.default_tenant)
    low = limit.min_priority if limit.min_priority is not None else limits.min_priority
    high = limit.max_priority if limit.max_priority is not None else limits.max_priority
    return low, max(low, high)


def clamp_priority(priority: int, limits, tenant: str) -> int:
    """`priority` clamped into the tenant's range."""
    low, high = priority_range(limits, tenant)
    return min(max(priority, low), high)


def cancel_key(request_id: str, tenant: str | None) -> str:
    """How a cancel is remembered: per tenant in topic mode (ids are unique per tenant only)."""
    return request_id if tenant is None else f"{tenant}/{request_id}"
