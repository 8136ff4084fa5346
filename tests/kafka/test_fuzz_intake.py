"""Fuzzing a running worker: a few hundred hostile messages into it through the real broker; each
ends as a dead letter or a `done`, and the worker serves a valid request afterwards. The offline
fuzzing of the intake (10,000+ messages): tests/unit/test_fuzz_intake.py."""

from __future__ import annotations

import random

import pytest

from inferline.contract.schema import (
    InvalidRequest,
    UndecodableMessage,
    decode_event,
    decode_request,
)
from tests.worker_fixtures import start_worker  # noqa: F401 - fixture
from tests.chaos_fixtures import (
    hostile_messages,
    pack,
    special_messages,
)
from tests.unit.test_fuzz_intake import SCALE  # noqa: F401


@pytest.mark.kafka
async def test_hostile_messages_into_a_running_worker(kafka_bootstrap, new_topic, start_worker):
    """A few hundred hostile messages into a running worker: each one ends as a dead letter or as a
    `done` on its reply topic, and the worker then serves a valid request as usual."""
    from collections import Counter

    from tests.kafka_fixtures import consume_until, produce_raw
    from tests.worker_fixtures import Topics, check_attempts, final_done, request

    topics = Topics(
        requests=await new_topic(2, prefix="req"),
        cancel=await new_topic(1, prefix="cancel"),
        dlq=await new_topic(1, prefix="dlq"),
        replies=await new_topic(2, prefix="reply", reply=True),
    )
    worker = await start_worker(topics, limits={"max_tokens_cap": 4})
    max_bytes, max_len = (
        worker.settings.kafka.max_message_bytes,
        worker.settings.model.max_model_len,
    )
    candidates = hostile_messages(random.Random(2024), topics.replies, 300 * SCALE)
    candidates += [v for _, v in special_messages(topics.replies) if len(v) < 900_000]
    values, dead, answers = [], 0, Counter()
    for value in candidates:
        try:
            req = decode_request(value, max_bytes, max_len)
            reply, rid = req.reply_topic, req.id
        except UndecodableMessage:
            dead += 1
            values.append(value)
            continue
        except InvalidRequest as exc:
            reply, rid = exc.reply_topic, exc.request_id
        if reply == topics.replies:  # (a mutation that renamed the reply topic would create topics)
            answers[rid] += 1
            values.append(value)
    await produce_raw(kafka_bootstrap, topics.requests, values)

    def all_answered(records) -> bool:
        assert worker.engine_loop._thread.is_alive(), (
            "the engine thread died (see the thread warning)"
        )
        assert all(not t.done() for t in worker.intake._tasks), "the intake's tasks stopped"
        dones = Counter(
            decode_event(r.value).id
            for r in records
            if decode_event(r.value).type == "done"
            and decode_event(r.value).finish_reason != "requeued"
        )
        return all(dones[rid] >= n for rid, n in answers.items())

    records = await consume_until(kafka_bootstrap, topics.replies, all_answered, timeout=180)
    letters = await consume_until(
        kafka_bootstrap, topics.dlq, lambda rs: len(rs) >= dead, timeout=60
    )
    assert len(letters) == dead
    events: dict[str, list] = {}
    for r in records:
        ev = decode_event(r.value)
        events.setdefault(ev.id, []).append(ev)
    for rid in answers:
        check_attempts(events[rid])

    good = request(topics.replies, max_tokens=3)
    await produce_raw(kafka_bootstrap, topics.requests, [(good["id"].encode(), pack(good))])
    after = await consume_until(
        kafka_bootstrap,
        topics.replies,
        lambda rs: any(
            decode_event(r.value).id == good["id"] and decode_event(r.value).type == "done"
            for r in rs
        ),
        timeout=60,
    )
    done = final_done(
        [decode_event(r.value) for r in after if decode_event(r.value).id == good["id"]]
    )
    assert done.finish_reason == "length" and done.usage.completion_tokens == 3
    print(
        f"\nlive worker: {len(values)} hostile messages: {dead} dead letters, "
        f"{sum(answers.values())} answered ({len(answers)} ids), then served a valid request"
    )
    assert worker.engine_loop._thread.is_alive()
    assert all(not t.done() for t in worker.intake._tasks), "the intake stopped"
