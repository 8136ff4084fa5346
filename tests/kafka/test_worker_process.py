"""The worker as a process: kill -9 and restart, SIGTERM drain, a second worker joining.

Each of these loads the model in a subprocess (`python -m inferline.worker`), so they are `slow`."""

import asyncio
import signal
import uuid

import pytest

from inferline.contract.schema import DoneEvent, StartedEvent, TokensEvent, decode_event
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    attempts_of,
    check_attempts,
    collect,
    final_done,
    final_dones,
    request,
    spawn_worker,
    start_worker,
    submit,
    topics,
    wait_log,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def count(records, kind, ids=None) -> int:
    evs = [decode_event(r.value) for r in records]
    return sum(isinstance(e, kind) and (ids is None or e.id in ids) for e in evs)


async def stop(proc, sig=signal.SIGTERM, timeout=90.0) -> int:
    proc.send_signal(sig)
    return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)


async def test_kill_9_mid_run_and_restart_loses_nothing(kafka_bootstrap, topics, tmp_path):
    # Static membership: the restarted worker takes the dead one's place without a rebalance wait.
    cfg = {
        "kafka": {"group_id": f"g-{uuid.uuid4().hex[:8]}", "group_instance_id": "kill-test"},
        "scheduler": {"max_num_seqs": 8},
    }
    log = tmp_path / "worker.log"
    proc = spawn_worker(kafka_bootstrap, topics, log, **cfg)
    try:
        await wait_log(log, "intake.assigned", proc)
        reqs = [
            request(topics.replies, max_tokens=3 if i < 4 else 20, ignore_eos=True)
            for i in range(12)
        ]
        ids = await submit(kafka_bootstrap, topics.requests, reqs)
        long_ids = set(ids[4:])
        await consume_until(
            kafka_bootstrap,
            topics.replies,
            timeout=120,
            predicate=lambda rs: (
                count(rs, DoneEvent) >= 2 and count(rs, TokensEvent, long_ids) >= 2
            ),
        )
    finally:
        proc.kill()
        proc.wait()
    # Restarted at once: within the killed member's session (6 s) the broker refuses its instance
    # id, and the worker replaces its consumer until the session ends (test_static_member.py).
    proc = spawn_worker(kafka_bootstrap, topics, log, **cfg)
    try:
        events = await collect(kafka_bootstrap, topics.replies, ids, timeout=240)
        assert await stop(proc) == 0
    finally:
        proc.kill()
    cut = 0
    for i in ids:
        check_attempts(events[i], allow_cut=True)
        done = final_done(events[i])
        assert done.finish_reason == "length" and done.usage.completion_tokens == (
            3 if i not in long_ids else 20
        )
        check_attempts([e for e in events[i] if e.attempt == done.attempt])
        cut += len(attempts_of(events[i])) > len(final_dones(events[i]))
    assert cut >= 1  # some request was cut by the kill and ran again under a new attempt


async def test_sigterm_drains_running_requeues_waiting_and_commits(
    kafka_bootstrap, topics, tmp_path, start_worker
):
    group = f"g-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "worker.log"
    # Paced steps and every admission logged: SIGTERM comes once all 6 are in the worker and 2
    # run, whatever the machine's speed (the records may reach the worker in several fetches).
    proc = spawn_worker(
        kafka_bootstrap,
        topics,
        log,
        {"INFERLINE_FAULT_STEP_DELAY_S": "0.2"},
        kafka={"group_id": group},
        scheduler={"max_num_seqs": 2},
        worker={"drain_timeout_s": 60},
        log={"level": "DEBUG"},
    )
    try:
        await wait_log(log, "intake.assigned", proc)
        ids = await submit(
            kafka_bootstrap,
            topics.requests,
            [request(topics.replies, max_tokens=10, ignore_eos=True) for _ in range(6)],
        )
        records = await consume_until(
            kafka_bootstrap,
            topics.replies,
            timeout=120,
            predicate=lambda rs: count(rs, StartedEvent) >= 2,
        )
        while log.read_text().count('"request.admitted"') < 6:
            assert proc.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.05)
        assert await stop(proc) == 0
    finally:
        proc.kill()
    assert "worker.stopped" in log.read_text()
    first = {
        decode_event(r.value).id for r in records if isinstance(decode_event(r.value), StartedEvent)
    }

    await start_worker(topics, kafka={"group_id": group})  # picks up what was requeued
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=180)
    for i in ids:
        check_attempts(events[i])
        assert len(final_dones(events[i])) == 1 and final_done(events[i]).finish_reason == "length"
        if i in first:  # was running at SIGTERM: finished in the drain, committed, never rerun
            assert len(attempts_of(events[i])) == 1
    requeued = [
        e
        for i in ids
        for e in events[i]
        if isinstance(e, DoneEvent) and e.finish_reason == "requeued"
    ]
    assert requeued and all(e.error is None for e in requeued)


async def test_second_worker_joining_mid_run(kafka_bootstrap, topics, tmp_path, start_worker):
    group = f"g-{uuid.uuid4().hex[:8]}"
    worker = await start_worker(topics, kafka={"group_id": group}, scheduler={"max_num_seqs": 4})
    log = tmp_path / "worker-b.log"
    proc = spawn_worker(
        kafka_bootstrap, topics, log, kafka={"group_id": group}, scheduler={"max_num_seqs": 4}
    )
    try:
        await wait_log(log, "model ready", proc)  # B joins the group right after this
        ids = await submit(
            kafka_bootstrap,
            topics.requests,
            [request(topics.replies, max_tokens=12, ignore_eos=True) for _ in range(12)],
        )
        await wait_log(log, "intake.assigned", proc)
        # A may finish the first 12 before the rebalance ends (then B finds nothing left on its
        # partition): 12 more sent now land on both partitions, so B must serve some of them.
        ids += await submit(
            kafka_bootstrap,
            topics.requests,
            [request(topics.replies, max_tokens=12, ignore_eos=True) for _ in range(12)],
        )
        events = await collect(kafka_bootstrap, topics.replies, ids, timeout=240)
        assert await stop(proc) == 0
    finally:
        proc.kill()
    for i in ids:
        check_attempts(events[i])
        assert len(final_dones(events[i])) == 1 and final_done(events[i]).finish_reason == "length"
    workers = {e.worker for i in ids for e in events[i] if isinstance(e, StartedEvent)}
    print("workers:", workers, "requeued:", worker.metrics.requests.labels("requeued")._value.get())
    assert len(workers) == 2  # both served


async def test_a_stop_during_model_load_never_joins_the_group(
    kafka_bootstrap, topics, model_runner, monkeypatch
):
    """SIGTERM while the model loads: the worker exits once the load ends, without joining the
    group (a join and an immediate leave would only make every other worker rebalance)."""
    import threading

    import inferline.worker.app as app
    from inferline.config.settings import Settings
    from tests.worker_fixtures import worker_config
    from inferline.worker.engine.engine import LLMEngine

    loading, release = threading.Event(), threading.Event()

    def slow_build(settings):
        assert threading.current_thread().name == "inferline-engine"  # loaded where it will run
        loading.set()
        release.wait(30)
        return LLMEngine(model_runner, app.engine_settings(settings))

    monkeypatch.setattr(app, "build_engine", slow_build)
    worker = app.Worker(Settings(**worker_config(kafka_bootstrap, topics)))
    task = asyncio.create_task(worker.run())
    assert await asyncio.to_thread(loading.wait, 30)
    worker.request_stop()
    release.set()
    await asyncio.wait_for(task, 30)
    assert worker.intake._consumer is None and worker.engine_loop is None
    assert not worker.readiness()["in_group"]
