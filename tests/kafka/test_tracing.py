"""One trace per request across the Kafka hop: the Python client (in a caller's span), and the
gateway (continuing an HTTP traceparent), send through the real broker to a real worker in this
process, all exporting to the SDK's in-memory exporter; the worker's spans continue the
sender's, and each event on the reply topic carries the worker's request span as its trace
context. Headers alone: tests/unit/test_tracing.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry import trace

from inferline.config import tracing
from inferline.contract.schema import decode_event
from inferline.producer.client import InferenceClient
from tests.kafka_fixtures import consume_until, wait_until
from tests.gateway_fixtures import fleet  # noqa: F401 - fixture
from tests.unit.test_tracing import PARENT_ID, TRACE_ID, TRACEPARENT, WORKER_SPANS
from tests.unit.test_tracing import spans  # noqa: F401 - fixture
from tests.worker_fixtures import PROMPTS

pytestmark = pytest.mark.kafka
N = 3


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def ended(spans, name: str) -> list:  # noqa: F811
    return [s for s in spans.get_finished_spans() if s.name == name]


async def test_one_trace_per_request_parented_across_kafka(
    kafka_bootstrap,
    fleet,
    spans,  # noqa: F811
):
    topics = fleet.topics
    callers, handles = {}, []
    async with InferenceClient(
        kafka_bootstrap,
        request_topic=topics.requests,
        cancel_topic=topics.cancel,
        reply_topic=topics.replies,
    ) as client:
        for i in range(N):
            with tracing.tracer().start_as_current_span(f"caller-{i}") as caller:
                handles.append(await client.submit(PROMPTS[i], max_tokens=4))
            callers[handles[-1].id] = caller.get_span_context()
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)
    reasons = {h.id: r.finish_reason for h, r in zip(handles, results)}

    requests_ended = lambda: ended(spans, "inferline.request")  # noqa: E731
    await wait_until(lambda: len(requests_ended()) == N, 10, "every request span to end")
    finished = spans.get_finished_spans()
    records = await consume_until(kafka_bootstrap, topics.replies, timeout=10)
    for rid, caller in callers.items():
        trace_id = caller.trace_id
        in_trace = {s.name: s for s in finished if s.context.trace_id == trace_id}
        assert set(in_trace) == {
            f"caller-{list(callers).index(rid)}",
            "inferline.submit",
            "inferline.request",
            *WORKER_SPANS,
        }, rid
        submit, root = in_trace["inferline.submit"], in_trace["inferline.request"]
        assert submit.parent.span_id == caller.span_id
        assert submit.kind == trace.SpanKind.PRODUCER
        assert root.parent.span_id == submit.context.span_id and root.parent.is_remote
        assert root.attributes["gen_ai.request.id"] == rid
        assert root.attributes["gen_ai.response.finish_reasons"] == (reasons[rid],)
        assert root.attributes["gen_ai.usage.output_tokens"] >= 1
        for name in WORKER_SPANS:
            assert in_trace[name].parent.span_id == root.context.span_id, name
        events = [r for r in records if decode_event(r.value).id == rid]
        expected = [hex_id(trace_id, 32), hex_id(root.context.span_id, 16)]
        assert len(events) >= 3  # started, tokens, done
        for r in events:  # version-traceid-spanid-flags
            assert dict(r.headers)["traceparent"].decode().split("-")[1:3] == expected, r


async def test_the_gateway_continues_the_http_trace_into_the_worker(fleet, spans):  # noqa: F811
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4}
    headers = {"authorization": "Bearer sk-acme", "traceparent": TRACEPARENT}
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:
        response = await http.post("/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    await wait_until(lambda: ended(spans, "inferline.request"), 10, "the request span to end")
    in_trace = {s.name: s for s in spans.get_finished_spans()}
    assert set(in_trace) == {
        "POST /v1/chat/completions",
        "inferline.submit",
        "inferline.request",
        *WORKER_SPANS,
    }
    assert {hex_id(s.context.trace_id, 32) for s in in_trace.values()} == {TRACE_ID}
    server = in_trace["POST /v1/chat/completions"]
    assert hex_id(server.parent.span_id, 16) == PARENT_ID
    assert server.attributes["http.response.status_code"] == 200
    submit, root = in_trace["inferline.submit"], in_trace["inferline.request"]
    assert submit.parent.span_id == server.context.span_id
    assert root.parent.span_id == submit.context.span_id
    assert root.attributes["inferline.tenant"] == "acme"
