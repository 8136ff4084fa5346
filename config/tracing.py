"""OpenTelemetry tracing, set up from the standard OTEL_* variables, and W3C trace context in and
out of Kafka record headers. Off unless OTEL_TRACES_EXPORTER names an exporter: then no SDK is
set up, nothing is extracted, and no header is written (docs/operations.md#tracing).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = structlog.get_logger(__name__)
TRACE_HEADERS = ("traceparent", "tracestate")
# W3C: a traceparent is 55 characters; vendors need not pass on a tracestate over 512. A
# longer header is ignored, never decoded: a producer cannot make the worker parse megabytes.
MAX_TRACE_HEADER_BYTES = 512
# Only W3C trace context crosses Kafka: no baggage (unbounded, producer-chosen) in or out.
_W3C = TraceContextTextMapPropagator()
_provider = None  # the SDK's TracerProvider once setup_tracing() turned tracing on
_tracer = None  # its tracer


class _ListSetter(Setter):
    """Writes Kafka headers: a list of (str, bytes)."""

    def set(self, carrier: list, key: str, value: str) -> None:
        carrier.append((key, value.encode("ascii", "replace")))


class _DictGetter(Getter):
    def get(self, carrier: dict, key: str) -> list[str] | None:
        value = carrier.get(key)
        return None if value is None else [value]

    def keys(self, carrier: dict) -> list[str]:
        return list(carrier)


def exporter_names() -> list[str]:
    """OTEL_TRACES_EXPORTER's names; empty (tracing off) when unset, `none`, or the SDK is
    disabled by OTEL_SDK_DISABLED."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").lower().split(",")
    return [n.strip() for n in names if n.strip() and n.strip() != "none"]


def setup_tracing(service_name: str, exporter=None, set_global: bool = True) -> bool:
    """Install the SDK's TracerProvider when OTEL_TRACES_EXPORTER names an exporter (or an
    `exporter` is given: tests); the resource is OTEL_SERVICE_NAME's, else `service_name`.
    Returns whether tracing is on. The SDK is imported only then."""
    global _provider, _tracer
    names = exporter_names()
    if exporter is None and not names:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:  # the light client's install: say how to get it
        raise RuntimeError(
            f"OTEL_TRACES_EXPORTER={','.join(names)} needs the OpenTelemetry SDK: "
            "pip install 'inferline[tracing]'"
        ) from exc

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER, else parent's
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    for name in names if exporter is None else []:
        if (made := _exporter(name)) is not None:
            provider.add_span_processor(BatchSpanProcessor(made))
    if set_global:
        trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("inferline")
    log.info(
        "tracing.on", exporters=names or ["given"], service=resource.attributes.get("service.name")
    )
    return True


def _exporter(name: str):
    """The span exporter OTEL_TRACES_EXPORTER names; its endpoint and headers it reads itself
    (OTEL_EXPORTER_OTLP_ENDPOINT, ...). None, logged, for one that is not installed."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    try:
        if name == "otlp" and protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            log.error("tracing.unknown_exporter", exporter=name, known="otlp, console, none")
            return None
    except ImportError as exc:
        log.error("tracing.exporter_missing", exporter=name, protocol=protocol, error=str(exc))
        return None
    return OTLPSpanExporter()


def reset_tracing() -> None:
    """Tracing off again (tests): spans ended from here on are not exported by this module's
    provider; a global provider set before stays."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def tracer():
    """inferline's tracer, or None when tracing is off: callers skip all span work then. Off
    here but set up by the application (the client as a library): the global provider's."""
    if _tracer is not None:
        return _tracer
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer("inferline")


@contextlib.contextmanager
def producer_span(name: str, attributes: dict):
    """A PRODUCER span around sending one record, a child of the current context; yields the
    record's headers (its traceparent), or None when tracing is off."""
    tracer_ = tracer()
    if tracer_ is None:
        yield None
        return
    with tracer_.start_as_current_span(name, kind=SpanKind.PRODUCER, attributes=attributes):
        yield inject_headers() or None


def inject_headers(ctx=None) -> list[tuple[str, bytes]]:
    """W3C traceparent/tracestate of `ctx` (default: the current context) as Kafka headers;
    empty when it holds no valid span."""
    headers: list[tuple[str, bytes]] = []
    _W3C.inject(headers, context=ctx, setter=_ListSetter())
    return headers


def extract_headers(headers: Iterable | None):
    """The trace context that Kafka `headers` ((key, bytes) pairs) carry, or None: none there,
    tracing off, or a traceparent that is malformed or over MAX_TRACE_HEADER_BYTES (ignored)."""
    if not headers or tracer() is None:
        return None
    carrier: dict[str, str] = {}
    for key, value in headers:
        key = key.decode("latin-1") if isinstance(key, bytes) else str(key)
        key = key.lower()
        if key not in TRACE_HEADERS or key in carrier or not isinstance(value, (bytes, str)):
            continue
        if len(value) > MAX_TRACE_HEADER_BYTES:
            continue
        try:
            carrier[key] = value.decode("ascii") if isinstance(value, bytes) else value
        except UnicodeDecodeError:
            continue
    return extract_mapping(carrier)


def extract_mapping(carrier: dict[str, str]):
    """As extract_headers, from a mapping of header name to value (HTTP); None unless it holds
    a valid traceparent."""
    carrier = {k: v for k, v in carrier.items() if len(v) <= MAX_TRACE_HEADER_BYTES}
    if "traceparent" not in carrier:
        return None
    try:
        ctx = _W3C.extract(carrier, context=otel_context.Context(), getter=_DictGetter())
    except Exception:  # noqa: BLE001 - a producer's header is never fatal
        return None
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None
