"""Structured outputs and logprobs through the real broker and a real worker."""

import json

import jsonschema
import pytest

from inferline.contract.schema import TokensEvent
from tests.unit.test_structured_output import PERSON, ASK_PERSON
from tests.worker_fixtures import (  # noqa: F401 - fixtures
    check_attempts,
    collect,
    final_done,
    request,
    start_worker,
    streamed_text,
    submit,
    topics,
)

pytestmark = pytest.mark.kafka


async def test_constrained_requests_and_logprobs_over_kafka(kafka_bootstrap, topics, start_worker):
    person = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reqs = [
        request(
            topics.replies,
            max_tokens=160,
            temperature=0.9,
            seed=s,
            messages=ASK_PERSON,
            response_format=person,
            logprobs=True,
            top_logprobs=3,
        )
        for s in range(3)
    ]
    for r in reqs:
        del r["prompt"]
    reqs.append(
        request(topics.replies, "Is water wet?", max_tokens=8, structured={"choice": ["yes", "no"]})
    )
    reqs.append(
        request(
            topics.replies,
            "hi",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "broken", "schema": {"type": "nope"}},
            },
        )
    )
    await start_worker(topics)
    ids = await submit(kafka_bootstrap, topics.requests, reqs)
    events = await collect(kafka_bootstrap, topics.replies, ids, timeout=240)
    for r in reqs[:3]:
        evs = events[r["id"]]
        check_attempts(evs)
        done = final_done(evs)
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), PERSON)
        assert streamed_text(evs) == done.text
        tokens = [e for e in evs if isinstance(e, TokensEvent)]
        for ev in tokens:
            assert len(ev.logprobs) == len(ev.token_ids)
            for lp in ev.logprobs:
                assert lp.logprob <= 0 and 1 <= len(lp.top_logprobs) <= 3
                assert [t.logprob for t in lp.top_logprobs] == sorted(
                    (t.logprob for t in lp.top_logprobs), reverse=True
                )
    choice = final_done(events[reqs[3]["id"]])
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no")
    assert all(e.logprobs is None for e in events[reqs[3]["id"]] if isinstance(e, TokensEvent))
    broken = final_done(events[reqs[4]["id"]])
    assert broken.finish_reason == "rejected" and broken.error.code == "invalid_request"
    assert broken.error.message.startswith("response_format: cannot be compiled")
