"""Kafka plumbing shared by the client, the CLI and the benchmarks: connection options, retention
configs, topic creation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError

from inferline.contract.topics import TENANT_SEGMENT  # noqa: F401 - re-exported for the CLI

T = TypeVar("T")

# Kafka protocol error codes.
TOPIC_ALREADY_EXISTS = 36
UNKNOWN_TOPIC = 3


def topic_configs(retention_ms: int | None) -> dict[str, str]:
    """Retention settings; data expires per closed segment, so segments roll too."""
    if retention_ms is None:
        return {}
    return {"retention.ms": str(retention_ms), "segment.ms": str(max(60_000, retention_ms // 4))}


async def create_topics(
    admin: AIOKafkaAdminClient,
    topics: Iterable[tuple[str, int]],
    *,
    replication_factor: int | None = None,
    min_insync_replicas: int | None = None,
    configs: dict[str, str] | None = None,
    wait_s: float = 10.0,
) -> list[str]:
    """Create each missing (name, partitions) and wait until all have leaders; returns the names
    created. Unset, the replication factor and min.insync.replicas are the broker's defaults.
    Topics that exist are not asked for: a principal without CREATE on them, or a client that
    starts while a broker it still thinks alive is dead (aiokafka waits out its request timeout on
    that one when it is the controller), goes on."""
    wanted = list(topics)
    existing = await existing_topics(admin)
    missing = [(name, n) for name, n in wanted if name not in existing]
    created: list[str] = []
    if missing:
        created = await _create(admin, missing, replication_factor, min_insync_replicas, configs)
    await wait_for_topics(admin, [name for name, _ in wanted], wait_s)
    return created


async def existing_topics(admin: AIOKafkaAdminClient) -> set[str]:
    """Every topic the cluster has; by listing them all, as naming one may auto-create it."""
    return set(await any_broker(admin.list_topics))


async def any_broker(call: Callable[[], Awaitable[T]], tries: int = 10) -> T:
    """`await call()` (a metadata read: aiokafka asks a broker at random), again while the broker
    asked does not answer: a lost one stays in the metadata until the cluster fences it (the
    brokers' session timeout), so a client starting then would fail on it a third of the time."""
    for attempt in range(tries):
        try:
            return await call()
        except (NodeNotReadyError, KafkaConnectionError):
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def _create(
    admin: AIOKafkaAdminClient,
    wanted: list[tuple[str, int]],
    replication_factor: int | None,
    min_insync_replicas: int | None,
    configs: dict[str, str] | None,
) -> list[str]:
    replicas = replication_factor or await default_replication_factor(admin)
    configs = dict(configs or {})
    if min_insync_replicas is not None:
        configs["min.insync.replicas"] = str(min_insync_replicas)
    new = [NewTopic(name, n, replicas, topic_configs=configs) for name, n in wanted]
    response = await admin.create_topics(new)
    created = []
    for name, code, *rest in response.topic_errors:
        if code == 0:
            created.append(name)
        elif code != TOPIC_ALREADY_EXISTS:
            raise RuntimeError(
                f"cannot create topic {name}: error {code} {rest[0] if rest else ''}"
            )
    return created


async def default_replication_factor(admin: AIOKafkaAdminClient) -> int:
    """The broker's `default.replication.factor` (aiokafka's CreateTopics predates the -1 that
    asks the broker to apply it)."""
    broker = (await admin.describe_cluster())["brokers"][0]["node_id"]
    name = "default.replication.factor"
    resource = ConfigResource(ConfigResourceType.BROKER, str(broker), {name: None})
    (response,) = await admin.describe_configs([resource])
    (res,) = response.to_object()["resources"]
    entries = {e["config_names"]: e["config_value"] for e in res["config_entries"]}
    return int(entries[name])


async def topic_partitions(admin: AIOKafkaAdminClient, topic: str) -> list[int] | None:
    """Partition ids of a topic whose partitions all have leaders, or None."""
    (meta,) = await any_broker(lambda: admin.describe_topics([topic]))
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
