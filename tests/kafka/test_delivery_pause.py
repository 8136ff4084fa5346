"""A broker paused (SIGSTOP) past the transaction timeout and the session timeout while finals are
being committed: when it wakes, it aborts the open transactions (fencing their producers) and
evicts the worker from the group. Every request still ends with exactly one final `done` (read with
read_committed) and nothing is dead-lettered: a passing cause is retried, a fence is resolved with
the group coordinator, work of the lost assignment is given back and run again."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest

from inferline.config.settings import Settings
from tests.chaos_fixtures import private_topics, running_private_broker
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (
    check_attempts,
    collect,
    final_dones,
    request,
    submit,
    wait_ready,
    worker_config,
)
from inferline.worker.app import Worker, engine_settings
from inferline.worker.engine.engine import LLMEngine

pytestmark = [pytest.mark.chaos, pytest.mark.kafka, pytest.mark.slow]
PAUSE_S = 12.0


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory):
    yield from running_private_broker(tmp_path_factory.mktemp("kafka-pause"))


async def test_a_broker_paused_past_the_transaction_timeout_loses_and_dead_letters_nothing(
    private_broker, model_runner
):
    bootstrap = private_broker.bootstrap
    topics = await private_topics(bootstrap, "pause", 2, 2)
    settings = Settings(
        **worker_config(
            bootstrap,
            topics,
            kafka={"group_id": f"pause-{uuid.uuid4().hex[:8]}", "transaction_timeout_ms": 1000},
        )
    )
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    pid = int((private_broker.kdir / "kafka.pid").read_text())
    try:
        await wait_ready(worker, task)
        reqs = [
            request(topics.replies, f"Count to {n}.", max_tokens=12, ignore_eos=True)
            for n in range(10)
        ]
        await submit(bootstrap, topics.requests, reqs)
        while not any(j.state == "running" for j in worker.jobs.values()):
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        events = await collect(bootstrap, topics.replies, [r["id"] for r in reqs], timeout=240)
        dead = await consume_until(
            bootstrap, topics.dlq, timeout=2, raise_on_timeout=False, predicate=lambda rs: bool(rs)
        )
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 90)
    for r in reqs:
        check_attempts(events[r["id"]], allow_cut=True)
        (final,) = final_dones(events[r["id"]])
        assert final.finish_reason == "length" and final.usage.completion_tokens == 12
    assert dead == []


async def test_an_assignment_while_the_broker_is_paused_waits_for_it(
    private_broker, model_runner, monkeypatch
):
    """The broker stops answering (SIGSTOP) just as an assignment reads its committed offsets:
    the read is asked again until the broker is back (its retry, not a lucky timing: the pause
    starts inside the first read), then every request waiting there is answered once."""
    import threading

    import inferline.worker.intake.group as group

    bootstrap = private_broker.bootstrap
    topics = await private_topics(bootstrap, "assign", 2, 2)
    pid = int((private_broker.kdir / "kafka.pid").read_text())
    reqs = [request(topics.replies, f"Say {n}.", max_tokens=4, ignore_eos=True) for n in range(6)]
    await submit(bootstrap, topics.requests, reqs)
    read_committed, reads = group.Intake.committed, []

    def pause_on_first_read(intake, tps):
        reads.append(len(tps))
        if len(reads) == 1:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(5.0, os.kill, (pid, signal.SIGCONT)).start()
        return read_committed(intake, tps)

    monkeypatch.setattr(group.Intake, "committed", pause_on_first_read)
    kafka = {"group_id": f"assign-{uuid.uuid4().hex[:8]}"}
    settings = Settings(**worker_config(bootstrap, topics, kafka=kafka))
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    try:
        await wait_ready(worker, task, timeout=120)
        events = await collect(bootstrap, topics.replies, [r["id"] for r in reqs], timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
        worker.request_stop()
        await asyncio.wait_for(task, 90)
    assert len(reads) >= 2, reads  # the first read failed while paused, a later one succeeded
    for r in reqs:
        (final,) = final_dones(events[r["id"]])
        assert final.finish_reason == "length"
