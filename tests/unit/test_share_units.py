"""Share mode's bookkeeping without a broker (worker/intake/share.py; the verdicts in
worker/delivery/finals.py): what is handed to the worker and when, where a verdict goes, which
verdict each outcome sends, when a record is dead-lettered, the client settings. The
broker-backed behaviour is tests/kafka/test_share_intake.py."""

from __future__ import annotations

import time

import pytest
from aiokafka import TopicPartition
from pydantic import ValidationError

from inferline.config.settings import Settings
from inferline.contract.schema import Request
from inferline.worker.intake.cancels import RecentCancels
from inferline.worker.intake.triage import Admission
from inferline.worker.service.metrics import Metrics
from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.service.ratelimit import RateLimiter
from inferline.worker.intake.share import (
    BrokerLimits,
    ShareIntake,
    Record,
    _Lane,
    client_config,
    group_configs,
    lock_ms,
    max_deliveries,
    overflow_hops,
    read_broker_limits,
)

TOPIC = "llm.requests"


class FakeSink:
    def __init__(self, room: int) -> None:
        self.capacity, self.handled, self.dead = room, [], []

    def room(self) -> int:
        return self.capacity - len(self.handled)

    def hold(self, tp, record) -> None:
        pass

    def dead_letter(self, record, reason: str) -> None:
        self.dead.append((record.offset, reason))


def make_intake(room: int, **kafka) -> ShareIntake:
    settings = Settings(kafka={"intake": "share", **kafka})
    tracker, metrics = OffsetTracker(), Metrics()
    sink = FakeSink(room)
    intake = ShareIntake(
        settings,
        sink,
        tracker,
        RateLimiter(settings.limits),
        metrics,
        RecentCancels(ttl_s=60),
        sink,
    )
    intake._handle_safely = lambda tp, record, unverified=None: intake._sink.handled.append(
        record.offset
    )
    return intake


def record(offset: int, delivery_count: int = 1) -> Record:
    return Record(TOPIC, 0, offset, b"k", b"v", None, delivery_count=delivery_count)


def released(lane) -> list[int]:
    out = []
    while not lane.verdicts.empty():
        topic, partition, offset, verdict = lane.verdicts.get_nowait()
        assert verdict == "release"
        out.append(offset)
    return out


def test_a_poll_larger_than_the_room_releases_the_rest():
    intake = make_intake(room=2)
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(o) for o in range(5)])
    assert intake._sink.handled == [0, 1]
    assert released(lane) == [2, 3, 4] and not intake._polled  # for a worker with room


def test_records_whose_reply_topics_are_looked_up_take_room():
    intake = make_intake(room=3)
    intake._num_verifying = 2  # admitted once the broker's topic list answers
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(o) for o in range(3)])
    assert intake._sink.handled == [0] and released(lane) == [1, 2]


def test_a_batch_set_aside_for_a_reply_topic_lookup_takes_room():
    intake = make_intake(room=2)
    intake._handle_safely = lambda tp, record, unverified=None: unverified.append(record.offset)
    intake._verify_in_background = lambda unverified: None
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(o) for o in range(5)])
    assert released(lane) == [
        2,
        3,
        4,
    ]  # before: the whole batch went to the lookup, then the engine


def test_overflow_is_handed_off_on_its_first_delivery_only():
    """Every acquisition counts as a delivery: handed off again and again, a record would run out
    of deliveries unstarted (#48: 24 honest requests dead-lettered). Past its first delivery it
    waits here for room."""
    intake = make_intake(room=1)
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(0), record(1), record(2, delivery_count=2)])
    assert intake._sink.handled == [0] and released(lane) == [1]
    assert [r.offset for _, r in intake._polled] == [2]
    intake._sink.capacity = 2  # a request finished
    intake._hand_out()
    assert intake._sink.handled == [0, 2]


def test_a_handed_off_record_keeps_its_deliveries():
    """One hand-off of overflow is not counted: a record handed off, then taken by workers that
    died max_deliveries - 1 times, still runs."""
    intake = make_intake(room=4, max_deliveries=3)
    tp = TopicPartition(TOPIC, 0)
    intake._decode(tp, record(7, delivery_count=4))  # 1 hand-off + 3 deliveries: b"v" decoded
    ((offset, reason),) = intake._sink.dead
    assert offset == 7 and "delivered" not in reason  # dead-lettered as undecodable, not counted


def test_overflow_kept_past_its_first_delivery_is_logged():
    """Kept here while other workers may idle: an operator must see it (#37)."""
    from structlog.testing import capture_logs

    intake = make_intake(room=1, max_deliveries=3)
    intake.max_deliveries = 3
    lane = _Lane(intake, 0, {})
    with capture_logs() as logs:
        intake._take(lane, [record(0, delivery_count=3), record(1, delivery_count=3)])
    assert intake._sink.handled == [0] and released(lane) == []
    assert [(e["event"], e["records"]) for e in logs if "overflow" in e["event"]] == [
        ("share_intake.overflow_kept", 1)
    ]


def test_nothing_is_handed_out_while_draining():
    intake = make_intake(room=4)
    intake.fetching = False
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(0)])
    assert intake._sink.handled == [] and released(lane) == [0]


class FakeShareConsumer:
    def __init__(self, records: list[Record]) -> None:
        self.records, self.subscribed, self.polls = records, False, 0

    def subscribe(self, topics) -> None:
        self.subscribed = True

    def unsubscribe(self) -> None:
        self.subscribed = False

    def poll(self, timeout):
        assert self.subscribed
        self.polls += 1
        batch, self.records = self.records[:1], self.records[1:]
        return [FakeMessage(r) for r in batch]


class FakeMessage:
    def __init__(self, r: Record) -> None:
        self.r = r

    def error(self):
        return None

    def topic(self):
        return self.r.topic

    def partition(self):
        return self.r.partition

    def offset(self):
        return self.r.offset

    def key(self):
        return self.r.key

    def value(self):
        return self.r.value

    def headers(self):
        return self.r.headers

    def timestamp(self):  # confluent-kafka's (type, ms): 0 is TIMESTAMP_NOT_AVAILABLE
        return (0, -1) if self.r.sent_at is None else (1, int(self.r.sent_at * 1000))

    def delivery_count(self):
        return self.r.delivery_count


def test_a_full_worker_stops_fetching_until_room_returns():
    intake = make_intake(room=1)
    intake._hand_out()  # the loop measures the room: 1
    intake.hand_over = intake._take  # no event loop here: the lane's records go straight in
    a, b = _Lane(intake, 0, {}), _Lane(intake, 1, {})
    intake._lanes = [a, b]
    ca, cb = FakeShareConsumer([record(0), record(1)]), FakeShareConsumer([record(2)])
    held_a, held_b = set(), set()
    a._take(ca, held_a)  # room for one: a polls it
    assert intake._sink.handled == [0] and ca.subscribed and ca.polls == 1
    b._take(cb, held_b)  # full: b fetches nothing, and leaves the share group meanwhile
    assert cb.polls == 0 and not cb.subscribed and intake.free_room == 0 and not a.claimed
    intake._sink.handled.clear()  # the request finished: room again
    intake._hand_out()
    b._take(cb, held_b)
    assert cb.subscribed and cb.polls == 1 and intake._sink.handled == [2]


def test_lanes_claim_room_before_they_poll():
    intake = make_intake(room=3)
    intake._hand_out()
    a, b, c = _Lane(intake, 0, {"max.poll.records": 2}), _Lane(intake, 1, {}), _Lane(intake, 2, {})
    intake._lanes = [a, b, c]
    assert intake.claim_room(a) and intake.claim_room(b)
    assert not intake.claim_room(c)  # a may bring 2, b 1: the 3 free places are spoken for
    intake.free_claim(b)  # b's poll came back empty
    assert intake.claim_room(c)


def test_verdicts_go_to_the_lane_that_holds_the_record():
    intake = make_intake(room=4)
    a, b = _Lane(intake, 0, {}), _Lane(intake, 1, {})
    intake._take(a, [record(0)])
    intake._take(b, [record(1)])
    intake.decide(TopicPartition(TOPIC, 0), 1, "accept")
    intake.decide(TopicPartition(TOPIC, 0), 0, "release")
    assert b.verdicts.get_nowait() == (TOPIC, 0, 1, "accept")
    assert a.verdicts.get_nowait() == (TOPIC, 0, 0, "release")
    intake.decide(TopicPartition(TOPIC, 0), 0, "accept")  # decided already: nothing more
    assert a.verdicts.empty()


def test_a_record_back_while_it_runs_keeps_running_under_the_new_lock():
    intake = make_intake(room=4)
    a, b = _Lane(intake, 0, {}), _Lane(intake, 1, {})
    intake._take(a, [record(0)])
    intake._take(b, [record(0, delivery_count=2)])  # its lock expired on a
    assert intake._sink.handled == [0]  # not run twice
    assert a.verdicts.get_nowait() == (TOPIC, 0, 0, "release")  # the stale acquisition let go
    intake.decide(TopicPartition(TOPIC, 0), 0, "accept")
    assert b.verdicts.get_nowait() == (TOPIC, 0, 0, "accept")


def test_a_record_back_while_it_runs_is_no_overflow():
    intake = make_intake(room=1)
    a, b = _Lane(intake, 0, {}), _Lane(intake, 1, {})
    intake._take(a, [record(0)])
    intake._take(b, [record(0, delivery_count=2)])  # the pool is full now: still not released
    assert intake._sink.handled == [0] and b.verdicts.empty()
    assert a.verdicts.get_nowait() == (TOPIC, 0, 0, "release")


def test_past_max_deliveries_is_a_dead_letter():
    intake = make_intake(room=4, max_deliveries=3)
    assert intake._decode(TopicPartition(TOPIC, 0), record(7, delivery_count=5)) is None
    ((offset, reason),) = intake._sink.dead
    assert offset == 7 and "delivered 5 times" in reason
    intake._sink.dead.clear()
    intake._decode(TopicPartition(TOPIC, 0), record(8, delivery_count=4))  # b"v": not a request
    ((offset, reason),) = intake._sink.dead
    assert offset == 8 and "delivered" not in reason


def test_client_and_group_settings():
    kafka = Settings(
        kafka={
            "intake": "share",
            "group_id": "g",
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "PLAIN",
            "sasl_username": "u",
            "sasl_password": "p",
            "ssl_cafile": "/ca.pem",
            "share_lock_ms": 120_000,
        }
    ).kafka
    conf = client_config(kafka, "g", 8, 600_000)
    assert conf["share.acknowledgement.mode"] == "explicit" and conf["max.poll.records"] == 8
    assert (
        conf["max.poll.interval.ms"] > 600_000
    )  # a lane pinned by a request as long as the lock stays
    assert conf["sasl.password"] == "p" and conf["ssl.ca.location"] == "/ca.pem"
    assert group_configs(120_000) == {
        "share.auto.offset.reset": "earliest",
        "share.record.lock.duration.ms": "120000",
    }
    assert conf["client.id"] == kafka.client_id  # KafkaSettings.librdkafka_config: the one place


def test_the_lock_follows_the_request_timeout_within_the_brokers_cap():
    settings = Settings(kafka={"intake": "share"}, limits={"default_timeout_s": 50})
    assert lock_ms(settings, BrokerLimits(max_lock_ms=3_600_000)) == 60_000  # timeout + margin
    assert lock_ms(settings, BrokerLimits(max_lock_ms=30_000)) == 30_000  # the broker refuses more
    pinned = Settings(kafka={"intake": "share", "share_lock_ms": 120_000})
    assert lock_ms(pinned, BrokerLimits(max_lock_ms=3_600_000)) == 120_000


def test_max_deliveries_stays_below_the_brokers_limit():
    kafka = Settings(kafka={"intake": "share", "max_deliveries": 10}).kafka
    # 3 plus one hand-off of overflow: the 5th is dead-lettered, not run (and not archived unseen)
    assert max_deliveries(kafka, BrokerLimits(delivery_limit=5)) == 3
    assert overflow_hops(BrokerLimits(delivery_limit=5)) == 1
    assert max_deliveries(kafka, BrokerLimits(delivery_limit=20)) == 10
    assert max_deliveries(Settings().kafka, BrokerLimits()) == 3  # the defaults agree
    # The broker's smallest limit leaves no delivery to spare: overflow is never handed off.
    assert overflow_hops(BrokerLimits(delivery_limit=2)) == 0
    assert max_deliveries(kafka, BrokerLimits(delivery_limit=2)) == 1


def test_no_hand_offs_when_the_broker_leaves_none():
    intake = make_intake(room=1)
    intake.hops = 0
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(0), record(1)])
    assert intake._sink.handled == [0] and released(lane) == []


def test_unreadable_broker_limits_stop_the_start(monkeypatch):
    """Guessed limits would archive records unseen or let a long request's lock run out: no
    guess."""
    import confluent_kafka.admin

    class Unreachable:
        def __init__(self, conf) -> None:
            pass

        def list_topics(self, timeout):
            raise RuntimeError("no DESCRIBE_CONFIGS right")

    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", Unreachable)
    with pytest.raises(RuntimeError, match="share limits"):
        read_broker_limits(Settings(kafka={"intake": "share"}).kafka, tries=1)


class AckingConsumer(FakeShareConsumer):
    """Acknowledgements and commits as a lane sends them; the first `failures` commits fail."""

    def __init__(self, failures: int = 0, poll_error: Exception | None = None) -> None:
        super().__init__([])
        self.acks, self.commits, self.failures, self.poll_error = [], 0, failures, poll_error

    def acknowledge_offset(self, topic, partition, offset, kind) -> None:
        self.acks.append((offset, kind))

    def commit_sync(self, timeout):
        from confluent_kafka import KafkaError, KafkaException

        self.commits += 1
        error = None
        if self.commits <= self.failures:
            error = KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return {FakeTP(TOPIC, 0): error}

    def poll(self, timeout):
        if self.poll_error is not None:
            error, self.poll_error = self.poll_error, None
            raise error
        return super().poll(timeout)


class FakeTP:
    def __init__(self, topic: str, partition: int) -> None:
        self.topic, self.partition = topic, partition


def test_an_accept_whose_commit_failed_is_sent_again(monkeypatch):
    """Only logged, a lost ACCEPT lets the lock expire and another worker answer again."""
    from confluent_kafka import AcknowledgeType

    monkeypatch.setattr("inferline.worker.intake.share.LANE_BACKOFF_S", 0)
    intake = make_intake(room=4)
    lane = _Lane(intake, 0, {})
    consumer = AckingConsumer(failures=1)
    held = {(TOPIC, 0, 5)}
    lane.verdicts.put((TOPIC, 0, 5, "accept"))
    lane._acknowledge(consumer, held, wait=None)
    assert consumer.commits == 2 and consumer.acks == [(5, AcknowledgeType.ACCEPT)] * 2


def test_a_lane_error_keeps_the_lane_and_its_consumer(monkeypatch):
    """Closed on an error, the consumer would release the records still running here (#48): the
    lane goes on after a pause, the worker keeps serving."""
    monkeypatch.setattr("inferline.worker.intake.share.LANE_BACKOFF_S", 0)
    intake = make_intake(room=4)
    intake._hand_out()
    failed = []
    intake.lane_failed = failed.append
    intake.hand_over = intake._take
    lane = _Lane(intake, 0, {})
    intake._lanes = [lane]
    consumer = AckingConsumer(poll_error=RuntimeError("broker said something odd"))
    consumer.records = [record(3)]
    lane._step(consumer, lane.held)  # the error: logged, the claim freed
    assert not failed and not lane.claimed and consumer.subscribed
    lane._step(consumer, lane.held)
    assert intake._sink.handled == [3]


def test_close_waits_for_the_verdicts_of_finals_on_their_way():
    """Shutdown closed the lanes before the last finals' verdicts came: their records were
    released although answered, and answered again elsewhere (#48)."""
    import asyncio

    intake = make_intake(room=4)
    lane = _Lane(intake, 0, {})
    intake._take(lane, [record(0)])  # handed to the worker; its `done` is on its way
    order = []

    class StubThread:
        def join(self, timeout) -> None:
            order.append("joined")

    lane.thread = StubThread()
    intake._lanes = [lane]

    async def scenario() -> None:
        intake._close_triage = lambda: asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        loop.call_later(
            0.3,
            lambda: (order.append("verdict"), intake.decide(TopicPartition(TOPIC, 0), 0, "accept")),
        )
        await intake.close()

    asyncio.run(scenario())
    assert order == ["verdict", "joined"]
    assert lane.verdicts.get_nowait() == (TOPIC, 0, 0, "accept")


def test_a_lane_opens_when_every_lane_is_pinned():
    intake = make_intake(room=4, share_consumers=2)
    opened = []
    intake._open_lane = lambda: opened.append(1)
    a = _Lane(intake, 0, {})
    intake._lanes = [a]
    intake._hand_out()
    assert not opened  # a can poll
    a.held.add((TOPIC, 0, 0))  # its request runs
    intake._hand_out()
    assert opened == [1]
    intake._lanes.append(_Lane(intake, 1, {}))
    intake._lanes[1].held.add((TOPIC, 0, 1))
    intake._hand_out()
    assert opened == [1]  # share_consumers reached


def test_share_mode_is_body_tenancy_only():
    with pytest.raises(ValidationError, match="tenancy must be body"):
        Settings(kafka={"intake": "share", "tenancy": "topic"})


# -- the verdicts: which acknowledgement each outcome sends (worker/delivery/finals.py) ------------


class AckingPublisher:
    """Stands in for the Publisher: each final outcome is on the broker at once (or `failed` for
    the `done`s, when told so)."""

    def __init__(self, done_outcome: str = "ok") -> None:
        self.done_outcome, self.sent = done_outcome, []

    def dead_letter(self, topic, key, value, headers, source, on_acked) -> None:
        self.sent.append(("dead_letter", source[1]))
        on_acked("ok")

    def done(self, rs, on_acked, source=None, *, finish_reason: str, **fields) -> None:
        self.sent.append((finish_reason, source and source[1]))
        on_acked(self.done_outcome)

    def finish_offset(self, source, record, on_acked) -> None:
        on_acked("ok")


class FakeEngineLoop:
    def add_request(self, request) -> None:
        pass

    def abort(self, attempt: str, reason: str) -> None:
        pass


def share_worker(done_outcome: str = "ok"):
    from inferline.worker.app import Worker

    worker = Worker(Settings(kafka={"intake": "share"}))
    worker.publisher = worker.delivery.publisher = AckingPublisher(done_outcome)
    worker.engine_loop = worker.requests.engine_loop = FakeEngineLoop()
    worker.delivery.dlq_limit.topic_limit = 1_048_588  # as read from the DLQ at start
    decided = []
    worker.intake.decide = lambda tp, offset, verdict: decided.append((offset, verdict))
    return worker, decided


def make_request(offset: int) -> Request:
    return Request.model_validate(
        {"v": 1, "id": f"r-{offset}", "reply_topic": "inferline.reply.t", "prompt": "hi"}
    )


def admit(worker, offset: int) -> str:
    req = make_request(offset)
    worker.requests.admit(
        Admission(TopicPartition(TOPIC, 0), offset, req, time.time(), 8, time.time() + 60)
    )
    (attempt,) = worker.ledger.attempts(req.id)
    return attempt


def test_share_verdicts_follow_each_outcome():
    from inferline.worker.engine.request import RequestOutput
    from inferline.worker.delivery.publisher import ReplyRoute

    worker, decided = share_worker()
    tp = TopicPartition(TOPIC, 0)
    worker.tracker.partition(tp).held[1] = record(1)
    worker.delivery.dead_letter(
        record(1), "undecodable"
    )  # dead-lettered: REJECT once the DLQ has it
    worker.delivery.reject(
        tp, 2, ReplyRoute("r-2", "inferline.reply.t", None), "invalid_request", "bad"
    )
    finished, requeued = admit(worker, 3), admit(worker, 4)
    worker.requests._finish(
        worker.jobs[finished], RequestOutput(finished, finished=True, finish_reason="stop")
    )
    worker.requests._finish(
        worker.jobs[requeued], RequestOutput(requeued, finished=True, finish_reason="requeued")
    )
    assert decided == [(1, "reject"), (2, "accept"), (3, "accept"), (4, "release")]
    assert ("requeued", None) in worker.publisher.sent  # no source: a requeued done ends nothing
    assert worker.ledger.empty()


def test_share_a_request_answered_here_before_is_accepted_without_running():
    from inferline.worker.engine.request import RequestOutput

    worker, decided = share_worker()
    attempt = admit(worker, 3)
    worker.requests._finish(
        worker.jobs[attempt], RequestOutput(attempt, finished=True, finish_reason="stop")
    )
    # The same record again (its lock expired just after the done): answered from the ledger,
    # first thing in triage.
    worker.intake._triage(TopicPartition(TOPIC, 0), record(3), make_request(3))
    assert decided == [(3, "accept"), (3, "accept")] and not worker.jobs


def test_share_an_undeliverable_done_dead_letters_the_record():
    from inferline.worker.delivery.publisher import ReplyRoute

    worker, decided = share_worker(done_outcome="failed")
    tp = TopicPartition(TOPIC, 0)
    worker.tracker.partition(tp).held[6] = record(6)
    worker.delivery.reject(
        tp, 6, ReplyRoute("r-6", "inferline.reply.t", None), "invalid_request", "bad"
    )
    assert ("dead_letter", 6) in worker.publisher.sent
    assert decided == [(6, "reject")]


def test_group_mode_sends_no_verdicts():
    from inferline.worker.app import Worker

    worker = Worker(Settings())
    worker.publisher = worker.delivery.publisher = AckingPublisher()
    worker.delivery.dlq_limit.topic_limit = 1_048_588  # as read from the DLQ at start
    assert not hasattr(worker.intake, "decide")
    worker.tracker.partition(TopicPartition(TOPIC, 0)).held[1] = record(1)
    worker.delivery.dead_letter(record(1), "undecodable")
    assert worker.ledger.empty()


def test_a_verdict_for_a_record_no_longer_in_flight_unpins_its_lane():
    """The client refuses to acknowledge a record whose lock is gone: the lane lets it go
    (held, it would pin the lane for good)."""

    class Refusing(AckingConsumer):
        def acknowledge_offset(self, topic, partition, offset, kind) -> None:
            raise RuntimeError("IllegalStateException: not in flight")

    intake = make_intake(room=4)
    lane = _Lane(intake, 0, {})
    consumer = Refusing()
    held = {(TOPIC, 0, 5)}
    lane.verdicts.put((TOPIC, 0, 5, "accept"))
    lane._acknowledge(consumer, held, wait=None)
    assert not held and consumer.commits == 0


def test_no_lane_opens_right_after_a_release():
    """Its own new lane would take the released overflow back before an idle worker polls (seen:
    one worker took 28 of 32 released records back and ran all 36, the others none)."""
    import time

    from inferline.worker.intake import share

    intake = make_intake(room=8)
    opened = []
    intake._open_lane = lambda: opened.append(1)
    intake._lanes = [type("Pinned", (), {"held": {("t", 0, 0)}})()]
    intake.free_room = 4
    intake._released_at = time.monotonic()
    intake._lanes_wanted()
    assert not opened
    intake._released_at -= share.RELEASE_GRACE_S
    intake._lanes_wanted()
    assert opened == [1]
