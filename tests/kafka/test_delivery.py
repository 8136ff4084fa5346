"""A worker whose engine thread dies hands its requests to the next worker in the group, on the
real broker. The offline delivery rules: tests/unit/test_delivery.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from inferline.config.settings import Settings
from tests.worker_fixtures import topics  # noqa: F401 - a fixture


@pytest.mark.kafka
async def test_a_worker_whose_engine_dies_hands_its_requests_to_the_next(
    kafka_bootstrap, topics, model_runner
):
    """The engine thread dies mid-request: the worker publishes `requeued`, fails readiness, stops
    with EngineDied without committing the offset; a new worker in the group then finishes it."""
    from tests.worker_fixtures import (
        collect,
        final_done,
        request,
        submit,
        wait_ready,
        worker_config,
    )
    from inferline.worker.app import EngineDied, Worker, engine_settings
    from inferline.worker.engine.engine import LLMEngine

    settings = Settings(**worker_config(kafka_bootstrap, topics))

    async def run_worker():
        worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
        task = asyncio.create_task(worker.run())
        await wait_ready(worker, task)
        return worker, task

    worker, task = await run_worker()
    req = request(topics.replies, max_tokens=200, ignore_eos=True)
    await submit(kafka_bootstrap, topics.requests, [req])
    deadline = time.monotonic() + 60
    while not any(j.state == "running" for j in worker.jobs.values()):
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.05)
    worker.engine_loop._inbox.put(("poison",))  # a command the loop cannot apply: it dies
    with pytest.raises(EngineDied):
        await asyncio.wait_for(task, 60)
    assert worker.readiness()["engine_alive"] is False

    worker, task = await run_worker()  # the same group: the offset was not committed
    try:
        events = await collect(kafka_bootstrap, topics.replies, [req["id"]], timeout=240)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    reasons = [e.finish_reason for e in events[req["id"]] if e.type == "done"]
    assert reasons[0] == "requeued" and final_done(events[req["id"]]).finish_reason == "length"
