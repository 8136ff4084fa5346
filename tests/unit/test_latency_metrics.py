"""Latency where the user feels it (worker/service/metrics.py): time in Kafka from the record's
timestamp, TTFT from it beside TTFT from receipt, every inter-token gap, prompt and output
lengths, all labelled `model_name`. A real Worker through the intake harness, on a fake clock:
each step's outputs go through the Worker's own engine-output path."""

from __future__ import annotations

import time
import uuid

import msgpack
import pytest

from inferline.config.settings import Settings
from inferline.worker.engine.engine import EngineStats
from inferline.worker.engine.request import RequestOutput
from inferline.worker.intake.triage import Record
from tests.chaos_fixtures import IntakeHarness

MODEL = "test-model"
START = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(time, "time", clock)
    return clock


def harness() -> IntakeHarness:
    return IntakeHarness(Settings(gateway={"model_name": MODEL}))


def body(**fields) -> bytes:
    req = {"v": 1, "id": f"r-{uuid.uuid4().hex[:8]}", "reply_topic": "inferline.reply.lat"}
    return msgpack.packb({**req, "prompt": "Hi.", "max_tokens": 8, **fields})


def step(h: IntakeHarness, req, tokens: int, index: int = 0, **fields) -> None:
    """One engine step that gave sample `index` of `req` this many tokens."""
    out = RequestOutput(
        request_id=req.request_id,
        index=index,
        new_token_ids=[42] * tokens,
        text_delta="x" * tokens,
        num_prompt_tokens=3,
        **fields,
    )
    h.worker.requests.on_outputs([out], EngineStats())


def finish(h: IntakeHarness, req, num_output_tokens: int) -> None:
    fields = {"finished": True, "finish_reason": "length", "text": "x"}
    step(h, req, 0, num_output_tokens=num_output_tokens, **fields)


def sample(h: IntakeHarness, name: str, **labels) -> float:
    value = h.worker.metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if value is None else value


def test_a_request_s_time_in_kafka_ttfts_gaps_and_lengths(clock):
    h = harness()
    _, (req,) = h.feed(body(), timestamp_ms=int((START - 2.5) * 1000))  # 2.5 s in Kafka
    clock.now += 0.5
    step(h, req, 1, started=True)  # the first token: 0.5 s after receipt, 3 s after the record
    for gap, tokens in ((0.25, 1), (0.75, 2), (0.125, 1)):  # 2 tokens in one step: one gap
        clock.now += gap
        step(h, req, tokens)
    finish(h, req, num_output_tokens=5)

    assert sample(h, "inferline_time_in_kafka_seconds_count") == 1
    assert sample(h, "inferline_time_in_kafka_seconds_sum") == pytest.approx(2.5)
    assert sample(h, "inferline_ttft_seconds_sum", priority="0") == pytest.approx(0.5)
    assert sample(h, "inferline_e2e_ttft_seconds_sum") == pytest.approx(3.0)
    assert sample(h, "inferline_inter_token_gap_seconds_count") == 3  # 4 steps with tokens
    assert sample(h, "inferline_inter_token_gap_seconds_sum") == pytest.approx(1.125)
    assert sample(h, "inferline_inter_token_gap_seconds_bucket", le="0.3") == 2
    assert sample(h, "inferline_prompt_tokens_total") == 3
    assert sample(h, "inferline_request_prompt_tokens_sum") == 3
    assert sample(h, "inferline_request_generation_tokens_sum") == 5
    assert sample(h, "inferline_request_generation_tokens_count") == 1
    assert sample(h, "inferline_e2e_seconds_count", priority="0") == 1
    assert h.settled()


def test_a_timestamp_after_receipt_counts_as_no_time_in_kafka(clock):
    h = harness()
    _, (req,) = h.feed(body(), timestamp_ms=int((START + 60) * 1000))  # the producer's clock ahead
    clock.now += 0.5
    step(h, req, 1, started=True)
    finish(h, req, num_output_tokens=1)
    assert sample(h, "inferline_time_in_kafka_seconds_count") == 1
    assert sample(h, "inferline_time_in_kafka_seconds_sum") == 0
    assert sample(h, "inferline_e2e_ttft_seconds_sum") == pytest.approx(0.5)  # from receipt
    assert sample(h, "inferline_inter_token_gap_seconds_count") == 0  # one token: no gap


def test_a_record_without_a_timestamp_is_not_timed_in_kafka(clock):
    h = harness()
    _, (req,) = h.feed(body(), timestamp_ms=-1)
    clock.now += 0.5
    step(h, req, 1, started=True)
    assert sample(h, "inferline_time_in_kafka_seconds_count") == 0
    assert sample(h, "inferline_e2e_ttft_seconds_sum") == pytest.approx(0.5)


def test_each_sample_has_its_own_gaps(clock):
    h = harness()
    _, (req,) = h.feed(body(n=2))
    for i in range(3):  # both samples move in each of 3 steps
        clock.now += 0.25
        for index in (0, 1):
            step(h, req, 1, index=index, started=i == 0 and index == 0)
    assert sample(h, "inferline_inter_token_gap_seconds_count") == 4  # (3 - 1) per sample
    assert sample(h, "inferline_inter_token_gap_seconds_sum") == pytest.approx(1.0)
    assert sample(h, "inferline_prompt_tokens_total") == 3  # the prompt, once


def test_a_requeued_request_s_lengths_are_left_to_where_it_ends(clock):
    h = harness()
    _, (req,) = h.feed(body())
    step(h, req, 1, started=True)
    step(h, req, 0, finished=True, finish_reason="requeued", num_output_tokens=1)
    assert sample(h, "inferline_request_prompt_tokens_count") == 0
    assert sample(h, "inferline_prompt_tokens_total") == 3


class Message:
    """confluent-kafka's Message, as far as Record.read reads it."""

    def __init__(self, timestamp: tuple[int, int]) -> None:
        self._timestamp = timestamp

    def error(self):
        return None

    def topic(self):
        return "t"

    def partition(self):
        return 0

    def offset(self):
        return 7

    def key(self):
        return None

    def value(self):
        return b"v"

    def headers(self):
        return None

    def timestamp(self) -> tuple[int, int]:
        return self._timestamp

    def delivery_count(self):
        return None


def test_records_read_carry_their_kafka_timestamp():
    stamped, unstamped = Record.read([Message((1, 1_500)), Message((0, -1))])
    assert stamped.sent_at == 1.5 and unstamped.sent_at is None
