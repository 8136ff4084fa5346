"""The gateway's ASGI app: OpenAI's routes plus /healthz, /readyz and /metrics."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from inferline.config.settings import Settings, load_settings
from inferline.producer.gateway.auth import ApiKeys, load_keys
from inferline.producer.gateway.clients import ClientPool
from inferline.producer.gateway.batches import BatchService
from inferline.producer.gateway.errors import OpenAIError
from inferline.producer.gateway.files import parse_upload
from inferline.producer.gateway.metrics import GatewayMetrics
from inferline.producer.gateway.responses_store import Responses
from inferline.producer.gateway.service import Gateway, json_object
from inferline.producer.gateway.tracing import TraceMiddleware


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; its lifespan connects to Kafka and, at shutdown, cancels what is in flight."""
    settings = settings or load_settings()
    keys = ApiKeys(load_keys(settings.gateway, settings.kafka.tenancy == "topic", settings.kafka))
    gateway = Gateway(settings, keys, ClientPool(settings, keys.tenants), GatewayMetrics())
    batches = BatchService(settings, gateway.pool.instance)
    responses = Responses(settings, gateway)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gateway.pool.start()
        # Side by side (each reads a topic to its end); a refused topic leaves only the Batch API
        # off (503), or only stored responses.
        await asyncio.gather(batches.start(), responses.start())
        yield
        await responses.close()
        await batches.close()
        await gateway.pool.close()

    # FastAPI's own tracing (0.16x, on once a global provider is set) would add a second server
    # span, a sibling of TraceMiddleware's, with the URL's query as attributes: ours only.
    # (An older FastAPI keeps the unknown keyword in app.extra.)
    app = FastAPI(
        title="inferline gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        telemetry={"tracing": False},
    )
    app.state.gateway = gateway
    app.state.batches = batches
    app.state.responses = responses
    app.add_middleware(TraceMiddleware)  # a no-op while tracing is off
    _add_routes(app, gateway)
    _add_batch_routes(app, gateway, batches)
    _add_responses_routes(app, responses)
    _add_error_handlers(app)
    return app


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.complete(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            gateway.keys.tenant_of(request.headers.get("authorization"))
        except OpenAIError as exc:
            return exc.response()
        model = {
            "id": gateway.model,
            "object": "model",
            "created": created,
            "owned_by": "inferline",
        }
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/healthz")
    @app.get("/health")  # vLLM's name: OpenAI benchmark clients probe it first
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = gateway.pool.started
        return JSONResponse(
            {"ready": ready, "in_flight": len(gateway.pool.in_flight)},
            status_code=200 if ready else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_batch_routes(app: FastAPI, gateway: Gateway, batches: BatchService) -> None:
    """OpenAI's Files and Batch API: files and batches belong to the key's tenant."""

    async def answer(request: Request, work) -> Response:
        try:
            tenant = gateway.keys.tenant_of(request.headers.get("authorization"))
            if not batches.available:
                raise OpenAIError(
                    503,
                    "the Batch API is unavailable: its Kafka topics could not be set up "
                    "(see the gateway's log)",
                    type="server_error",
                    code="unavailable",
                )
            result = await work(tenant)
        except OpenAIError as exc:
            return exc.response()
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/files")
    async def upload(request: Request) -> Response:
        async def work(tenant):
            data, filename, purpose = parse_upload(
                request.headers.get("content-type", ""), await request.body()
            )
            return await batches.files.put(data, filename, purpose, tenant)

        return await answer(request, work)

    @app.get("/v1/files/{file_id}")
    async def file_meta(request: Request, file_id: str) -> Response:
        return await answer(request, lambda tenant: batches.files.meta(file_id, tenant))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        async def work(tenant):
            return Response(
                await batches.files.content(file_id, tenant), media_type="application/octet-stream"
            )

        return await answer(request, work)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Response:
        return await answer(request, lambda tenant: batches.delete_file(tenant, file_id))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        return await answer(
            request, lambda tenant: _then(json_object(request), lambda b: batches.create(tenant, b))
        )

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> Response:
        async def work(tenant):
            return batches.public(await batches.record(batch_id, tenant))

        return await answer(request, work)

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> Response:
        return await answer(
            request, lambda tenant: _now(batches.list(tenant, max(1, min(limit, 100)), after))
        )

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        return await answer(request, lambda tenant: batches.cancel(tenant, batch_id))


def _add_responses_routes(app: FastAPI, responses: Responses) -> None:
    """OpenAI's Responses API; stored responses belong to the key's tenant."""

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await responses.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses.delete(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await responses.cancel(request, response_id)


async def _now(value):
    return value


async def _then(first, then):
    return await then(await first)


def _add_error_handlers(app: FastAPI) -> None:
    # Every error in OpenAI's shape, including the framework's own (404 route, 405 method).
    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return OpenAIError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return OpenAIError(400, str(exc.errors()[0].get("msg", "invalid request"))).response()
