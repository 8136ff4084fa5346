"""Final results committed with their input offsets: one transactional producer per worker, whose
transactions carry the finals of every owned partition and commit their offsets with the
consumer's group metadata (KIP-447: the broker fences a stale member's commit).
design: docs/reliability.md#exactly-one-final-result-transactions
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import os
import signal
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Protocol

import structlog
from aiokafka import TopicPartition
from aiokafka import errors as aiokafka_errors
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as OffsetEntry

from inferline.worker.delivery.offsets import decode_ledger

log = structlog.get_logger(__name__)
# Refusals no retry changes: the record, or the topic, is not this worker's to write.
PERMANENT = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
}
_AIOKAFKA_PERMANENT = tuple(  # the same, as the reply events' producer (aiokafka) says them
    getattr(aiokafka_errors, name)
    for name in "MessageSizeTooLargeError RecordListTooLargeError RecordTooLargeError "
    "TopicAuthorizationFailedError InvalidTopicError CorruptRecordException "
    "UnsupportedForMessageFormatError".split()
)
RETRY_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
CALL_TIMEOUT_S = 30.0  # one producer call (begin, flush, send offsets, commit, abort)
# A transaction not done by then is given up and its producer replaced (InitProducerId aborts it,
# or waits for its commit): librdkafka's calls can outlast their own timeouts.
STUCK_S = 1.5 * CALL_TIMEOUT_S
# librdkafka keeps, and keeps refreshing, metadata for every topic a producer ever wrote to (a
# deleted one every second): past this many reply topics the producer is renewed.
MAX_PRODUCER_TOPICS = 512
# Test hooks: SIGKILL after the Nth transaction's records reach the broker, before its commit;
# the first N producer starts fail (a replacement that cannot start).
_KILL_BEFORE_COMMIT = int(os.environ.get("INFERLINE_FAULT_KILL_BEFORE_COMMIT", "0"))
_FAILED_STARTS = int(os.environ.get("INFERLINE_FAULT_PRODUCER_START_FAILS", "0"))


class Outcome(enum.StrEnum):
    """How a final ended; a string enum, so `outcome == "ok"` still reads."""

    COMMITTED = "ok"  # the records and the offset are committed (not a final: acked)
    FAILED = "failed"  # refused for good, or for longer than final_retry_s
    MOVED = "moved"  # the partition is no longer this worker's: its next owner reads it again


class Owner(Protocol):
    """What the committer asks the group intake."""

    def owns(self, tp: TopicPartition, generation: int) -> bool: ...
    def group_metadata(self): ...  # the consumer's, for send_offsets_to_transaction
    def committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, tuple]: ...


@dataclass(eq=False)
class Final:
    """One request's final records (none if answered before) and its input offset."""

    tp: TopicPartition
    offset: int
    generation: int
    records: list[tuple]  # (topic, partition, key, value, headers)
    on_done: Callable[..., None]  # (outcome, error: str | None)
    dead_letter: bool = False  # given up: its offset still advances, without the record
    tries: int = 0
    first_failed: float | None = None
    not_before: float = 0.0


@dataclass
class _Result:
    """What one transaction did: committed, or aborted with the finals each refused record cost
    (`refused`), or aborted for everyone (`error`); `lost`: the producer must be replaced."""

    committed: bool = False
    refused: dict[Final, KafkaError] = field(default_factory=dict)
    error: KafkaError | None = None
    lost: bool = False
    commit_sent: bool = False


def transactional_id(kafka, worker_name: str) -> str:
    """Stable under static membership (a restart fences its previous incarnation), else unique:
    KIP-447 fences a stale member by its group metadata, not by this id."""
    if kafka.group_instance_id:
        return f"{kafka.group_id}.{kafka.group_instance_id}"
    return f"{kafka.group_id}.{worker_name}.{uuid.uuid4().hex[:8]}"


def producer_config(kafka, txn_id: str) -> dict:
    return {
        **kafka.librdkafka_config(),
        "transactional.id": txn_id,
        "transaction.timeout.ms": kafka.transaction_timeout_ms,
        "message.max.bytes": kafka.max_message_bytes + 64 * 1024,
        "allow.auto.create.topics": False,  # a deleted reply topic stays deleted
        "topic.metadata.propagation.max.ms": 5000,  # an unknown topic is refused after this
        "linger.ms": 5,
        "batch.size": kafka.min_reply_message_bytes,  # a batch every reply topic and the DLQ take
        "partitioner": "murmur2_random",  # the Java client's and aiokafka's: one reply partition
    }


class Committer:
    """Queues finals from every owned partition and commits them together, at most one transaction
    per `transaction_interval_ms`, in a thread of its own (the producer is synchronous)."""

    def __init__(self, settings, tracker, metrics, worker_name: str = "worker") -> None:
        self._k, self._tracker, self._m = settings.kafka, tracker, metrics
        self._txn_id = transactional_id(self._k, worker_name)
        self._interval = self._k.transaction_interval_ms / 1000
        self.owner: Owner | None = None
        self._producer: Producer | None = None
        self._topics: set[str] = set()  # what the producer has written to
        self._queue: list[Final] = []
        self._committing: list[Final] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.ready = False  # a producer holds the transactional id

    async def start(self) -> None:
        await self._replace_producer()
        self._task = asyncio.create_task(self._run(), name="committer")

    def submit(self, final: Final) -> None:
        if not self.owner.owns(final.tp, final.generation):
            final.on_done(Outcome.MOVED)
            return
        self._queue.append(final)
        self._wake.set()

    def busy(self, tps=None) -> bool:
        return any(tps is None or f.tp in tps for f in self._queue + self._committing)

    async def flush(self, tps=None, timeout: float = 10.0) -> None:
        """Wait (bounded) until what is queued (for `tps`, or all) is committed or given up."""
        deadline = time.monotonic() + timeout
        while self.busy(tps) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def settle(self, tps) -> None:
        """Wait until no transaction in flight carries a final of `tps` (a revoke that returned
        sooner would let the partitions' next owner read their committed offsets before that
        transaction sends them, and run the requests again), bounded past a stuck transaction's
        give-up: its lost-commit check asks the consumer, which waits for the revoke."""
        deadline = time.monotonic() + STUCK_S + 15.0
        while any(f.tp in tps for f in self._committing):
            if time.monotonic() > deadline:
                log.error("commit.revoke_unsettled", partitions=len(tps))
                return
            await asyncio.sleep(0.02)

    def drop(self, tps) -> None:
        """Partitions gone: their queued finals are their next owner's."""
        gone = [f for f in self._queue if f.tp in tps]
        self._queue = [f for f in self._queue if f.tp not in tps]
        for f in gone:
            f.on_done(Outcome.MOVED)

    async def close(self, timeout: float = 10.0) -> None:
        await self.flush(timeout=timeout)
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.drop({f.tp for f in self._queue})
        if self._producer is not None:
            await self._call(self._producer.flush, 1.0)

    async def _run(self) -> None:
        last_begin = float("-inf")
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(max(0.0, last_begin + self._interval - time.monotonic()))
            batch = self._take()
            if not batch:
                continue
            last_begin = time.monotonic()
            self._committing = batch
            try:
                await self._commit(batch)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one batch
                log.exception("commit.unexpected")
                self._retry(batch, exc, charge=False)
            self._committing = []
            if len(self._topics) > MAX_PRODUCER_TOPICS and self._producer is not None:
                await self._renew_producer()
            if self._queue:
                self._wake.set()

    def _take(self) -> list[Final]:
        """Every due final of an owned partition, within each partition's ledger limit; none waits
        behind another's failures (retries are charged per record)."""
        now, due, later = time.monotonic(), defaultdict(list), []
        for f in self._queue:
            if not self.owner.owns(f.tp, f.generation):
                f.on_done(Outcome.MOVED)
            elif f.not_before > now:
                later.append(f)
            else:
                due[f.tp].append(f)
        batch = []
        for tp, finals in due.items():
            finals.sort(key=lambda f: f.offset)  # the rest is cut from the same order
            fitting = self._fitting(tp, finals)
            batch += fitting
            later += finals[len(fitting) :]
        self._queue = later
        if later:
            wake_in = max(0.0, min(f.not_before for f in later) - now)
            asyncio.get_running_loop().call_later(wake_in, self._wake.set)
        return batch

    def _fitting(self, tp: TopicPartition, finals: list[Final]) -> list[Final]:
        """The lowest offsets whose ledger fits the limit (the lowest always does)."""
        limit = self._k.offset_metadata_max_bytes
        whole = self._tracker.ledger(tp, [f.offset for f in finals])
        if whole is None or len(whole[1]) <= limit:
            return finals
        for n in range(2, len(finals) + 1):
            ledger = self._tracker.ledger(tp, [f.offset for f in finals[:n]])
            if ledger is not None and len(ledger[1]) > limit:
                return finals[: n - 1]
        return finals

    async def _commit(self, batch: list[Final]) -> None:
        ledgers = self._ledgers(batch)
        started, result = time.perf_counter(), _Result()
        try:
            await asyncio.wait_for(self._call(self._transact, batch, ledgers, result), STUCK_S)
        except asyncio.TimeoutError:  # seen after a broker restart: a call past its own timeout
            log.warning("commit.transaction_stuck", finals=len(batch), after_s=STUCK_S)
            result.lost, result.error = True, KafkaError(KafkaError._TIMED_OUT, "transaction stuck")
        if result.committed:
            self._m.transaction_seconds.observe(time.perf_counter() - started)
            self._committed(batch, ledgers)
        elif result.lost:
            await self._lost(batch, ledgers, result)
        elif result.refused:
            self._refused(batch, result.refused)
        else:
            self._m.transactions.labels("aborted").inc()
            log.warning("commit.aborted", finals=len(batch), error=str(result.error))
            self._retry(batch, KafkaException(result.error), charge=False)

    def _ledgers(self, batch: list[Final]) -> dict[TopicPartition, tuple[int, str]]:
        finishing = defaultdict(list)
        for f in batch:
            finishing[f.tp].append(f.offset)
        ledgers = {tp: self._tracker.ledger(tp, offsets) for tp, offsets in finishing.items()}
        return {tp: ledger for tp, ledger in ledgers.items() if ledger is not None}

    def _committed(self, batch: list[Final], ledgers) -> None:
        self._m.transactions.labels("committed").inc()
        for f in batch:
            self._tracker.finish(f.tp, f.offset)
        self._tracker.committed({tp: mark for tp, (mark, _) in ledgers.items()})
        for f in batch:
            f.on_done(Outcome.COMMITTED)

    def _refused(self, batch: list[Final], refused: dict[Final, KafkaError]) -> None:
        """Each refused record costs its own final; the rest go again at once."""
        self._m.transactions.labels("aborted").inc()
        for f in batch:
            if f in refused:
                self._retry([f], KafkaException(refused[f]), charge=True)
            else:
                self._queue.append(f)

    async def _lost(self, batch: list[Final], ledgers, result: _Result) -> None:
        """The producer failed for good: a new one takes the id (waiting for a commit in
        flight), then the group's committed offsets say whether a sent commit happened."""
        self._m.transactions.labels("lost").inc()
        log.warning("commit.producer_lost", error=str(result.error), commit_sent=result.commit_sent)
        await self._replace_producer()
        if not result.commit_sent:
            self._retry(batch, KafkaException(result.error), charge=False)
            return
        committed = await self._read_committed(list(ledgers))
        done = [f for f in batch if _covered(committed.get(f.tp), f.offset)]
        if len(done) == len(batch):
            log.warning("commit.commit_confirmed", finals=len(batch))
            self._committed(batch, ledgers)
        else:
            self._retry(batch, KafkaException(result.error), charge=False)

    async def _read_committed(self, tps: list[TopicPartition]) -> dict:
        while True:  # no answer yet: no retry either (it could commit a final twice)
            try:
                return await asyncio.to_thread(self.owner.committed, tps)
            except Exception as exc:  # noqa: BLE001 - broker away: ask again
                log.warning("commit.outcome_unknown", error=repr(exc))
                await asyncio.sleep(RETRY_BACKOFF_S)

    def _retry(self, batch: list[Final], exc: BaseException, *, charge: bool) -> None:
        """Queue `batch` again after a backoff. Only a record's own refusal is charged: permanent
        at once, a passing one after final_retry_s; a dead letter then goes without its record."""
        now = time.monotonic()
        for f in batch:
            f.tries += 1
            f.not_before = now + min(RETRY_BACKOFF_S * f.tries, MAX_BACKOFF_S)
            self._m.send_failures.inc()
            if charge:
                f.first_failed = f.first_failed or now
                if permanent(exc) or now - f.first_failed >= self._k.final_retry_s:
                    self._give_up(f, exc)
                    continue
            self._queue.append(f)
        self._wake.set()

    def _give_up(self, f: Final, exc: BaseException) -> None:
        where = {"partition": f.tp.partition, "offset": f.offset, "error": repr(exc)}
        if not f.dead_letter:
            log.error("commit.gave_up", **where)
            f.on_done(Outcome.FAILED, _cause(exc))
            return
        # A dead letter the DLQ will not take: the offset advances anyway, logged and counted.
        log.error("commit.dead_letter_lost", **where)
        self._m.dead_letters_lost.inc()
        f.records, f.not_before = [], 0.0
        self._queue.append(f)

    async def _call(self, fn, *args):
        """`fn(*args)` on a daemon thread of its own, one call at a time (the loop awaits each):
        a call stuck past its timeouts is left there, and cannot hold the process's exit."""
        future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():  # given up before it started
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)

        threading.Thread(target=run, name="committer", daemon=True).start()
        return await asyncio.wrap_future(future)

    async def _replace_producer(self) -> None:
        """A producer holding the transactional id, tried until one starts (each try fences the
        last and aborts its open transaction)."""
        self.ready = False
        for tries in itertools.count(1):
            try:
                self._producer = await self._call(self._new_producer)
                self.ready = True
                return
            except Exception as exc:  # noqa: BLE001 - coordinator away, broker restarting
                self._m.producer_start_failures.inc()
                log.warning("commit.producer_start_failed", error=repr(exc), tries=tries)
                await asyncio.sleep(min(RETRY_BACKOFF_S * tries, MAX_BACKOFF_S))

    async def _renew_producer(self) -> None:
        """A new producer takes the transactional id between two transactions (fencing the idle
        old one, which closes); if it cannot start, the old one serves on (a fenced one fails its
        next transaction, and the lost-commit path replaces it)."""
        old, topics = self._producer, len(self._topics)
        try:
            self._producer = await self._call(self._new_producer)
        except Exception as exc:  # noqa: BLE001 - coordinator away: renewed after the next one
            self._m.producer_start_failures.inc()
            log.warning("commit.producer_renewal_failed", error=repr(exc))
            return
        self._m.producer_renewals.inc()
        log.info("commit.producer_renewed", topics=topics)
        # Closed on a thread of its own: it may block, and the next transaction need not wait.
        threading.Thread(target=old.close, name="committer-close", daemon=True).start()

    def _new_producer(self) -> Producer:
        global _FAILED_STARTS
        if _FAILED_STARTS > 0:
            _FAILED_STARTS -= 1
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "test hook: start fails"))
        producer = Producer(producer_config(self._k, self._txn_id))
        producer.init_transactions(CALL_TIMEOUT_S)
        self._topics = set()
        return producer

    def _transact(self, batch: list[Final], ledgers, result: _Result) -> _Result:
        p = self._producer
        try:
            p.begin_transaction()
            self._produce(p, batch, result.refused)
            p.flush(CALL_TIMEOUT_S)
            if result.refused:
                p.abort_transaction(CALL_TIMEOUT_S)
                return result
            if ledgers:
                offsets = [OffsetEntry(tp.topic, tp.partition, *lg) for tp, lg in ledgers.items()]
                p.send_offsets_to_transaction(offsets, self.owner.group_metadata(), CALL_TIMEOUT_S)
            _fault_point()
            result.commit_sent = True
            _commit(p)
            after_commit()
            result.committed = True
        except KafkaException as exc:
            result.error = exc.args[0]
            result.lost = result.error.fatal() or not _aborted(p, result.error)
        return result

    def _produce(self, p: Producer, batch: list[Final], refused: dict) -> None:
        for f in batch:
            for topic, partition, key, value, headers in f.records:
                self._topics.add(topic)
                kwargs = {"headers": headers} if headers else {}
                if partition is not None:
                    kwargs["partition"] = partition
                try:
                    p.produce(topic, value, key, on_delivery=partial(_refuse, refused, f), **kwargs)
                except KafkaException as exc:  # too large, unknown partition: this record's
                    _refuse(refused, f, exc.args[0])


def _commit(p: Producer) -> None:
    """Commit; a retriable error (a timeout, say) leaves the outcome to a repeated call."""
    while True:
        try:
            p.commit_transaction(CALL_TIMEOUT_S)
            return
        except KafkaException as exc:
            if not exc.args[0].retriable():
                raise
            log.warning("commit.retry_commit", error=str(exc.args[0]))


def _aborted(p: Producer, error: KafkaError) -> bool:
    """Abort after `error`; False if the producer could not (then it is replaced)."""
    try:
        p.abort_transaction(CALL_TIMEOUT_S)
        return True
    except KafkaException as exc:
        log.warning("commit.abort_failed", error=str(exc.args[0]), after=str(error))
        return False


def _refuse(refused: dict, f: Final, err: KafkaError | None, _msg=None) -> None:
    """`f`'s record was refused (if `err`). A reply partition the topic lacks gives way to the
    key's partition: better a `done` by key than none."""
    if err is None:
        return
    refused[f] = err
    if err.code() == KafkaError._UNKNOWN_PARTITION:
        f.records = [(t, None, k, v, h) for t, _, k, v, h in f.records]


def permanent(exc: BaseException) -> bool:
    """A refusal no retry changes (either producer's)."""
    if isinstance(exc, KafkaException):
        return exc.args[0].code() in PERMANENT
    return isinstance(exc, _AIOKAFKA_PERMANENT)


def _covered(committed: tuple | None, offset: int) -> bool:
    if committed is None:
        return False
    mark, metadata = committed
    return offset < mark or offset in decode_ledger(mark, metadata)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, KafkaException):
        return f"{exc.args[0].name()}: {exc.args[0].str()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def after_commit() -> None:
    """Test hook, on the committer's thread after each commit: a test makes it raise, as a lost
    answer would, or wait, as a slow broker would."""


def _fault_point() -> None:
    global _KILL_BEFORE_COMMIT
    if _KILL_BEFORE_COMMIT <= 0:
        return
    _KILL_BEFORE_COMMIT -= 1
    if _KILL_BEFORE_COMMIT == 0:
        log.warning("commit.fault_kill_before_commit")
        os.kill(os.getpid(), signal.SIGKILL)
