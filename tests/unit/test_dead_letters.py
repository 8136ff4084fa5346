"""Dead letters end visibly whatever the record's size (worker/delivery/dead_letters.py): cut to
the dead-letter topic's real limit, read from its config, with headers saying so; while they are
not on the broker they count against intake's room. Offline through the intake harness; on the
real broker: tests/kafka/test_dead_letters.py."""

from __future__ import annotations

import structlog
from hypothesis import given, strategies as st

from inferline.worker.delivery.dead_letters import (
    BROKER_DEFAULT_MAX_MESSAGE_BYTES,
    DeadLetterLimit,
    batch_size,
    fit,
)
from tests.unit.test_delivery import DLQ, harness

HEADERS = [("error", b"message is not msgpack"), ("source-topic", b"requests")]


def _letters(h) -> list:
    return [o for o in h.sent if o.topic == DLQ]


def _rough_size(out) -> int:
    # What the broker counts, at least: the batch header, key, value and headers.
    return 61 + len(out.key or b"") + len(out.value) + sum(len(k) + len(v) for k, v in out.headers)


def test_a_record_the_request_topic_takes_is_cut_to_fit_the_dlq_with_its_headers():
    h = harness()
    value = b"\xc1" * 1_048_500  # under the request topic's default limit, not msgpack
    h.feed(value)
    (letter,) = _letters(h)
    assert _rough_size(letter) <= BROKER_DEFAULT_MAX_MESSAGE_BYTES
    headers = dict(letter.headers)
    assert headers["truncated"] == b"value" and headers["original-size"] == b"1048500"
    assert value.startswith(letter.value) and headers["source-offset"] == b"0"


def test_dead_letters_in_flight_take_intake_room_until_acked():
    h = harness()
    held = []
    h.worker.publisher._enqueue = held.append  # the dead-letter topic answers nothing yet
    room = h.worker.requests.room()
    for _ in range(5):
        h.feed(b"\xc1 not msgpack")
    assert h.worker.requests.room() == room - 5
    for out in held:
        out.on_acked("ok")
    assert h.worker.requests.room() == room


@given(st.integers(0, 3000), st.integers(0, 3000), st.integers(300, 4000), st.booleans())
def test_fit_always_fits_and_keeps_the_head(key_len, value_len, limit, tombstone):
    key, value = b"k" * key_len, None if tombstone else b"v" * value_len
    k, v, headers = fit(key, value, HEADERS, limit)
    assert batch_size(k, v, headers) <= limit
    assert key.startswith(k) and (value or b"").startswith(v or b"")
    if (k, v) != (key, value):
        cut = dict(headers)
        assert cut["truncated"] in (b"value", b"key,value")
        assert cut["original-size"] == str(len(value or b"")).encode()


async def test_the_limit_is_the_dlq_topics_config_or_the_broker_default_when_unreadable(
    monkeypatch,
):
    from inferline.config.settings import Settings

    kafka = Settings().kafka
    read = DeadLetterLimit(kafka, read=lambda k, topic: 2000)
    assert await read.load() == 2000 and read.bytes() == 2000

    def unreadable(k, topic):
        raise TimeoutError("no broker")

    with structlog.testing.capture_logs() as logs:
        assumed = DeadLetterLimit(kafka, read=unreadable)
        assert await assumed.load() == BROKER_DEFAULT_MAX_MESSAGE_BYTES
    assert any(e["event"] == "dead_letters.limit_unknown" for e in logs)


async def test_a_dead_letter_is_sized_to_the_limit_read_at_start():
    h = harness()
    h.worker.delivery.dlq_limit = DeadLetterLimit(h.worker.settings.kafka, read=lambda k, t: 4096)
    await h.worker.delivery.start()
    h.feed(b"\xc1" * 10_000)
    (letter,) = _letters(h)
    assert batch_size(letter.key, letter.value, letter.headers) <= 4096
    assert dict(letter.headers)["original-size"] == b"10000"


async def test_a_limit_unreadable_at_start_is_read_again_by_a_later_dead_letter(monkeypatch):
    from inferline.worker.delivery import dead_letters

    answers = iter([TimeoutError("no broker"), 4096])

    def read(k, topic):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    h = harness()
    h.worker.delivery.dlq_limit = limit = DeadLetterLimit(h.worker.settings.kafka, read=read)
    await h.worker.delivery.start()
    assert limit.bytes() == BROKER_DEFAULT_MAX_MESSAGE_BYTES  # and not read again yet
    monkeypatch.setattr(dead_letters, "RETRY_READ_S", 0.0)
    h.feed(b"\xc1" * 10_000)  # sized to the default, and asks again
    await limit._loading
    assert limit.bytes() == 4096
