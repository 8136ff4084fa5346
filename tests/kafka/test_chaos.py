"""Chaos: requests flow while the worker is SIGKILLed at random points and restarted, the broker is
restarted, and a second worker joins and leaves. The long form adds a SIGKILL between a `done`'s
send and its commit (the worker's test hook, INFERLINE_FAULT_KILL_BEFORE_COMMIT), a restart after
cancels were sent while no worker ran, a poisoned reply topic (under the prefix, refusing every
write) named by requests interleaved with honest ones, and a reply topic deleted mid-stream. At the
end every request has exactly one final `done` that is not `requeued` (read with read_committed),
or, for the deleted reply topic, that or its record on the dead-letter topic; every poisoned request
is dead-lettered, no honest one; none is lost. Prints (and writes
to bench/results/chaos-<form>.json) a report: requests, kills, broker restarts, lost, duplicated
final results, dead letters by reason, attempts per request, latency.

Runs on a private broker (scripts/kafka.sh with INFERLINE_KAFKA_PORT/INFERLINE_KAFKA_DIR), so
restarting it disturbs no other test. Short form in `make test`; the long form (>= 200 requests,
several kills, a joining and leaving worker) with `--chaos-long` (`make chaos`).
INFERLINE_CHAOS_SEED replays a run's random kill points.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from aiokafka.admin import AIOKafkaAdminClient

from inferline.contract.schema import DoneEvent, StartedEvent
from tests.chaos_fixtures import (
    ReplyWatcher,
    WorkerProcess,
    percentile,
    private_topics,
    running_private_broker,
)
from tests.kafka_fixtures import consume_until, create_named_topics
from tests.worker_fixtures import Topics, cancel, check_attempts, submit
from tests.worker_fixtures import request as make_request

# make chaos and make test-full (the suite's budget): make test keeps a broker's SIGKILL under
# streams (test_replication.py), a paused broker (test_delivery_pause.py) and a worker's kill -9.
pytestmark = [pytest.mark.chaos, pytest.mark.kafka, pytest.mark.slow, pytest.mark.full]

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = (2, 8)  # each request's max_tokens is drawn from this range: finishes spread out
PARTITIONS = 4

# Each wave: how many requests, then what happens while they run.
SHORT = [(15, ["kill"]), (15, ["broker_restart"])]
LONG = [
    (42, ["kill"]),
    (42, ["join_b", "kill"]),
    (42, ["broker_restart"]),
    (42, ["leave_b", "kill"]),
    (42, ["kill"]),
    (30, ["kill_before_commit"]),
    (30, ["cancel_while_down"]),
    (20, ["poisoned_reply_topic", "kill"]),
    (20, ["delete_reply_topic"]),
]


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory):
    yield from running_private_broker(tmp_path_factory.mktemp("kafka-chaos"))


async def make_topics(bootstrap: str) -> Topics:
    return await private_topics(bootstrap, "chaos", PARTITIONS, PARTITIONS)


async def submit_wave(
    bootstrap: str,
    topics: Topics,
    n: int,
    rng: random.Random,
    submitted: dict,
    expected: dict,
    reply_topic: str | None = None,
) -> list[str]:
    reqs = [
        make_request(
            reply_topic or topics.replies,
            prompt=f"Count: {rng.randrange(1000)}",
            max_tokens=rng.randint(*MAX_TOKENS),
            ignore_eos=True,
        )
        for _ in range(n)
    ]
    expected.update({r["id"]: r["max_tokens"] for r in reqs})
    for attempt in range(5):  # the broker may be coming back
        try:
            ids = await submit(bootstrap, topics.requests, reqs)
            break
        except Exception:  # noqa: BLE001 - retried, then raised
            if attempt == 4:
                raise
            await asyncio.sleep(2.0)
    now = time.time()
    submitted.update({i: now for i in ids})
    return ids


async def wait_random_point(
    watcher: ReplyWatcher, ids: list[str], rng: random.Random, timeout: float = 120.0
) -> None:
    """A random point in a wave's life: after a random number of its requests have started, a
    random moment later (so some are running, some finishing, some waiting, some finished)."""
    k = rng.randint(1, len(ids))
    deadline = time.monotonic() + timeout
    while watcher.started(ids) < k and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(rng.uniform(0.0, 0.5))


def scaling_steps(timeline: list[tuple[float, str]], events: dict[str, list]) -> list[dict]:
    """What each join or leave of worker b threw away: of the requests running when it happened
    (started, no final yet), how many were ended `requeued` before the next action. A lower
    bound: a kill soon after the step ends the window, and a killed worker sends no `requeued`
    (bench/scaling_step.py measures a step alone)."""
    out = []
    for k, (at, action) in enumerate(timeline):
        if action not in ("join_b", "leave_b"):
            continue
        until = timeline[k + 1][0] if k + 1 < len(timeline) else float("inf")
        running = requeued = 0
        for evs in events.values():
            started = any(isinstance(ev, StartedEvent) and ts <= at for ts, ev in evs)
            ended = any(isinstance(ev, DoneEvent) and ts <= at for ts, ev in evs)
            if not started or ended:
                continue
            running += 1
            requeued += any(
                isinstance(ev, DoneEvent) and ev.finish_reason == "requeued" and at < ts <= until
                for ts, ev in evs
            )
        out.append(
            {
                "step": action,
                "running": running,
                "requeued_before_next_action": requeued,
                "requeued_share": round(requeued / running, 2) if running else None,
            }
        )
    return out


def analyse(
    ids: list[str],
    submitted: dict[str, float],
    expected: dict[str, int | str],
    events: dict[str, list],
    dead: dict[str, str],
) -> dict:
    """`expected`: id -> its max_tokens (it must end with `length` and that many tokens) or a
    finish reason; `dead`: id -> the reason it is on the dead-letter topic (requests whose reply
    topic was deleted may end there instead)."""
    attempts, finals, latencies, lost, dup, conflicting, bad = Counter(), 0, [], [], [], [], []
    dup_details = []
    for i in ids:
        evs = [ev for _, ev in events.get(i, [])]
        check_attempts(evs, allow_cut=True)
        finals_i = [
            (ts, ev)
            for ts, ev in events.get(i, [])
            if isinstance(ev, DoneEvent) and ev.finish_reason != "requeued"
        ]
        attempts[len({ev.attempt for ev in evs})] += 1
        if not finals_i:
            if i not in dead:
                lost.append(i)
            continue
        finals += 1
        if len(finals_i) > 1:
            dup.append(i)
            workers = {ev.attempt: ev.worker for _, ev in events[i] if isinstance(ev, StartedEvent)}
            dup_details.append(
                {
                    "id": i,
                    "finals": [
                        (round(ts, 2), workers.get(ev.attempt), ev.finish_reason)
                        for ts, ev in finals_i
                    ],
                }
            )
            if (
                len({(ev.finish_reason, ev.text, ev.usage.completion_tokens) for _, ev in finals_i})
                > 1
            ):
                conflicting.append(i)
        ts, first = finals_i[0]
        want = expected[i]
        if (
            first.finish_reason != want
            if isinstance(want, str)
            else first.finish_reason != "length" or first.usage.completion_tokens != want
        ):
            bad.append((i, first.finish_reason, first.error))
        latencies.append(max(0.0, ts - submitted[i]))
    return {
        "requests": len(ids),
        "final": finals,
        "lost": len(lost),
        "lost_ids": lost[:10],
        "dead_letters": len(dead),
        "dead_letter_reasons": dict(Counter(_reason(r) for r in dead.values())),
        "duplicated_final_results": len(dup),
        "duplicates": dup_details[:5],
        "conflicting_final_results": len(conflicting),
        "not_length": bad[:10],
        "attempts_per_request": dict(sorted(attempts.items())),
        "latency_p50_s": round(percentile(latencies, 50), 2) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 99), 2) if latencies else None,
        "latency_max_s": round(max(latencies), 2) if latencies else None,
    }


def _reason(error: str) -> str:
    """A dead letter's reason without the topic name (to count them by kind)."""
    return error.split(" to ")[0].split(" '")[0]


async def dead_letters(bootstrap: str, dlq: str) -> dict[str, str]:
    """request id (the record key) -> the `error` header, for every record on the dead-letter
    topic."""
    records = await consume_until(bootstrap, dlq, timeout=30)
    return {r.key.decode(): dict(r.headers).get("error", b"").decode() for r in records if r.key}


async def fault_kill(a: WorkerProcess, rng: random.Random, stats: dict) -> None:
    """Restart worker a with the hook that SIGKILLs it between a transaction's send and its
    commit, wait for that, then restart it plainly."""
    a.kill()
    a.spawn(env_extra={"INFERLINE_FAULT_KILL_BEFORE_COMMIT": str(rng.randint(1, 3))})
    await a.wait_started()
    try:
        await asyncio.wait_for(asyncio.to_thread(a.proc.wait), 120)
    except asyncio.TimeoutError:  # fewer transactions than the hook waited for: a plain kill
        a.kill()
    if "commit.fault_kill_before_commit" in a.log_path.read_text(errors="replace"):
        stats["kills_before_commit"] += 1
    stats["kills"] += 1
    a.spawn()
    await a.wait_started()


def done_before(logs, ids: set[str], when: float) -> set[str]:
    """Of ids, those whose `done` a worker queued before `when` (its JSON log says so)."""
    from datetime import datetime

    out = set()
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            if '"request.done"' not in line:
                continue
            entry = json.loads(line)
            if (
                entry.get("request_id") in ids
                and datetime.fromisoformat(entry["timestamp"]).timestamp() < when
            ):
                out.add(entry["request_id"])
    return out


def worker_logs(*workers: WorkerProcess) -> set[Path]:
    return {path for w in workers for path in w.log_dir.glob(f"{w.name}-*.log")}


async def delete_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def create_poisoned_topic(bootstrap: str, topic: str) -> None:
    """A topic under the reply prefix that refuses every write, as a hostile producer may create."""
    from aiokafka.admin import NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "1"})])
    finally:
        await admin.close()


async def test_chaos_kills_broker_restart_and_rebalance(private_broker, tmp_path, request):
    long = request.config.getoption("--chaos-long")
    plan = LONG if long else SHORT
    seed = int(os.environ.get("INFERLINE_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    bootstrap = private_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"chaos-{uuid.uuid4().hex[:8]}"
    common = {
        "kafka": {"group_id": group, "session_timeout_ms": 6000},
        "scheduler": {"max_num_seqs": 16, "max_waiting": 32},
        "model": {"max_model_len": 256},
        "worker": {"drain_timeout_s": 15},
    }
    a = WorkerProcess(
        "a",
        bootstrap,
        topics,
        tmp_path,
        **{**common, "kafka": {**common["kafka"], "group_instance_id": f"{group}-a"}},
    )
    b = WorkerProcess(
        "b", bootstrap, topics, tmp_path, **common
    )  # dynamic member: leaving rebalances
    watcher = ReplyWatcher(bootstrap, topics.replies, PARTITIONS)
    stats = {
        "kills": 0,
        "kills_before_commit": 0,
        "broker_restarts": 0,
        "b_joined": 0,
        "b_left": 0,
        "broker_restart_s": [],
        "cancelled_while_down": 0,
        "reply_topic_deleted": 0,
        "poisoned_requests": 0,
    }
    poisoned_ids: set[str] = set()
    doomed = f"{topics.replies}-doomed"  # a reply topic deleted mid-stream
    await create_named_topics({doomed: PARTITIONS}, bootstrap_servers=bootstrap)
    doomed_watcher = ReplyWatcher(bootstrap, doomed, PARTITIONS)
    doomed_ids: set[str] = set()
    deleted_at = 0.0
    submitted: dict[str, float] = {}
    expected: dict[str, int] = {}  # id -> max_tokens
    timeline: list[tuple[float, str]] = []  # (unix time, what happened), for the report
    ids: list[str] = []
    t0 = time.monotonic()
    await watcher.start()
    await doomed_watcher.start()
    a.spawn()
    try:
        await a.wait_started()
        for n, actions in plan:
            if actions == [
                "cancel_while_down"
            ]:  # no worker runs while the wave and its cancels are sent
                assert await a.terminate() == 0, "worker a did not drain cleanly"
            reply_topic = doomed if actions == ["delete_reply_topic"] else None
            if "poisoned_reply_topic" in actions:  # poisoned requests ahead of the honest wave
                poisoned = f"{topics.replies}-poisoned"
                await create_poisoned_topic(bootstrap, poisoned)
                bad = await submit_wave(bootstrap, topics, n, rng, submitted, expected, poisoned)
                poisoned_ids |= set(bad)
                ids += bad
                stats["poisoned_requests"] += n
                timeline.append((round(time.time(), 2), "poisoned_reply_topic"))
            wave = await submit_wave(bootstrap, topics, n, rng, submitted, expected, reply_topic)
            ids += wave
            for action in actions:
                if action == "poisoned_reply_topic":
                    continue
                if action == "cancel_while_down":
                    for i in wave[::2]:
                        await cancel(bootstrap, topics.cancel, i)
                        expected[i] = "cancelled"
                    stats["cancelled_while_down"] += len(wave[::2])
                    timeline.append((round(time.time(), 2), action))
                    a.spawn()
                    await a.wait_started()
                    continue
                await wait_random_point(doomed_watcher if reply_topic else watcher, wave, rng)
                timeline.append((round(time.time(), 2), action))
                if action == "kill_before_commit":
                    await fault_kill(a, rng, stats)
                elif action == "delete_reply_topic":
                    await delete_topic(bootstrap, doomed)
                    stats["reply_topic_deleted"] += 1
                    doomed_ids, deleted_at = set(wave), time.time()
                elif action == "kill":
                    a.kill()
                    stats["kills"] += 1
                    a.spawn()
                    await a.wait_started()
                elif action == "broker_restart":
                    stats["broker_restart_s"].append(
                        round(await asyncio.to_thread(private_broker.restart), 1)
                    )
                    stats["broker_restarts"] += 1
                elif action == "join_b":
                    b.spawn()
                    await b.wait_started()
                    stats["b_joined"] += 1
                elif action == "leave_b":
                    assert await b.terminate() == 0, "worker b did not drain cleanly"
                    stats["b_left"] += 1
        deadline = time.monotonic() + (480 if long else 240)
        dead: dict[str, str] = {}
        while time.monotonic() < deadline:
            assert a.alive(), f"worker a died: {a.log_path.read_text()[-3000:]}"
            seen = {
                i
                for i, evs in {**doomed_watcher.events(), **watcher.events()}.items()
                if any(
                    isinstance(ev, DoneEvent) and ev.finish_reason != "requeued" for _, ev in evs
                )
            }
            if stats["reply_topic_deleted"] or poisoned_ids:
                dead = await dead_letters(bootstrap, topics.dlq)
                seen |= done_before(worker_logs(a, b), doomed_ids - seen - set(dead), deleted_at)
            if len(seen | set(dead)) >= len(ids):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # late duplicates, if any, arrive now
        rc = await a.terminate()
        rc_b = await b.terminate() if b.alive() else 0
        dead = await dead_letters(bootstrap, topics.dlq)
    finally:
        for w in (a, b):
            if w.alive():
                w.proc.kill()
                w.proc.wait()
        await watcher.stop()
        await doomed_watcher.stop()
    events = {**doomed_watcher.events(), **watcher.events()}
    # A doomed request neither read nor dead-lettered: its `done` was committed just before the
    # topic went, unread by the watcher, if a worker queued it before the deletion (a done queued
    # after it can only fail and be dead-lettered).
    unread = (
        doomed_ids
        - set(dead)
        - {
            i
            for i in doomed_ids
            if any(
                isinstance(ev, DoneEvent) and ev.finish_reason != "requeued"
                for _, ev in events.get(i, [])
            )
        }
    )
    answered_unread = done_before(worker_logs(a, b), unread, deleted_at)
    dead.update(
        {i: "done committed before the topic was deleted, not read" for i in answered_unread}
    )
    report = {
        "form": "long" if long else "short",
        "seed": seed,
        **stats,
        **analyse(ids, submitted, expected, events, dead),
        "timeline": timeline,
        "scaling_steps": scaling_steps(timeline, events),
        "poisoned_dead_lettered": len(poisoned_ids & set(dead)),
        "honest_dead_lettered": len(set(dead) - doomed_ids - poisoned_ids),
        "wall_s": round(time.monotonic() - t0, 1),
        "max_tokens": list(MAX_TOKENS),
    }
    print("\nchaos report: " + json.dumps(report))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"chaos-{report['form']}.json").write_text(json.dumps(report, indent=2))
    assert report["lost"] == 0, report
    assert report["conflicting_final_results"] == 0, report
    # A final `done` and its offset commit in one transaction (worker/delivery/transactions.py):
    # a SIGKILL at any point leaves both or neither, so read_committed sees one final result per
    # request.
    assert report["duplicated_final_results"] == 0, report
    assert not report["not_length"], report
    assert rc == 0 and rc_b == 0
    assert stats["kills"] >= (4 if long else 1) and stats["broker_restarts"] >= 1
    assert report["honest_dead_lettered"] == 0, (
        "dead letters of requests whose reply topic was fine"
    )
    assert poisoned_ids <= set(dead), "a poisoned request was not dead-lettered"
    if long:
        assert stats["kills_before_commit"] >= 1, "the hook never fired: the window was not hit"
