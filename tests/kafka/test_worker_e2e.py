"""End to end through the real broker and the real engine: the vertical slice."""

import pytest

from inferline.config.settings import Settings
from inferline.contract.schema import Request, StartedEvent, TokensEvent
from tests.engine_fixtures import run_to_completion
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    PROMPTS,
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    streamed_text,
    submit,
    topics,
)
from inferline.worker.app import engine_settings
from inferline.worker.request_tracker import engine_request
from inferline.worker.engine.engine import LLMEngine

pytestmark = pytest.mark.kafka


def reference(model_runner, reqs: list[dict]) -> dict[str, str]:
    """Greedy texts from the engine run directly, without Kafka."""
    engine = LLMEngine(model_runner, engine_settings(Settings()))
    for r in reqs:
        req = Request.model_validate(r)
        engine.add_request(engine_request(req, req.id, req.max_tokens, 0.0, None))
    return {rid: res["final"].text for rid, res in run_to_completion(engine, check=False).items()}


async def test_requests_stream_started_tokens_done(
    kafka_bootstrap, topics, start_worker, model_runner
):
    reqs = [
        request(
            topics.replies, PROMPTS[i % len(PROMPTS)], max_tokens=8 + i % 5, metadata={"n": str(i)}
        )
        for i in range(50)
    ]
    reqs[0]["reply_partition"] = 1
    reqs[1]["stream"] = False
    expected = reference(model_runner, reqs)
    await start_worker(topics)
    ids = await submit(kafka_bootstrap, topics.requests, reqs)
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=180)
    for i, r in enumerate(reqs):
        evs = events[r["id"]]
        check_attempts(evs)
        assert len({e.attempt for e in evs}) == 1
        assert isinstance(evs[0], StartedEvent) and evs[0].worker
        done = final_done(evs)
        assert done.finish_reason in ("stop", "length") and done.error is None
        assert done.text == expected[r["id"]]
        tokens = [t for e in evs if isinstance(e, TokensEvent) for t in e.token_ids]
        if r.get("stream", True):
            assert streamed_text(evs) == done.text and done.usage.completion_tokens == len(tokens)
        else:  # the whole text arrives in `done`
            assert not tokens and len(evs) == 2
        assert 0 < done.usage.completion_tokens <= r["max_tokens"]
        assert done.usage.prompt_tokens > 0
        assert done.metadata == {"n": str(i)}
        assert events.partitions[r["id"]] == ({1} if i == 0 else events.partitions[r["id"]])
        assert len(events.partitions[r["id"]]) == 1
        assert 0 <= done.timing.queue_s <= done.timing.ttft_s <= done.timing.total_s


async def test_speculative_decoding_streams_what_plain_decoding_does(
    kafka_bootstrap, topics, start_worker, model_runner
):
    """Through Kafka with n-gram drafts on: a step may now yield several tokens; the stream, the
    `done` text and the usage still agree, and equal plain decoding's; the metrics count drafts."""
    looping = "red, green, blue, yellow, purple, red, green, blue, yellow, purple, red, green,"
    reqs = [
        request(topics.replies, looping if i % 2 else PROMPTS[i % len(PROMPTS)], max_tokens=24)
        for i in range(8)
    ]
    reqs[3]["stop"] = ["yellow"]
    expected = reference(model_runner, reqs)
    worker = await start_worker(topics, speculative={"method": "ngram", "prompt_lookup_min": 1})
    ids = await submit(kafka_bootstrap, topics.requests, reqs)
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=180)
    for r in reqs:
        evs = events[r["id"]]
        done = final_done(evs)
        assert done.text == expected[r["id"]] and done.error is None
        tokens = [t for e in evs if isinstance(e, TokensEvent) for t in e.token_ids]
        assert streamed_text(evs) == done.text and done.usage.completion_tokens == len(tokens)
    assert "yellow" not in final_done(events[reqs[3]["id"]]).text
    metric = {s.name: s.value for m in worker.metrics.registry.collect() for s in m.samples}
    assert metric["inferline_spec_accepted_tokens_total"] > 0
    assert (
        metric["inferline_spec_draft_tokens_total"]
        >= metric["inferline_spec_accepted_tokens_total"]
    )


async def test_client_settings_the_project_does_not_model_reach_both_libraries(
    kafka_bootstrap, topics, start_worker, capfd
):
    """#51: librdkafka's `debug` reaches the group consumer (its log shows the consumer group's
    protocol), aiokafka's request timeout the reply producer, and requests are served."""
    passthrough = {"librdkafka": {"debug": "cgrp"}, "aiokafka": {"request_timeout_ms": 17_000}}
    worker = await start_worker(topics, kafka=passthrough)
    ids = await submit(kafka_bootstrap, topics.requests, [request(topics.replies, max_tokens=2)])
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=60)
    assert final_done(events[ids[0]]).finish_reason == "length"
    assert worker.publisher._producer.client._request_timeout_ms == 17_000
    assert "CGRP" in capfd.readouterr().err  # librdkafka's consumer-group debug lines
