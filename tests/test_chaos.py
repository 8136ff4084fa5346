"""Chaos: requests flow while the worker is SIGKILLed at random points and restarted, the broker is
restarted, and a second worker joins and leaves. At the end every request has a final `done` that
is not `requeued`; none is lost. Prints (and writes to bench/results/chaos-<form>.json) a report:
requests, kills, broker restarts, lost, duplicated final results, attempts per request, latency.

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

from producer.schema import DoneEvent, StartedEvent
from tests.chaos_fixtures import PrivateBroker, ReplyWatcher, WorkerProcess, percentile
from tests.kafka_fixtures import create_named_topics
from tests.worker_fixtures import Topics, check_attempts, submit
from tests.worker_fixtures import request as make_request

pytestmark = [pytest.mark.chaos, pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = (2, 8)  # each request's max_tokens is drawn from this range: finishes spread out
PARTITIONS = 4

# Each wave: how many requests, then what happens while they run.
SHORT = [(15, ["kill"]), (15, ["broker_restart"])]
LONG = [(42, ["kill"]), (42, ["join_b", "kill"]), (42, ["broker_restart"]), (42, ["leave_b", "kill"]),
        (42, ["kill"])]


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory):
    broker = PrivateBroker(tmp_path_factory.mktemp("kafka-chaos"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def make_topics(bootstrap: str) -> Topics:
    stem = uuid.uuid4().hex[:8]
    topics = Topics(requests=f"chaos-req-{stem}", cancel=f"chaos-cancel-{stem}", dlq=f"chaos-dlq-{stem}",
                    replies=f"inferline.reply.chaos-{stem}")
    await create_named_topics({topics.requests: PARTITIONS, topics.cancel: 1, topics.dlq: 1,
                               topics.replies: PARTITIONS}, bootstrap_servers=bootstrap)
    return topics


async def submit_wave(bootstrap: str, topics: Topics, n: int, rng: random.Random, submitted: dict,
                      expected: dict) -> list[str]:
    reqs = [make_request(topics.replies, prompt=f"Count: {rng.randrange(1000)}",
                         max_tokens=rng.randint(*MAX_TOKENS), ignore_eos=True) for _ in range(n)]
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


async def wait_random_point(watcher: ReplyWatcher, ids: list[str], rng: random.Random,
                            timeout: float = 120.0) -> None:
    """A random point in a wave's life: after a random number of its requests have started, a
    random moment later (so some are running, some finishing, some waiting, some finished)."""
    k = rng.randint(1, len(ids))
    deadline = time.monotonic() + timeout
    while watcher.started(ids) < k and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(rng.uniform(0.0, 0.5))


def analyse(ids: list[str], submitted: dict[str, float], expected: dict[str, int], events: dict[str, list]) -> dict:
    attempts, finals, latencies, lost, dup, conflicting, bad = Counter(), 0, [], [], [], [], []
    dup_details = []
    for i in ids:
        evs = [ev for _, ev in events.get(i, [])]
        check_attempts(evs, allow_cut=True)
        finals_i = [(ts, ev) for ts, ev in events.get(i, [])
                    if isinstance(ev, DoneEvent) and ev.finish_reason != "requeued"]
        attempts[len({ev.attempt for ev in evs})] += 1
        if not finals_i:
            lost.append(i)
            continue
        finals += 1
        if len(finals_i) > 1:
            dup.append(i)
            workers = {ev.attempt: ev.worker for _, ev in events[i] if isinstance(ev, StartedEvent)}
            dup_details.append({"id": i, "finals": [(round(ts, 2), workers.get(ev.attempt), ev.finish_reason)
                                                    for ts, ev in finals_i]})
            if len({(ev.finish_reason, ev.text, ev.usage.completion_tokens) for _, ev in finals_i}) > 1:
                conflicting.append(i)
        ts, first = finals_i[0]
        if first.finish_reason != "length" or first.usage.completion_tokens != expected[i]:
            bad.append((i, first.finish_reason, first.error))
        latencies.append(max(0.0, ts - submitted[i]))
    return {
        "requests": len(ids), "final": finals, "lost": len(lost), "lost_ids": lost[:10],
        "duplicated_final_results": len(dup), "duplicates": dup_details[:5],
        "conflicting_final_results": len(conflicting),
        "not_length": bad[:10], "attempts_per_request": dict(sorted(attempts.items())),
        "latency_p50_s": round(percentile(latencies, 50), 2) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 99), 2) if latencies else None,
        "latency_max_s": round(max(latencies), 2) if latencies else None,
    }


async def test_chaos_kills_broker_restart_and_rebalance(private_broker, tmp_path, request):
    long = request.config.getoption("--chaos-long")
    plan = LONG if long else SHORT
    seed = int(os.environ.get("INFERLINE_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    bootstrap = private_broker.bootstrap
    topics = await make_topics(bootstrap)
    group = f"chaos-{uuid.uuid4().hex[:8]}"
    common = {"kafka": {"group_id": group, "session_timeout_ms": 6000},
              "scheduler": {"max_num_seqs": 16, "max_waiting": 32}, "model": {"max_model_len": 256},
              "worker": {"drain_timeout_s": 15}}
    a = WorkerProcess("a", bootstrap, topics, tmp_path,
                      **{**common, "kafka": {**common["kafka"], "group_instance_id": f"{group}-a"}})
    b = WorkerProcess("b", bootstrap, topics, tmp_path, **common)  # dynamic member: leaving rebalances
    watcher = ReplyWatcher(bootstrap, topics.replies, PARTITIONS)
    stats = {"kills": 0, "broker_restarts": 0, "b_joined": 0, "b_left": 0, "broker_restart_s": []}
    submitted: dict[str, float] = {}
    expected: dict[str, int] = {}  # id -> max_tokens
    timeline: list[tuple[float, str]] = []  # (unix time, what happened), for the report
    ids: list[str] = []
    t0 = time.monotonic()
    await watcher.start()
    a.spawn()
    try:
        await a.wait_started()
        for n, actions in plan:
            wave = await submit_wave(bootstrap, topics, n, rng, submitted, expected)
            ids += wave
            for action in actions:
                await wait_random_point(watcher, wave, rng)
                timeline.append((round(time.time(), 2), action))
                if action == "kill":
                    a.kill()
                    stats["kills"] += 1
                    a.spawn()
                    await a.wait_started()
                elif action == "broker_restart":
                    stats["broker_restart_s"].append(round(await asyncio.to_thread(private_broker.restart), 1))
                    stats["broker_restarts"] += 1
                elif action == "join_b":
                    b.spawn()
                    await b.wait_started()
                    stats["b_joined"] += 1
                elif action == "leave_b":
                    assert await b.terminate() == 0, "worker b did not drain cleanly"
                    stats["b_left"] += 1
        deadline = time.monotonic() + (480 if long else 240)
        while watcher.finished(ids) < len(ids) and time.monotonic() < deadline:
            assert a.alive(), f"worker a died: {a.log_path.read_text()[-3000:]}"
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # late duplicates, if any, arrive now
        rc = await a.terminate()
        rc_b = await b.terminate() if b.alive() else 0
    finally:
        for w in (a, b):
            if w.alive():
                w.proc.kill()
                w.proc.wait()
        await watcher.stop()
    logs = {path for w in (a, b) for path in w.log_dir.glob(f"{w.name}-*.log")}
    stats["redeliveries_skipped"] = sum(p.read_text(errors="replace").count("redelivered_after_done") for p in logs)
    report = {"form": "long" if long else "short", "seed": seed, **stats,
              **analyse(ids, submitted, expected, watcher.events()), "timeline": timeline, "wall_s": round(time.monotonic() - t0, 1),
              "max_tokens": list(MAX_TOKENS)}
    print("\nchaos report: " + json.dumps(report))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"chaos-{report['form']}.json").write_text(json.dumps(report, indent=2))
    assert report["lost"] == 0, report
    assert report["conflicting_final_results"] == 0, report
    # A SIGKILL between a `done`'s ack and its offset commit redelivers a finished request; the
    # next owner finds its final `done` on the reply topic and skips it (worker/redelivery.py).
    assert report["duplicated_final_results"] == 0, report
    assert not report["not_length"], report
    assert rc == 0 and rc_b == 0
    assert stats["kills"] >= (4 if long else 1) and stats["broker_restarts"] >= 1
