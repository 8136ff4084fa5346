"""Redelivered requests whose final `done` is already on the reply topic are not run again.

The crash window under test: a worker's `done`s are acked but its offsets are not committed
(killed between the two, a commit lost to a broker restart). The next owner of the partition
reads those requests again; without the redelivery check it runs them again and the client
gets a second final result.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import msgpack
import pytest
from aiokafka import AIOKafkaProducer

from config.settings import Settings
from producer.schema import DoneEvent, TokensEvent, Timing, Usage, encode_event
from tests.worker_fixtures import (  # noqa: F401 - topics is a fixture
    collect, final_done, request, submit, topics, wait_ready, worker_config)
from worker.app import Worker, engine_settings
from worker.engine.engine import LLMEngine
from worker.redelivery import Suspect, final_done_id, reply_partition_of


def _done(rid: str, finish_reason: str) -> bytes:
    return encode_event(DoneEvent(id=rid, attempt="a", seq=3, finish_reason=finish_reason,
                                  usage=Usage(prompt_tokens=1, completion_tokens=2),
                                  timing=Timing(queue_s=0, ttft_s=0, total_s=0), text="x"))


def test_only_a_final_done_counts():
    assert final_done_id(b"r1", _done("r1", "length")) == "r1"
    assert final_done_id(b"r1", _done("r1", "cancelled")) == "r1"
    assert final_done_id(b"r1", _done("r1", "requeued")) is None  # another attempt follows
    tokens = encode_event(TokensEvent(id="r1", attempt="a", seq=1, token_ids=[1], text="done"))
    assert final_done_id(b"r1", tokens) is None  # "done" inside the text is not a done
    assert final_done_id(b"r1", b"\xc1 not msgpack done" + msgpack.packb("done")) is None
    assert final_done_id(b"r1", msgpack.packb(["done"])) is None
    assert final_done_id(None, _done("r1", "length")) is None


async def test_reply_partition_is_the_producers_choice(kafka_bootstrap, new_topic):
    """The check must look where the worker's producer put the events: murmur2 of the id key."""
    topic = await new_topic(7, prefix="reply")
    ids = [f"r-{uuid.uuid4().hex}" for _ in range(60)]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        metas = [await (await producer.send(topic, b"x", key=i.encode())) for i in ids]
    finally:
        await producer.stop()
    parts = list(range(7))
    assert len({m.partition for m in metas}) > 3  # the ids do spread
    for i, meta in zip(ids, metas):
        assert reply_partition_of(Suspect(i, topic, None, 0), parts) == meta.partition
    assert reply_partition_of(Suspect(ids[0], topic, 5, 0), parts) == 5
    # A named partition that does not exist: the publisher falls back to the key.
    assert reply_partition_of(Suspect(ids[0], topic, 99, 0), parts) == metas[0].partition


async def _run_worker(settings: Settings, model_runner) -> tuple[Worker, asyncio.Task]:
    worker = Worker(settings, LLMEngine(model_runner, engine_settings(settings)))
    task = asyncio.create_task(worker.run())
    await wait_ready(worker, task)
    return worker, task


async def _stop(worker: Worker, task: asyncio.Task) -> None:
    worker.request_stop()
    await asyncio.wait_for(task, 60)


async def _never_commit(tps=None) -> bool:
    return True  # as if the worker died after its `done`s were acked, before any commit


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
async def test_a_new_owner_does_not_rerun_what_finished_before_the_crash(kafka_bootstrap, topics, model_runner,
                                                                        check):
    config = worker_config(kafka_bootstrap, topics)
    first = Settings(**config)
    worker_a, task_a = await _run_worker(first, model_runner)
    worker_a.intake.committer.commit = _never_commit
    finished = [request(topics.replies, f"Say the number {n}.", max_tokens=3) for n in range(6)]
    await submit(kafka_bootstrap, topics.requests, finished)
    await collect(kafka_bootstrap, topics.replies, [r["id"] for r in finished], timeout=90)
    await _stop(worker_a, task_a)

    # Sent while no worker ran: below the next owner's boundary too, but never answered.
    unanswered = [request(topics.replies, "Name a colour.", max_tokens=3) for _ in range(2)]
    await submit(kafka_bootstrap, topics.requests, unanswered)
    second = Settings(**{**config, "kafka": {**config["kafka"], "redelivery_check": check}})
    worker_b, task_b = await _run_worker(second, model_runner)
    try:
        ids = [r["id"] for r in finished + unanswered]
        await collect(kafka_bootstrap, topics.replies, ids, timeout=90)
        await _wait_for(lambda: sum(worker_b.tracker.pending(tp) for tp in worker_b.tracker.partitions()) == 0
                        and len(worker_b.jobs) == 0)
        await asyncio.sleep(1.0)  # a duplicate, if any, would be on its way now
        events = await collect(kafka_bootstrap, topics.replies, ids, timeout=30)
        finals = {i: [e for e in events[i] if isinstance(e, DoneEvent) and e.finish_reason != "requeued"]
                  for i in ids}
        metrics = worker_b.metrics.render().decode()
    finally:
        await _stop(worker_b, task_b)

    for r in unanswered:  # no done anywhere: they run, once
        assert len(finals[r["id"]]) == 1
        assert final_done(events[r["id"]]).usage.completion_tokens == 3
    reruns = [r["id"] for r in finished if len(finals[r["id"]]) > 1]
    if check:
        assert reruns == []
        assert worker_b.num_redelivered == len(finished)
        assert f'inferline_redeliveries_total{{outcome="already_done"}} {float(len(finished))}' in metrics
        assert f'inferline_redeliveries_total{{outcome="rerun"}} {float(len(unanswered))}' in metrics
    else:  # the window is real: without the check every finished request runs twice
        assert len(reruns) == len(finished)


async def test_a_half_read_reply_topic_is_read_on(kafka_bootstrap, topics, model_runner):
    """Suspects in several fetched batches: the reply partition is read on from where the
    previous batch stopped, and dones written in between are found."""
    config = worker_config(kafka_bootstrap, topics, scheduler={"max_waiting": 2})
    worker_a, task_a = await _run_worker(Settings(**config), model_runner)
    worker_a.intake.committer.commit = _never_commit
    finished = [request(topics.replies, "Say hello.", max_tokens=2) for _ in range(7)]
    await submit(kafka_bootstrap, topics.requests, finished)
    await collect(kafka_bootstrap, topics.replies, [r["id"] for r in finished], timeout=90)
    await _stop(worker_a, task_a)

    worker_b, task_b = await _run_worker(Settings(**config), model_runner)  # takes 2 per fetch
    try:
        await _wait_for(lambda: worker_b.num_redelivered == len(finished))
        assert len(worker_b.jobs) == 0
    finally:
        await _stop(worker_b, task_b)


async def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)
