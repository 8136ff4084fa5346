"""Topic-name rules of the wire contract, shared by the worker, the client and the CLI."""

from __future__ import annotations

import re

# Topic tenancy: a tenant is one topic-name segment (no '.'), so `<request topic>.<tenant>` and
# `<reply prefix><tenant>.` cannot be ambiguous.
TENANT_SEGMENT = r"[A-Za-z0-9_-]{1,64}"
# Names no tenant may take (any case), besides the words of the topic names: `dlq` would own
# `llm.requests.dlq`; the rest are common internal suffixes and `default`, the unclaimed tenant.
RESERVED_TENANTS = frozenset(
    {
        "dlq",
        "dlt",
        "dead-letter",
        "deadletter",
        "dead_letter",
        "retry",
        "cancel",
        "cancels",
        "request",
        "requests",
        "reply",
        "replies",
        "response",
        "responses",
        "internal",
        "changelog",
        "repartition",
        "offsets",
        "transaction",
        "transactions",
        "default",
        "admin",
        "system",
    }
)


def reserved_words(*topics: str) -> set[str]:
    """RESERVED_TENANTS and every word of `topics` (split at '.', '_' and '-'), lower case."""
    return set(RESERVED_TENANTS) | {w.lower() for t in topics for w in re.split(r"[._-]+", t) if w}


def _collide(a: str, b: str) -> bool:
    # Kafka refuses (or confuses in metrics) topics that differ only in '.' versus '_'.
    return a == b or a.replace(".", "_") == b.replace(".", "_")


def tenant_problem(tenant: str, kafka, dlq_topic: str | None = None) -> str | None:
    """Why `tenant` cannot be a topic-tenancy tenant, or None; `dlq_topic` overrides `kafka`'s."""
    if not isinstance(tenant, str) or not re.fullmatch(TENANT_SEGMENT, tenant):
        return "must be 1-64 of [A-Za-z0-9_-]"
    internal = (kafka.request_topic, kafka.cancel_topic, dlq_topic or kafka.dlq_topic)
    if tenant.lower() in reserved_words(*internal, kafka.reply_topic_prefix) or tenant.startswith(
        "_"
    ):
        return "is reserved: it names (a part of) an internal topic"
    for base in (kafka.request_topic, kafka.cancel_topic):
        for topic in internal:
            if _collide(f"{base}.{tenant}", topic):
                return (
                    f"would make {base}.{tenant}, which is (or collides with) the internal topic "
                    f"{topic}"
                )
    return None
