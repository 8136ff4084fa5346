"""One request's spans in the worker: `inferline.request` continues the producer's trace (the
record's traceparent) and holds a child span for each phase: kafka_wait (the record's timestamp
to receipt), pool_wait, prefill (to the first token), decode, delivery (to the final's commit).
Phases end in the past as the request moves, so each child is made with explicit times; with
tracing off every method is a no-op (NO_TRACE). docs/operations.md#tracing
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from inferline.config.tracing import extract_headers, inject_headers, tracer


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class NoTrace:
    """Tracing off: no spans, no headers."""

    headers: list | None = None

    def started(self, now: float) -> None: ...
    def first_token(self, now: float) -> None: ...
    def finished(self, now: float, prompt_tokens: int, output_tokens: int, reason: str): ...
    def delivered(self, outcome: str) -> None: ...


NO_TRACE = NoTrace()


class RequestTrace(NoTrace):
    """The spans of one attempt, from its record's receipt to its last `done`'s outcome."""

    def __init__(self, tracer_, parent, adm) -> None:
        req, tp = adm.request, adm.tp
        # A timestamp after receipt (clock skew, or one the producer set) counts as receipt.
        sent = adm.sent_at if adm.sent_at is not None and adm.sent_at <= adm.received else None
        self._tracer = tracer_
        attributes = {
            "gen_ai.request.id": req.id,
            "inferline.tenant": req.tenant,
            "inferline.priority": req.priority,
            "messaging.system": "kafka",
            "messaging.destination.name": tp.topic,
            "messaging.destination.partition.id": str(tp.partition),
            "messaging.kafka.offset": adm.offset,
        }
        self.span = tracer_.start_span(
            "inferline.request",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_time=_ns(sent if sent is not None else adm.received),
        )
        self._ctx = trace.set_span_in_context(self.span)
        self.headers = inject_headers(self._ctx) or None  # on every event of the attempt
        if sent is not None:
            self._child("inferline.kafka_wait", sent, adm.received)
        self._mark = adm.received  # where the current phase began
        self._phase = "inferline.pool_wait"

    def _child(self, name: str, start: float, end: float) -> None:
        span = self._tracer.start_span(name, context=self._ctx, start_time=_ns(start))
        span.end(end_time=_ns(max(start, end)))

    def _next(self, now: float, phase: str | None) -> None:
        if self._phase is not None:
            self._child(self._phase, self._mark, now)
        self._mark, self._phase = now, phase

    def started(self, now: float) -> None:
        """The engine took it from the waiting pool."""
        self._next(now, "inferline.prefill")

    def first_token(self, now: float) -> None:
        self._next(now, "inferline.decode")

    def finished(self, now: float, prompt_tokens: int, output_tokens: int, reason: str) -> None:
        """Its last output; delivery (the `done`, committed with its offset) begins."""
        self._next(now, "inferline.delivery")
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": (reason,),
            }
        )

    def delivered(self, outcome: str) -> None:
        """The `done`'s outcome (committed, moved, failed): the request span ends."""
        now = time.time()  # one instant: delivery ends where the request does
        self._next(now, None)
        self.span.set_attribute("inferline.delivery.outcome", str(outcome))
        self.span.end(end_time=_ns(now))


def request_trace(adm, headers) -> NoTrace:
    """The trace of an admitted request, continuing the one its record's `headers` carry (or a
    new one); NO_TRACE when tracing is off."""
    tracer_ = tracer()
    if tracer_ is None:
        return NO_TRACE
    return RequestTrace(tracer_, extract_headers(headers), adm)


def reply_headers(headers) -> list[tuple[str, bytes]] | None:
    """Headers for a reply to a request that did not run (a rejection): its producer's trace
    context as it came, if valid; None when there is none or tracing is off."""
    ctx = extract_headers(headers)
    return (inject_headers(ctx) or None) if ctx is not None else None
