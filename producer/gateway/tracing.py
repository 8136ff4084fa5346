"""The gateway's HTTP side of a trace: a SERVER span around each request, continuing the caller's
W3C traceparent; the client's `inferline.submit` span, and so the request record's headers, are
its children. Nothing is done when tracing is off (docs/operations.md#tracing).
"""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from inferline.config.tracing import MAX_TRACE_HEADER_BYTES, TRACE_HEADERS, extract_mapping
from inferline.config.tracing import tracer


class TraceMiddleware:
    """Pure ASGI: the span lasts until the last byte of a streamed answer."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        tracer_ = tracer()
        if scope["type"] != "http" or tracer_ is None:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        attributes = {"http.request.method": method}
        with tracer_.start_as_current_span(
            method, context=_parent(scope), kind=SpanKind.SERVER, attributes=attributes
        ) as span:

            async def send_traced(message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                # The route's template, not the path: the caller does not choose span names.
                route = getattr(scope.get("route"), "path", None)
                if route is not None:
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)


def _parent(scope):
    """The caller's trace context, or None (a new trace): a malformed or huge one is ignored."""
    carrier: dict[str, str] = {}
    for key, value in scope.get("headers", ()):
        key = key.decode("latin-1").lower()
        if key in TRACE_HEADERS and key not in carrier and len(value) <= MAX_TRACE_HEADER_BYTES:
            carrier[key] = value.decode("latin-1")
    return extract_mapping(carrier)
