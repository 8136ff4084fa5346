"""A Server-Sent Events response that notices a client hanging up while nothing is sent, and
always calls ``on_close`` at the end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        # no-cache, no proxy buffering: each event must reach the client as written.
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close  # public: a re-shaped stream keeps it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette only sees a hang-up when a write fails: listen for it instead.
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()
            self.on_close()
