"""Share intake: the request topic read through a Kafka share group (KIP-932, "queues").

Every worker of the share group reads every partition; the broker hands each record to one of
them and locks it there until the worker acknowledges it: ACCEPT (its final `done` is on the
broker), REJECT (dead-lettered: undecodable, or delivered more than `max_deliveries` times) or
RELEASE (given back: shutdown, requeued by the engine). A worker that dies holds its records
only until their locks expire; then another worker gets them, with a higher delivery count.

The client is confluent-kafka's ShareConsumer, which blocks and is not thread-safe: each one
lives on a thread of its own (`_Lane`) and hands records to the event loop. In explicit
acknowledgement mode it refuses to poll again before every record of its last poll is
acknowledged, so a worker runs `share_consumers` of them: one takes new records while another
waits for its batch to finish. Records go to the worker only while its waiting pool has room;
the rest wait here, in order.

A full worker stops fetching: a lane polls only for room nobody else has claimed, and a lane that
holds nothing and may not poll unsubscribes until room returns. The client fetches (and the
broker locks to it) records in the background, not only inside poll(): a subscribed consumer of a
busy worker would take records it cannot run for a while (or, unpolled, until their locks
expire), while another worker sits idle. Unsubscribing acquires nothing, and releases nothing
that was handed out: only a lane holding nothing leaves.
Decoding, tenancy, cancels, deadlines and rate limits are the group intake's (Intake).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import structlog
from aiokafka import TopicPartition

from contract.schema import InvalidRequest, Request, UndecodableMessage, decode_request
from worker.intake.group import Intake

log = structlog.get_logger(__name__)
POLL_S = 0.1  # how soon a freed slot in the pool is noticed
COMMIT_TIMEOUT_S = 10.0
VERDICTS = ("accept", "release", "reject")


@dataclass
class ShareRecord:
    """A polled record, in the shape the intake and the worker's dead-letter path read."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list | None
    delivery_count: int


def client_config(kafka, group_id: str, max_poll_records: int) -> dict:
    """librdkafka settings of a share consumer: the worker's connection (KafkaSettings), explicit acks."""
    return {**kafka.librdkafka_config(), "group.id": group_id, "share.acknowledgement.mode": "explicit",
            "max.poll.records": max_poll_records}


def group_configs(kafka) -> dict[str, str]:
    """The share group's settings the worker relies on. A new share group starts at the end of
    the topic by default: requests already waiting would never be read."""
    configs = {"share.auto.offset.reset": "earliest"}
    if kafka.share_lock_ms is not None:
        configs["share.record.lock.duration.ms"] = str(kafka.share_lock_ms)
    return configs


def set_group_configs(kafka) -> None:
    """Blocking (run it off the loop): apply group_configs() to the share group, one at a time
    (a lock the broker refuses, e.g. over group.share.max.record.lock.duration.ms, must not
    stop the offset reset), logging each refusal."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

    admin = AdminClient(kafka.librdkafka_config())
    for name, value in group_configs(kafka).items():
        entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
        resource = ConfigResource(ResourceType.GROUP, kafka.group_id, incremental_configs=[entry])
        try:
            for future in admin.incremental_alter_configs([resource]).values():
                future.result(timeout=30)
        except Exception as exc:  # noqa: BLE001 - no ALTER_CONFIGS right, a value out of range
            log.warning("share_intake.group_config_failed", group=kafka.group_id, config=name, error=repr(exc))


class _Lane:
    """One ShareConsumer on its own thread. It polls only when every record of its last poll
    is acknowledged (the client's rule); verdicts come from the loop."""

    def __init__(self, intake: "ShareIntake", index: int, conf: dict) -> None:
        self._intake, self._conf = intake, conf
        self.verdicts: queue.SimpleQueue = queue.SimpleQueue()  # (topic, partition, offset, verdict)
        self.closing = threading.Event()
        self.claim_size = conf.get("max.poll.records", 1)  # room a poll of this lane may fill
        self.claimed = 0  # room claimed for a poll whose records are not in the intake's queue yet
        self.subscribed = False
        self.thread = threading.Thread(target=self._run, name=f"share-intake-{index}", daemon=True)

    def _run(self) -> None:
        from confluent_kafka import ShareConsumer

        consumer = ShareConsumer(self._conf)
        held: set[tuple[str, int, int]] = set()  # polled, not acknowledged yet
        try:
            while not self.closing.is_set():
                if held:
                    self._acknowledge(consumer, held, wait=POLL_S)
                else:
                    self._take(consumer, held)
        except Exception as exc:  # noqa: BLE001 - a dead lane takes nothing: the worker must stop
            log.exception("share_intake.lane_failed")
            self._intake.lane_failed(exc)
        finally:
            self._close(consumer, held)

    def _take(self, consumer, held: set) -> None:
        if not self._intake.fetching:  # draining: nothing new
            time.sleep(POLL_S)
            return
        if not self._intake.claim_room(self):  # full: fetch nothing (see the module docstring)
            if self.subscribed:
                consumer.unsubscribe()
                self.subscribed = False
            time.sleep(POLL_S)
            return
        if not self.subscribed:
            consumer.subscribe(self._intake.topics)
            self.subscribed = True
        records = self._poll(consumer)
        if records:
            held.update((r.topic, r.partition, r.offset) for r in records)
            self._intake.hand_over(self, records)  # the loop frees the claim once they are queued
        else:
            self._intake.free_claim(self)

    def _poll(self, consumer) -> list[ShareRecord]:
        from confluent_kafka import KafkaException

        records = []
        try:
            polled = consumer.poll(POLL_S)
        except KafkaException as exc:  # broker restarting, coordinator moving: try again
            log.warning("share_intake.poll_failed", error=str(exc))
            time.sleep(1.0)
            return records
        for msg in polled:
            if msg.error() is not None:
                log.warning("share_intake.poll_error", error=str(msg.error()))
                continue
            records.append(ShareRecord(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                                       msg.headers(), msg.delivery_count() or 1))
        return records

    def _acknowledge(self, consumer, held: set, wait: float | None) -> None:
        """Acknowledge the verdicts that came (waiting `wait` s for the first), then send them."""
        types = _ack_types()
        sent = 0
        while True:
            try:
                topic, partition, offset, verdict = (self.verdicts.get(timeout=wait) if wait and not sent
                                                     else self.verdicts.get_nowait())
            except queue.Empty:
                break
            if (topic, partition, offset) in held:
                consumer.acknowledge_offset(topic, partition, offset, types[verdict])
                held.discard((topic, partition, offset))
                sent += 1
        if sent:
            self._commit(consumer)

    def _commit(self, consumer) -> None:
        for tp, error in (consumer.commit_sync(COMMIT_TIMEOUT_S) or {}).items():
            if error is not None:  # e.g. the lock expired first: the record went to another worker
                log.warning("share_intake.ack_failed", topic=tp.topic, partition=tp.partition, error=str(error))

    def _close(self, consumer, held: set) -> None:
        """Verdicts that came, then RELEASE for the rest (another worker takes them), leave."""
        try:
            self._acknowledge(consumer, held, wait=None)
            for topic, partition, offset in held:
                consumer.acknowledge_offset(topic, partition, offset, _ack_types()["release"])
            if held:
                log.info("share_intake.released", records=len(held))
                self._commit(consumer)
        finally:
            consumer.close()


def _ack_types() -> dict:
    # Imported here: confluent-kafka is needed in share mode only (the `share` extra).
    from confluent_kafka import AcknowledgeType

    return {"accept": AcknowledgeType.ACCEPT, "release": AcknowledgeType.RELEASE, "reject": AcknowledgeType.REJECT}


class ShareIntake(Intake):
    """The intake of share mode: the same Sink calls as Intake, records from a share group."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lanes: list[_Lane] = []
        self._owner: dict[tuple[TopicPartition, int], _Lane] = {}  # taken record -> its lane
        # Polled, not yet handed to the worker: waiting for room in the pool (a poll may also
        # return more than max.poll.records: the broker hands out whole producer batches). They
        # wait here, locked to this worker, rather than go back with a higher delivery count.
        self._polled: deque[tuple[_Lane, ShareRecord]] = deque()
        self._verifying: set[asyncio.Task] = set()
        # Room for records nobody polled yet: the pool's room less the polled records waiting for
        # it, set by the loop; lanes claim from it before they poll (under _claims).
        self.free_room = 0
        self._claims = threading.Lock()

    @property
    def topics(self) -> list[str]:
        return [self._s.kafka.request_topic]

    async def start(self) -> None:
        k = self._s.kafka
        assert k.tenancy == "body", "share mode reads one request topic (tenancy=topic is group mode only)"
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(set_group_configs, k)
        per_poll = max(1, self._s.scheduler.max_waiting // k.share_consumers)
        self._lanes = [_Lane(self, i, client_config(k, k.group_id, per_poll)) for i in range(k.share_consumers)]
        for lane in self._lanes:
            lane.thread.start()
        self._tasks = [asyncio.create_task(self._hand_out_loop(), name="share-intake-hand-out")]
        self.joined = True
        log.info("share_intake.started", group=k.group_id, consumers=len(self._lanes))

    async def close(self) -> None:
        """Release what was taken and not answered, leave the share group."""
        for lane in self._lanes:
            lane.closing.set()
        await asyncio.gather(*(asyncio.to_thread(lane.thread.join, 30.0) for lane in self._lanes))
        for task in [*self._tasks, *self._verifying]:
            task.cancel()
        if self._admin:
            await self._admin.close()

    # -- lanes (their threads call these) ---------------------------------------------------------

    def hand_over(self, lane: _Lane, records: list[ShareRecord]) -> None:
        self._loop.call_soon_threadsafe(self._take, lane, records)

    def claim_room(self, lane: _Lane) -> bool:
        """May `lane` poll? Yes while room is left that no other lane's poll has claimed."""
        with self._claims:
            if not lane.claimed and self.free_room - sum(other.claimed for other in self._lanes) > 0:
                lane.claimed = lane.claim_size
            return lane.claimed > 0

    def free_claim(self, lane: _Lane) -> None:
        with self._claims:
            lane.claimed = 0

    def lane_failed(self, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._sink.fatal, exc)

    # -- the loop's side --------------------------------------------------------------------------

    def _take(self, lane: _Lane, records: list[ShareRecord]) -> None:
        self._polled.extend((lane, record) for record in records)
        self._hand_out()
        self.free_claim(lane)  # after _hand_out: free_room counts these records now

    async def _hand_out_loop(self) -> None:
        while True:  # room frees as requests start: polled records waiting for it go in then
            await asyncio.sleep(POLL_S)
            self._hand_out()

    def _hand_out(self) -> None:
        """Polled records to the worker, while its pool has room (the group intake's rule)."""
        unverified = []
        while self._polled and self.fetching and self._sink.room() > 0:
            lane, record = self._polled.popleft()
            tp = TopicPartition(record.topic, record.partition)
            earlier = self._owner.get((tp, record.offset))
            self._owner[(tp, record.offset)] = lane
            if earlier is not None:
                self._taken_again(tp, record, earlier)
                continue
            self._handle_safely(tp, record, unverified)
        self.free_room = self._sink.room() - len(self._polled) if self.fetching else 0
        if unverified:
            self._verify_in_background(unverified)

    def _taken_again(self, tp: TopicPartition, record: ShareRecord, earlier: _Lane) -> None:
        """A record still running here came back (its lock expired first): this delivery's lock
        is the live one, so the running job's verdict goes to it; the stale one is let go."""
        log.warning("share_intake.lock_expired", partition=tp.partition, offset=record.offset,
                    delivery_count=record.delivery_count)
        earlier.verdicts.put((tp.topic, tp.partition, record.offset, "release"))

    def decide(self, tp: TopicPartition, offset: int, verdict: str) -> None:
        """The worker's verdict on a record it was handed: sent to the broker by its lane."""
        assert verdict in VERDICTS, verdict
        lane = self._owner.pop((tp, offset), None)
        if lane is not None:
            lane.verdicts.put((tp.topic, tp.partition, offset, verdict))

    def _decode(self, tp: TopicPartition, record: ShareRecord) -> Request | InvalidRequest | None:
        """As Intake._decode, with no offsets to track; too many deliveries is a dead letter."""
        self._delivery.hold(tp, record)
        limit = self._s.kafka.max_deliveries
        if record.delivery_count > limit:
            reason = f"delivered {record.delivery_count} times (max_deliveries {limit}): its workers died or gave it up"
            log.warning("share_intake.dead_letter", partition=tp.partition, offset=record.offset, reason=reason)
            self._delivery.dead_letter(record, reason)
            return None
        try:
            return decode_request(record.value, self._s.kafka.max_message_bytes, self._s.model.max_model_len)
        except UndecodableMessage as exc:
            log.warning("share_intake.dead_letter", partition=tp.partition, offset=record.offset, reason=exc.reason)
            self._delivery.dead_letter(record, exc.reason)
            return None
        except InvalidRequest as exc:
            return exc
