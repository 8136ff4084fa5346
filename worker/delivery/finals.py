"""Delivery: the one place a request's result becomes final (answer, dead letter or give back)
and its input finished. design: docs/architecture.md#the-delivery-path
"""

from __future__ import annotations

import uuid
from typing import Callable

import structlog
from aiokafka import TopicPartition

from inferline.contract.schema import Request, content_headers, transcode_event
from inferline.worker.delivery.commit import Outcome
from inferline.worker.delivery.dead_letters import DeadLetterLimit, fit
from inferline.worker.delivery.ledger import Job, JobLedger
from inferline.worker.delivery.publisher import Publisher, ReplyRoute, ReplyStream, Source

log = structlog.get_logger(__name__)
# A resubmission whose final `done` is no longer kept here: it is on its reply topic already.
ANSWERED_BEFORE = (
    "answered_before",
    "this request was answered before; its final done is on the reply topic, no longer kept here",
)


class Delivery:
    """Answers, dead letters and give-backs, and what finishes their input."""

    def __init__(self, settings, publisher: Publisher, ledger: JobLedger, metrics, generation):
        self._k = settings.kafka
        self.publisher, self.ledger, self._m = publisher, ledger, metrics
        self._generation = generation  # a partition's assignment epoch (OffsetTracker.epoch)
        self.num_resubmitted = 0
        self.dlq_limit = DeadLetterLimit(self._k)
        self.dead_letters_in_flight = 0  # not acked yet: they count against intake's room

    async def start(self) -> None:
        """Read the dead-letter topic's limit before the first dead letter needs it."""
        await self.dlq_limit.load()

    def dead_letter(self, record, reason: str) -> None:
        """Send `record` to the dead-letter topic with `reason`, cut to fit the topic's limit; its
        offset finishes once the dead letter is on the broker."""
        source = self._taken(TopicPartition(record.topic, record.partition), record.offset)
        self.dead_letters_in_flight += 1
        where = {"topic": record.topic, "partition": record.partition, "offset": record.offset}
        headers = [("error", reason.encode())]
        headers += [(f"source-{name}", str(value).encode()) for name, value in where.items()]
        self._send_dead_letter(record, headers, source, self.dlq_limit.bytes())

    def _send_dead_letter(self, record, headers, source: Source, limit: int) -> None:
        key, value, headers = fit(record.key, record.value, headers, limit)
        if len(headers) > 4:
            where = {"partition": record.partition, "offset": record.offset}
            log.warning(
                "dead_letter.truncated", **where, size=len(record.value or b""), limit=limit
            )

        def on_acked(outcome, error=None) -> None:
            self.dead_letters_in_flight -= 1
            self._input_done(source, outcome, "reject")

        self.publisher.dead_letter(self._k.dlq_topic, key, value, headers, source, on_acked)

    def reject(self, tp, offset: int, route: ReplyRoute, code: str, message: str, **done) -> None:
        """Answer a request that will not run: one `done` (seq 0); `done`: its finish_reason
        ("rejected" unless given) and metadata."""
        reason = done.setdefault("finish_reason", "rejected")
        rs = ReplyStream(attempt=uuid.uuid4().hex, **vars(route))
        source = self._taken(tp, offset)

        def on_acked(outcome, error=None) -> None:
            self._answered(source, outcome, rs.topic, error)

        self.publisher.done(rs, on_acked, source, text="", error=(code, message), **done)
        self._m.requests.labels(reason).inc()
        if reason == "rejected":
            self._m.rejections.labels(code).inc()

    def answered_before(self, tp, offset: int, req: Request) -> bool:
        """The same request again after its final `done`: the remembered `done` is resent with its
        offset, or, when it is not kept (too big, evicted), a fresh `done` saying it was answered
        before. Either one that cannot be delivered dead-letters the request."""
        if not self.ledger.finished(req):
            return False
        where = {"partition": tp.partition, "offset": offset}
        log.warning("request.resubmitted_after_done", request_id=req.id, **where)
        self.num_resubmitted += 1
        final = self.ledger.final_event(req.id)
        if final is None:
            self.reject(tp, offset, ReplyRoute.of(req), *ANSWERED_BEFORE, metadata=req.metadata)
            return True
        source, (topic, partition, done, encoding) = self._taken(tp, offset), final
        done = transcode_event(done, encoding, req.content_type)  # it may come in the other one

        def on_acked(outcome, error=None) -> None:
            self._answered(source, outcome, topic, error)

        record = (topic, partition, req.id.encode(), done, content_headers(req.content_type))
        self.publisher.finish_offset(source, record, on_acked)
        return True

    def _taken(self, tp: TopicPartition, offset: int) -> Source:
        """A final of `tp` is on its way: counted until acked; its input, as of now."""
        self.ledger.taken(tp)
        return tp, offset, self._generation(tp)

    def finish(self, job: Job, final: bool, **done) -> None:
        """The attempt's last event, `done` its DoneEvent fields: a final one ends its input, else
        (`requeued`) gives it back."""
        self.publisher.done(
            job.reply,
            lambda outcome, err=None: self._settle(job, final, outcome, err),
            job.source if final else None,
            metadata=job.request.metadata,
            **done,
        )

    def stale(self, job: Job) -> bool:
        """Its partition moved since admission: a final from here would be a second one."""
        return job.generation != self._generation(job.tp)

    def _settle(self, job: Job, final: bool, outcome: str, error: str | None) -> None:
        self.ledger.forget(job)
        job.trace.delivered(outcome)
        if not final:
            self._verdict(job.tp, job.offset, "release")
            self.ledger.acked(job.tp)
            return
        if outcome == "ok":
            self.ledger.remember(job)
        elif outcome == Outcome.MOVED:
            # Its final never committed: the attempt still ends, with a `requeued` outside any
            # transaction, and the partition's new owner runs the request. The `requeued` takes
            # the final's seq: read_committed readers never saw that `done`, so no gap shows.
            job.reply.closed = False
            job.reply.seq -= 1
            meta = job.request.metadata
            self.publisher.done(job.reply, _ignore, finish_reason="requeued", metadata=meta)
        self._answered(job.source, outcome, job.reply.topic, error)

    def _answered(self, source: Source, outcome: str, topic: str, error: str | None) -> None:
        """A `done` is final, or refused for good (dead-lettered), or moved (to the next owner)."""
        tp, offset, generation = source
        if outcome != "failed":
            self._input_done(source, outcome)
            return
        record = self.ledger.held(tp, offset)
        if record is None or generation != self._generation(tp):
            self._input_done(source, Outcome.MOVED)  # its new owner reads it again
            return
        where = {"partition": tp.partition, "offset": offset}
        log.error("request.reply_undeliverable", **where, topic=topic, error=error)
        cause = f"the reply could not be delivered to {topic!r}" + (f": {error}" if error else "")
        self.dead_letter(record, cause)
        self.ledger.acked(tp)

    def _input_done(self, source: Source, outcome: str, verdict: str = "accept") -> None:
        # Committed with its offset, or (moved, stopping) left for the partition's next owner.
        tp, offset, generation = source
        if outcome == "ok" and generation == self._generation(tp):
            self.ledger.release(tp, offset)
        self._verdict(tp, offset, verdict if outcome == "ok" else "release")
        self.ledger.acked(tp)

    def _verdict(self, tp: TopicPartition, offset: int, verdict: str) -> None:
        """Group mode: nothing (the offset committed in the transaction)."""


class AcknowledgedDelivery(Delivery):
    """Share mode: each record is acknowledged once its outcome is on the broker."""

    def __init__(self, *args, decide: Callable[[TopicPartition, int, str], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._decide = decide

    def _verdict(self, tp: TopicPartition, offset: int, verdict: str) -> None:
        self.ledger.release(tp, offset)
        self._decide(tp, offset, verdict)


def _ignore(*outcome) -> None:
    """A `requeued` after a moved final: nothing waits for it."""
