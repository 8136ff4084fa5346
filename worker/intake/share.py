"""Share intake: the request topic through a Kafka share group (KIP-932), one confluent-kafka
ShareConsumer per thread (`_Lane`), each record acknowledged on its own.
design: docs/operations.md#group-or-share-mode
"""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import structlog
from aiokafka import TopicPartition
from confluent_kafka import KafkaException, admin

from inferline.worker.intake.triage import Record, Triage, set_group_configs  # noqa: F401

log = structlog.get_logger(__name__)
POLL_S = 0.1  # how soon a freed slot is noticed
RELEASE_GRACE_S = 3.0  # after a release, other workers' polls get the records first
COMMIT_TIMEOUT_S = 10.0
VERDICTS = ("accept", "release", "reject")
LOCK_MARGIN_S = 10.0  # past a request's deadline: its `done` and the ack
POLL_INTERVAL_MARGIN_MS = 60_000  # a pinned lane polls again within its lock, plus this
# Every acquisition counts as a delivery, a RELEASE of overflow included: a record is handed off
# unstarted at most this often (on its first delivery), and max_deliveries does not count it. More
# would let a poison request kill as many more workers.
OVERFLOW_HOPS = 1
LIMITS_TRIES = 5  # reads of the broker's limits before the worker gives up starting
LANE_BACKOFF_S = 1.0  # after a lane's unexpected error, before it goes on
COMMIT_TRIES = 3  # sends of the acknowledgements of one commit
CLOSE_WAIT_S = 10.0  # for the verdicts of finals still on their way, before lanes close


@dataclass(frozen=True)
class BrokerLimits:
    """The broker's share-group limits (Kafka's defaults until read)."""

    delivery_limit: int = 5  # past it, archived unseen
    max_lock_ms: int = 60_000  # static on the broker


def read_broker_limits(kafka, tries: int = LIMITS_TRIES) -> BrokerLimits:
    """Blocking: the limits the broker describes. Raises when it cannot be asked: a guessed
    delivery limit or lock cap would archive records unseen or run long requests twice."""
    client = admin.AdminClient(kafka.librdkafka_config())
    for attempt in itertools.count(1):
        try:
            broker_id = next(iter(client.list_topics(timeout=30).brokers))
            resource = admin.ConfigResource("broker", str(broker_id))
            configs = client.describe_configs([resource])[resource].result(timeout=30)
            names = "group.share.delivery.count.limit", "group.share.max.record.lock.duration.ms"
            return BrokerLimits(*(int(configs[name].value) for name in names))
        except Exception as exc:  # noqa: BLE001 - broker starting, no DESCRIBE_CONFIGS right
            log.warning("share_intake.broker_limits_unread", attempt=attempt, error=repr(exc))
            if attempt == tries:
                raise RuntimeError(f"share mode needs the broker's share limits: {exc!r}") from exc
            time.sleep(2.0 * attempt)


def lock_ms(settings, broker: BrokerLimits) -> int:
    """The record lock: share_lock_ms, or past the longest request; never over the broker's cap."""
    longest_ms = math.ceil((settings.limits.default_timeout_s + LOCK_MARGIN_S) * 1000)
    wanted = settings.kafka.share_lock_ms or longest_ms
    if wanted > broker.max_lock_ms:  # a request running longer is run again by another worker
        log.warning("share_intake.lock_capped", wanted_ms=wanted, broker_max_ms=broker.max_lock_ms)
    return min(wanted, broker.max_lock_ms)


def overflow_hops(broker: BrokerLimits) -> int:
    """Hand-offs of unstarted overflow a record may have: none at the broker's least limit (2)."""
    return max(0, min(OVERFLOW_HOPS, broker.delivery_limit - 2))


def max_deliveries(kafka, broker: BrokerLimits) -> int:
    """Deliveries a record may have here, overflow hand-offs not counted: with them, below the
    broker's limit, so the last is dead-lettered, not archived unseen."""
    limit = broker.delivery_limit - 1 - overflow_hops(broker)
    return max(1, min(kafka.max_deliveries, limit))


def client_config(kafka, group_id: str, max_poll_records: int, lock: int) -> dict:
    """A share consumer's settings: explicit acks, a poll interval a pinned lane stays within."""
    return {
        **kafka.librdkafka_config(),
        "group.id": group_id,
        "share.acknowledgement.mode": "explicit",
        "max.poll.records": max_poll_records,
        "max.poll.interval.ms": max(300_000, lock + POLL_INTERVAL_MARGIN_MS),
    }


def group_configs(lock: int) -> dict[str, str]:
    """The share group's settings (a new one would start at the end, skipping waiting requests)."""
    return {"share.auto.offset.reset": "earliest", "share.record.lock.duration.ms": str(lock)}


class _Lane:
    """One ShareConsumer on its own thread; it polls only when its last poll is acknowledged."""

    def __init__(self, intake: "ShareIntake", index: int, conf: dict) -> None:
        self._intake, self._conf = intake, conf
        self.verdicts = queue.SimpleQueue()  # (topic, partition, offset, verdict) to send
        self.closing = threading.Event()
        self.claim_size = conf.get("max.poll.records", 1)
        self.claimed = 0  # room claimed for a poll not yet queued in the intake
        self.subscribed = False
        self.held: set[tuple[str, int, int]] = set()  # polled, not acknowledged yet: pinned
        self.thread = threading.Thread(target=self._run, name=f"share-intake-{index}", daemon=True)

    def _run(self) -> None:
        from confluent_kafka import ShareConsumer

        try:
            consumer = ShareConsumer(self._conf)
        except Exception as exc:  # noqa: BLE001 - a lane that cannot start: the worker must stop
            log.exception("share_intake.lane_failed")
            self._intake.lane_failed(exc)
            return
        held = self.held
        try:
            while not self.closing.is_set():
                self._step(consumer, held)
        finally:
            self._close(consumer, held)

    def _step(self, consumer, held: set) -> None:
        """One poll or one round of acknowledgements. An error goes on after a pause, the consumer
        kept: closed, it would release records still running here to other workers."""
        try:
            if held:
                self._acknowledge(consumer, held, wait=POLL_S)
            else:
                self._take(consumer, held)
        except Exception:  # noqa: BLE001 - see above
            log.exception("share_intake.lane_error", held=len(held))
            self._intake.free_claim(self)
            time.sleep(LANE_BACKOFF_S)

    def _take(self, consumer, held: set) -> None:
        if not self._intake.fetching:
            time.sleep(POLL_S)
            return
        claimed = self._intake.claim_room(self)
        if claimed != self.subscribed:  # no room: out of the share group meanwhile
            consumer.subscribe(self._intake.topics) if claimed else consumer.unsubscribe()
            self.subscribed = claimed
        if not claimed:
            time.sleep(POLL_S)
            return
        records = self._poll(consumer)
        if records:
            held.update((r.topic, r.partition, r.offset) for r in records)
            self._intake.hand_over(self, records)  # the loop frees the claim once they are queued
        else:
            self._intake.free_claim(self)

    def _poll(self, consumer) -> list[Record]:
        try:
            return Record.read(consumer.poll(POLL_S))
        except KafkaException as exc:  # broker restarting, coordinator moving: try again
            log.warning("share_intake.poll_failed", error=str(exc))
            time.sleep(1.0)
            return []

    def _acknowledge(self, consumer, held: set, wait: float | None) -> None:
        """Acknowledge the verdicts that came (waiting `wait` s for the first), then send them."""
        sent: list[tuple[str, int, int, object]] = []
        while True:
            try:
                *key, verdict = self.verdicts.get(timeout=wait if wait and not sent else 0)
            except queue.Empty:
                break
            if tuple(key) in held:
                held.discard(tuple(key))  # acknowledged, or no longer ours
                if self._mark_acks(consumer, [ack := (*key, _ack_type(verdict))]):
                    sent.append(ack)
        if sent:
            self._commit(consumer, sent)

    def _commit(self, consumer, acks: list) -> None:
        """Send `acks`; those of a partition whose send failed are sent again. An ACCEPT lost here
        lets the record's lock expire and another worker answer it a second time."""
        for attempt in range(1, COMMIT_TRIES + 1):
            try:
                results = consumer.commit_sync(COMMIT_TIMEOUT_S) or {}
                failed = {(tp.topic, tp.partition): str(e) for tp, e in results.items() if e}
            except KafkaException as exc:  # the whole request: every partition again
                failed = {(t, p): str(exc) for t, p, _, _ in acks}
            acks = [a for a in acks if (a[0], a[1]) in failed]
            if not acks:
                return
            log.warning("share_intake.ack_failed", attempt=attempt, errors=failed)
            if attempt == COMMIT_TRIES or not self._mark_acks(consumer, acks):
                break
            time.sleep(LANE_BACKOFF_S)
        # Once its lock expires, another worker may run it again.
        log.error("share_intake.ack_lost", records=[(t, p, o) for t, p, o, _ in acks])

    @staticmethod
    def _mark_acks(consumer, acks: list) -> bool:
        """Acknowledge `acks`; False when the client no longer holds them (lock gone): a record
        left held would pin its lane for good."""
        try:
            for topic, partition, offset, kind in acks:
                consumer.acknowledge_offset(topic, partition, offset, kind)
        except Exception as exc:  # noqa: BLE001 - IllegalStateException: no longer in flight
            log.warning("share_intake.ack_not_in_flight", error=repr(exc))
            return False
        return True

    def _close(self, consumer, held: set) -> None:
        """Verdicts that came, then RELEASE for the rest, and leave."""
        try:
            self._acknowledge(consumer, held, wait=None)
            acks = [(*key, _ack_type("release")) for key in held]
            for ack in acks:
                consumer.acknowledge_offset(*ack)
            if acks:
                log.info("share_intake.released", records=len(acks))
                self._commit(consumer, acks)
        finally:
            consumer.close()


def _ack_type(verdict: str):
    from confluent_kafka import AcknowledgeType  # share mode's client (the `share` extra)

    return getattr(AcknowledgeType, verdict.upper())


class ShareIntake(Triage):
    """The intake of share mode: the same Sink calls as Intake, records from a share group. The
    lanes' threads call hand_over, claim_room, free_claim and lane_failed; the rest runs on the
    loop."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lanes: list[_Lane] = []
        self._owner: dict[tuple[TopicPartition, int], _Lane] = {}
        # Polled, not yet handed to the worker: past the room only last-delivery records wait here.
        self._polled: deque[tuple[_Lane, Record]] = deque()
        self._conf: dict = {}
        self.broker = BrokerLimits()
        self.max_deliveries = self._s.kafka.max_deliveries
        self.hops = OVERFLOW_HOPS  # hand-offs of unstarted overflow, not counted as deliveries
        # Room for records nobody polled yet, set by the loop; lanes claim it before they poll.
        self.free_room = 0
        self._claims = threading.Lock()
        self._released_at = float("-inf")  # the last overflow release

    @property
    def topics(self) -> list[str]:
        return [self._s.kafka.request_topic]

    async def start(self) -> None:
        k = self._s.kafka
        assert k.tenancy == "body", "share mode reads one topic (tenancy=topic: group mode only)"
        self._loop = asyncio.get_running_loop()
        self.broker = await asyncio.to_thread(read_broker_limits, k)
        self.max_deliveries = max_deliveries(k, self.broker)
        self.hops = overflow_hops(self.broker)
        lock = lock_ms(self._s, self.broker)
        await asyncio.to_thread(set_group_configs, k, group_configs(lock))
        per_poll = max(1, self._s.scheduler.max_waiting // 2)
        self._conf = client_config(k, k.group_id, per_poll, lock)
        self._open_lane()
        self._tasks = [asyncio.create_task(self._hand_out_loop(), name="share-intake-hand-out")]
        self.joined = True
        log.info(
            "share_intake.started",
            group=k.group_id,
            lock_ms=lock,
            max_deliveries=self.max_deliveries,
            overflow_hops=self.hops,
            delivery_limit=self.broker.delivery_limit,
        )

    def _open_lane(self) -> None:
        lane = _Lane(self, len(self._lanes), self._conf)
        self._lanes.append(lane)
        lane.thread.start()
        if len(self._lanes) > 1:
            log.info("share_intake.lane_opened", lanes=len(self._lanes))

    def _lanes_wanted(self) -> None:
        """Room, and every lane pinned: open another, up to share_consumers; not just after a
        release (its own new lane would take the released records back before an idle worker)."""
        if (
            self._lanes
            and self.free_room > 0
            and time.monotonic() - self._released_at >= RELEASE_GRACE_S
            and len(self._lanes) < self._s.kafka.share_consumers
            and all(lane.held for lane in self._lanes)  # each waits for its verdicts
        ):
            self._open_lane()

    async def close(self) -> None:
        """Wait (bounded) for the verdicts of what was handed to the worker, then release what was
        taken and not answered, and leave the share group. Closed before a final's verdict came,
        a lane would release a record already answered: another worker would answer it again."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._owner and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self._owner:
            log.warning("share_intake.closed_with_verdicts_pending", records=len(self._owner))
        for lane in self._lanes:
            lane.closing.set()
        await asyncio.gather(*(asyncio.to_thread(lane.thread.join, 30.0) for lane in self._lanes))
        await self._close_triage()

    def hand_over(self, lane: _Lane, records: list[Record]) -> None:
        self._loop.call_soon_threadsafe(self._take, lane, records)

    def claim_room(self, lane: _Lane) -> bool:
        """May `lane` poll? While room is left that no other lane's poll has claimed."""
        with self._claims:
            unclaimed = self.free_room - sum(other.claimed for other in self._lanes)
            if not lane.claimed and unclaimed > 0:
                lane.claimed = lane.claim_size
            return lane.claimed > 0

    def free_claim(self, lane: _Lane) -> None:
        with self._claims:
            lane.claimed = 0

    def lane_failed(self, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._sink.fatal, exc)

    def _take(self, lane: _Lane, records: list[Record]) -> None:
        self._polled.extend((lane, r) for r in records if not self._running_here(lane, r))
        self._hand_out()
        self._release_overflow()
        self.free_claim(lane)  # after _hand_out: free_room counts these now

    def _release_overflow(self) -> None:
        """Release what the pool has no room for, for a worker with room, on its first delivery
        only (`hops`): every acquisition counts as a delivery, so a record handed off again and
        again would run out of deliveries unstarted. The rest waits here for room (a poll claims
        room first, so only a producer batch's overshoot of max.poll.records waits)."""
        keep: deque[tuple[_Lane, Record]] = deque()
        for lane, record in self._polled:
            if self.fetching and record.delivery_count > self.hops:
                keep.append((lane, record))
            else:
                lane.verdicts.put((record.topic, record.partition, record.offset, "release"))
        if len(keep) < len(self._polled):
            self._released_at = time.monotonic()
            log.info("share_intake.overflow_released", records=len(self._polled) - len(keep))
        if keep:  # handed off already: another hop would cost a delivery
            log.warning("share_intake.overflow_kept", records=len(keep), hops=self.hops)
        self._polled = keep
        self.free_room = self._room() - len(self._polled) if self.fetching else 0

    async def _hand_out_loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            self._hand_out()

    def _room(self) -> int:
        return self._sink.room() - self._num_verifying

    def _hand_out(self) -> None:
        unverified = []
        while self._polled and self.fetching and self._room() - len(unverified) > 0:
            lane, record = self._polled.popleft()
            if not self._running_here(lane, record):
                tp = TopicPartition(record.topic, record.partition)
                self._owner[(tp, record.offset)] = lane
                self._handle_safely(tp, record, unverified)
        self.free_room = self._room() - len(self._polled) if self.fetching else 0
        if unverified:
            self._verify_in_background(unverified)
        self._lanes_wanted()

    def _running_here(self, lane: _Lane, record: Record) -> bool:
        """A record back while it still runs here (its lock expired) needs no room: its verdict
        goes to the live delivery through `lane`, the stale one is let go."""
        key = (TopicPartition(record.topic, record.partition), record.offset)
        earlier = self._owner.get(key)
        if earlier is None:
            return False
        self._owner[key] = lane
        where = {"partition": record.partition, "offset": record.offset}
        log.warning("share_intake.lock_expired", **where, delivery_count=record.delivery_count)
        earlier.verdicts.put((record.topic, record.partition, record.offset, "release"))
        return True

    def decide(self, tp: TopicPartition, offset: int, verdict: str) -> None:
        """The worker's verdict on a record: sent to the broker by its lane."""
        assert verdict in VERDICTS, verdict
        lane = self._owner.pop((tp, offset), None)
        if lane is not None:
            lane.verdicts.put((tp.topic, tp.partition, offset, verdict))

    def _claim(self, tp: TopicPartition, record: Record) -> bool:
        """Too many deliveries is a dead letter (a first one's hand-off of overflow not counted)."""
        limit = self.max_deliveries
        if record.delivery_count <= limit + self.hops:
            return True
        reason = (
            f"delivered {record.delivery_count} times (max_deliveries {limit}, "
            f"plus {self.hops} hand-off of overflow): its workers died or gave it up"
        )
        where = {"partition": tp.partition, "offset": record.offset}
        log.warning("share_intake.dead_letter", **where, reason=reason)
        self._delivery.dead_letter(record, reason)
        return False
