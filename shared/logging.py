"""structlog set-up shared by every service: one JSON object per line on stderr, or, when
stderr is a terminal (a person watching `pacer up`), one readable line per event.

Values bound with `structlog.contextvars.bind_contextvars(request_id=...)` appear on every
line logged from the same asyncio task, so a request can be followed across a service's log.
"""
from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | int = "info", **names) -> None:
    """Log JSON lines tagged with `service` and `names` (which of several: a worker's rank,
    an engine instance; one None or "" is left out); stdlib loggers (aiohttp, redis) go the
    same way."""
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service, {k: v for k, v in names.items() if v not in (None, "")}),
    ]
    # JSON for files and pipes (log collectors, tests); a terminal gets aligned, coloured lines
    if sys.stderr.isatty():
        render = [_service_first, structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.plain_traceback)]
        exc = []
    else:
        render = [structlog.processors.JSONRenderer()]
        exc = [structlog.processors.format_exc_info]
    structlog.configure(
        processors=[*shared, *exc, *render],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per record, its newline included: the services share `pacer up`'s stderr,
        # and a record written as two (print's text, then its "\n") could have another
        # process's record land between them, two JSON objects on one line
        logger_factory=structlog.WriteLoggerFactory(_LogFile()),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *render],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def output_gone() -> None:
    """Point stdout and stderr at /dev/null: whoever read them has gone (`pacer inspect |
    head` read enough; `pacer up | tee` or the ssh session it ran in ended). What is written
    from now on is lost instead of raising BrokenPipeError at every write."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    finally:
        os.close(devnull)


class _LogFile:
    """stderr, for log records: one that cannot be written, its reader gone, is dropped. A log
    line that raised would stop what logged it half-way: a service's signal handler (the
    service never drained or ended: `pacer up`'s children outlived it)."""

    def write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except BrokenPipeError:
            output_gone()

    def flush(self) -> None:
        pass                # each write flushed already


def _add_service(service: str, names: dict):
    def add(_logger, _method, event: dict) -> dict:
        event.setdefault("service", service)
        for key, value in names.items():
            event.setdefault(key, value)
        return event
    return add


def _service_first(_logger, _method, event: dict) -> dict:
    """At a terminal, lead with the service: four of them share `pacer up`'s console."""
    event["event"] = f"{event.pop('service', '')}: {event.get('event', '')}"
    return event
