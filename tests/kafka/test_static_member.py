"""A static member (group_instance_id) restarted while its killed predecessor's session lasts.

KIP-848 refuses the instance id until that session expires, with a fatal error that kills
librdkafka's consumer: the worker replaces its consumer until the broker lets it in, and gives
up (exits, for its orchestrator to restart) only past the longest session a broker may keep."""

import asyncio
import signal
import subprocess
import sys
import uuid

import pytest

from inferline.config.settings import Settings
from inferline.worker.app import Worker, WorkerFailed, engine_settings
from inferline.worker.engine.engine import LLMEngine
from inferline.worker.intake import group as group_intake
from tests.kafka_fixtures import wait_until
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
    wait_ready,
    worker_config,
)

pytestmark = pytest.mark.kafka

HOLDER = """
import sys
from confluent_kafka import Consumer
c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": sys.argv[2],
              "group.protocol": "consumer", "group.instance.id": sys.argv[3]})
c.subscribe([sys.argv[4]])
while not c.assignment():
    c.poll(0.1)
print("assigned", flush=True)
while True:
    c.poll(0.1)
"""


def hold_instance_id(bootstrap: str, topics, group: str, instance: str, session_ms: int):
    """A member holding `instance` in `group` (a process: killed, it never says goodbye)."""
    kafka = {"group_id": group, "session_timeout_ms": session_ms}
    group_intake.set_session_timeout(
        Settings(**worker_config(bootstrap, topics, kafka=kafka)).kafka
    )
    argv = [sys.executable, "-c", HOLDER, bootstrap, group, instance, topics.requests]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "assigned"
    return proc


def _restarts(worker) -> float:
    return worker.metrics.consumer_restarts._value.get()


async def test_a_restart_within_the_killed_members_session_takes_its_place(
    kafka_bootstrap, topics, start_worker
):
    group, instance = f"g-{uuid.uuid4().hex[:8]}", "static-0"
    holder = hold_instance_id(kafka_bootstrap, topics, group, instance, 6000)
    kafka = {"group_id": group, "group_instance_id": instance}
    worker = await start_worker(topics, ready=False, kafka=kafka)
    try:
        # Refused for certain: the holder is alive. Killed, its session ends 6 s later.
        await wait_until(lambda: _restarts(worker) >= 1, 60, "the broker to refuse the id")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    await wait_ready(worker, worker.task)
    reqs = [request(topics.replies, max_tokens=3)]
    events = await collect(
        kafka_bootstrap, topics.replies, await submit(kafka_bootstrap, topics.requests, reqs)
    )
    check_attempts(events[reqs[0]["id"]])
    assert final_done(events[reqs[0]["id"]]).finish_reason == "length"


async def test_an_instance_id_held_by_a_live_member_stops_the_worker(
    kafka_bootstrap, topics, model_runner, monkeypatch
):
    # Two workers configured with one group_instance_id: the second exits, naming the refusal,
    # once the longest session a broker may keep has passed (lowered here to the group's 3 s).
    monkeypatch.setattr(group_intake, "BROKER_SESSION_TIMEOUT_MS", 0)
    group, instance = f"g-{uuid.uuid4().hex[:8]}", "static-1"
    holder = hold_instance_id(kafka_bootstrap, topics, group, instance, 3000)
    try:
        kafka = {"group_id": group, "group_instance_id": instance, "session_timeout_ms": 3000}
        settings = Settings(**worker_config(kafka_bootstrap, topics, kafka=kafka))
        worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
        with pytest.raises(WorkerFailed, match="instance ID is still used"):
            await asyncio.wait_for(worker.run(), 60)
        assert _restarts(worker) >= 2
    finally:
        holder.kill()
        holder.wait()
