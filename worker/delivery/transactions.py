"""Final results committed together with their input offsets, one Kafka transaction at a time
per owned input partition (the consume-transform-produce pattern).

Each owned request partition has its own transactional producer, `transactional_id`
`<group>.<topic>.<partition>`: when the partition moves, its new owner's producer takes the same
id, which aborts whatever the old owner left open and fences it (its later commits fail with
ProducerFenced). A final outcome (a `done`, a rejection, a dead letter) is queued here with its
input offset; the partition's task takes everything queued and commits it in one transaction
with the offset ledger (worker/delivery/offsets.py). A read_committed reader sees the records and the
offset together or not at all, so a request is rerun only if its final result was never visible.
`started`/`tokens` stay outside, streamed at once by the Publisher's idempotent producer.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Literal

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced

log = structlog.get_logger(__name__)
Outcome = Literal["ok", "failed", "fenced"]  # ok: committed (or, not final, acked)
# A final result is tried this often before its request is dead-lettered instead (worker/app.py);
# a dead letter is tried until the broker takes it.
MAX_ATTEMPTS = 5
RETRY_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# A reply topic's metadata is awaited this long before the transaction begins: a deleted topic
# then costs a retry, not an open transaction that holds back every read_committed reader.
METADATA_WAIT_S = 5.0
# A transaction that has not committed by then is given up: the producer is replaced (its new
# InitProducerId aborts the transaction on the broker) and the finals are retried.
TRANSACTION_WAIT_S = 30.0
# Reply topics a producer keeps metadata for; past it, topics idle now are dropped.
MAX_PRODUCER_TOPICS = 512
# Test hook (tests/kafka/test_transactions.py, make chaos): SIGKILL this process after the Nth
# transaction's records are on the broker and before its commit.
_KILL_BEFORE_COMMIT = int(os.environ.get("INFERLINE_FAULT_KILL_BEFORE_COMMIT", "0"))


@dataclass
class Final:
    """One request's final records (none for a request already answered) and its input offset."""

    offset: int
    records: list[tuple]  # (topic, partition, key, value, headers)
    on_done: Callable[[Outcome], None]
    forever: bool = False  # a dead letter: retried until the broker takes it
    tries: int = 0
    not_before: float = 0.0

    @property
    def topics(self) -> set[str]:
        return {r[0] for r in self.records}


def listed(producer, topic: str) -> None:
    """Put `topic` on the producer's metadata list before sending to it. aiokafka lists a topic
    only when its cache lacks it: one cached by an all-topic fetch (a refresh with the list still
    empty) or kept from before a prune would go out unlisted, and a later refresh would drop it."""
    client = producer.client
    if topic not in client._topics:
        client.add_topic(topic)


def transactional_id(group_id: str, tp: TopicPartition) -> str:
    return f"{group_id}.{tp.topic}.{tp.partition}"


class PartitionTxn:
    """The transactional producer of one owned input partition and its queue of finals."""

    def __init__(self, tp: TopicPartition, producer_factory, tracker, group_id: str, metrics,
                 metadata_max_bytes: int) -> None:
        self.tp, self._factory, self._tracker = tp, producer_factory, tracker
        self._group, self._m, self._metadata_max = group_id, metrics, metadata_max_bytes
        self._producer: AIOKafkaProducer | None = None
        self._queue: list[Final] = []
        self._committing: list[Final] = []  # taken from the queue, outcome not known yet
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.fenced = False

    async def start(self) -> None:
        """Takes the partition's transactional id: the old owner's open transaction is aborted
        and the old owner fenced before this returns (so its ledger can be read after)."""
        self._producer = self._factory(self.tp)
        await self._take_id()
        self._task = asyncio.create_task(self._run(), name=f"txn-{self.tp.topic}-{self.tp.partition}")

    async def _take_id(self) -> None:
        await self._producer.start()
        await self._producer.begin_transaction()  # waits for InitProducerId: the fencing
        await self._producer.abort_transaction()  # empty: nothing goes to the broker

    def submit(self, final: Final) -> None:
        if self.fenced:
            final.on_done("fenced")
            return
        self._queue.append(final)
        self._wake.set()

    def idle(self) -> bool:
        return not self._queue and not self._committing

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for final in self._committing + self._queue:  # the next owner reads these requests again
            final.on_done("fenced")
        self._committing, self._queue = [], []
        if self._producer:
            try:
                await self._producer.stop()
            except Exception as exc:  # noqa: BLE001 - a fenced producer's stop may raise
                log.debug("txn.stop_failed", error=repr(exc))

    # -- the loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self.fenced:
            await self._wake.wait()
            self._wake.clear()
            while (batch := self._take()) and not self.fenced:
                self._committing = batch
                try:
                    await self._commit(batch)
                except Exception as exc:  # noqa: BLE001 - the loop must outlive any one batch
                    log.exception("txn.unexpected", partition=self.tp.partition)
                    self._retry(batch, exc)
                self._committing = []

    def _take(self) -> list[Final]:
        """Everything due, fresh ones together; one that failed before goes alone, so a bad
        reply topic cannot keep failing the others' transactions."""
        now = time.monotonic()
        due = [f for f in self._queue if f.not_before <= now]
        fresh = [f for f in due if f.tries == 0]
        batch = self._fitting(fresh) if fresh else due[:1]
        for f in batch:
            self._queue.remove(f)
        return batch

    def _fitting(self, batch: list[Final]) -> list[Final]:
        """The finals whose ledger fits the broker's metadata limit, lowest offsets first (the
        lowest unfinished offset always fits: finishing it shortens the ledger)."""
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
        try:
            await asyncio.wait_for(self._transact(batch, ledger), TRANSACTION_WAIT_S)
        except ProducerFenced as exc:
            self._fence(batch, exc)
            return
        except Exception as exc:  # noqa: BLE001 - abort, then retry each final on its own
            await self._abort(exc)
            self._retry(batch, exc)
            return
        self._m.transactions.labels("committed").inc()
        self._m.transaction_seconds.observe(time.perf_counter() - started)
        for f in batch:
            self._tracker.finish(self.tp, f.offset)
        if ledger is not None:
            self._tracker.committed({self.tp: ledger[0]})
        for f in batch:
            f.on_done("ok")
        self._prune_metadata()

    async def _transact(self, batch: list[Final], ledger: tuple[int, str] | None) -> None:
        p = self._producer
        await p.begin_transaction()
        sent = [await p.send(topic, value, key=key, partition=partition, headers=headers)
                for f in batch for topic, partition, key, value, headers in f.records]
        if ledger is not None:
            await p.send_offsets_to_transaction({self.tp: ledger}, self._group)
        # aiokafka would commit around a record the broker refused: every one must be in first.
        await asyncio.gather(*sent)
        await _fault_point()
        await p.commit_transaction()

    async def _with_metadata(self, batch: list[Final]) -> list[Final]:
        """The finals whose topics this producer knows now (or within METADATA_WAIT_S); a named
        partition the topic does not have gives way to the key's (better a done by key than none)."""
        topics = sorted(set().union(*(f.topics for f in batch)))
        known = dict(zip(topics, await asyncio.gather(*(self._partitions(t) for t in topics))))
        missing = {t for t, parts in known.items() if parts is None}
        if missing:
            bad = [f for f in batch if f.topics & missing]
            self._retry(bad, RuntimeError(f"no metadata for {sorted(missing)}"))
            batch = [f for f in batch if not f.topics & missing]
        for f in batch:
            f.records = [(t, p if p is None or p in known[t] else None, *rest) for t, p, *rest in f.records]
        return batch

    async def _partitions(self, topic: str) -> set[int] | None:
        listed(self._producer, topic)
        try:
            return await asyncio.wait_for(self._producer.partitions_for(topic), METADATA_WAIT_S)
        except Exception:  # noqa: BLE001 - missing, unauthorized or slow: all mean "not now"
            return None

    async def _abort(self, exc: BaseException) -> None:
        """After a failed transaction the producer is replaced, not reused: aiokafka does not reset
        its sequence numbers after a refused batch, so the next send to that partition would be
        retried forever. The new producer's InitProducerId aborts the transaction on the broker."""
        self._m.transactions.labels("aborted").inc()
        log.warning("txn.aborted", partition=self.tp.partition, error=repr(exc))
        old, self._producer = self._producer, self._factory(self.tp)
        try:
            await asyncio.wait_for(old.stop(), 5.0)
        except Exception:  # noqa: BLE001 - closing a broken producer
            pass
        try:
            await asyncio.wait_for(self._take_id(), TRANSACTION_WAIT_S)
        except Exception as again:  # noqa: BLE001 - the next transaction tries again
            log.warning("txn.reopen_failed", partition=self.tp.partition, error=repr(again))

    def _fence(self, batch: list[Final], exc: BaseException) -> None:
        """Another worker owns the partition now: nothing final from here, nothing committed."""
        self._m.transactions.labels("fenced").inc()
        log.warning("txn.fenced", partition=self.tp.partition, error=repr(exc))
        self.fenced = True
        for f in batch + self._queue:
            f.on_done("fenced")
        self._queue = []

    def _retry(self, batch: list[Final], exc: BaseException) -> None:
        for f in batch:
            f.tries += 1
            self._m.send_failures.inc()
            if f.tries >= MAX_ATTEMPTS and not f.forever:
                log.error("txn.gave_up", partition=self.tp.partition, offset=f.offset, error=repr(exc))
                f.on_done("failed")
                continue
            delay = min(RETRY_BACKOFF_S * f.tries, MAX_BACKOFF_S)
            f.not_before = time.monotonic() + delay
            self._queue.append(f)
            asyncio.get_running_loop().call_later(delay, self._wake.set)

    def _prune_metadata(self) -> None:
        # aiokafka's producer refreshes metadata for every topic it ever sent to: with a reply
        # topic per client that grows without end. Between transactions nothing is in flight.
        client = self._producer.client
        if len(client._topics) > MAX_PRODUCER_TOPICS:
            client.set_topics(set().union(*(f.topics for f in self._queue)) or {self.tp.topic})


async def _fault_point() -> None:
    global _KILL_BEFORE_COMMIT
    if _KILL_BEFORE_COMMIT <= 0:
        return
    _KILL_BEFORE_COMMIT -= 1
    if _KILL_BEFORE_COMMIT == 0:  # the records are on the broker, in an open transaction
        log.warning("txn.fault_kill_before_commit")
        os.kill(os.getpid(), signal.SIGKILL)


class Transactions:
    """The PartitionTxn of every owned request partition."""

    def __init__(self, settings, tracker, metrics, producer_factory=None) -> None:
        self._k = settings.kafka
        self._tracker, self._m = tracker, metrics
        self._factory = producer_factory or self._producer
        self._parts: dict[TopicPartition, PartitionTxn] = {}

    def _producer(self, tp: TopicPartition) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            **self._k.client_options(), transactional_id=transactional_id(self._k.group_id, tp),
            transaction_timeout_ms=self._k.transaction_timeout_ms, enable_idempotence=True, acks="all",
            max_request_size=self._k.max_message_bytes + 64 * 1024)

    async def open(self, tps) -> None:
        """Take these partitions' transactional ids (fencing their previous owners)."""
        new = [PartitionTxn(tp, self._factory, self._tracker, self._k.group_id, self._m,
                            self._k.offset_metadata_max_bytes) for tp in tps if tp not in self._parts]
        await asyncio.gather(*(p.start() for p in new))
        self._parts.update({p.tp: p for p in new})

    def submit(self, tp: TopicPartition, final: Final) -> None:
        part = self._parts.get(tp)
        if part is None:  # not owned here (any more): its next owner reads the request again
            final.on_done("fenced")
            return
        part.submit(final)

    def fenced(self, tp: TopicPartition) -> bool:
        """Another worker took this partition's transactional id."""
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
