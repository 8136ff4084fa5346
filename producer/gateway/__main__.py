"""`inferline-gateway` and `python -m inferline.producer.gateway`: serve the OpenAI-compatible
API."""

from __future__ import annotations

import argparse
import asyncio
import sys

from inferline.config.logging import configure_logging
from inferline.config.settings import load_settings
from inferline.config.tracing import setup_tracing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="default: INFERLINE_GATEWAY__HOST (0.0.0.0)")
    parser.add_argument(
        "--port", type=int, default=None, help="default: INFERLINE_GATEWAY__PORT (8000)"
    )


async def serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    kafka = {
        k: v
        for k, v in (
            ("bootstrap_servers", getattr(args, "bootstrap_servers", None)),
            ("request_topic", getattr(args, "request_topic", None)),
            ("cancel_topic", getattr(args, "cancel_topic", None)),
        )
        if v
    }
    if kafka:
        settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update=kafka)})
    configure_logging(settings.log.level, settings.log.format)
    setup_tracing("inferline-gateway")  # OTEL_TRACES_EXPORTER: off unless it names one
    from inferline.producer.gateway.server import (
        make_server,
    )  # FastAPI and uvicorn: only when serving

    await make_server(settings, args.host, args.port).serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inferline-gateway", description=__doc__.split(":")[1].strip()
    )
    add_arguments(parser)
    try:
        return asyncio.run(serve(parser.parse_args(argv)))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
