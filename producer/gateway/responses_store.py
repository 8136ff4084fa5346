"""`/v1/responses`: create (answered through the chat path), and the stored responses that
retrieve, cancel, delete and previous_response_id read, in a compacted topic every replica reads
back (as the Batch API's state, table.py). design: docs/gateway.md#responses-api
"""

from __future__ import annotations

import asyncio
import json
import time

import structlog
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from inferline.config.settings import Settings
from inferline.producer.gateway.errors import OpenAIError, bad_request
from inferline.producer.gateway.responses_events import EventStream, translate
from inferline.producer.gateway.responses_mapping import (
    chat_body,
    finish,
    new_id,
    output_items,
    param_of,
    response_object,
    assistant_turn,
)
from inferline.producer.gateway.service import Gateway
from inferline.producer.gateway.sse import SSEResponse
from inferline.producer.gateway.table import MAX_VALUE_BYTES, TopicTable

log = structlog.get_logger(__name__)

ENDPOINT = "responses"  # the metrics' label
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
# A stored conversation fits one Kafka message, with room for the response object around it.
MAX_CONVERSATION_BYTES = MAX_VALUE_BYTES // 2


def store_topic(settings: Settings) -> str:
    """Two segments deep, so topic tenancy never reads it as a tenant's request topic."""
    return f"{settings.kafka.request_topic}.responses.state"


class _Cancelled:
    """Stands for a background response's HTTP request: it "hangs up" when cancelled."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def is_disconnected(self) -> bool:
        return self.event.is_set()


class Responses:
    """POST/GET/DELETE /v1/responses[/{id}] and POST /v1/responses/{id}/cancel."""

    def __init__(self, settings: Settings, gateway: Gateway):
        self.gateway = gateway
        self.table = TopicTable(settings.kafka, store_topic(settings), on_change=self._changed)
        self.available = False
        self.running: dict[str, _Cancelled] = {}  # background responses this replica runs
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Read the stored responses; if the topic is refused, responses are not stored."""
        try:
            await self.table.start()
        except Exception as exc:
            log.warning("responses store unavailable", error=repr(exc), topic=self.table.topic)
            await self.table.close()
            return
        self.available = True

    async def close(self) -> None:
        for run in self.running.values():
            run.event.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.table.close()

    # --- create -------------------------------------------------------------------------------

    async def create(self, request: HttpRequest) -> Response:
        t0 = time.monotonic()
        try:
            tenant = self.gateway.keys.tenant_of(request.headers.get("authorization"))
            body = await self.gateway.body(request)
            store, background = _flag(body, "store", True), _flag(body, "background", False)
            history = await self._history(tenant, body.get("previous_response_id"))
            chat = chat_body(body, history)
            turns = (
                chat["messages"][1:] if body.get("instructions") is not None else chat["messages"]
            )
            store = store and self._can_store(turns, background)
            if background and (body.get("stream") or not store):
                raise bad_request("background", "background: needs store and no stream")
        except OpenAIError as exc:
            return self.gateway.answered(ENDPOINT, t0, exc.response())
        response = response_object({**body, "store": store}, new_id("resp"), self.gateway.model)
        keep = (lambda r: self._keep(r, turns, tenant)) if store else _nothing
        if background:
            return await self._background(response, tenant, chat, keep)
        answer = await self.gateway.run(request, tenant, chat, endpoint=ENDPOINT)
        if isinstance(answer, SSEResponse):  # the chat stream, re-shaped; its close still runs
            events = translate(answer.body_iterator, EventStream(response), keep)
            return SSEResponse(events, answer.on_close)
        if answer.status_code != 200:
            return _error(answer)
        await keep(_completed(response, answer))
        return JSONResponse(response)

    def _can_store(self, turns: list[dict], background: bool) -> bool:
        if not self.available:  # answered all the same; the object says it was not stored
            if background:
                raise _unavailable()
            return False
        size = len(json.dumps(turns).encode())
        if size > MAX_CONVERSATION_BYTES:
            raise bad_request(
                "input",
                f"input: the conversation is {size} bytes, at most {MAX_CONVERSATION_BYTES} "
                "for a stored response (or store: false)",
            )
        return True

    async def _history(self, tenant: str | None, previous: str | None) -> list[dict]:
        if previous is None:
            return []
        if not self.available:
            raise _unavailable()
        rec = await self._record(previous, tenant, "previous_response_id")
        if rec["response"]["status"] not in ("completed", "incomplete"):
            raise bad_request(
                "previous_response_id",
                f"previous_response_id: {previous} is {rec['response']['status']}",
            )
        return rec["messages"]

    async def _keep(self, response: dict, turns: list[dict], tenant: str | None) -> None:
        """Store the response with its conversation; a background one only while its record
        is still running (not cancelled, not deleted)."""
        if response["status"] == "failed":
            turns = []
        stored = json.loads(self.table.data.get(response["id"], b"{}"))
        if response["background"] and stored.get("response", {}).get("status") != "in_progress":
            return
        messages = [*turns, assistant_turn(response["output"])]
        await self._save(response, messages, tenant)

    async def _save(self, response: dict, messages: list[dict], tenant: str | None) -> None:
        value = json.dumps({"response": response, "messages": messages, "tenant": tenant}).encode()
        if len(value) > MAX_VALUE_BYTES:  # the answer itself was too long to keep
            log.warning("response too large to store", response_id=response["id"])
            response["store"] = False
            return
        await self.table.put(response["id"], value)

    # --- background ---------------------------------------------------------------------------

    async def _background(self, response: dict, tenant: str | None, chat: dict, keep) -> Response:
        response["status"] = "queued"
        await self._save(response, [], tenant)
        run = self.running[response["id"]] = _Cancelled()
        task = asyncio.create_task(self._run(run, response, tenant, chat, keep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return JSONResponse(response)

    async def _run(self, run: _Cancelled, response: dict, tenant, chat: dict, keep) -> None:
        try:
            response = {**response, "status": "in_progress"}
            if run.event.is_set():  # cancelled while queued
                return
            await self._save(response, [], tenant)
            answer = await self.gateway.run(run, tenant, chat, endpoint=ENDPOINT)
            if run.event.is_set():
                return  # cancelled: the canceller stored it so
            if answer.status_code == 200:
                await keep(_completed(response, answer))
            else:
                error = json.loads(answer.body)["error"]
                response.update(
                    status="failed",
                    error={
                        "code": error.get("code") or "server_error",
                        "message": error["message"],
                    },
                )
                await keep(response)
        except Exception:
            log.exception("background response failed", response_id=response["id"])
        finally:
            self.running.pop(response["id"], None)

    def _changed(self, key: str, value: bytes) -> None:
        # Another replica cancelled (or deleted) a response this one runs.
        if key in self.running and json.loads(value)["response"]["status"] == "cancelled":
            self.running[key].event.set()

    # --- retrieve, cancel, delete -------------------------------------------------------------

    async def retrieve(self, request: HttpRequest, resp_id: str) -> Response:
        async def work(tenant):
            for name in request.query_params:  # `stream`, `include`, ...: not implemented
                raise bad_request(name, f"{name} is not supported")
            return (await self._record(resp_id, tenant))["response"]

        return await self._answer(request, work)

    async def cancel(self, request: HttpRequest, resp_id: str) -> Response:
        async def work(tenant):
            rec = await self._record(resp_id, tenant)
            response = rec["response"]
            if not response["background"]:
                raise bad_request(None, "only a background response can be cancelled")
            if response["status"] not in TERMINAL:
                response["status"] = "cancelled"
                await self.table.put(resp_id, json.dumps(rec).encode())
                if resp_id in self.running:
                    self.running[resp_id].event.set()
            elif response["status"] != "cancelled":
                raise bad_request(None, f"cannot cancel a response that is {response['status']}")
            return response

        return await self._answer(request, work)

    async def delete(self, request: HttpRequest, resp_id: str) -> Response:
        async def work(tenant):
            await self._record(resp_id, tenant)
            if resp_id in self.running:
                self.running[resp_id].event.set()
            await self.table.delete(resp_id)
            return {"id": resp_id, "object": "response", "deleted": True}

        return await self._answer(request, work)

    async def _answer(self, request: HttpRequest, work) -> Response:
        try:
            tenant = self.gateway.keys.tenant_of(request.headers.get("authorization"))
            if not self.available:
                raise _unavailable()
            return JSONResponse(await work(tenant))
        except OpenAIError as exc:
            return exc.response()

    async def _record(self, resp_id: str, tenant: str | None, param: str = "response_id") -> dict:
        raw = await self.table.get(resp_id, fresh=True)
        rec = json.loads(raw) if raw is not None else None
        if rec is None or rec.get("tenant") != tenant:
            raise OpenAIError(404, f"no such response: {resp_id}", param=param, code="not_found")
        return rec


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name}: must be a boolean")
    return value


def _completed(response: dict, answer: Response) -> dict:
    completion = json.loads(answer.body)
    choice = completion["choices"][0]
    return finish(
        response, output_items(choice["message"]), choice["finish_reason"], completion["usage"]
    )


def _error(answer: Response) -> Response:
    """A chat error, its `param` renamed to the Responses parameter it came from."""
    body = json.loads(answer.body)
    body["error"]["param"] = param_of(body["error"].get("param"))
    return JSONResponse(body, status_code=answer.status_code, headers=_retry_after(answer))


def _retry_after(answer: Response) -> dict[str, str]:
    value = answer.headers.get("retry-after")
    return {"Retry-After": value} if value else {}


def _unavailable() -> OpenAIError:
    return OpenAIError(
        503,
        "stored responses are unavailable: their Kafka topic could not be set up "
        "(see the gateway's log)",
        type="server_error",
        code="unavailable",
    )


async def _nothing(_response: dict) -> None:
    return None
