"""The worker's shutdown steps are bounded and contained: one that fails lets the next run. A
step whose own awaited task was cancelled (aiokafka's consumer stop, after a fetch on a broken
connection: seen when an OAuth token expired) raised CancelledError through the shutdown."""

from __future__ import annotations

import asyncio

import pytest

from inferline.worker.app import _bounded


async def test_a_step_cancelled_inside_is_a_failed_step_not_a_cancelled_shutdown():
    async def stop_that_awaits_a_cancelled_task() -> None:
        inner = asyncio.create_task(asyncio.sleep(10))
        await asyncio.sleep(0)
        inner.cancel()
        await inner  # as aiokafka's Fetcher.close does

    await _bounded(stop_that_awaits_a_cancelled_task(), 5.0, "cancels.close")  # no raise


async def test_a_cancelled_shutdown_still_stops():
    started = asyncio.Event()

    async def slow_step() -> None:
        started.set()
        await asyncio.sleep(10)

    shutdown = asyncio.create_task(_bounded(slow_step(), 5.0, "slow"))
    await started.wait()
    shutdown.cancel()
    with pytest.raises(asyncio.CancelledError):
        await shutdown
