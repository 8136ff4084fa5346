"""`python -m inferline.worker` / `inferline-worker`: load settings, build the engine, serve.
Exit codes: 0 after a clean drain, 1 on a start-up failure, 2 on a bad setting or backend.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog

from inferline.config.logging import configure_logging
from inferline.config.settings import SettingsError, load_settings
from inferline.config.tracing import setup_tracing


async def serve(settings) -> None:
    from inferline.worker.app import Worker  # imports torch: after the settings are good

    worker = Worker(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    await worker.run()


def main() -> int:
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"inferline-worker: {exc.code}", file=sys.stderr)
        return 2
    configure_logging(settings.log.level, settings.log.format)
    setup_tracing("inferline-worker")  # OTEL_TRACES_EXPORTER: off unless it names one
    try:
        asyncio.run(serve(settings))
    except Exception as exc:  # start-up failures: one line with the cause, not a hang
        from inferline.kernels.backends import BackendUnavailable  # torch is loaded by now

        if isinstance(exc, BackendUnavailable):
            print(f"inferline-worker: {exc}", file=sys.stderr)
            return 2
        structlog.get_logger("worker").exception("worker.failed", error=repr(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
