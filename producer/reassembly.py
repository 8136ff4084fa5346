"""One submitted request's reply events reassembled across attempts (duplicates dropped by
(attempt, seq), gaps counted): the RequestHandle and what it yields.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from inferline.producer.errors import ClientTimeout, IncompleteStream, InferenceError, error_for
from inferline.contract.schema import (
    DoneEvent,
    ErrorInfo,
    Request,
    Sample,
    StartedEvent,
    Timing,
    TokensEvent,
    Usage,
)

if TYPE_CHECKING:
    from inferline.producer.client import InferenceClient

log = structlog.get_logger(__name__)

Event = StartedEvent | TokensEvent | DoneEvent


class TextDelta(str):
    """New text; ``restart`` marks a new attempt's first delta: discard the text shown so far."""

    attempt: str
    restart: bool

    def __new__(cls, text: str, attempt: str, restart: bool = False) -> TextDelta:
        obj = super().__new__(cls, text)
        obj.attempt, obj.restart = attempt, restart
        return obj


@dataclass
class Result:
    """One request's outcome: the final attempt's text and the worker's accounting, plus the
    client's timings (``client_*``, seconds since submit); with n > 1 ``samples`` lists each."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None = None
    timing: Timing | None = None
    error: ErrorInfo | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    attempt: str | None = None
    attempts: int = 0
    duplicates: int = 0
    gaps: int = 0
    client_ttft_s: float | None = None
    client_total_s: float | None = None
    samples: list[Sample] | None = None


class RequestHandle:
    """One submitted request, fed by the client's consumer task; any number of readers may follow
    it, each from the start."""

    def __init__(self, request: Request, client: InferenceClient | None = None):
        self.request = request
        self.id = request.id
        self._client = client
        self.log: list[Event] = []  # accepted events, all attempts
        self.attempt: str | None = None
        self.attempts = 0
        self.duplicates = 0
        self.gaps = 0
        self._next_seq = 0
        self._dead: set[str] = set()  # superseded or requeued attempts
        self._parts: list[str] = []
        self.token_ids: list[int] = []
        self.done_event: DoneEvent | None = None
        self.failure: InferenceError | None = None
        self.finished = False
        self.t_submit = time.monotonic()
        self.t_first_token: float | None = None
        self.t_done: float | None = None
        # (monotonic time, tokens) of the current attempt's tokens events, for ITL stats.
        self.token_times: list[tuple[float, int]] = []
        self._changed = asyncio.Event()
        self._on_finish: Callable[[RequestHandle], None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    # --- fed by the consumer task (synchronous: no reader sees half a state) --------------------

    def feed(self, ev: Event) -> bool:
        """Take one event; False when stale, a duplicate, or after the end."""
        if self.finished or ev.attempt in self._dead:
            return False
        if ev.attempt != self.attempt:
            if not self._takes_over(ev):
                return False
            self._new_attempt(ev.attempt)
            if isinstance(ev, DoneEvent):
                self._next_seq = ev.seq  # a re-sent final done alone is whole: no gap before it
        if ev.seq < self._next_seq:
            self.duplicates += 1
            return False
        if ev.seq > self._next_seq:
            self.gaps += 1
            log.warning(
                "event gap",
                request_id=self.id,
                attempt=ev.attempt,
                expected=self._next_seq,
                got=ev.seq,
            )
        self._next_seq = ev.seq + 1
        self.log.append(ev)
        self._apply(ev)
        self._wake()
        return True

    def _takes_over(self, ev: Event) -> bool:
        """Whether another attempt's event makes it the live one: its first event or a final `done`
        does; an older attempt's late `requeued` or stray tokens never do."""
        if isinstance(ev, DoneEvent) and ev.finish_reason == "requeued":
            self._dead.add(ev.attempt)
            return False
        return self.attempt is None or ev.seq == 0 or isinstance(ev, DoneEvent)

    def _new_attempt(self, attempt: str) -> None:
        # The old attempt's worker is gone (or a zombie): its text is void.
        if self.attempt is not None:
            self._dead.add(self.attempt)
            log.info("new attempt", request_id=self.id, old=self.attempt, new=attempt)
        self.attempt, self.attempts, self._next_seq = attempt, self.attempts + 1, 0
        self._parts, self.token_ids, self.token_times, self.t_first_token = [], [], [], None

    def _apply(self, ev: Event) -> None:
        if isinstance(ev, TokensEvent):
            now = time.monotonic()
            if self.t_first_token is None and ev.token_ids:
                self.t_first_token = now
            self.token_times.append((now, len(ev.token_ids)))
            if ev.index == 0:  # n > 1: other samples' texts arrive whole in `done`
                self._parts.append(ev.text)
                self.token_ids.extend(ev.token_ids)
        elif isinstance(ev, DoneEvent):
            if ev.finish_reason == "requeued":
                self._dead.add(ev.attempt)  # another attempt follows
            else:
                self._finish(ev, error_for(ev))

    def _finish(self, done: DoneEvent | None, failure: InferenceError | None) -> None:
        self.done_event, self.failure, self.finished = done, failure, True
        self.t_done = time.monotonic()
        if self._timer:
            self._timer.cancel()
        if failure is not None:
            failure.result = self.partial_result()
        if self._on_finish:
            self._on_finish(self)
        self._wake()

    def fail(self, failure: InferenceError) -> None:
        """End the request on the client side (timeout, client closed)."""
        if not self.finished:
            failure.request_id = self.id
            self._finish(None, failure)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # --- readers ---------------------------------------------------------------------------

    @property
    def text_so_far(self) -> str:
        """The current attempt's text (the whole text once done)."""
        done = self.done_event
        if done is not None and done.text is not None:
            return done.text  # the worker's text also repairs a gap
        return "".join(self._parts)

    def partial_result(self) -> Result:
        done = self.done_event
        since = self.t_submit
        return Result(
            id=self.id,
            text=self.text_so_far,
            token_ids=list(self.token_ids),
            finish_reason=done.finish_reason
            if done
            else ("timeout" if isinstance(self.failure, ClientTimeout) else "none"),
            usage=done.usage if done else None,
            timing=done.timing if done else None,
            error=done.error if done else None,
            metadata=dict(done.metadata) if done else {},
            attempt=self.attempt,
            attempts=self.attempts,
            duplicates=self.duplicates,
            gaps=self.gaps,
            client_ttft_s=self.t_first_token - since if self.t_first_token else None,
            client_total_s=self.t_done - since if self.t_done else None,
            samples=list(done.samples) if done and done.samples else None,
        )

    async def events(self) -> AsyncIterator[Event]:
        """Every accepted event (all attempts, in order) until the final ``done``; raises only
        for client-side endings."""
        i = 0
        while True:
            while i < len(self.log):
                yield self.log[i]
                i += 1
            if self.finished:
                break
            await self._changed.wait()
        if self.done_event is None and self.failure is not None:
            raise self.failure

    async def text(self) -> AsyncIterator[TextDelta]:
        """Text deltas (sample 0's) as they arrive; at the end, raises the request's InferenceError
        unless it finished with ``stop`` or ``length``."""
        attempt = None
        streamed = False
        async for ev in self.events():
            if ev.attempt != attempt:
                if attempt is not None:
                    yield TextDelta("", ev.attempt, restart=True)
                attempt, streamed = ev.attempt, False
            if isinstance(ev, TokensEvent) and ev.text and ev.index == 0:
                streamed = True
                yield TextDelta(ev.text, ev.attempt)
            elif isinstance(ev, DoneEvent) and not streamed and ev.text:
                yield TextDelta(ev.text, ev.attempt)  # stream=false: the whole text comes in done
        if self.failure is not None:
            raise self.failure

    async def wait(self) -> None:
        while not self.finished:
            await self._changed.wait()

    async def result(self, check: bool = True) -> Result:
        """The final Result; with ``check``, raises the InferenceError for anything but
        ``stop``/``length``, or IncompleteStream for an unrepairable gap."""
        await self.wait()
        result = self.partial_result()
        if check and self.failure is not None:
            raise self.failure
        if check and self.gaps and (self.done_event is None or self.done_event.text is None):
            raise IncompleteStream(
                f"{self.gaps} gap(s) in the event stream", request_id=self.id, result=result
            )
        return result

    async def cancel(self) -> None:
        """Ask the workers to stop this request; its ``done`` (``cancelled``) still arrives."""
        assert self._client is not None, "handle is not attached to a client"
        await self._client.cancel(self.id)
