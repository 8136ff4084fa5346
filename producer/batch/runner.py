"""One batch on the fleet: collect what earlier runs got back, send the rest with bounded
concurrency, retry shed load, hand each finished line to a sink.
design: docs/batch.md#resume-and-exactly-once
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from inferline.config.settings import KafkaSettings
from inferline.contract.schema import DoneEvent, Request, UndecodableMessage, decode_event
from inferline.producer.batch.lines import BatchLine, error_line, request_id, response_line
from inferline.producer.client import (
    ClientTimeout,
    InferenceClient,
    Overloaded,
    RateLimited,
    RequestHandle,
)
from inferline.producer.gateway.errors import from_inference
from inferline.producer.gateway.openai_responses import Shape
from inferline.producer.gateway.service import logprobs_by_sample
from inferline.producer.reassembly import Event

log = structlog.get_logger(__name__)

# Shed load (pool full, tenant over its rate): sent again after a pause.
RETRIED = (Overloaded, RateLimited)
MAX_RETRIES = 8
RETRY_BASE_S, RETRY_MAX_S = 0.5, 30.0
SUCCESS = ("stop", "length")


@dataclass
class Progress:
    done: int = 0
    failed: int = 0
    completion_tokens: int = 0  # of answers this run received
    found: int = 0  # answered by an earlier run, found on the reply topic
    followed: int = 0  # sent earlier, still running: awaited, not resent
    retries: int = 0


# (line, output line, completion tokens): called once per line, as lines finish.
Sink = Callable[[BatchLine, dict, int], None]


class BatchRunner:
    """Runs ``lines`` (those without output yet) on ``client``, whose reply topic is the batch's.
    ``sent``: ids an earlier run sent; ``on_sent`` hears each id this run sends."""

    def __init__(
        self,
        client: InferenceClient,
        batch_id: str,
        lines: Iterable[BatchLine],
        sink: Sink,
        *,
        max_in_flight: int = 64,
        sent: Iterable[str] = (),
        on_sent: Callable[[str], None] | None = None,
        model: str = "inferline",
        timeout_s: float | None = None,
        retry_after_s: int = 1,
        extra_fields: dict | None = None,
        collect_only: bool = False,
    ):
        assert max_in_flight >= 1
        self.client, self.batch_id, self.sink = client, batch_id, sink
        self.lines = list(lines)
        self.max_in_flight, self.sent, self.on_sent = (
            max_in_flight,
            set(sent),
            on_sent or (lambda _id: None),
        )
        self.model, self.timeout_s, self.retry_after_s = model, timeout_s, retry_after_s
        self.extra_fields = extra_fields or {}
        self.collect_only = collect_only  # write what earlier runs got back, send nothing
        self.written: set[str] = set()
        self.request_ids: dict[str, BatchLine] = {}
        self.progress = Progress()
        self._requests: dict[str, Request] = {}

    # --- the run ----------------------------------------------------------------------------

    async def run(self) -> Progress:
        """Until every line has its output line; cancelled, it stops sending."""
        for line in self.lines:
            if line.error is not None:
                self._write(line, error_line(line, "invalid_request", line.error), 0)
        good = [ln for ln in self.lines if ln.error is None]
        ids = self.request_ids = {request_id(self.batch_id, ln): ln for ln in good}
        self._requests = {rid: self._request(rid, ln) for rid, ln in ids.items()}
        # Followed before the history is read: an answer landing meanwhile reaches one of them.
        followed = {rid: self.client.follow(self._requests[rid]) for rid in ids if rid in self.sent}
        parts = await self.client.partitions_of(self.client.reply_topic)
        history = await read_history(
            self.client.kafka, self.client.reply_topic, parts or [], set(ids)
        )
        work: deque[tuple[BatchLine, RequestHandle | None]] = deque()
        for rid, line in ids.items():
            found = self._from_history(rid, history.get(rid, []))
            if found is None:
                work.append((line, followed.get(rid)))
                continue
            self.client.forget(rid)
            if _shed(found):  # refused for load: send again
                work.append((line, None))
            else:
                self.progress.found += 1
                self._finish(line, found, count_tokens=False)
        self.progress.followed = sum(1 for _, h in work if h is not None)
        log.info(
            "batch run",
            batch_id=self.batch_id,
            lines=len(self.lines),
            found=self.progress.found,
            followed=self.progress.followed,
            to_send=len(work) - self.progress.followed,
        )
        if self.collect_only:
            return self.progress
        async with asyncio.TaskGroup() as group:  # one failing (the broker is gone) stops them all
            for _ in range(min(self.max_in_flight, len(work))):
                group.create_task(self._drain(work))
        return self.progress

    async def _drain(self, work: deque) -> None:
        while work:
            line, handle = work.popleft()
            await self._one(line, handle)

    async def _one(self, line: BatchLine, handle: RequestHandle | None) -> None:
        rid = request_id(self.batch_id, line)
        for attempt in range(MAX_RETRIES + 1):
            if handle is None:
                handle = await self._send(rid, line)
            await handle.wait()
            again = isinstance(handle.failure, RETRIED) or (
                isinstance(handle.failure, ClientTimeout) and rid in self.sent
            )
            if not again or attempt == MAX_RETRIES:
                break
            # Shed load, or an earlier send that never came back: send it (again), later.
            self.progress.retries += 1
            self.sent.discard(rid)
            handle = None
            await asyncio.sleep(
                min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
            )
        self._finish(line, handle)

    async def _send(self, rid: str, line: BatchLine) -> RequestHandle:
        fields = {**line.fields, **self.extra_fields}
        fields["metadata"] = {**fields.get("metadata", {}), "batch": self.batch_id}
        if self.timeout_s is not None:
            fields["timeout_s"] = self.timeout_s
        handle = await self.client.submit(request_id=rid, **fields)
        self.on_sent(rid)
        return handle

    def _request(self, rid: str, line: BatchLine) -> Request:
        return Request(id=rid, reply_topic=self.client.reply_topic, **line.fields)

    def unanswered(self) -> list[str]:
        return [rid for rid, ln in self.request_ids.items() if ln.key not in self.written]

    # --- answers -----------------------------------------------------------------------------

    def _from_history(self, rid: str, events: list[Event]) -> RequestHandle | None:
        """A finished handle from the best attempt an earlier run got back: the last that
        succeeded, else the last that ended; None when none ended."""
        attempt = _best_attempt(events)
        if attempt is None:
            return None
        handle = RequestHandle(self._requests[rid])
        for ev in events:
            if ev.attempt == attempt:
                handle.feed(ev)
        return handle if handle.finished else None

    def _finish(self, line: BatchLine, handle: RequestHandle, count_tokens: bool = True) -> None:
        out, tokens = self.output_line(line, handle)
        self._write(line, out, tokens if count_tokens else 0)

    def output_line(self, line: BatchLine, handle: RequestHandle) -> tuple[dict, int]:
        """The output line of a finished request, and its completion tokens."""
        rid, failure = handle.id, handle.failure
        if isinstance(failure, ClientTimeout):
            return error_line(
                line, "expired", f"line {line.lineno}: no answer came in time ({failure.message})"
            ), 0
        if failure is not None:
            err = from_inference(failure, self.retry_after_s, "messages" if line.chat else "prompt")
            return response_line(line, rid, err.status, err.body()), 0
        result = handle.partial_result()
        shape = Shape(line.chat, rid, line.model or self.model)
        by_sample = logprobs_by_sample(handle) if line.logprobs else None
        body = shape.whole(
            result.text, result.finish_reason, result.usage, result.samples, by_sample
        )
        return response_line(
            line, rid, 200, body
        ), result.usage.completion_tokens if result.usage else 0

    def _write(self, line: BatchLine, out: dict, tokens: int) -> None:
        ok = out["error"] is None and out["response"]["status_code"] == 200
        self.written.add(line.key)
        self.progress.done += 1
        self.progress.failed += not ok
        self.progress.completion_tokens += tokens
        self.sink(line, out, tokens)


def _shed(handle: RequestHandle) -> bool:
    return isinstance(handle.failure, RETRIED)


def _best_attempt(events: list[Event]) -> str | None:
    finals = [ev for ev in events if isinstance(ev, DoneEvent) and ev.finish_reason != "requeued"]
    good = [ev for ev in finals if ev.finish_reason in SUCCESS]
    chosen = (good or finals or [None])[-1]
    return chosen.attempt if chosen is not None else None


async def read_history(
    kafka: KafkaSettings, topic: str, partitions: list[int], ids: set[str]
) -> dict[str, list[Event]]:
    """Every event for ``ids`` on ``topic`` up to its end now (read_committed), by request id."""
    out: dict[str, list[Event]] = {}
    if not partitions:
        return out
    consumer = AIOKafkaConsumer(
        **kafka.connection_options(),
        client_id=f"{kafka.client_id}-batch-history",
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            for records in (await consumer.getmany(timeout_ms=500, max_records=5000)).values():
                for record in records:
                    _take(out, ids, record.key, record.value)
    finally:
        await consumer.stop()
    return out


def _take(out: dict[str, list[Event]], ids: set[str], key: bytes | None, value: bytes) -> None:
    if key is not None and key.decode("utf-8", "replace") not in ids:
        return
    try:
        ev = decode_event(value)
    except UndecodableMessage:
        return
    if ev.id in ids:
        out.setdefault(ev.id, []).append(ev)
