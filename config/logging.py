"""The only place structlog is configured: JSON lines on stderr, or a console on a terminal
(`INFERLINE_LOG__FORMAT` forces either); stdlib loggers go through the same renderer.
"""

from __future__ import annotations

import logging
import sys

import structlog

# Chatty libraries: their INFO lines are per-connection noise, their warnings matter.
_QUIET = ("aiokafka", "aiohttp.access", "kafka")


def _renderer(fmt: str):
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer()


def configure_logging(level: str = "INFO", fmt: str = "auto") -> None:
    """Configure structlog and the stdlib root logger; safe to call more than once."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.add_logger_name,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                _renderer(fmt),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
