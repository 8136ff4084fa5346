"""Traces (config/tracing.py, worker/tracing.py, producer/gateway/tracing.py): W3C trace context
in and out of Kafka headers, a worker's spans per request on the SDK's in-memory exporter, a
malformed or huge header ignored, and nothing at all with tracing off. The worker is a real one
through the intake harness (tests/chaos_fixtures.py), on a fake clock."""

from __future__ import annotations

import time
import uuid

import httpx
import msgpack
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from inferline.config import tracing
from inferline.config.settings import Settings
from inferline.producer.gateway.tracing import TraceMiddleware
from inferline.worker.engine.engine import EngineStats
from inferline.worker import tracing as worker_tracing
from inferline.worker.engine.request import RequestOutput
from tests.chaos_fixtures import IntakeHarness
from tests.unit.test_latency_metrics import START, clock  # noqa: F401 - the fixture

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
WORKER_SPANS = {
    "inferline.kafka_wait",
    "inferline.pool_wait",
    "inferline.prefill",
    "inferline.decode",
    "inferline.delivery",
}
# What docs/operations.md#tracing lists for inferline.request: nothing a producer can add.
REQUEST_ATTRIBUTES = {
    "gen_ai.request.id",
    "inferline.tenant",
    "inferline.priority",
    "messaging.system",
    "messaging.destination.name",
    "messaging.destination.partition.id",
    "messaging.kafka.offset",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
    "inferline.delivery.outcome",
}


@pytest.fixture
def spans(monkeypatch):
    """Tracing on, into memory (no global provider set, so tests stay independent)."""
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    exporter = InMemorySpanExporter()
    assert tracing.setup_tracing("test", exporter=exporter, set_global=False)
    yield exporter
    tracing.reset_tracing()


@pytest.fixture
def off(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tracing.reset_tracing()
    assert tracing.tracer() is None, "a global TracerProvider was set by something else"


def body(**fields) -> bytes:
    req = {"v": 1, "id": f"r-{uuid.uuid4().hex[:8]}", "reply_topic": "inferline.reply.trace"}
    return msgpack.packb({**req, "prompt": "Hi.", "max_tokens": 8, **fields})


def run_one(clock: Clock, headers, **fields):
    """One request through a real worker: 2 s in Kafka, 0.5 s in the pool, 0.25 s to its first
    token, 3 tokens 0.125 s apart; returns what the worker sent (started, tokens, done)."""
    h = IntakeHarness(Settings())
    _, (req,) = h.feed(body(**fields), timestamp_ms=int((START - 2) * 1000), headers=headers)
    # As the engine reports a prefill done in one step: `started` (with its time in the pool)
    # and the first token in one output, at the end of that step.
    clock.now += 0.75
    step(h, req, started=True, queue_s=0.5, new_token_ids=[42], text_delta="a", num_prompt_tokens=3)
    for _ in range(2):
        clock.now += 0.125
        step(h, req, new_token_ids=[42], text_delta="a")
    step(h, req, finished=True, finish_reason="length", num_prompt_tokens=3, num_output_tokens=3)
    assert h.settled()
    return h.sent


def step(h: IntakeHarness, req, **fields) -> None:
    out = RequestOutput(request_id=req.request_id, **fields)
    h.worker.requests.on_outputs([out], EngineStats())


def by_name(exporter) -> dict:
    found = {s.name: s for s in exporter.get_finished_spans()}
    assert len(found) == len(exporter.get_finished_spans()), "a span name twice"
    return found


def header(out, name: str) -> str | None:
    values = [v.decode() for k, v in out.headers or () if k == name]
    return values[0] if values else None


# -- headers -------------------------------------------------------------------------------------


def test_inject_extract_round_trip(spans):
    tracer = tracing.tracer()
    with tracer.start_as_current_span("producer") as span:
        headers = tracing.inject_headers()
    assert [k for k, _ in headers] == ["traceparent"]
    ctx = tracing.extract_headers(headers + [("tracestate", b"vendor=1")])
    got = trace.get_current_span(ctx).get_span_context()
    assert got.trace_id == span.get_span_context().trace_id
    assert got.span_id == span.get_span_context().span_id
    assert got.is_remote and got.trace_state.get("vendor") == "1"


@pytest.mark.parametrize(
    "headers",
    [
        [("traceparent", b"00-xyz-00f067aa0ba902b7-01")],
        [("traceparent", b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01")],  # all-zero trace id
        [("traceparent", TRACEPARENT.encode() + b"-" + b"x" * 600)],  # huge
        [("traceparent", TRACEPARENT.encode() + b" " * 1000)],  # huge, if trimmed valid
        [("traceparent", b"\xff\xfe" + TRACEPARENT.encode())],
        [("traceparent", None)],
        [("tracestate", b"a=1")],  # no traceparent
        [(b"\xff", b"\x00"), ("other", b"x" * 10_000)],
    ],
)
def test_malformed_or_huge_headers_are_ignored(spans, headers):
    assert tracing.extract_headers(headers) is None


def test_a_huge_tracestate_is_dropped_the_traceparent_kept(spans):
    # 30 valid members, 1.4 kB: what the SDK alone would take (it allows 8 kB)
    huge = ",".join(f"k{i}={'v' * 40}" for i in range(30)).encode()
    ctx = tracing.extract_headers([("traceparent", TRACEPARENT.encode()), ("tracestate", huge)])
    got = trace.get_current_span(ctx).get_span_context()
    assert format(got.trace_id, "032x") == TRACE_ID and len(got.trace_state) == 0


def test_off_extracts_and_injects_nothing(off):
    assert tracing.extract_headers([("traceparent", TRACEPARENT.encode())]) is None
    with tracing.producer_span("inferline.submit", {}) as headers:
        assert headers is None
    assert tracing.inject_headers() == []


def test_off_by_default_and_none_means_off(monkeypatch, off):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.setup_tracing("test", set_global=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.setup_tracing("test", set_global=False)
    assert tracing.tracer() is None


def test_otel_traces_exporter_turns_it_on(monkeypatch, off):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-worker")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # never reached
    try:
        assert tracing.setup_tracing("inferline-worker", set_global=False)
        assert tracing._provider.resource.attributes["service.name"] == "my-worker"
    finally:
        tracing.reset_tracing()


# -- the worker ----------------------------------------------------------------------------------


def test_a_request_s_spans_continue_the_producer_s_trace(spans, clock):
    sent = run_one(clock, [("traceparent", TRACEPARENT.encode())], priority=3)
    found = by_name(spans)
    assert set(found) == WORKER_SPANS | {"inferline.request"}
    root = found["inferline.request"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID and root.parent.is_remote
    for name in WORKER_SPANS:
        assert found[name].parent.span_id == root.context.span_id, name
        assert found[name].context.trace_id == root.context.trace_id, name
    took = {n: (found[n].end_time - found[n].start_time) / 1e9 for n in WORKER_SPANS}
    assert took["inferline.kafka_wait"] == pytest.approx(2.0, abs=1e-3)
    assert took["inferline.pool_wait"] == pytest.approx(0.5, abs=1e-3)
    assert took["inferline.prefill"] == pytest.approx(0.25, abs=1e-3)
    assert took["inferline.decode"] == pytest.approx(0.25, abs=1e-3)
    assert root.start_time == int((START - 2) * 1e9)
    attrs = root.attributes
    assert attrs["inferline.priority"] == 3 and attrs["inferline.tenant"] == "default"
    assert attrs["gen_ai.usage.input_tokens"] == 3 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["inferline.delivery.outcome"] == "ok"
    # Every event carries the request span's context: the requester can link them.
    expected = f"00-{TRACE_ID}-{format(root.context.span_id, '016x')}-01"
    assert len(sent) >= 3 and all(header(out, "traceparent") == expected for out in sent)


def test_baggage_and_other_headers_set_no_attribute(spans, clock):
    headers = [
        ("traceparent", TRACEPARENT.encode()),
        ("baggage", b"inferline.tenant=evil,user.id=7"),
        ("inferline.priority", b"100"),
    ]
    sent = run_one(clock, headers)
    for span in spans.get_finished_spans():
        assert set(span.attributes) <= REQUEST_ATTRIBUTES, span.name
    assert by_name(spans)["inferline.request"].attributes["inferline.tenant"] == "default"
    # Nor is baggage passed on, to the requester or anyone else, even on a rejection.
    rejected, _ = IntakeHarness(Settings()).feed(body(max_tokens=10**9), headers=headers)
    for out in [*sent, *rejected]:
        assert [k for k, _ in out.headers] == ["content-type", "traceparent"]


def test_a_malformed_traceparent_starts_a_new_trace(spans, clock):
    sent = run_one(clock, [("traceparent", b"00-garbage-" + b"x" * 4000)])
    root = by_name(spans)["inferline.request"]
    assert root.parent is None
    assert all(header(out, "traceparent").split("-")[1] != TRACE_ID for out in sent)


def test_a_rejection_carries_the_producer_s_trace_context(spans, clock):
    h = IntakeHarness(Settings())
    sent, admitted = h.feed(body(max_tokens=10**9), headers=[("traceparent", TRACEPARENT.encode())])
    assert not admitted and len(sent) == 1
    assert header(sent[0], "traceparent") == TRACEPARENT


def test_off_means_no_spans_and_no_headers(off, clock, monkeypatch):
    def no_span(*args, **kwargs):
        raise AssertionError("a span was made with tracing off")

    monkeypatch.setattr(worker_tracing, "RequestTrace", no_span)
    sent = run_one(clock, [("traceparent", TRACEPARENT.encode())])
    assert len(sent) >= 3 and all(trace_headers(out) == [] for out in sent)
    h = IntakeHarness(Settings())
    sent, _ = h.feed(body(max_tokens=10**9), headers=[("traceparent", TRACEPARENT.encode())])
    assert trace_headers(sent[0]) == []


def trace_headers(out) -> list[str]:
    """The names of `out`'s headers beside its content type."""
    return [k for k, _ in out.headers or () if k != "content-type"]


# -- the gateway's HTTP side ---------------------------------------------------------------------


async def test_the_gateway_continues_the_http_traceparent(spans):
    seen = {}

    async def endpoint(request):
        seen["headers"] = tracing.inject_headers()  # what the client's request record gets
        return JSONResponse({})

    app = TraceMiddleware(Starlette(routes=[Route("/v1/items/{item}", endpoint, methods=["POST"])]))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        response = await http.post("/v1/items/42", headers={"traceparent": TRACEPARENT})
        assert response.status_code == 200
        await http.post("/v1/items/43", headers={"traceparent": "00-" + "f" * 600})
    first, second = spans.get_finished_spans()
    assert first.name == "POST /v1/items/{item}"  # the route, not the caller's path
    assert format(first.context.trace_id, "032x") == TRACE_ID
    assert format(first.parent.span_id, "016x") == PARENT_ID
    assert first.attributes["http.response.status_code"] == 200
    assert seen["headers"] and second.parent is None
    assert dict(seen["headers"])["traceparent"].decode().split("-")[1] != TRACE_ID


# -- the real exporter ---------------------------------------------------------------------------


def test_otlp_over_http_reaches_the_endpoint_the_variables_name(monkeypatch, off):
    """The OTLP/HTTP exporter that OTEL_TRACES_EXPORTER=otlp sets up posts spans to
    OTEL_EXPORTER_OTLP_ENDPOINT's /v1/traces, as protobuf, with OTEL_SERVICE_NAME in them."""
    import http.server
    import threading

    posts = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            posts.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None: ...

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "otlp-check")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        assert tracing.setup_tracing("inferline-worker", set_global=False)
        with tracing.tracer().start_as_current_span("inferline.request"):
            pass
        assert tracing._provider.force_flush(10_000)
    finally:
        tracing.reset_tracing()
        server.shutdown()
    path, content_type, body = posts[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    assert b"otlp-check" in body and b"inferline.request" in body
