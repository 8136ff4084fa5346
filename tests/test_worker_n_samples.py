"""n > 1 samples through the real broker and a real worker (issue #28)."""
from collections import defaultdict

import pytest

from producer.schema import MAX_N, TokensEvent
from tests.test_worker_cancel_deadline import first_tokens
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    cancel, check_attempts, collect, final_done, request, start_worker, submit, topics,
)

pytestmark = pytest.mark.kafka


def texts_by_index(events: list) -> dict[int, str]:
    texts = defaultdict(str)
    for ev in events:
        if isinstance(ev, TokensEvent):
            texts[ev.index] += ev.text
    return dict(texts)


async def test_samples_stream_by_index_and_done_lists_them(kafka_bootstrap, topics, start_worker):
    three = request(topics.replies, max_tokens=12, temperature=0.9, seed=11, n=3, ignore_eos=True)
    whole = request(topics.replies, max_tokens=6, temperature=0.9, seed=11, n=2, stream=False)
    too_many = request(topics.replies, n=MAX_N + 1)
    worker = await start_worker(topics)
    ids = await submit(kafka_bootstrap, topics.requests, [three, whole, too_many])
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=180)

    evs = events[three["id"]]
    check_attempts(evs)
    done = final_done(evs)
    assert done.finish_reason == "length" and [s.index for s in done.samples] == [0, 1, 2]
    streamed = texts_by_index(evs)
    assert sorted(streamed) == [0, 1, 2]
    assert [s.text for s in done.samples] == [streamed[i] for i in range(3)]
    assert all(s.finish_reason == "length" and s.completion_tokens == 12 for s in done.samples)
    assert done.text == done.samples[0].text and done.usage.completion_tokens == 36
    assert len({s.text for s in done.samples}) > 1  # temperature 0.9: the samples differ

    whole_done = final_done(events[whole["id"]])
    assert not [e for e in events[whole["id"]] if isinstance(e, TokensEvent)]
    assert len(whole_done.samples) == 2 and whole_done.text == whole_done.samples[0].text

    assert worker.metrics.forked_samples._value.get() == 2 + 1  # samples 1..n-1 of each request

    rejected = final_done(events[too_many["id"]])
    assert rejected.finish_reason == "rejected" and rejected.error.code == "invalid_request"
    assert rejected.error.message.startswith("n:") and rejected.samples is None


async def test_a_cancel_ends_every_sample(kafka_bootstrap, topics, start_worker):
    await start_worker(topics)
    req = request(topics.replies, max_tokens=400, temperature=0.9, n=3, ignore_eos=True)
    await submit(kafka_bootstrap, topics.requests, [req])
    await first_tokens(kafka_bootstrap, topics.replies, req["id"])
    await cancel(kafka_bootstrap, topics.cancel, req["id"])
    evs = (await collect(kafka_bootstrap, topics.replies, [req["id"]]))[req["id"]]
    check_attempts(evs)
    done = final_done(evs)
    assert done.finish_reason == "cancelled" and done.error.code == "cancelled"
    assert [s.finish_reason for s in done.samples] == ["cancelled"] * 3
    assert done.usage.completion_tokens < 3 * 400
