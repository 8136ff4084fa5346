"""The gateway's ASGI app: OpenAI's routes plus /healthz, /readyz and /metrics."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from config.settings import Settings, load_settings
from producer.gateway.auth import ApiKeys, load_keys
from producer.gateway.clients import ClientPool
from producer.gateway.errors import OpenAIError
from producer.gateway.metrics import GatewayMetrics
from producer.gateway.service import Gateway


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; its lifespan connects to Kafka and, at shutdown, cancels what is in flight."""
    settings = settings or load_settings()
    keys = ApiKeys(load_keys(settings.gateway, settings.kafka.tenancy == "topic", settings.kafka))
    gateway = Gateway(settings, keys, ClientPool(settings, keys.tenants), GatewayMetrics())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gateway.pool.start()
        yield
        await gateway.pool.close()

    app = FastAPI(title="inferline gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    _add_routes(app, gateway)
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
        model = {"id": gateway.model, "object": "model", "created": created, "owned_by": "inferline"}
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/healthz")
    @app.get("/health")  # vLLM's name: OpenAI benchmark clients (guidellm) probe it first
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = gateway.pool.started
        return JSONResponse({"ready": ready, "in_flight": len(gateway.pool.in_flight)}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    # Every error in OpenAI's shape, including the framework's own (404 route, 405 method).
    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return OpenAIError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return OpenAIError(400, str(exc.errors()[0].get("msg", "invalid request"))).response()
