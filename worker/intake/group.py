"""Intake: the consumer group on the request topic. Each record becomes a dead letter, a rejection
or an admission; with no room every partition pauses, but `getmany` goes on (aiokafka measures
max_poll_interval_ms from it). design: docs/operations.md#scaling-partitions-and-consumer-groups
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocol

from inferline.worker.delivery.offsets import LagGauge, OffsetTracker
from inferline.worker.delivery.transactions import Transactions
from inferline.worker.intake import group_join
from inferline.worker.intake.cancels import RecentCancels
from inferline.worker.intake.triage import Sink, Triage, _Unverified
from inferline.worker.service.ratelimit import RateLimiter
from inferline.worker.service.tenancy import tenant_pattern

log = structlog.get_logger(__name__)
POLL_MS = 100  # how soon a freed slot is noticed
TAKE_OVER_TRIES = 5
OVERLOAD_BATCH = 64


def assignors(rebalance: str) -> tuple:
    """`hold`: sticky first, round robin still agreed with members that know only it (mid-upgrade).
    A class per consumer: aiokafka keeps the sticky assignor's state on it."""
    if rebalance == "requeue":
        return (RoundRobinPartitionAssignor,)
    return (type("StickyAssignor", (StickyPartitionAssignor,), {}), RoundRobinPartitionAssignor)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, intake: "Intake") -> None:
        self._intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        await self._intake.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        assigned = set(assigned)
        self._intake.assigning(assigned)  # before any await: aiokafka fetches them from here on
        kept, moved = self._intake.on_assigned(assigned, await self._intake.kept(assigned))
        await self._intake.take_over(assigned - kept, moved=moved, kept=kept)


class Intake(Triage):
    def __init__(
        self,
        settings,
        sink: Sink,
        tracker: OffsetTracker,
        limiter: RateLimiter,
        metrics,
        cancels: RecentCancels,
        transactions: Transactions,
        delivery,
    ) -> None:
        super().__init__(settings, sink, tracker, limiter, metrics, cancels, delivery)
        self._txns = transactions
        self._consumer: AIOKafkaConsumer | None = None
        self._full_since: float | None = None
        self._revoking: set[TopicPartition] = set()
        self._given_up: set[TopicPartition] = set()  # another worker holds its transactional id
        self._taking_over: set[TopicPartition] = set()  # ledger not read yet: untouched
        self.lag = LagGauge(tracker, metrics.consumer_lag)
        self._generation = 0
        self._epochs: dict[TopicPartition, int] = {}  # partition -> generation it was taken in
        self._holding: set[TopicPartition] = set()  # revoked, held until the assignment is known
        self._rebalanced = asyncio.Event()  # set while no revocation waits for its assignment
        self._rebalanced.set()
        transactions.owner = self

    @property
    def generation(self) -> int:
        return self._generation

    def epoch(self, tp: TopicPartition) -> int:
        """The generation `tp` was taken over in; work taken under another belongs to no partition
        here."""
        return self._epochs.get(tp, self._generation)

    def _claim(self, tp: TopicPartition, record) -> bool:
        if tp in self._revoking or tp in self._taking_over or not self.owns(tp, self.epoch(tp)):
            return False  # untracked: read again by the next owner or after the seek
        if not self._tracker.add(tp, record.offset):
            self._m.redeliveries.labels("already_final").inc()
            return False
        return True

    async def _settled(self) -> None:
        await self._rebalanced.wait()

    def _still_ours(self, tp: TopicPartition, generation: int) -> bool:
        return generation == self.epoch(tp) and tp not in self._revoking

    async def start(self) -> None:
        k = self._s.kafka
        group_join.install()  # hold names two assignors: one JoinGroup for both
        self._consumer = AIOKafkaConsumer(
            **k.client_options(),
            group_id=k.group_id,
            group_instance_id=k.group_instance_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            partition_assignment_strategy=assignors(k.rebalance),
            session_timeout_ms=k.session_timeout_ms,
            heartbeat_interval_ms=k.session_timeout_ms // 4,
            max_partition_fetch_bytes=k.max_message_bytes + 64 * 1024,
            metadata_max_age_ms=30_000,  # how soon a new tenant's topic is subscribed
        )
        if k.tenancy == "topic":
            self._consumer.subscribe(
                pattern=tenant_pattern(
                    k.request_topic, (k.dlq_topic, k.cancel_topic, k.reply_topic_prefix)
                ),
                listener=_Rebalance(self),
            )
        else:
            self._consumer.subscribe([k.request_topic], listener=_Rebalance(self))
        await self._consumer.start()
        self.lag.consumer = self._consumer
        self._tasks = [
            asyncio.create_task(self._fetch_loop(), name="intake-fetch"),
            asyncio.create_task(self.lag.run(), name="intake-lag"),
        ]

    async def close(self) -> None:
        """Leave the group; offsets commit with their finals, so nothing is left to commit."""
        await self._close_triage()
        if self._consumer:
            await self._consumer.stop()

    # -- fetching -------------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        # Must outlive anything: stopped, the worker would sit in the group taking nothing.
        while True:
            try:
                batch = await self._fetch_once()
            except Exception as exc:  # noqa: BLE001 - broker hiccups, coordinator errors
                log.warning("intake.fetch_error", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            unverified: list[_Unverified] = []
            for tp, records in batch.items():
                for record in records:
                    self._handle_safely(tp, record, unverified)
            if unverified:  # off the fetch loop: a slow lookup holds up no other request
                self._verify_in_background(unverified)
            self.lag.update()

    async def _fetch_once(self) -> dict:
        room = self._sink.room() - self._num_verifying if self.fetching else 0
        self._overloading = self.fetching and room <= 0 and self._overloaded()
        take = room > 0 or self._overloading
        self._set_paused(not take)
        max_records = room if room > 0 else OVERLOAD_BATCH
        return await self._consumer.getmany(timeout_ms=POLL_MS, max_records=max_records)

    def _overloaded(self) -> bool:
        after = self._s.limits.overload_reject_after_s
        if after is None or not self._sink.pool_full():
            self._full_since = None
            return False
        now = time.monotonic()
        self._full_since = self._full_since or now
        return now - self._full_since >= after

    def _set_paused(self, paused: bool) -> None:
        assigned = self._consumer.assignment()
        if paused:
            todo = assigned - self._consumer.paused()
            if todo:
                self._consumer.pause(*todo)
        elif (
            resumable := self._consumer.paused()
            - self._revoking
            - self._taking_over
            - self._given_up
        ):
            self._consumer.resume(*resumable)
        self._m.intake_paused.set(1 if paused and assigned else 0)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Requeue what runs from these partitions, commit what finished, let them go; to hold,
        only stop taking from them."""
        if self._s.kafka.rebalance == "hold":
            self._hold(revoked)
            return
        if revoked:
            log.info("intake.revoked", partitions=sorted(tp.partition for tp in revoked))
            # The fetch loop runs on meanwhile: no new work from these.
            self._revoking = set(revoked)
            self._consumer.pause(*revoked)
            await self._sink.requeue(revoked)
            await self._txns.close(revoked)
        self._tracker.forget(revoked)
        self.lag.remove(revoked)

    def _hold(self, revoked: set[TopicPartition]) -> None:
        """Take nothing more from these partitions, but let running work commit (a new owner fences
        their ids first)."""
        if not revoked:
            return
        log.info(
            "intake.revoked",
            partitions=sorted(tp.partition for tp in revoked),
            held=True,
            group_generation=self._consumer._coordinator.generation,
        )
        self._holding |= revoked
        self._revoking = set(revoked)
        self._rebalanced.clear()
        self._consumer.pause(*revoked)

    async def kept(self, assigned: set[TopicPartition]) -> set[TopicPartition]:
        """Held partitions assigned here again whose transactional ids this worker still holds,
        checked by a round trip (the generation cannot say); their work goes on."""
        candidates = {tp for tp in self._holding & assigned if tp not in self._given_up}
        return await self._txns.holds_ids(candidates) if candidates else set()

    def assigning(self, assigned: set[TopicPartition]) -> None:
        """Read nothing of the new assignment until take_over(): a record taken while kept() asks
        the broker would carry the old generation."""
        self._taking_over |= assigned
        if assigned:
            self._consumer.pause(*assigned)

    def on_assigned(
        self, assigned: set[TopicPartition], kept: set[TopicPartition] = frozenset()
    ) -> tuple[set[TopicPartition], set[TopicPartition]]:
        """A new assignment: which held partitions stay (kept) and which moved."""
        kept = set(kept) & self._holding & assigned
        moved = self._holding - kept
        self.joined = True
        self._revoking = set()
        self._given_up = set()
        self._generation += 1
        self._epochs = {
            tp: self._epochs.get(tp, self._generation) if tp in kept else self._generation
            for tp in assigned
        }
        self._holding = set()
        self._rebalanced.set()
        log.info(
            "intake.assigned",
            partitions=sorted(tp.partition for tp in assigned),
            kept=sorted(tp.partition for tp in kept),
            moved=sorted(tp.partition for tp in moved),
            group_generation=self._consumer._coordinator.generation,
        )
        # Nothing is read from a new partition before take_over() has read its ledger.
        self._taking_over = set(assigned)
        if assigned:
            self._consumer.pause(*assigned)
        return kept, moved

    async def take_over(
        self,
        assigned: set[TopicPartition],
        moved: set[TopicPartition] = frozenset(),
        kept: set[TopicPartition] = frozenset(),
    ) -> None:
        """Let go of held partitions that moved and take over the new ones; kept ones read on."""
        generation = self._generation
        await self._let_go(moved & assigned)  # back after a generation elsewhere: taken over anew
        if moved - assigned:  # no heartbeats while this callback runs: requeue beside it
            self._tasks.append(asyncio.create_task(self._let_go(moved - assigned)))
        ready = await self._take_over(assigned, generation)
        if not ready or generation != self._generation:
            return
        for tp in kept:
            offset = self._tracker.next_offset(tp)
            if offset is not None:
                self._consumer.seek(tp, offset)
        self._taking_over = set()

    async def _let_go(self, moved: set[TopicPartition]) -> None:
        """Moved held partitions: stop their producers (no finals commit) and requeue their work."""
        if not moved:
            return
        await self._txns.close(moved, timeout=0)
        await self._sink.requeue(moved)
        gone = {tp for tp in moved if tp not in self._epochs}
        self._tracker.forget(gone)
        self.lag.remove(gone)

    async def _take_over(self, assigned: set[TopicPartition], generation: int) -> bool:
        """Fence previous owners, then resume from committed offsets and ledgers; a worker that
        cannot, stops (its orchestrator restarts it)."""
        if not assigned:
            return True
        for attempt in range(TAKE_OVER_TRIES):
            try:
                await self._txns.open(assigned, generation)
                committed = await (await self._admin_client()).list_consumer_group_offsets(
                    self._s.kafka.group_id, partitions=list(assigned)
                )
                # Nothing committed: from the log's start, whatever the fetcher read before.
                fresh = [
                    tp for tp in assigned if committed.get(tp) is None or committed[tp].offset < 0
                ]
                starts = await self._consumer.beginning_offsets(fresh) if fresh else {}
                break
            except Exception as exc:  # noqa: BLE001 - coordinator moving, broker restarting
                log.warning("intake.take_over_failed", error=repr(exc), attempt=attempt + 1)
                if attempt + 1 == TAKE_OVER_TRIES:
                    self._sink.fatal(exc)
                    return False
                await asyncio.sleep(1.0 * (attempt + 1))
        if generation != self._generation:
            return False
        for tp in assigned:
            meta = committed.get(tp)
            offset = meta.offset if meta is not None and meta.offset >= 0 else None
            self._tracker.resume(tp, offset, meta.metadata if meta is not None else None)
            self._consumer.seek(tp, offset if offset is not None else starts[tp])
        return True

    # -- ownership, as the transactions ask it (Ownership) -----------------------------------------

    def owns(self, tp: TopicPartition, generation: int) -> bool:
        """Assigned, taken over in `generation`, not given up."""
        return (
            self._epochs.get(tp) == generation
            and tp in self._consumer.assignment()
            and tp not in self._given_up
        )

    async def confirm(self, tp: TopicPartition) -> bool:
        """The coordinator lists this member, in a stable group, with `tp` assigned."""
        member = self._consumer._coordinator.member_id
        (response,) = await (await self._admin_client()).describe_consumer_groups(
            [self._s.kafka.group_id]
        )
        for group in response.groups:
            error, state, members = group[0], group[2], group[5]
            if error or state != "Stable":
                return False
            for m in members:
                if m[0] == member:
                    assignment = ConsumerProtocol.ASSIGNMENT.decode(m[-1])
                    return any(
                        topic == tp.topic and tp.partition in parts
                        for topic, parts in assignment.assignment
                    )
        return False

    async def committed(self, tp: TopicPartition) -> tuple[int, str | None] | None:
        offsets = await (await self._admin_client()).list_consumer_group_offsets(
            self._s.kafka.group_id, partitions=[tp]
        )
        meta = offsets.get(tp)
        return (meta.offset, meta.metadata) if meta is not None and meta.offset >= 0 else None

    async def gone(self, topic: str) -> bool:
        return topic not in await self._list_topics()

    def give_up(self, tp: TopicPartition) -> None:
        """Another worker holds the partition's transactional id: stop taking it and requeue."""
        log.warning("intake.partition_given_up", partition=tp.partition)
        self._given_up.add(tp)
        if tp in self._consumer.assignment():
            self._consumer.pause(tp)
        task = asyncio.get_running_loop().create_task(self._sink.requeue({tp}))
        self._tasks.append(task)
