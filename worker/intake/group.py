"""Group intake: the request topic through a consumer group on the broker's incremental protocol
(KIP-848: a rebalance revokes only the partitions that move). confluent-kafka's consumer is
synchronous, so it lives in a thread of its own; records and rebalances cross to the event loop,
where triage and the partitions' state live. design: docs/operations.md#scaling
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
import threading
import time

import structlog
from aiokafka import TopicPartition
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException
from confluent_kafka import TopicPartition as KafkaPartition

from inferline.worker.delivery.commit import Committer
from inferline.worker.intake.triage import Record, Triage, is_fatal, set_group_configs
from inferline.worker.service.tenancy import tenant_pattern

log = structlog.get_logger(__name__)
POLL_S = 0.1  # how soon a freed slot is noticed
MAX_BATCH = 500
OVERLOAD_BATCH = 64
LAG_EVERY_S = 5.0
SUBSCRIBE_EVERY_S = 30.0  # how soon a new tenant's topic is subscribed
FLUSH_ON_REVOKE_S = 5.0  # a revoked partition's queued finals get this long to commit
ASSIGN_TRIES_S = 120.0  # committed offsets unreadable this long: the worker stops
REJOIN_EVERY_S = 1.0  # a consumer the broker refused is replaced this often
BROKER_SESSION_TIMEOUT_MS = 45_000  # the broker's default, kept where the group's is not ours


def consumer_config(kafka) -> dict:
    config = {
        **kafka.librdkafka_config(),
        "group.id": kafka.group_id,
        "group.protocol": "consumer",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",  # committed offsets are read stable too
        "topic.metadata.refresh.interval.ms": 30_000,
    }
    if kafka.group_instance_id:
        config["group.instance.id"] = kafka.group_instance_id
    return config


def set_session_timeout(kafka) -> None:
    """Blocking: the group's session timeout (the broker keeps it under KIP-848)."""
    set_group_configs(kafka, {"consumer.session.timeout.ms": str(kafka.session_timeout_ms)})


class Intake(Triage):
    """Takes what the waiting pool has room for; each partition it owns is a `Partition` in the
    tracker (its epoch: work taken under an older one is stale). The poll thread runs the consumer
    and its rebalance callbacks (`_on_*`); the coroutines run on the loop."""

    def __init__(self, *parts, committer: Committer) -> None:
        super().__init__(*parts)  # as Triage's
        self._committer = committer
        committer.owner = self
        self._consumer: Consumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._want = 0  # records the poll thread may take next; set on the loop
        self._paused = False  # the poll thread's: every partition paused
        self._crowded: frozenset[str] = frozenset()  # topics left in Kafka: set on the loop
        self._crowded_paused: frozenset[str] | None = frozenset()  # the poll thread's
        self._full_since: float | None = None
        self._subscribed: list[str] | None = None
        self._refusals = (0.0, 0.0)  # the poll thread's: (first, last) of a run of refusals
        self._metadata = None  # the consumer's group metadata, read on the poll thread

    def owns(self, tp: TopicPartition, generation: int) -> bool:
        return self._tracker.owns(tp, generation)

    def group_metadata(self):
        """The consumer's, as of its last poll: asked from another thread while a rebalance
        callback runs, librdkafka would block until the callback returned."""
        return self._metadata

    def committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, tuple]:
        """Blocking: (offset, ledger) of each partition that has a commit, read stable."""
        out = {}
        for p in self._consumer.committed([_kafka(tp) for tp in tps], timeout=10):
            if p.error is not None:
                raise RuntimeError(f"committed offset of {p.topic}[{p.partition}]: {p.error}")
            if p.offset >= 0:
                out[_tp(p)] = (p.offset, p.metadata)
        return out

    def _claim(self, tp: TopicPartition, record) -> bool:
        if not self._tracker.taking(tp):
            return False  # read again by the partition's next owner
        if not self._tracker.add(tp, record.offset):
            self._m.redeliveries.labels("already_final").inc()
            return False
        return True

    def _still_ours(self, tp: TopicPartition, generation: int) -> bool:
        return self._tracker.taking(tp, generation)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(set_session_timeout, self._s.kafka)
        self._consumer = Consumer(consumer_config(self._s.kafka))
        try:
            await asyncio.to_thread(self._subscribe)
        except BaseException:
            # Never left to the garbage collector: librdkafka 2.16 can spin forever destroying a
            # KIP-848 consumer that was not closed, holding the thread that collected it.
            await asyncio.to_thread(self._consumer.close)
            raise
        self._thread = threading.Thread(target=self._poll_thread, name="group-intake", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Leave the group (what is still revoked in it runs through on_revoke)."""
        self._closing.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        await self._close_triage()

    def _poll_thread(self) -> None:
        try:
            while not self._closing.is_set():
                try:
                    self._poll()
                except KafkaException as exc:
                    if not is_fatal(exc.args[0]):
                        raise
                    self._rejoin(exc)  # this consumer can take nothing more
        except BaseException as exc:  # noqa: BLE001 - stopped, the worker would take nothing
            log.exception("intake.poll_thread_died")
            self._loop.call_soon_threadsafe(self._sink.fatal, exc)
        finally:
            self._consumer.close()  # revokes what is left through on_revoke

    def _poll(self) -> None:
        next_lag = next_subscribe = time.monotonic()
        while not self._closing.is_set():
            self._set_paused(self._want <= 0)
            self._pause_crowded()
            messages = self._consumer.consume(max(1, min(self._want, MAX_BATCH)), POLL_S)
            self._metadata = self._consumer.consumer_group_metadata()  # epoch of what it owns
            self._call(self._take(Record.read(messages)))
            now = time.monotonic()
            if now >= next_subscribe:
                self._subscribe()
                next_subscribe = now + SUBSCRIBE_EVERY_S
            if now >= next_lag:
                self._report_lag()
                next_lag = now + LAG_EVERY_S

    def _rejoin(self, exc: KafkaException) -> None:
        """A new consumer in place of one the broker refused for good. KIP-848 refuses a static
        member's instance id while the session of its killed predecessor lasts (a restart is
        quicker than that); past the longest session a broker may keep, `exc` stops the worker:
        another live member holds the id (two workers configured with one group_instance_id)."""
        k = self._s.kafka
        now, (first, last) = time.monotonic(), self._refusals
        give_up_s = max(k.session_timeout_ms, BROKER_SESSION_TIMEOUT_MS) / 1000 + 5 * REJOIN_EVERY_S
        first = first if now - last < 10 * REJOIN_EVERY_S else now  # else a new run
        self._refusals = (first, now)
        if now - first > give_up_s:
            raise exc
        log.warning("intake.consumer_refused", error=str(exc.args[0]), retry_in_s=REJOIN_EVERY_S)
        self._m.consumer_restarts.inc()
        self._consumer.close()  # revokes (as lost) what it still held
        self._closing.wait(REJOIN_EVERY_S)
        self._consumer = Consumer(consumer_config(k))
        self._subscribed = None
        self._subscribe()

    def _call(self, coro):
        """Run `coro` on the event loop and wait for it, however long the loop is busy (a slow
        loop is no reason to stop taking requests); only closing gives up. So the loop never calls
        the consumer: a call could wait for the rebalance callback that waits here."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self._closing.is_set() and self._loop.is_closed():
                    future.cancel()
                    raise

    def _set_paused(self, paused: bool) -> None:
        if paused != self._paused:
            self._paused = paused
            assigned = self._consumer.assignment()
            if assigned:
                (self._consumer.pause if paused else self._consumer.resume)(assigned)
            self._m.intake_paused.set(1 if paused else 0)
            self._crowded_paused = None if not paused else self._crowded_paused

    def _pause_crowded(self) -> None:
        """Topic tenancy: the topics of tenants whose lane holds its share stay in Kafka, so the
        fetches go to the other tenants' topics in turn (body tenancy mixes tenants in a
        partition: nothing to pause)."""
        crowded = self._crowded
        if self._paused or crowded == self._crowded_paused:
            return
        assigned = self._consumer.assignment()
        running = [p for p in assigned if p.topic not in crowded]
        if running:
            self._consumer.resume(running)
        if len(running) < len(assigned):
            self._consumer.pause([p for p in assigned if p.topic in crowded])
        self._crowded_paused = crowded

    def _subscribe(self) -> None:
        topics = self._wanted_topics()
        if topics != self._subscribed:
            log.info("intake.subscribe", topics=topics)
            self._subscribed = topics
            if topics:
                self._consumer.subscribe(
                    topics,
                    on_assign=self._on_assign,
                    on_revoke=self._on_revoke,
                    on_lost=functools.partial(self._on_revoke, orderly=False),
                )
            else:
                self._consumer.unsubscribe()

    def _wanted_topics(self) -> list[str]:
        """The request topic, or (tenancy=topic) every tenant's topic: matched here, as the broker's
        RE2 patterns have no lookahead to leave out the DLQ and reserved names."""
        k = self._s.kafka
        if k.tenancy != "topic":
            return [k.request_topic]
        reserved = (k.dlq_topic, k.cancel_topic, k.reply_topic_prefix)
        pattern = re.compile(tenant_pattern(k.request_topic, reserved))
        listed = self._consumer.list_topics(timeout=10).topics
        return sorted(t for t in listed if pattern.match(t))

    def _report_lag(self) -> None:
        ends = {}
        for p in self._consumer.assignment():
            try:
                ends[_tp(p)] = self._consumer.get_watermark_offsets(p, timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - a gauge is worth a log line at most
                log.debug("intake.lag_error", error=repr(exc))
        self._loop.call_soon_threadsafe(self._set_lag, ends)

    def _on_assign(self, consumer, partitions) -> None:
        tps = [_tp(p) for p in partitions]
        committed = self._read_committed(tps)
        self._call(self._assigned(tps, committed))
        starts = [_kafka(tp, committed.get(tp, (OFFSET_BEGINNING,))[0]) for tp in tps]
        consumer.incremental_assign(starts)
        if self._paused and starts:
            consumer.pause(starts)
        self._crowded_paused = None  # new partitions of a crowded topic: paused next poll

    def _read_committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, tuple]:
        """Stable reads wait out a previous owner's open transaction; a broker away for longer than
        ASSIGN_TRIES_S stops the worker (its orchestrator restarts it)."""
        deadline = time.monotonic() + ASSIGN_TRIES_S
        while True:
            try:
                return self.committed(tps) if tps else {}
            except Exception as exc:  # noqa: BLE001 - coordinator moving, broker restarting
                log.warning("intake.committed_unreadable", error=repr(exc))
                if time.monotonic() > deadline or self._closing.is_set():
                    raise
                time.sleep(1.0)

    def _on_revoke(self, consumer, partitions, orderly: bool = True) -> None:
        """Revoked (`orderly`: this member may still commit) or lost."""
        self._call(self._revoked({_tp(p) for p in partitions}, orderly))

    async def _take(self, records: list[Record]) -> None:
        """Triage what was polled; then say how many the poll thread may take next."""
        unverified: list = []
        for record in records:
            self._handle_safely(TopicPartition(record.topic, record.partition), record, unverified)
        if unverified:  # off the poll thread: a slow lookup holds up no other request
            self._verify_in_background(unverified)
        room = self._sink.room() - self._num_verifying if self.fetching else 0
        # Rejecting a full pool's overflow takes records past its room: at most one batch of dead
        # letters may wait for the broker meanwhile, or a flood of them would grow memory.
        calm = self._delivery.dead_letters_in_flight < OVERLOAD_BATCH
        self._overloading = self.fetching and room <= 0 and calm and self._overloaded()
        self._want = room if room > 0 else OVERLOAD_BATCH if self._overloading else 0
        self._crowded = self._crowded_topics()

    def _crowded_topics(self) -> frozenset[str]:
        k = self._s.kafka
        if k.tenancy != "topic" or not hasattr(self._sink, "crowded"):
            return frozenset()
        return frozenset(f"{k.request_topic}.{t}" for t in self._sink.crowded())

    def _overloaded(self) -> bool:
        after = self._s.limits.overload_reject_after_s
        if after is None or not self._sink.pool_full():
            self._full_since = None
            return False
        now = time.monotonic()
        self._full_since = self._full_since or now
        return now - self._full_since >= after

    async def _assigned(self, tps: list[TopicPartition], committed: dict) -> None:
        for tp in tps:
            offset, metadata = committed.get(tp, (None, None))
            self._tracker.resume(tp, offset, metadata)
        self.joined = True
        log.info("intake.assigned", partitions=_names(tps), owned=_names(self._tracker.owned()))

    async def _revoked(self, tps: set[TopicPartition], orderly: bool) -> None:
        """Moved partitions: what is queued commits (if the group still lets this member), what
        runs is requeued, and their state goes."""
        tps &= set(self._tracker.owned())
        if not tps:
            return
        log.info("intake.revoked", partitions=_names(tps), orderly=orderly)
        parts = [self._tracker.get(tp) for tp in tps]
        for p in parts:
            p.revoking = True  # nothing more is taken from it
        if orderly:
            await self._committer.flush(tps, FLUSH_ON_REVOKE_S)
        for p in parts:
            p.epoch = 0  # its finals are its next owner's now
        if orderly:  # a lost member's commits are refused by the broker: no need to wait
            await self._committer.settle(tps)
        self._committer.drop(tps)  # what is queued, and what a settled transaction gave back
        await self._sink.requeue(tps)
        self._tracker.forget(tps)
        for tp in tps:
            self._m.forget_partition(tp.topic, tp.partition)

    def _set_lag(self, ends: dict[TopicPartition, tuple[int, int]]) -> None:
        """Per owned partition, records from the watermark (else the log's start) to the end, and
        the backlog: what of them is not finished (the autoscaler's signal)."""
        for tp, (start, end) in ends.items():
            if self._tracker.epoch(tp):
                mark = self._tracker.watermark(tp)
                lag = end - (start if mark is None else mark)
                backlog = self._tracker.backlog(tp, start, end)
                self._m.set_partition(tp.topic, tp.partition, lag, backlog)


def _names(tps) -> list[str]:
    return sorted(f"{tp.topic}[{tp.partition}]" for tp in tps)


def _tp(p) -> TopicPartition:
    return TopicPartition(p.topic, p.partition)


def _kafka(tp: TopicPartition, *offset) -> KafkaPartition:
    return KafkaPartition(tp.topic, tp.partition, *offset)
