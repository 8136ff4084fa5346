"""Share mode (INFERLINE_KAFKA__INTAKE=share, worker/intake/share.py) against a real broker.

Three workers in one share group on a one-partition request topic all serve requests; one of
them is SIGKILLed while it runs requests, whose records come back to the others as its
connections close (long before their lock expires), and every request still ends with a final
`done`; a worker that joins mid-run takes
requests while the others go on serving. A request delivered more often than
`max_deliveries` goes to the dead-letter topic while the fleet keeps serving.

Share groups need Kafka 4.2+ (on 4.1.1 with share.version=1, the broker cannot parse the member
ids librdkafka makes): these tests run their own broker, SHARE_KAFKA_VERSION from Maven Central.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import pytest

from inferline.contract.schema import DoneEvent, StartedEvent
from tests.chaos_fixtures import ReplyWatcher, WorkerProcess, private_topics, running_private_broker
from tests.kafka_fixtures import consume_until, wait_until
from tests.worker_fixtures import Topics, check_attempts, submit
from tests.worker_fixtures import request as make_request

pytest.importorskip("confluent_kafka", minversion="2.16")
pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SHARE_KAFKA_VERSION = "4.2.0"
# A SIGKILLed worker's records come back at once: the broker releases a member's records when its
# connections close (checked on 4.2.0). The lock only bounds a worker that hangs, so it is longer
# than every wait here: a test that got its records back only when their lock expired would time
# out. It must outlast a request even on a loaded 2-core machine (a 48-token request took 75-115 s
# at load average 12). Kafka's default cap (group.share.max.record.lock.duration.ms, 60 s) would
# allow no more; scripts/kafka.sh raises it.
LOCK_MS = 900_000
# A share member fetches nothing until a heartbeat answer gives it its partitions: the broker's
# group.share.heartbeat.interval.ms (5 s) after it subscribed, later on a loaded machine.
ASSIGNMENT_S = 15


@pytest.fixture(scope="module")
def share_broker(tmp_path_factory):
    yield from running_private_broker(
        tmp_path_factory.mktemp("kafka-share"), INFERLINE_KAFKA_VERSION=SHARE_KAFKA_VERSION
    )


async def make_topics(bootstrap: str) -> Topics:
    return await private_topics(bootstrap, "share", 1, 2)


def share_worker(
    name: str, bootstrap: str, topics: Topics, log_dir, group: str, **kafka
) -> WorkerProcess:
    # A small pool: a worker takes a few records at a time, so the others get some too.
    return WorkerProcess(
        name,
        bootstrap,
        topics,
        log_dir,
        worker={"name": name, "drain_timeout_s": 20},
        kafka={"intake": "share", "group_id": group, "share_lock_ms": LOCK_MS, **kafka},
        scheduler={"max_num_seqs": 4, "max_waiting": 4},
    )


async def submit_each(bootstrap: str, topic: str, requests: list[dict]) -> list[str]:
    """One produce per request, as independent clients send them: the broker hands a share
    consumer whole producer batches, so one batch of many requests would go to one worker."""
    return [(await submit(bootstrap, topic, [r]))[0] for r in requests]


def workers_of(events: list) -> tuple[set[str], set[str]]:
    """(workers that started an attempt, workers that sent a final done)."""
    started = {e.worker for e in events if isinstance(e, StartedEvent)}
    final = {e.worker for e in events if isinstance(e, DoneEvent) and e.finish_reason != "requeued"}
    return started, final


@pytest.mark.full  # `make chaos` runs it: several worker processes, a minute or more
@pytest.mark.chaos
async def test_three_workers_share_one_partition_and_survive_a_kill(share_broker, tmp_path):
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"share-{uuid.uuid4().hex[:8]}"
    workers = [share_worker(f"w{i}", bootstrap, topics, tmp_path, group) for i in range(3)]
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        for w in workers:
            w.spawn()
        await asyncio.gather(*(w.wait_started(600) for w in workers))
        # Wave 1: every worker serves some of the requests of the one partition.
        ids = await submit_each(
            bootstrap,
            topics.requests,
            [
                make_request(topics.replies, prompt=f"Count: {i}", max_tokens=6, ignore_eos=True)
                for i in range(24)
            ],
        )
        await wait_until(lambda: watcher.finished(ids) == len(ids), 240, "wave 1")
        events = watcher.events()
        served = set().union(*(workers_of([e for _, e in events[i]])[1] for i in ids))
        assert served == {"w0", "w1", "w2"}, f"workers that served: {served}"
        # Wave 2: w0 dies while it runs requests; the others finish them, none lost.
        ids2 = await submit_each(
            bootstrap,
            topics.requests,
            [
                make_request(topics.replies, prompt=f"Count: {i}", max_tokens=24, ignore_eos=True)
                for i in range(12)
            ],
        )
        victim_started = lambda: [
            i
            for i, evs in watcher.events().items()  # noqa: E731
            if i in ids2 and "w0" in workers_of([e for _, e in evs])[0]
        ]
        await wait_until(lambda: victim_started(), 240, "w0 to start a request")
        workers[0].kill()
        cut = set(victim_started())
        # Well within LOCK_MS: the killed worker's records came back when its connections closed.
        await wait_until(lambda: watcher.finished(ids2) == len(ids2), 420, "wave 2")
        events = watcher.events()
        for i in ids2:
            check_attempts([e for _, e in events[i]], allow_cut=True)
            finals = [
                e
                for _, e in events[i]
                if isinstance(e, DoneEvent) and e.finish_reason != "requeued"
            ]
            assert finals and all(d.finish_reason == "length" for d in finals), (i, finals)
        rerun = [i for i in cut if "w0" not in workers_of([e for _, e in events[i]])[1]]
        assert rerun, "no request that w0 had started was completed by another worker"
        for i in rerun:
            assert workers_of([e for _, e in events[i]])[1] <= {"w1", "w2"}
        # Wave 3: w3 joins mid-run. The others keep finishing requests while it starts (no
        # rebalance stops them), and it takes requests as soon as it is up.
        wave = lambda n, tokens: submit_each(
            bootstrap,
            topics.requests,
            [  # noqa: E731
                make_request(
                    topics.replies, prompt=f"Count: {i}", max_tokens=tokens, ignore_eos=True
                )
                for i in range(n)
            ],
        )
        ids3 = await wave(12, 12)
        joiner = share_worker("w3", bootstrap, topics, tmp_path, group)
        workers.append(joiner)
        spawned = time.time()
        joiner.spawn()
        await joiner.wait_started(600)
        up = time.time()
        ids4 = await wave(24, 6)
        await wait_until(lambda: watcher.finished(ids3 + ids4) == len(ids3 + ids4), 420, "wave 3")
        events = watcher.events()
        finals = {
            i: [
                (t, e.worker)
                for t, e in events[i]
                if isinstance(e, DoneEvent) and e.finish_reason != "requeued"
            ]
            for i in ids3 + ids4
        }
        assert any(spawned < t < up for i in ids3 for t, _ in finals[i]), (
            "nothing finished while w3 started"
        )
        assert any(w == "w3" for i in ids4 for _, w in finals[i]), "w3 took no request"
    finally:
        await watcher.stop()
        for w in workers:
            if w.alive():
                await w.terminate()


async def test_a_request_past_max_deliveries_is_dead_lettered(share_broker, tmp_path):
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"share-{uuid.uuid4().hex[:8]}"
    # max_deliveries 1, plus the hand-off of overflow a record may have had: a stand-in takes
    # and releases the request once, the first worker to take it dies with it, and its third
    # delivery is one too many (a poison request that kills every worker stops after the limit).
    first = share_worker("first", bootstrap, topics, tmp_path, group, max_deliveries=1)
    second = share_worker("second", bootstrap, topics, tmp_path, group, max_deliveries=1)
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        await set_group_lock(bootstrap, group, LOCK_MS)  # and the offset reset to earliest
        (poison,) = await submit(
            bootstrap,
            topics.requests,
            [make_request(topics.replies, prompt="Count slowly.", max_tokens=400, ignore_eos=True)],
        )
        assert await asyncio.to_thread(deliver_and_release, bootstrap, topics, group, 1) == [1]
        first.spawn()
        await first.wait_started(600)
        await wait_until(lambda: watcher.started([poison]) == 1, 240, "the request to start")
        first.kill()
        second.spawn()
        await second.wait_started(600)
        dead = await consume_until(bootstrap, topics.dlq, lambda recs: len(recs) >= 1, timeout=240)
        headers = dict(dead[0].headers)
        assert dead[0].key == poison.encode()
        # At least 3: as a worker dies, its other consumer may take the record in the moment
        # between the first one's connection closing (a release) and its own.
        delivered = re.match(rb"delivered (\d+) times", headers["error"])
        assert delivered and int(delivered[1]) >= 3, headers
        # The fleet keeps serving.
        ids = await submit(bootstrap, topics.requests, [make_request(topics.replies, max_tokens=4)])
        await wait_until(lambda: watcher.finished(ids) == 1, 120, "a request after the poison one")
        assert watcher.finished([poison]) == 0
    finally:
        await watcher.stop()
        for w in (first, second):
            if w.alive():
                await w.terminate()


def deliver_and_release(bootstrap: str, topics: Topics, group: str, times: int) -> list[int]:
    """Stands in for workers that took the record and died or gave it back."""
    from confluent_kafka import AcknowledgeType, ShareConsumer

    consumer = ShareConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "share.acknowledgement.mode": "explicit",
        }
    )
    consumer.subscribe([topics.requests])
    counts = []
    try:
        while len(counts) < times:
            for msg in consumer.poll(1.0):
                counts.append(msg.delivery_count())
                consumer.acknowledge(msg, AcknowledgeType.RELEASE)
            consumer.commit_sync(10)
    finally:
        consumer.close()
    return counts


# -- a full worker hands back what it cannot run (#37) ---------------------------------------------


def finals_of(events) -> list[DoneEvent]:
    return [e for _, e in events if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]


@pytest.mark.full  # `make chaos` runs it: several worker processes, a minute or more
@pytest.mark.chaos
async def test_a_full_worker_hands_its_overflow_to_idle_workers(share_broker, tmp_path):
    """36 requests in one producer batch (the broker hands a share consumer whole batches) to
    three workers whose pools hold 8 each: the one that takes the batch keeps what it can run and
    releases the rest, which an idle worker takes. None is rejected, each finishes once."""
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"share-{uuid.uuid4().hex[:8]}"
    # Every hop of the batch (taken, the overflow released) costs each record still in it a
    # delivery: a record is handed off on its first delivery only, and the worker that takes the
    # rest keeps what it cannot run yet (the broker hands out released records together too).
    workers = [share_worker(f"w{i}", bootstrap, topics, tmp_path, group) for i in range(3)]
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        for w in workers:
            w.spawn()
        await asyncio.gather(*(w.wait_started(600) for w in workers))
        # A share member is given its partitions in a heartbeat answer (the broker's
        # group.share.heartbeat.interval.ms, 5 s): until then it fetches nothing, and a batch
        # submitted earlier would hop between the members already assigned (seen: w2 served none).
        await asyncio.sleep(ASSIGNMENT_S)
        ids = await submit(
            bootstrap,
            topics.requests,
            [
                make_request(topics.replies, prompt=f"Count: {i}", max_tokens=8, ignore_eos=True)
                for i in range(36)
            ],
        )
        await wait_until(lambda: watcher.finished(ids) == len(ids), 600, "36 requests")
        events = watcher.events()
        finals = {i: finals_of(events[i]) for i in ids}
        assert all(len(f) == 1 for f in finals.values()), {
            i: len(f) for i, f in finals.items() if len(f) != 1
        }
        reasons = {f[0].finish_reason for f in finals.values()}
        assert reasons == {"length"}, [
            (i, f[0].error) for i, f in finals.items() if f[0].finish_reason != "length"
        ]
        served = {f[0].worker for f in finals.values()}
        # The rest of the batch goes to one worker (the broker hands out released records
        # together, and a record is handed off on its first delivery only, #48).
        assert len(served) >= 2, f"workers that served: {served}"
    finally:
        await watcher.stop()
        for w in workers:
            if w.alive():
                await w.terminate()


async def test_the_projects_broker_lets_a_lock_outlast_the_default_request_timeout(share_broker):
    """scripts/kafka.sh's broker caps share locks at an hour, not Kafka's 60 s: the worker's lock
    for the default 600 s timeout is not cut short (it would be, and logged, on a default
    broker)."""
    from inferline.config.settings import KafkaSettings, Settings
    from inferline.worker.intake.share import lock_ms, read_broker_limits

    kafka = KafkaSettings(bootstrap_servers=share_broker.bootstrap, intake="share")
    limits = await asyncio.to_thread(read_broker_limits, kafka)
    assert limits.max_lock_ms == 3_600_000
    settings = Settings(kafka=kafka)
    assert lock_ms(settings, limits) == (settings.limits.default_timeout_s + 10) * 1000 > 60_000


# The group's lock a request must outlast, and a request that does by construction: the engine
# sleeps STEP_DELAY_S before each step (INFERLINE_FAULT_STEP_DELAY_S), one step a token.
GROUP_LOCK_S = 3
LONG_TOKENS = 8
STEP_DELAY_S = 1.0


async def set_group_lock(bootstrap: str, group: str, lock_ms: int) -> None:
    from inferline.config.settings import KafkaSettings
    from inferline.worker.intake.share import group_configs, set_group_configs

    kafka = KafkaSettings(bootstrap_servers=bootstrap, group_id=group, intake="share")
    await asyncio.to_thread(set_group_configs, kafka, group_configs(lock_ms))


@pytest.mark.chaos  # share mode's long-request tests: make chaos and make test-full
@pytest.mark.full
async def test_a_request_longer_than_the_groups_lock_runs_once(share_broker, tmp_path):
    """The share group's lock is 3 s (an operator's, or the broker's default) and a request runs
    longer: the worker sets the group's lock from its request timeout at start-up, so the idle
    second worker never gets the record while it runs, nor does its own worker get it back."""
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"share-{uuid.uuid4().hex[:8]}"
    await set_group_lock(bootstrap, group, GROUP_LOCK_S * 1000)
    # No share_lock_ms: the lock follows the request timeout (default_timeout_s 50: 60 s).
    # One consumer: its batch pins it.
    kafka = {"intake": "share", "group_id": group, "share_consumers": 1}
    workers = [
        WorkerProcess(
            name,
            bootstrap,
            topics,
            tmp_path,
            worker={"name": name, "drain_timeout_s": 20},
            kafka=kafka,
            limits={"default_timeout_s": 50},
            scheduler={"max_num_seqs": 1, "max_waiting": 1},
        )
        for name in ("a", "b")
    ]
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        for w in workers:  # every engine step waits STEP_DELAY_S: the request's length is ours
            w.spawn({"INFERLINE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)})
        await asyncio.gather(*(w.wait_started(600) for w in workers))
        long_request = make_request(
            topics.replies, prompt="Count slowly.", max_tokens=LONG_TOKENS, ignore_eos=True
        )
        (long_id,) = await submit(bootstrap, topics.requests, [long_request])
        await wait_until(lambda: watcher.finished([long_id]) == 1, 300, "the long request")
        done = finals_of(watcher.events()[long_id])[0]
        # One step a token, each after STEP_DELAY_S: longer than the lock whatever the machine.
        assert done.timing.total_s >= LONG_TOKENS * STEP_DELAY_S > GROUP_LOCK_S
        # Had its lock expired, the record came back at least 5 s before this `done`: the other
        # worker would have started it, or its own logged it back; 1 s more for a `started`.
        await asyncio.sleep(1)
        events = [e for _, e in watcher.events()[long_id]]
        started = [(e.worker, e.attempt) for e in events if isinstance(e, StartedEvent)]
        assert len(started) == 1 and len(finals_of(watcher.events()[long_id])) == 1, started
        for w in workers:
            log = w.log_path.read_text(errors="replace")
            assert "share_intake.lock_expired" not in log, w.name  # it came back to its worker
            assert "share_intake.ack_failed" not in log, w.name  # the lock was gone at the ack
    finally:
        await watcher.stop()
        for w in workers:
            if w.alive():
                await w.terminate()


async def test_a_record_on_the_brokers_last_delivery_is_dead_lettered(share_broker, tmp_path):
    """The broker archives a record unseen once it has been delivered
    group.share.delivery.count.limit times (10 on the test broker). A worker whose MAX_DELIVERIES
    is not below that (10 here) must still dead-letter it on that last delivery instead of running
    it: if it killed this worker too, nothing would show where it went."""
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"share-{uuid.uuid4().hex[:8]}"
    await set_group_lock(bootstrap, group, 60_000)  # and the offset reset to earliest
    (poison,) = await submit(
        bootstrap, topics.requests, [make_request(topics.replies, max_tokens=4)]
    )

    counts = await asyncio.to_thread(deliver_and_release, bootstrap, topics, group, 9)
    assert counts == list(range(1, 10)), counts
    worker = share_worker("last", bootstrap, topics, tmp_path, group, max_deliveries=10)
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        worker.spawn()
        await worker.wait_started(600)
        dead = await consume_until(bootstrap, topics.dlq, lambda recs: len(recs) >= 1, timeout=120)
        assert dead[0].key == poison.encode()
        assert re.match(rb"delivered 10 times", dict(dead[0].headers)["error"]), dead[0].headers
        assert watcher.started([poison]) == 0
    finally:
        await watcher.stop()
        if worker.alive():
            await worker.terminate()


@pytest.mark.full  # `make chaos` runs it: several worker processes, a minute or more
@pytest.mark.chaos
async def test_long_requests_do_not_stall_intake(share_broker, tmp_path):
    """A share consumer whose requests still run cannot poll (explicit acknowledgement): two long
    requests pin two consumers. Short requests sent after them must still be taken and finish
    while the long ones run: the worker opens another consumer."""
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    worker = share_worker("w", bootstrap, topics, tmp_path, f"share-{uuid.uuid4().hex[:8]}")
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        worker.spawn()
        await worker.wait_started(600)
        longs = []
        for i in range(2):  # one at a time: each is its own poll, on its own consumer
            longs += await submit(
                bootstrap,
                topics.requests,
                [
                    make_request(
                        topics.replies, prompt=f"Count slowly: {i}", max_tokens=200, ignore_eos=True
                    )
                ],
            )
            await wait_until(
                lambda: watcher.started(longs) == len(longs), 240, "a long request to start"
            )
        shorts = await submit_each(
            bootstrap,
            topics.requests,
            [make_request(topics.replies, prompt=f"Hi {i}", max_tokens=2) for i in range(2)],
        )
        await wait_until(lambda: watcher.finished(shorts + longs) == 4, 600, "every request")
        events = watcher.events()
        end = {
            i: max(ts for ts, e in events[i] if isinstance(e, DoneEvent)) for i in shorts + longs
        }
        assert max(end[i] for i in shorts) < min(end[i] for i in longs), end
    finally:
        await watcher.stop()
        if worker.alive():
            await worker.terminate()


# -- released overflow must not cost a request its life (#48, item 6) ------------------------------


def kept_overflow(workers: list[WorkerProcess]) -> WorkerProcess | None:
    """A worker that keeps records it has no room for (it logged so)."""
    for w in workers:
        if w.alive() and "share_intake.overflow_kept" in w.log_path.read_text(errors="replace"):
            return w
    return None


@pytest.mark.full  # `make chaos` runs it: several worker processes, a minute or more
@pytest.mark.chaos
async def test_overflow_hand_offs_do_not_dead_letter_after_one_death(share_broker, tmp_path):
    """36 requests in one producer batch to three workers whose pools hold 2 each: most of the
    batch is overflow wherever it lands. The worker that ends up keeping the overflow is then
    SIGKILLed: one death, under max_deliveries (4). Every request must still be answered: the
    hand-offs of overflow may not have spent their deliveries (before: each hop cost one, the
    batch sat at its 4th delivery, and the death made it a 5th: dead letters)."""
    bootstrap = share_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"share-{uuid.uuid4().hex[:8]}"
    workers = [
        WorkerProcess(
            f"w{i}",
            bootstrap,
            topics,
            tmp_path,
            worker={"name": f"w{i}", "drain_timeout_s": 20},
            kafka={"intake": "share", "group_id": group, "share_lock_ms": LOCK_MS},
            scheduler={"max_num_seqs": 1, "max_waiting": 1},
        )
        for i in range(3)
    ]
    watcher = ReplyWatcher(bootstrap, topics.replies, 2)
    await watcher.start()
    try:
        for w in workers:
            w.spawn()
        await asyncio.gather(*(w.wait_started(600) for w in workers))
        await asyncio.sleep(ASSIGNMENT_S)  # every member assigned (see the test above)
        ids = await submit(
            bootstrap,
            topics.requests,
            [
                make_request(topics.replies, prompt=f"Count: {i}", max_tokens=4, ignore_eos=True)
                for i in range(36)
            ],
        )
        await wait_until(lambda: kept_overflow(workers) is not None, 120, "overflow kept")
        victim = kept_overflow(workers)
        victim.kill()
        dead = lambda: [  # noqa: E731
            (w.name, line)
            for w in workers
            for line in w.log_path.read_text(errors="replace").splitlines()
            if "share_intake.dead_letter" in line
        ]
        await wait_until(lambda: watcher.finished(ids) == len(ids) or dead(), 600, "36 requests")
        assert not dead(), dead()[:3]
        finals = {i: finals_of(watcher.events()[i]) for i in ids}
        assert all(f and f[-1].finish_reason == "length" for f in finals.values()), finals
    finally:
        await watcher.stop()
        for w in workers:
            if w.alive():
                await w.terminate()
