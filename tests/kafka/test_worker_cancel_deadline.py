"""Cancels (running, waiting, before arrival) and deadlines (running, waiting, already past)."""

import asyncio
import time

import pytest

from inferline.contract.schema import StartedEvent, TokensEvent, decode_event
from tests.kafka_fixtures import consume_until, wait_until
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    cancel,
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    topics,
)

pytestmark = pytest.mark.kafka
ONE_AT_A_TIME = {"scheduler": {"max_num_seqs": 1}}


async def first_tokens(bootstrap, topic, request_id, timeout=60):
    def seen(records):
        return any(
            r.key == request_id.encode() and isinstance(decode_event(r.value), TokensEvent)
            for r in records
        )

    await consume_until(bootstrap, topic, seen, timeout=timeout)


async def test_cancel_running_waiting_and_early(kafka_bootstrap, topics, start_worker):
    worker = await start_worker(topics, **ONE_AT_A_TIME)
    early = request(topics.replies)
    await cancel(kafka_bootstrap, topics.cancel, early["id"])
    running = request(topics.replies, max_tokens=60, ignore_eos=True)
    waiting = request(topics.replies, max_tokens=8)
    await submit(kafka_bootstrap, topics.requests, [running])
    await first_tokens(kafka_bootstrap, topics.replies, running["id"])
    await submit(kafka_bootstrap, topics.requests, [waiting])
    await asyncio.sleep(0.5)  # read and queued behind `running`
    for r in (waiting, running):  # the waiting one first: cancelling `running` first lets it start
        await cancel(kafka_bootstrap, topics.cancel, r["id"])
    await submit(kafka_bootstrap, topics.requests, [early])
    events = await collect(
        kafka_bootstrap, topics.replies, [running["id"], waiting["id"], early["id"]]
    )

    for r in (running, waiting, early):
        check_attempts(events[r["id"]])
        done = final_done(events[r["id"]])
        assert done.finish_reason == "cancelled" and done.error.code == "cancelled"
    run_events = events[running["id"]]
    assert isinstance(run_events[0], StartedEvent)
    assert 0 < final_done(run_events).usage.completion_tokens < 60
    assert len(events[waiting["id"]]) == 1 and len(events[early["id"]]) == 1  # never started
    assert worker.metrics.cancels._value.get() == 3
    # A done is readable once its transaction commits; the job leaves a moment later.
    await wait_until(lambda: not worker.jobs, 30, "every job to leave the worker")


async def test_deadlines_while_running_waiting_and_on_arrival(
    kafka_bootstrap, topics, start_worker
):
    await start_worker(topics, **ONE_AT_A_TIME)
    running = request(topics.replies, max_tokens=400, ignore_eos=True, timeout_s=6.0)
    waiting = request(topics.replies, max_tokens=8, timeout_s=1.0)
    stale = request(topics.replies, created_at=time.time() - 100, timeout_s=10.0)
    await submit(kafka_bootstrap, topics.requests, [running])
    await first_tokens(kafka_bootstrap, topics.replies, running["id"])
    await submit(kafka_bootstrap, topics.requests, [waiting, stale])
    events = await collect(
        kafka_bootstrap, topics.replies, [running["id"], waiting["id"], stale["id"]]
    )

    for r in (running, waiting, stale):
        check_attempts(events[r["id"]])
        done = final_done(events[r["id"]])
        assert done.finish_reason == "timeout" and done.error.code == "timeout", done
    assert isinstance(events[running["id"]][0], StartedEvent)
    assert (
        0 < final_done(events[running["id"]]).usage.completion_tokens < 400
    )  # ended by the deadline
    assert len(events[waiting["id"]]) == 1 and len(events[stale["id"]]) == 1
    assert final_done(events[waiting["id"]]).timing.total_s >= 1.0

    after = request(topics.replies)  # the blocks were freed: the next request runs
    await submit(kafka_bootstrap, topics.requests, [after])
    events = await collect(kafka_bootstrap, topics.replies, [after["id"]])
    assert final_done(events[after["id"]]).finish_reason in ("stop", "length")


async def test_a_cancel_sent_before_the_worker_started_still_counts(
    kafka_bootstrap, topics, start_worker
):
    """The request and its cancel both wait in Kafka while no worker runs: the worker that starts
    reads the cancel topic back (kafka.cancel_lookback_s) and never runs the request."""
    req = request(topics.replies, max_tokens=50, ignore_eos=True)
    await submit(kafka_bootstrap, topics.requests, [req])
    await cancel(kafka_bootstrap, topics.cancel, req["id"])
    await start_worker(topics)
    done = final_done(
        (await collect(kafka_bootstrap, topics.replies, [req["id"]], timeout=60))[req["id"]]
    )
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 0
