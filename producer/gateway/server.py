"""Running the gateway under uvicorn; on SIGTERM/SIGINT the requests in flight are cancelled
first (their `done`s end the open streams)."""

from __future__ import annotations

import uvicorn

from inferline.config.settings import Settings
from inferline.producer.gateway.app import create_app


class GatewayServer(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        # uvicorn waits for open responses before the lifespan's shutdown: cancel them first.
        await self.config.app.state.gateway.pool.cancel_all()
        await super().shutdown(sockets)


def make_server(
    settings: Settings, host: str | None = None, port: int | None = None
) -> GatewayServer:
    g = settings.gateway
    config = uvicorn.Config(
        create_app(settings),
        host=host or g.host,
        port=g.port if port is None else port,
        log_level=settings.log.level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    return GatewayServer(config)
