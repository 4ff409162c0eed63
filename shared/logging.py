"""structlog set-up shared by every service: one JSON object per line on stderr.

Values bound with `structlog.contextvars.bind_contextvars(request_id=...)` appear on every
line logged from the same asyncio task, so a request can be followed across a service's log.
"""
from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str | int = "info") -> None:
    """Log JSON lines tagged with `service`; stdlib loggers (aiohttp, redis) go the same way."""
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.JSONRenderer()],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def _add_service(service: str):
    def add(_logger, _method, event: dict) -> dict:
        event.setdefault("service", service)
        return event
    return add
