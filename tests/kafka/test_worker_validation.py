"""Malformed and invalid requests: dead letters and `rejected` replies; the worker keeps serving."""

import msgpack
import pytest

from inferline.contract.schema import StartedEvent
from tests.kafka_fixtures import consume_until
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    submit,
    submit_raw,
    topics,
)

pytestmark = pytest.mark.kafka


async def test_malformed_messages_are_dead_lettered_or_rejected(
    kafka_bootstrap, topics, start_worker
):
    worker = await start_worker(
        topics, kafka={"max_message_bytes": 16384}, model={"max_model_len": 256}
    )
    r = lambda **kw: request(topics.replies, **kw)  # noqa: E731
    no_id = r()
    del no_id["id"]
    dead = [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb(no_id),
        msgpack.packb(r(id="bad id with spaces")),
        msgpack.packb(r(prompt="x" * 20000)),
    ]
    metas = await submit_raw(kafka_bootstrap, topics.requests, dead, key=b"k")
    rejected = {
        "temperature": r(temperature=-1.0),
        "max_tokens": r(max_tokens="8"),
        "top_p": r(top_p=0.0),
        "prompt": r(prompt=None),
        "messages": r(prompt=None, messages=[{"role": "user"}]),
        "prompt_token_ids": r(prompt=None, prompt_token_ids=list(range(300))),  # over max_model_len
        "metadata": r(metadata={"k": "v" * 5000}),
    }
    # Fits the byte limit but not the model (2048 tokens): the engine says so.
    too_long = r(prompt="hello " * 2100)
    good = r()
    stray = r(reply_partition=7)  # the reply topic has 2 partitions: the reply goes by key instead
    ids = await submit(
        kafka_bootstrap, topics.requests, [*rejected.values(), too_long, good, stray]
    )
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=60)

    for field, req in rejected.items():
        evs = events[req["id"]]
        check_attempts(evs)
        done = final_done(evs)
        assert len(evs) == 1 and done.finish_reason == "rejected", (field, evs)
        assert (
            done.error.code in ("invalid_request", "prompt_too_long")
            and field in done.error.message
        )
    assert final_done(events[too_long["id"]]).error.code == "prompt_too_long"
    assert final_done(events[stray["id"]]).finish_reason in ("stop", "length")
    good_events = events[good["id"]]
    check_attempts(good_events)
    assert isinstance(good_events[0], StartedEvent) and final_done(good_events).finish_reason in (
        "stop",
        "length",
    )

    letters = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= len(dead), timeout=30
    )
    assert [l.value for l in letters] == dead and all(l.key == b"k" for l in letters)
    # Over the worker's limit but within the dead-letter topic's: kept whole (cut only to fit the
    # topic: tests/kafka/test_dead_letters.py).
    assert "truncated" not in dict(letters[-1].headers)
    for letter, meta in zip(letters, metas):
        headers = dict(letter.headers)
        assert headers["source-topic"] == topics.requests.encode()
        assert headers["source-partition"] == str(meta.partition).encode()
        assert headers["source-offset"] == str(meta.offset).encode()
        assert headers["error"]
    assert b"over the 16384-byte limit" in dict(letters[-1].headers)["error"]
    metrics = worker.metrics.render().decode()
    assert f"inferline_dead_letters_total {float(len(dead))}" in metrics
    assert 'inferline_rejections_total{reason="prompt_too_long"}' in metrics


async def test_a_redelivered_finished_request_is_not_run_twice(
    kafka_bootstrap, topics, start_worker
):
    """A lost commit (broker restart, rebalance) redelivers finished requests: not run again; its
    final `done` is sent again as it was (same attempt, same bytes) for a requester that missed
    it."""
    from tests.worker_fixtures import collect as collect_replies

    worker = await start_worker(topics)
    req = request(topics.replies, max_tokens=4)
    await submit(kafka_bootstrap, topics.requests, [req])
    first = await collect_replies(kafka_bootstrap, topics.replies, [req["id"]], timeout=60)
    assert final_done(first[req["id"]]) is not None
    await submit(kafka_bootstrap, topics.requests, [req])  # the same message again
    marker = request(topics.replies, max_tokens=2)
    await submit(kafka_bootstrap, topics.requests, [marker])
    # The marker may be answered first (another partition): wait for the second `done` itself.
    events = await collect_replies(
        kafka_bootstrap, topics.replies, [req["id"], marker["id"]], timeout=60, dones={req["id"]: 2}
    )
    dones = [e for e in events[req["id"]] if e.type == "done"]
    assert len(dones) == 2 and dones[0] == dones[1]  # one attempt: the same final result twice
    assert len({e.attempt for e in events[req["id"]]}) == 1
    assert worker.tracker.pending(next(iter(worker.tracker.partitions()))) == 0
