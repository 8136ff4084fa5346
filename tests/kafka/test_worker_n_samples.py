"""n > 1 samples through the real broker and a real worker (issue #28)."""

from collections import defaultdict

import pytest

from inferline.contract.schema import MAX_N, TokensEvent
from tests.gateway_fixtures import fleet  # noqa: F401 - fixture
from tests.kafka.test_worker_cancel_deadline import first_tokens
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


async def test_the_gateway_returns_n_choices_whole_and_streamed(fleet):
    import openai

    aio = openai.AsyncOpenAI(base_url=fleet.url, api_key="sk-acme", max_retries=0)
    ask = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0.9,
        seed=5,
        n=3,
    )
    whole = await aio.chat.completions.create(**ask)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    chunks = [c async for c in await aio.chat.completions.create(**ask, stream=True)]
    streamed = defaultdict(str)
    finish = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    # Seeded: the stream and the whole answer are the same three samples.
    assert [streamed[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    legacy = await aio.completions.create(
        model=ask["model"], prompt="Colours:", max_tokens=4, n=2, seed=1, temperature=0.9
    )
    assert [c.index for c in legacy.choices] == [0, 1]
