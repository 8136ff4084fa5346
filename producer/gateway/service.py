"""One OpenAI request's life: key, body, publish, then the whole text or an SSE stream; a hang-up
cancels the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import structlog
from pydantic import ValidationError
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from inferline.config.settings import Settings
from inferline.producer.client import InferenceError, RequestHandle
from inferline.producer.gateway.auth import ApiKeys
from inferline.producer.gateway.clients import ClientPool
from inferline.producer.gateway.errors import (
    OpenAIError,
    bad_request,
    from_inference,
    from_validation,
)
from inferline.producer.gateway.follower import Diverged, TextFollower
from inferline.producer.gateway.metrics import GatewayMetrics
from inferline.producer.gateway.openai_mapping import Mapped, chat_request, completion_request
from inferline.producer.gateway.openai_responses import DONE, FINISH, Shape, sse, tool_finish
from inferline.producer.gateway.reasoning import ReasoningSplitter
from inferline.producer.gateway.sse import SSEResponse
from inferline.producer.gateway.tool_calls import ToolCallParser
from inferline.contract.schema import DoneEvent, TokenLogprob, TokensEvent

log = structlog.get_logger(__name__)

# How often a request still waiting on the fleet checks whether its client hung up.
DISCONNECT_POLL_S = 0.25
# nginx's code for "client closed the request": counted in metrics, never seen by anyone.
CLIENT_CLOSED = 499


class Gateway:
    def __init__(
        self, settings: Settings, keys: ApiKeys, pool: ClientPool, metrics: GatewayMetrics
    ):
        self.settings, self.keys, self.pool, self.metrics = settings, keys, pool, metrics
        self.model = settings.gateway.model_name

    async def complete(self, request: HttpRequest, chat: bool) -> Response:
        """POST /v1/chat/completions (``chat``) or /v1/completions."""
        t0 = time.monotonic()
        endpoint = "chat" if chat else "completions"
        try:
            tenant = self.keys.tenant_of(request.headers.get("authorization"))
            body = await self.body(request)
        except OpenAIError as exc:
            return self.answered(endpoint, t0, exc.response())
        return await self.run(request, tenant, body, chat, endpoint, t0)

    async def run(
        self,
        request: HttpRequest,
        tenant: str | None,
        body: dict,
        chat: bool = True,
        endpoint: str = "chat",
        t0: float | None = None,
    ) -> Response:
        """Answer an OpenAI chat (``chat``) or legacy body for ``tenant``; ``request`` only tells
        whether the client hung up (``is_disconnected``)."""
        t0 = time.monotonic() if t0 is None else t0
        try:
            gateway = self.settings.gateway
            mapped = (
                chat_request(body, gateway.tool_call_parser) if chat else completion_request(body)
            )
            handle = await self._submit(tenant, mapped)
        except OpenAIError as exc:
            return self.answered(endpoint, t0, exc.response())
        self.metrics.in_flight.inc()
        shape = Shape(
            chat, handle.id, self.model, self.settings.gateway.reasoning_parser, mapped.tools
        )
        if mapped.stream:
            return await self._stream(request, handle, shape, mapped, endpoint, t0)
        try:
            response = await self._whole(request, handle, shape, mapped)
        except OpenAIError as exc:
            response = exc.response()
        finally:
            self._release(handle)
        return self.answered(endpoint, t0, response)

    async def body(self, request: HttpRequest) -> dict:
        """The request's JSON object; a 404 when it names another model."""
        body = await json_object(request)
        model = body.get("model")
        if model is not None and model != self.model:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist (this gateway serves {self.model!r})",
                param="model",
                code="model_not_found",
            )
        return body

    async def _submit(self, tenant: str | None, mapped: Mapped) -> RequestHandle:
        fields = dict(mapped.fields)
        if tenant is None or tenant not in self.settings.gateway.priority_tenants:
            fields.pop("priority", None)  # only keys allowed to set it may
        try:
            return await self.pool.submit(tenant, fields)
        except ValidationError as exc:  # the contract's rules, before anything is sent
            raise from_validation(exc, mapped.rename) from None
        except ValueError as exc:  # over the message size limit
            raise bad_request(None, str(exc)) from None
        except Exception as exc:  # the broker did not take it
            log.warning("submit failed", error=repr(exc))
            raise OpenAIError(
                503, "the request could not be queued", type="server_error", code="unavailable"
            ) from None

    async def _whole(
        self, request: HttpRequest, handle: RequestHandle, shape: Shape, mapped: Mapped
    ) -> Response:
        if not await self._until(request, handle.wait()):
            return Response(status_code=CLIENT_CLOSED)
        try:
            result = await handle.result()
        except InferenceError as exc:
            raise self._failure(exc, shape, mapped) from None
        by_sample = logprobs_by_sample(handle) if mapped.logprobs else None
        return JSONResponse(
            shape.whole(result.text, result.finish_reason, result.usage, result.samples, by_sample)
        )

    async def _until(self, request: HttpRequest, waiting) -> object | bool:
        """``waiting``'s result, or False when the client hung up first."""
        task = asyncio.ensure_future(waiting)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result() if task.result() is not None else True
            if await request.is_disconnected():
                task.cancel()
                return False

    # --- streams ---------------------------------------------------------------------------

    async def _stream(
        self,
        request: HttpRequest,
        handle: RequestHandle,
        shape: Shape,
        mapped: Mapped,
        endpoint: str,
        t0: float,
    ) -> Response:
        # Headers wait for the first event, so a rejection still gets its own status.
        events = handle.events()
        try:
            first = await self._until(request, anext(events))
        except InferenceError as exc:  # no event at all: client-side timeout or shutdown
            first, failure = None, exc
        else:
            failure = handle.failure if isinstance(first, DoneEvent) else None
        if first is False or failure is not None:
            self._release(handle)
            response = (
                Response(status_code=CLIENT_CLOSED)
                if first is False
                else self._failure(failure, shape, mapped).response()
            )
            return self.answered(endpoint, t0, response)

        # Counted when the stream closes: a hang-up (499), or the error's status.
        outcome = {"status": 200}

        def closed() -> None:
            self.metrics.streams_open.dec()
            status = CLIENT_CLOSED if not handle.finished else outcome["status"]
            self._release(handle)
            self.answered(endpoint, t0, None, status)

        chunks = self._chunks(handle, events, first, shape, mapped, t0, outcome)
        self.metrics.streams_open.inc()
        return SSEResponse(chunks, closed)

    async def _chunks(
        self,
        handle: RequestHandle,
        events: AsyncIterator,
        first,
        shape: Shape,
        mapped: Mapped,
        t0: float,
        outcome: dict,
    ) -> AsyncIterator[str]:
        include_usage = mapped.include_usage
        followers, ev, quiet = [TextFollower(i) for i in range(handle.request.n)], first, True
        splitters = [ReasoningSplitter(shape.reasoning) for _ in followers]
        callers = [ToolCallParser(shape.tools) for _ in followers] if shape.tools else []
        offsets = [0] * len(followers)  # legacy logprobs' text_offset, per choice
        if shape.chat:
            for f in followers:
                yield shape.chunk("", first=True, include_usage=include_usage, index=f.index)
        try:
            while ev is not None:
                for f in followers:
                    text = f.feed(ev)
                    logprobs = None
                    if (
                        mapped.logprobs
                        and isinstance(ev, TokensEvent)
                        and ev.index == f.index
                        and ev.logprobs
                        and f.caught_up
                    ):  # a rerun's tokens already sent are not resent
                        logprobs = shape.logprobs(ev.logprobs, offsets[f.index])
                        offsets[f.index] += sum(len(e.token or "") for e in ev.logprobs)
                    if text and quiet:
                        quiet = False
                        self.metrics.ttft.observe(time.monotonic() - t0)
                    reasoning, calls = "", None
                    if text and shape.reasoning:
                        reasoning, text = splitters[f.index].feed(text)
                    if text and callers:
                        text, calls = callers[f.index].feed(text)
                    if text or reasoning or logprobs or calls:
                        yield shape.chunk(
                            text,
                            include_usage=include_usage,
                            index=f.index,
                            logprobs=logprobs,
                            reasoning=reasoning,
                            tool_calls=calls,
                        )
                ev = await anext(events, None)
        except (InferenceError, Diverged) as exc:
            yield self._stream_error(exc, shape, mapped, outcome)
            return
        if handle.failure is not None:  # ended by the worker after it started
            yield self._stream_error(handle.failure, shape, mapped, outcome)
            return
        done = handle.done_event
        reasons = {s.index: s.finish_reason for s in done.samples or []}
        for f in followers:
            reasoning, text = splitters[f.index].finish() if shape.reasoning else ("", "")
            calls: list[dict] = []
            if callers:  # what the reasoning parser held, then what the tool parser held
                text, calls = callers[f.index].feed(text) if text else ("", [])
                rest, more = callers[f.index].finish()
                text, calls = text + rest, calls + more
            if reasoning or text or calls:  # held back: it might have begun a tag or a call
                yield shape.chunk(
                    text,
                    include_usage=include_usage,
                    index=f.index,
                    reasoning=reasoning,
                    tool_calls=calls,
                )
            reason = reasons.get(f.index, done.finish_reason)
            called = bool(callers) and bool(callers[f.index].calls)
            yield shape.chunk(
                None,
                tool_finish(FINISH.get(reason, reason), called),
                include_usage=include_usage,
                index=f.index,
            )
        if include_usage:
            yield shape.usage_chunk(done.usage)
        yield DONE

    def _failure(self, exc: InferenceError, shape: Shape, mapped: Mapped) -> OpenAIError:
        prompt_param = "messages" if shape.chat else "prompt"
        return from_inference(exc, self.settings.gateway.retry_after_s, prompt_param, mapped.rename)

    def _stream_error(self, exc: Exception, shape: Shape, mapped: Mapped, outcome: dict) -> str:
        # Headers are sent: the status goes into the event, as vLLM does.
        error = (
            self._failure(exc, shape, mapped)
            if isinstance(exc, InferenceError)
            else OpenAIError(500, str(exc), type="server_error", code="diverged")
        )
        outcome["status"] = error.status
        return sse(error.body()) + DONE

    # --- bookkeeping -----------------------------------------------------------------------

    def _release(self, handle: RequestHandle) -> None:
        if handle.id not in self.pool.in_flight:
            return
        self.metrics.in_flight.dec()
        if not handle.finished:
            self.metrics.cancels.inc()
        self.pool.release(handle)

    def answered(
        self, endpoint: str, t0: float, response: Response | None, status: int = 200
    ) -> Response | None:
        """Count an answer (or, for a stream that closed, its `status`) in the metrics."""
        status = response.status_code if response is not None else status
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.duration.observe(time.monotonic() - t0)
        return response


def logprobs_by_sample(handle: RequestHandle) -> dict[int, list[TokenLogprob]]:
    """The final attempt's logprobs, by sample."""
    out: dict[int, list[TokenLogprob]] = {}
    for ev in handle.log:
        if isinstance(ev, TokensEvent) and ev.attempt == handle.attempt and ev.logprobs:
            out.setdefault(ev.index, []).extend(ev.logprobs)
    return out


async def json_object(request: HttpRequest) -> dict:
    """The request's body as a JSON object, or the OpenAI-shaped 400 saying why not."""
    try:
        body = await request.json()
    except ValueError:
        raise bad_request(None, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    return body
