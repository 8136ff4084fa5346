"""Final results committed with their input offsets, one Kafka transaction at a time per owned
input partition. design: docs/reliability.md#exactly-one-final-result-transactions
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    CorruptRecordException,
    InvalidTopicError,
    MessageSizeTooLargeError,
    ProducerFenced,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)

from inferline.worker.delivery.offsets import decode_ledger

log = structlog.get_logger(__name__)
Outcome = Literal["ok", "failed", "fenced"]  # ok: committed (or, not final, acked)
# Refusals no retry changes: the record, or the topic, is not this worker's to write.
PERMANENT = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    InvalidTopicError,
    CorruptRecordException,
    UnsupportedForMessageFormatError,
)
RETRY_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# Reply topics' metadata is awaited before a transaction begins: a deleted topic costs a retry,
# not an open transaction holding back read_committed readers.
METADATA_WAIT_S = 5.0
# A transaction not committed by then is given up and its producer replaced (InitProducerId
# aborts it, or waits for its commit).
TRANSACTION_WAIT_S = 30.0
# Reply topics a producer keeps metadata for; past it, idle ones are dropped.
MAX_PRODUCER_TOPICS = 512
# Test hook: SIGKILL after the Nth transaction's records reach the broker, before its commit.
_KILL_BEFORE_COMMIT = int(os.environ.get("INFERLINE_FAULT_KILL_BEFORE_COMMIT", "0"))


class Gone(RuntimeError):
    """The broker answers, and the reply topic is not there: a permanent refusal."""


def permanent(exc: BaseException) -> bool:
    return isinstance(exc, PERMANENT + (Gone,))


class Ownership(Protocol):
    """What PartitionTxn asks the intake before it acts for a partition."""

    def owns(self, tp: TopicPartition, generation: int) -> bool: ...
    async def confirm(self, tp: TopicPartition) -> bool: ...  # the group coordinator agrees
    async def committed(
        self, tp: TopicPartition
    ) -> tuple[int, str | None] | None: ...  # offset, ledger
    async def gone(self, topic: str) -> bool: ...  # the broker answers and lists no such topic
    def give_up(self, tp: TopicPartition) -> None: ...


class Owner:
    """Ownership of a lone PartitionTxn: every partition is its own."""

    def owns(self, tp, generation) -> bool:
        return True

    async def confirm(self, tp) -> bool:
        return True

    async def committed(self, tp):
        return None

    async def gone(self, topic) -> bool:
        return False

    def give_up(self, tp) -> None:
        pass


@dataclass
class Final:
    """One request's final records (none if already answered) and its input offset."""

    offset: int
    records: list[tuple]  # (topic, partition, key, value, headers)
    on_done: Callable[..., None]  # (outcome, error: str | None)
    forever: bool = False  # a dead letter: retried until the broker takes it
    generation: int = 0
    tries: int = 0
    first_failed: float | None = None
    not_before: float = 0.0

    @property
    def topics(self) -> set[str]:
        return {r[0] for r in self.records}


def listed(producer, topic: str) -> None:
    """Put `topic` on the producer's metadata list before sending: aiokafka lists only uncached
    topics, and a refresh drops unlisted ones."""
    client = producer.client
    if topic not in client._topics:
        client.add_topic(topic)


def reply_batch_bytes(kafka) -> int:
    """Batches as large as every reply topic takes: fewer, larger batches than aiokafka's 16 KiB."""
    return kafka.min_reply_message_bytes


def transactional_id(group_id: str, tp: TopicPartition) -> str:
    return f"{group_id}.{tp.topic}.{tp.partition}"


class _Unresolved(RuntimeError):
    """A commit was sent and its outcome is not known yet."""


class PartitionTxn:
    """The transactional producer of one owned input partition and its queue of finals. A failure
    is charged to its cause; the id is re-taken only on the coordinator's word."""

    def __init__(
        self,
        tp: TopicPartition,
        producer_factory,
        tracker,
        group_id: str,
        metrics,
        metadata_max_bytes: int,
        *,
        generation: int = 0,
        owner: Ownership | None = None,
        retry_s: float = 300.0,
        interval_s: float = 0.0,
    ) -> None:
        self.tp, self._factory, self._tracker = tp, producer_factory, tracker
        self._interval, self._last_begin = interval_s, float("-inf")
        self._group, self._m, self._metadata_max = group_id, metrics, metadata_max_bytes
        self.generation, self._owner, self._retry_s = generation, owner or Owner(), retry_s
        self._producer: AIOKafkaProducer | None = None
        self._queue: list[Final] = []
        self._committing: list[Final] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._commit_sent = False
        self._busy = asyncio.Lock()  # one transaction at a time
        self.fenced = False

    async def start(self) -> None:
        """Takes the partition's transactional id, fencing the old owner and aborting its open
        transaction, before the ledger is read."""
        self._producer = self._factory(self.tp)
        await self._take_id()
        self._task = asyncio.create_task(
            self._run(), name=f"txn-{self.tp.topic}-{self.tp.partition}"
        )

    async def _take_id(self) -> None:
        await self._producer.start()
        await self._producer.begin_transaction()  # waits for InitProducerId: the fencing
        await self._producer.abort_transaction()  # empty: nothing goes to the broker

    async def holds_id(self) -> bool:
        """A round trip as this producer (an offsets-only transaction): False once another took the
        id, or without an answer."""
        async with self._busy:
            ledger = self._tracker.ledger(self.tp)
            if self.fenced or self._producer is None or ledger is None:
                return False
            try:
                await asyncio.wait_for(self._commit_offsets(ledger), TRANSACTION_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - fenced, or not known: not kept
                log.warning("txn.id_not_held", partition=self.tp.partition, error=repr(exc))
                return False
            self._tracker.committed({self.tp: ledger[0]})
            return True

    async def _commit_offsets(self, ledger) -> None:
        await self._producer.begin_transaction()
        await self._producer.send_offsets_to_transaction({self.tp: ledger}, self._group)
        await self._producer.commit_transaction()

    def submit(self, final: Final) -> None:
        if self.fenced or final.generation != self.generation:
            final.on_done("fenced")  # another owner or assignment: its owner reads it again
            return
        self._queue.append(final)
        self._wake.set()

    def idle(self) -> bool:
        return not self._queue and not self._committing

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for final in self._committing + self._queue:
            final.on_done("fenced")
        self._committing, self._queue = [], []
        if self._producer:
            try:
                await self._producer.stop()
            except Exception as exc:  # noqa: BLE001 - a fenced producer's stop may raise
                log.debug("txn.stop_failed", error=repr(exc))

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self.fenced:
            await self._wake.wait()
            self._wake.clear()
            while not self.fenced and (batch := await self._next_batch()):
                self._committing = batch
                try:
                    async with self._busy:
                        await self._commit(batch)
                except Exception as exc:  # noqa: BLE001 - the loop must outlive any one batch
                    log.exception("txn.unexpected", partition=self.tp.partition)
                    self._retry(batch, exc)
                self._committing = []

    async def _next_batch(self) -> list[Final]:
        """What the next transaction carries, at most one per `interval_s`: a transaction costs the
        broker the same for one final as for a hundred."""
        await asyncio.sleep(max(0.0, self._last_begin + self._interval - time.monotonic()))
        batch = self._take()
        if batch:
            self._last_begin = time.monotonic()
        return batch

    def _take(self) -> list[Final]:
        """Everything due, fresh ones together; a retried one goes alone, so a bad reply topic
        cannot keep failing the others."""
        now = time.monotonic()
        due = [f for f in self._queue if f.not_before <= now]
        fresh = [f for f in due if f.tries == 0]
        batch = self._fitting(fresh) if fresh else due[:1]
        for f in batch:
            self._queue.remove(f)
        return batch

    def _fitting(self, batch: list[Final]) -> list[Final]:
        """The finals whose ledger fits the metadata limit, lowest offsets first (the lowest always
        fits: finishing it shortens the ledger)."""
        whole = self._tracker.ledger(self.tp, [f.offset for f in batch])
        if whole is None or len(whole[1]) <= self._metadata_max:
            return batch
        chosen: list[Final] = []
        for f in sorted(batch, key=lambda f: f.offset):
            ledger = self._tracker.ledger(self.tp, [c.offset for c in chosen] + [f.offset])
            if ledger is not None and len(ledger[1]) > self._metadata_max and chosen:
                break
            chosen.append(f)
        return chosen

    async def _commit(self, batch: list[Final]) -> None:
        batch = await self._with_metadata(batch)
        if not batch:
            return
        ledger = self._tracker.ledger(self.tp, [f.offset for f in batch])
        started = time.perf_counter()
        self._commit_sent = False
        try:
            refused = await asyncio.wait_for(self._transact(batch, ledger), TRANSACTION_WAIT_S)
        except ProducerFenced as exc:
            await self._fenced(batch, exc)
            return
        except Exception as exc:  # noqa: BLE001 - abort; resolve a commit that may have happened
            await self._resolve(batch, ledger, exc)
            return
        fence = next((exc for _, exc in refused if isinstance(exc, ProducerFenced)), None)
        if fence is not None:  # refused because the id was taken, not for themselves
            await self._fenced(batch, fence)
            return
        if refused:
            await self._refused(batch, refused)
            return
        self._m.transaction_seconds.observe(time.perf_counter() - started)
        self._committed(batch, ledger)

    async def _transact(self, batch: list[Final], ledger) -> list[tuple[Final, BaseException]]:
        """One transaction; returns the finals whose records were refused (nothing commits then)."""
        p = self._producer
        await p.begin_transaction()
        sent = [
            (f, await _sent(p, topic, value, key, partition, headers))
            for f in batch
            for topic, partition, key, value, headers in f.records
        ]
        # aiokafka would commit around a refused record: every one must be in first.
        results = await asyncio.gather(*(fut for _, fut in sent), return_exceptions=True)
        refused = [(f, r) for (f, _), r in zip(sent, results) if isinstance(r, BaseException)]
        if refused:
            return refused
        if ledger is not None:
            await p.send_offsets_to_transaction({self.tp: ledger}, self._group)
        await _fault_point()
        self._commit_sent = True
        await p.commit_transaction()
        await after_commit()
        return []

    def _committed(self, batch: list[Final], ledger) -> None:
        self._m.transactions.labels("committed").inc()
        for f in batch:
            self._tracker.finish(self.tp, f.offset)
        if ledger is not None:
            self._tracker.committed({self.tp: ledger[0]})
        for f in batch:
            f.on_done("ok")
        self._prune_metadata()

    async def _refused(
        self, batch: list[Final], refused: list[tuple[Final, BaseException]]
    ) -> None:
        """Refused records each cost their own final; the rest go again at once."""
        await self._reopen(refused[0][1])
        guilty = {id(f): exc for f, exc in refused}
        for f in batch:
            if id(f) in guilty or self.fenced:
                self._retry([f], guilty[id(f)])
            else:
                self._queue.insert(0, f)
        self._wake.set()

    async def _resolve(self, batch: list[Final], ledger, exc: BaseException) -> None:
        """A sent commit may have happened: the replaced producer's InitProducerId waits for it,
        then the group's committed offsets say. No retry until then."""
        sent = self._commit_sent
        await self._reopen(exc)
        if self.fenced or not sent or ledger is None:
            self._retry(batch, exc)
            return
        while not self.fenced:
            try:
                committed = await self._owner.committed(self.tp)
            except Exception as again:  # noqa: BLE001 - broker away: ask again
                log.warning("txn.outcome_unknown", partition=self.tp.partition, error=repr(again))
                await asyncio.sleep(RETRY_BACKOFF_S)
                continue
            if committed is not None and _covers(committed, batch):
                log.warning("txn.commit_confirmed", partition=self.tp.partition, error=repr(exc))
                self._committed(batch, ledger)
            else:
                self._retry(batch, exc)
            return

    async def _with_metadata(self, batch: list[Final]) -> list[Final]:
        """The finals whose topics the producer knows within METADATA_WAIT_S; a named partition the
        topic lacks gives way to the key's."""
        topics = sorted(set().union(*(f.topics for f in batch)))
        known = dict(zip(topics, await asyncio.gather(*(self._partitions(t) for t in topics))))
        for topic in [t for t, parts in known.items() if parts is None]:
            bad = [f for f in batch if topic in f.topics]
            gone = await self._gone(topic)
            self._retry(
                bad,
                Gone(f"reply topic {topic!r} does not exist")
                if gone
                else RuntimeError(f"no metadata for {topic!r}"),
            )
            batch = [f for f in batch if topic not in f.topics]
        for f in batch:
            f.records = [
                (t, p if p is None or p in known[t] else None, *rest) for t, p, *rest in f.records
            ]
        return batch

    async def _gone(self, topic: str) -> bool:
        try:
            return await self._owner.gone(topic)
        except Exception:  # noqa: BLE001 - no answer: not known to be gone
            return False

    async def _partitions(self, topic: str) -> set[int] | None:
        listed(self._producer, topic)
        try:
            return await asyncio.wait_for(self._producer.partitions_for(topic), METADATA_WAIT_S)
        except Exception:  # noqa: BLE001 - missing, unauthorized or slow: "not now"
            return None

    # -- failures ----------------------------------------------------------------------------------

    async def _reopen(self, exc: BaseException) -> None:
        """Replace the producer after a failed transaction (after a refused batch aiokafka's
        sequence numbers make the next send retry forever); its InitProducerId fences the id's
        holder, so only a confirmed owner may."""
        self._m.transactions.labels("aborted").inc()
        log.warning("txn.aborted", partition=self.tp.partition, error=repr(exc))
        old, self._producer = self._producer, None
        try:
            await asyncio.wait_for(old.stop(), 5.0)
        except Exception:  # noqa: BLE001 - closing a broken producer
            pass
        _read_failures(old)
        if not await self._confirmed():
            return
        self._producer = self._factory(self.tp)
        try:
            await asyncio.wait_for(self._take_id(), TRANSACTION_WAIT_S)
        except Exception as again:  # noqa: BLE001 - the next transaction tries again
            log.warning("txn.reopen_failed", partition=self.tp.partition, error=repr(again))

    async def _confirmed(self) -> bool:
        """This worker still owns the partition, locally and by the coordinator's word; otherwise
        the partition is given up."""
        for attempt in range(3):
            if not self._owner.owns(self.tp, self.generation):
                break
            try:
                if await self._owner.confirm(self.tp):
                    return True
                break
            except Exception as exc:  # noqa: BLE001 - ask again, then give up
                log.warning("txn.confirm_failed", partition=self.tp.partition, error=repr(exc))
                await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        self._give_up()
        return False

    async def _fenced(self, batch: list[Final], exc: BaseException) -> None:
        """Someone took the transactional id (the broker does too, aborting a timed-out
        transaction): retake it if the coordinator says the partition is ours, else give up."""
        self._m.transactions.labels("fenced").inc()
        log.warning("txn.fenced", partition=self.tp.partition, error=repr(exc))
        await self._reopen(exc)
        self._retry(batch, exc)

    def _give_up(self) -> None:
        if self.fenced:
            return
        log.warning("txn.partition_given_up", partition=self.tp.partition)
        self.fenced = True
        queued, self._queue = self._queue, []
        for f in queued:
            f.on_done("fenced")
        self._owner.give_up(self.tp)

    def _retry(self, batch: list[Final], exc: BaseException) -> None:
        now = time.monotonic()
        for f in batch:
            if self.fenced:
                f.on_done("fenced")
                continue
            f.tries += 1
            f.first_failed = f.first_failed or now
            self._m.send_failures.inc()
            if not f.forever and (permanent(exc) or now - f.first_failed >= self._retry_s):
                log.error(
                    "txn.gave_up", partition=self.tp.partition, offset=f.offset, error=repr(exc)
                )
                f.on_done("failed", _cause(exc))
                continue
            delay = min(RETRY_BACKOFF_S * f.tries, MAX_BACKOFF_S)
            f.not_before = now + delay
            self._queue.append(f)
            asyncio.get_running_loop().call_later(delay, self._wake.set)

    def _prune_metadata(self) -> None:
        # aiokafka refreshes metadata for every topic it ever sent to: prune between transactions.
        client = self._producer.client
        if len(client._topics) > MAX_PRODUCER_TOPICS:
            client.set_topics(set().union(*(f.topics for f in self._queue)) or {self.tp.topic})


async def _sent(producer, topic, value, key, partition, headers) -> asyncio.Future:
    """The send's delivery future; a send refused before it was queued, as a failed future."""
    listed(producer, topic)
    try:
        return await producer.send(topic, value, key=key, partition=partition, headers=headers)
    except Exception as exc:  # noqa: BLE001 - charged to this record's final
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        return failed


def _read_failures(producer) -> None:
    """Mark a replaced producer's failed futures read, or each logs "Future exception was never
    retrieved"."""
    tm, sender, acc = (
        getattr(producer, a, None) for a in ("_txn_manager", "_sender", "_message_accumulator")
    )
    futures = [getattr(tm, a, None) for a in ("_transaction_waiter", "_pid_waiter", "_task_waiter")]
    futures.append(getattr(sender, "sender_task", None))
    if acc is not None:
        futures += [b.future for batches in acc._batches.values() for b in batches]
        futures += [b.future for b in acc._pending_batches]
    for fut in futures:
        if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
            fut.exception()


def _covers(committed: tuple[int, str | None], batch: list[Final]) -> bool:
    mark, metadata = committed
    done = decode_ledger(mark, metadata)
    return all(f.offset < mark or f.offset in done for f in batch)


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _fault_point() -> None:
    global _KILL_BEFORE_COMMIT
    if _KILL_BEFORE_COMMIT <= 0:
        return
    _KILL_BEFORE_COMMIT -= 1
    if _KILL_BEFORE_COMMIT == 0:
        log.warning("txn.fault_kill_before_commit")
        os.kill(os.getpid(), signal.SIGKILL)


async def after_commit() -> None:
    """Test hook run after each commit; a test makes it raise, as a lost answer would."""


class Transactions:
    def __init__(self, settings, tracker, metrics, producer_factory=None) -> None:
        self._k = settings.kafka
        self._tracker, self._m = tracker, metrics
        self._factory = producer_factory or self._producer
        self._parts: dict[TopicPartition, PartitionTxn] = {}
        self.owner: Ownership = Owner()

    def _producer(self, tp: TopicPartition) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            **self._k.client_options(),
            transactional_id=transactional_id(self._k.group_id, tp),
            transaction_timeout_ms=self._k.transaction_timeout_ms,
            enable_idempotence=True,
            acks="all",
            max_request_size=self._k.max_message_bytes + 64 * 1024,
            max_batch_size=reply_batch_bytes(self._k),
        )

    async def open(self, tps, generation: int = 0) -> None:
        """Take these partitions' transactional ids (fencing previous owners) for `generation`."""
        new = [
            PartitionTxn(
                tp,
                self._factory,
                self._tracker,
                self._k.group_id,
                self._m,
                self._k.offset_metadata_max_bytes,
                generation=generation,
                owner=self.owner,
                retry_s=self._k.final_retry_s,
                interval_s=self._k.transaction_interval_ms / 1000,
            )
            for tp in tps
            if tp not in self._parts
        ]
        await asyncio.gather(*(p.start() for p in new))
        self._parts.update({p.tp: p for p in new})

    def submit(self, tp: TopicPartition, final: Final) -> None:
        part = self._parts.get(tp)
        if part is None:  # not owned here: its next owner reads it again
            final.on_done("fenced")
            return
        part.submit(final)

    async def holds_ids(self, tps) -> set[TopicPartition]:
        parts = [self._parts[tp] for tp in tps if tp in self._parts]
        held = await asyncio.gather(*(p.holds_id() for p in parts))
        return {p.tp for p, ok in zip(parts, held) if ok}

    def fenced(self, tp: TopicPartition) -> bool:
        part = self._parts.get(tp)
        return part is not None and part.fenced

    async def close(self, tps, timeout: float = 10.0) -> None:
        """Commit what is queued for these partitions (bounded), then let their ids go."""
        parts = [self._parts.pop(tp) for tp in list(tps) if tp in self._parts]
        deadline = time.monotonic() + timeout
        while any(not p.idle() and not p.fenced for p in parts) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.gather(*(p.stop() for p in parts))

    async def close_all(self, timeout: float = 10.0) -> None:
        await self.close(list(self._parts), timeout)
