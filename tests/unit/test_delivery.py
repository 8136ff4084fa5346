"""Every request ends where someone can see it (worker/app.py): a `done` that cannot be delivered
dead-letters the request; work from a revoked assignment publishes nothing final and finishes no
offset; a resubmitted finished id gets its final `done` again; a dead engine hands everything back
and stops the worker. Offline through the intake harness (real Worker, Kafka I/O recorded);
the dead engine on the real broker: tests/kafka/test_delivery.py."""

from __future__ import annotations

import threading
import time
import uuid

import msgpack
import pytest

from inferline.config.settings import Settings
from tests.chaos_fixtures import IntakeHarness, assign
from tests.worker_fixtures import topics  # noqa: F401 - a fixture
from inferline.worker.engine.engine import EngineLoop

REPLY, DLQ = "inferline.reply.delivery", "delivery-dlq"


def harness() -> IntakeHarness:
    return IntakeHarness(
        Settings(
            kafka={"request_topic": "delivery-requests", "dlq_topic": DLQ},
            model={"max_model_len": 256},
        )
    )


def body(**fields) -> bytes:
    return msgpack.packb(
        {
            "v": 1,
            "id": f"r-{uuid.uuid4().hex[:8]}",
            "reply_topic": REPLY,
            "prompt": "Hi.",
            "max_tokens": 2,
            **fields,
        }
    )


def committed(h: IntakeHarness) -> int:
    return h.worker.tracker.watermark(h.tp) or 0


def test_an_undeliverable_done_dead_letters_the_request_then_finishes_its_offset():
    h = harness()
    h.unreachable.add(REPLY)
    value = body()
    _, (admitted,) = h.feed(value)
    sent = h.finish_admitted(admitted)
    dead = [o for o in sent if o.topic == DLQ]
    assert len(dead) == 1 and dead[0].value == value
    assert (
        dict(dead[0].headers)["error"] == f"the reply could not be delivered to {REPLY!r}".encode()
    )
    assert committed(h) == 1 and h.settled()


def test_an_undeliverable_rejection_dead_letters_the_request_too():
    h = harness()
    h.unreachable.add(REPLY)
    value = body(max_tokens=-1)
    sent, _ = h.feed(value)
    assert [o.topic for o in sent] == [REPLY, DLQ] and sent[1].value == value
    assert committed(h) == 1 and h.settled()


def test_while_the_dead_letter_is_not_acked_the_offset_stays_unfinished():
    h = harness()
    h.unreachable.update({REPLY, DLQ})  # (the publisher retries a dead letter forever: never False)
    _, (admitted,) = h.feed(body())
    h.finish_admitted(admitted)
    assert committed(h) == 0  # nothing lost: the partition's next owner reads it again


def test_a_job_of_a_revoked_assignment_publishes_requeued_and_finishes_no_offset():
    h = harness()
    _, (admitted,) = h.feed(body())
    assign(h.worker.intake, [h.tp])  # a rebalance happened since (it was handed back then)
    (done,) = [o for o in h.finish_admitted(admitted) if msgpack.unpackb(o.value)["type"] == "done"]
    assert msgpack.unpackb(done.value)["finish_reason"] == "requeued"
    assert committed(h) == 0 and not h.worker.jobs


def test_a_final_that_never_committed_because_its_partition_moved_ends_its_attempt():
    """The committer answers `moved` (the partition was revoked before the final committed, its
    `done` aborted): the attempt still ends, with a `requeued` in the aborted `done`'s seq (no
    gap for read_committed readers), and no offset finishes."""
    h = harness()
    _, (admitted,) = h.feed(body())
    acked = h._enqueue

    def moved(out) -> None:
        if out.source is None:
            acked(out)
            return
        h.sent.append(out)
        out.on_acked("moved")

    h.worker.publisher._enqueue = moved
    dones = [o for o in h.finish_admitted(admitted) if msgpack.unpackb(o.value)["type"] == "done"]
    reasons = [msgpack.unpackb(o.value)["finish_reason"] for o in dones]
    assert reasons[-1] == "requeued" and len(reasons) == 2, reasons
    seqs = [msgpack.unpackb(o.value)["seq"] for o in dones]
    assert seqs[0] == seqs[1], seqs
    assert committed(h) == 0 and not h.worker.jobs


def test_a_resubmitted_finished_request_gets_its_final_done_again():
    h = harness()
    value = body()
    _, (admitted,) = h.feed(value)
    (first,) = [
        o for o in h.finish_admitted(admitted) if msgpack.unpackb(o.value)["type"] == "done"
    ]
    sent, added = h.feed(value)  # the same request again (a lost commit, or the client resubmits)
    assert not added and [(o.topic, o.key, o.value) for o in sent] == [
        (REPLY, first.key, first.value)
    ]
    assert committed(h) == 2


def test_a_dead_engine_hands_every_job_back_and_stops_the_worker():
    h = harness()
    for _ in range(3):
        h.feed(body())
    h.worker._on_engine_death(RuntimeError("boom"))
    dones = [
        msgpack.unpackb(o.value) for o in h.sent if msgpack.unpackb(o.value).get("type") == "done"
    ]
    assert [d["finish_reason"] for d in dones] == ["requeued"] * 3
    assert committed(h) == 0 and not h.worker.jobs  # uncommitted: the next owner runs them
    assert h.worker.readiness()["engine_alive"] is False and h.worker._stop.is_set()


class BrokenEngine:
    """An engine whose every step fails, so the loop's own recovery (fail_all, step again) fails
    too."""

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self):
        raise RuntimeError("step failed")

    def fail_all(self, reason: str) -> None:
        pass

    def stats(self):
        return None


def test_the_engine_loop_reports_its_death():
    died = threading.Event()
    errors = []
    loop = EngineLoop.__new__(EngineLoop)
    EngineLoop.__init__(
        loop,
        lambda: BrokenEngine(),
        lambda *a: None,
        on_death=lambda exc: (errors.append(exc), died.set()),
    )
    loop.start()
    assert died.wait(30) and isinstance(errors[0], RuntimeError)
    loop.stop(5)


# ------------------------------------------------------------------------ coalescing of tokens


def test_a_stream_with_an_event_unacked_keeps_buffering_its_tokens_into_one_event():
    from inferline.contract.schema import decode_event
    from inferline.worker.delivery.publisher import Publisher, ReplyStream
    from inferline.worker.service.metrics import Metrics

    pub = Publisher(Settings(), Metrics(), "w", committer=None)
    sent = []
    pub._enqueue = sent.append  # recorded, never acked: the stream's last event stays in flight
    rs = ReplyStream(
        "r", "a", REPLY, None, seq=2, in_flight=1
    )  # `started` and the first tokens out
    pub.tokens(rs, [1], "a")
    pub.tokens(rs, [2], "b")
    pub.flush_all()
    assert sent == []
    rs.in_flight = 0  # acked
    pub.tokens(rs, [3], "c")
    pub.flush_all()
    (ev,) = [decode_event(o.value) for o in sent]
    assert (ev.seq, ev.token_ids, ev.text) == (2, [1, 2, 3], "abc")
    rs.in_flight = 1
    pub.tokens(rs, [4], "d")
    pub.flush_all(force=True)  # stop(): everything goes
    assert decode_event(sent[-1].value).seq == 3 and rs.seq == 4


async def test_the_overload_path_takes_nothing_while_a_batch_of_dead_letters_waits():
    """Past overload_reject_after_s a full pool's overflow is taken to be rejected; dead letters
    of such records waiting for the broker stop it (issue 48: a flood must not grow memory)."""
    from inferline.worker.intake.group import OVERLOAD_BATCH

    h = IntakeHarness(Settings(limits={"overload_reject_after_s": 0.001}))
    intake = h.worker.intake

    class Full:
        def room(self) -> int:
            return 0

        def pool_full(self) -> bool:
            return True

    intake._sink = Full()
    await intake._take([])  # the pool is full from here on
    time.sleep(0.01)
    h.worker.delivery.dead_letters_in_flight = OVERLOAD_BATCH
    await intake._take([])
    assert intake._want == 0
    h.worker.delivery.dead_letters_in_flight = 0
    await intake._take([])
    assert intake._want == OVERLOAD_BATCH


def test_a_fatal_consumer_error_stops_the_poll_thread():
    """A fatal error (e.g. the broker refusing a static member's instance id) kills librdkafka's
    consumer: its poll thread must replace it (or stop), not poll it forever. librdkafka reports
    it as a message of code _FATAL whose fatal() is false (seen against Kafka 4.1)."""
    from confluent_kafka import KafkaError, KafkaException

    from inferline.worker.intake.group import Record

    class Message:
        def __init__(self, code: int) -> None:
            self._error = KafkaError(code, "test")

        def error(self):
            return self._error

    assert Record.read([Message(KafkaError._TRANSPORT)]) == []  # passing: logged, polled again
    with pytest.raises(KafkaException):
        Record.read([Message(KafkaError._FATAL)])
