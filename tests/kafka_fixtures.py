"""Real-broker pytest fixtures and helpers (loaded by tests/conftest.py as a plugin).

Fixtures
    kafka_bootstrap (session, sync) -> str
        The bootstrap servers of a broker that answers. Uses INFERLINE_KAFKA__BOOTSTRAP_SERVERS when
        it names another broker; otherwise starts the local one with ``scripts/kafka.sh acquire``
        (a no-op when it already runs) and releases it at the end of the session, which stops it
        only if this session started it and no other run uses it. Fails, never skips, when no
        broker can be had.
    new_topic (function, async) -> async factory
        ``name = await new_topic(partitions=4)`` creates a uniquely named topic, waits until every
        partition has a leader (a just-created topic may answer UnknownTopicOrPartition for a
        moment), and deletes it after the test. Keyword arguments: ``partitions`` (1),
        ``prefix`` (the test's name), ``config`` (topic configs, e.g.
        ``{"retention.ms": "60000"}``).

Helpers (plain coroutines, importable:
``from tests.kafka_fixtures import produce_raw, consume_until``)
    produce_raw(bootstrap, topic, values, ...)   sends raw bytes with acks=all, returns
                                                 RecordMetadata
    consume_until(bootstrap, topic, ...)         reads a topic without a consumer group until a
                                                 predicate holds (or, without one, to its end)
    wait_topic_ready(admin, topic, partitions)   waits until a topic's partitions all have leaders

Tests using them are marked ``kafka`` (``pytestmark = pytest.mark.kafka``).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, RecordMetadata

from inferline.producer.replies import REPLY_TOPIC_PREFIX

REPO = Path(__file__).resolve().parent.parent
KAFKA_SH = REPO / "scripts" / "kafka.sh"
# The broker scripts/kafka.sh runs (INFERLINE_KAFKA_PORT moves it, for a private test broker).
_LOCAL_PORT = os.environ.get("INFERLINE_KAFKA_PORT", "9092")
LOCAL_BOOTSTRAP = (f"localhost:{_LOCAL_PORT}", f"127.0.0.1:{_LOCAL_PORT}")
# The topic-name alphabet Kafka allows; '.' is avoided because it collides with '_' in metric names.
_NOT_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9-]+")

Message = bytes | tuple[bytes | None, bytes | None]
Predicate = Callable[[list[ConsumerRecord]], bool]


# --------------------------------------------------------------------------- the broker


def configured_bootstrap() -> str:
    return os.environ.get("INFERLINE_KAFKA__BOOTSTRAP_SERVERS", LOCAL_BOOTSTRAP[0])


def _kafka_sh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(KAFKA_SH), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


async def _cluster_brokers(bootstrap: str, timeout_s: float) -> list:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        cluster = await asyncio.wait_for(admin.describe_cluster(), timeout_s)
        return cluster["brokers"]
    finally:
        await admin.close()


def check_broker(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Raises unless an aiokafka client can read the cluster metadata within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # A fresh loop: this runs from a sync fixture, outside the tests' event loop.
            if asyncio.run(_cluster_brokers(bootstrap, 5.0)):
                return
            error: BaseException = RuntimeError("the cluster lists no broker")
        except Exception as exc:  # noqa: BLE001 - retried, then reported
            error = exc
        if time.monotonic() > deadline:
            raise RuntimeError(f"no Kafka broker answers on {bootstrap}: {error!r}") from error
        time.sleep(0.5)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterable[str]:
    bootstrap = configured_bootstrap()
    leased = bootstrap in LOCAL_BOOTSTRAP
    if leased:
        done = _kafka_sh("acquire", str(os.getpid()))
        if done.returncode != 0:
            pytest.fail(
                "could not start the local Kafka broker (scripts/kafka.sh acquire):\n"
                f"{done.stderr}",
                pytrace=False,
            )
    try:
        check_broker(bootstrap)
    except RuntimeError as exc:
        if leased:
            _kafka_sh("release", str(os.getpid()))
        pytest.fail(str(exc), pytrace=False)
    yield bootstrap
    if leased:
        _kafka_sh("release", str(os.getpid()))


# --------------------------------------------------------------------------- topics


def unique_topic_name(prefix: str) -> str:
    stem = _NOT_TOPIC_CHARS.sub("-", prefix).strip("-")[:80] or "t"
    return f"test-{stem}-{uuid.uuid4().hex[:10]}"


def _raise_topic_errors(response, action: str) -> None:
    # CreateTopics/DeleteTopics responses: (topic, error_code[, error_message]) tuples.
    for topic_error in (
        response.topic_errors if hasattr(response, "topic_errors") else response.topic_error_codes
    ):
        topic, code = topic_error[0], topic_error[1]
        if code != 0:
            message = topic_error[2] if len(topic_error) > 2 else ""
            raise RuntimeError(
                f"{action} topic {topic!r} failed: error code {code} {message or ''}"
            )


async def create_named_topics(partitions: dict[str, int], **admin_options) -> None:
    """Creates topics of exactly these names ({name: partitions}) and waits until all are ready;
    `admin_options`: the admin client's connection (bootstrap_servers, security)."""
    admin = AIOKafkaAdminClient(**admin_options)
    await admin.start()
    try:
        _raise_topic_errors(
            await admin.create_topics([NewTopic(t, n, 1) for t, n in partitions.items()]),
            "creating",
        )
        for t, n in partitions.items():
            await wait_topic_ready(admin, t, n)
    finally:
        await admin.close()


async def wait_topic_ready(
    admin: AIOKafkaAdminClient, topic: str, partitions: int, timeout_s: float = 30.0
) -> None:
    """Waits until the topic exists with `partitions` partitions, each with a leader."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        (last,) = await admin.describe_topics([topic])
        parts = last["partitions"]
        if (
            last["error_code"] == 0
            and len(parts) == partitions
            and all(p["error_code"] == 0 and p["leader"] >= 0 for p in parts)
        ):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"topic {topic!r} not ready after {timeout_s}s: {last}")


@pytest.fixture
async def new_topic(kafka_bootstrap: str, request: pytest.FixtureRequest):
    """An async factory of fresh topics, deleted after the test (see the module docstring)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    created: list[str] = []

    async def make(
        partitions: int = 1,
        *,
        prefix: str | None = None,
        config: dict[str, str] | None = None,
        reply: bool = False,
    ) -> str:
        # reply=True: under the reply prefix, where a worker (worker/intake/reply_topics.py)
        # may answer
        name = (REPLY_TOPIC_PREFIX if reply else "") + unique_topic_name(
            prefix or request.node.name
        )
        topic = NewTopic(
            name, num_partitions=partitions, replication_factor=1, topic_configs=config or {}
        )
        _raise_topic_errors(await admin.create_topics([topic]), "creating")
        created.append(name)
        await wait_topic_ready(admin, name, partitions)
        return name

    try:
        yield make
    finally:
        try:
            if created:
                await admin.delete_topics(created)
        finally:
            await admin.close()


# --------------------------------------------------------------------------- produce / consume


async def produce_raw(
    bootstrap: str,
    topic: str,
    values: Iterable[Message],
    *,
    key: bytes | None = None,
    partition: int | None = None,
    headers: Sequence[tuple[str, bytes]] | None = None,
) -> list[RecordMetadata]:
    """Sends raw messages with acks=all and waits for every acknowledgement, in order.

    Each item of `values` is the value bytes (sent with `key`) or a `(key, value)` tuple.
    """
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        futures = []
        for item in values:
            msg_key, value = item if isinstance(item, tuple) else (key, item)
            futures.append(
                await producer.send(
                    topic, value, key=msg_key, partition=partition, headers=list(headers or [])
                )
            )
        return list(await asyncio.gather(*futures))
    finally:
        await producer.stop()


async def _wait_partitions(bootstrap: str, topic: str, deadline: float) -> list[int]:
    """The topic's partitions once it exists. A broker that does not answer yet (just started,
    restarted or resumed by a test) is asked again until `deadline`."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        while True:
            try:
                return await _described_partitions(admin, topic)
            except (KafkaError, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"topic {topic!r}: {exc!r}") from exc
            await asyncio.sleep(0.1)
    finally:
        await admin.close()


async def _described_partitions(admin: AIOKafkaAdminClient, topic: str) -> list[int]:
    await admin.start()  # again after a failure: a no-op once started
    # All topics: asking for this one by name could auto-create it.
    for described in await admin.describe_topics():
        if described["topic"] == topic and described["error_code"] == 0 and described["partitions"]:
            return sorted(p["partition"] for p in described["partitions"])
    raise TimeoutError(f"topic {topic!r} does not exist")


async def wait_until(predicate, timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll `predicate` until true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def consume_until(
    bootstrap: str,
    topic: str,
    predicate: Predicate | None = None,
    *,
    timeout: float = 10.0,
    from_beginning: bool = True,
    raise_on_timeout: bool = True,
) -> list[ConsumerRecord]:
    """Reads `topic` (all partitions, no consumer group, nothing committed, read_committed) and
    returns the records.

    With a predicate: reads until ``predicate(records_so_far)`` is true. Without one: reads up to
    the end offsets the topic had when reading began ("everything there now"). A topic that does
    not exist yet is waited for. On timeout raises TimeoutError (with what was read), or returns
    what was read when `raise_on_timeout` is False (e.g. to check that nothing arrives).
    Records come in order within each partition, partitions interleaved.
    """
    deadline = time.monotonic() + timeout
    partitions = await _wait_partitions(bootstrap, topic, deadline)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        isolation_level="read_committed",  # as clients read: no result of an aborted transaction
    )
    await consumer.start()
    records: list[ConsumerRecord] = []
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        if from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)
        end = await consumer.end_offsets(tps) if predicate is None else None

        async def done() -> bool:
            if predicate is not None:
                return predicate(records)
            positions = [await consumer.position(tp) for tp in tps]
            return all(pos >= end[tp] for pos, tp in zip(positions, tps))

        while not await done():
            left = deadline - time.monotonic()
            if left <= 0:
                if raise_on_timeout:
                    tail = [
                        (r.partition, r.offset, r.key, r.value[:80] if r.value else r.value)
                        for r in records[-5:]
                    ]
                    raise TimeoutError(
                        f"consume_until({topic!r}): condition not met after {timeout}s; "
                        f"{len(records)} records read, last ones: {tail}"
                    )
                return records
            batch = await consumer.getmany(*tps, timeout_ms=int(min(left, 0.2) * 1000))
            for tp in tps:  # keep a stable partition order
                records.extend(batch.get(tp, []))
        return records
    finally:
        await consumer.stop()


ProduceRaw = Callable[..., Awaitable[list[RecordMetadata]]]


def free_port_pair() -> int:
    """A port P such that P and P + 1 (a private broker's controller) are free on localhost; from
    INFERLINE_TEST_PORTS ("LOW-HIGH") when set (runs side by side, each in a range of its own)."""
    low, _, high = os.environ.get("INFERLINE_TEST_PORTS", "").partition("-")
    for _ in range(200):
        if low:
            port = random.randrange(int(low), int(high))
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        if port > 64000:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


async def committed_offsets(bootstrap: str, group: str) -> dict:
    """The group's committed offsets, as Kafka's lag reads them."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
