"""/healthz (liveness: 503 once the engine loop has gone `stall_threshold_s` without a tick),
/readyz (readiness) and /metrics on INFERLINE_HTTP__PORT (docs/operations.md#running).
"""

from __future__ import annotations

import time
from typing import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST


class HttpServer:
    def __init__(
        self,
        settings,
        metrics,
        last_tick: Callable[[], float | None],  # None: starting
        readiness: Callable[[], dict[str, bool]],
    ) -> None:
        self._s = settings.http
        self._metrics = metrics
        self._last_tick = last_tick
        self._readiness = readiness
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_page)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._s.host, self._s.port)
        await site.start()
        # Port 0 picks a free port: report the real one.
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def _healthz(self, _request: web.Request) -> web.Response:
        tick = self._last_tick()
        if tick is None:  # still loading: alive, not ready
            return web.json_response({"status": "starting", "last_tick_age_s": None})
        age = time.monotonic() - tick
        ok = age < self._s.stall_threshold_s
        body = {"status": "ok" if ok else "stalled", "last_tick_age_s": round(age, 3)}
        return web.json_response(body, status=200 if ok else 503)

    async def _readyz(self, _request: web.Request) -> web.Response:
        checks = self._readiness()
        ok = all(checks.values())
        return web.json_response({"ready": ok, **checks}, status=200 if ok else 503)

    async def _metrics_page(self, _request: web.Request) -> web.Response:
        resp = web.Response(body=self._metrics.render())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp
