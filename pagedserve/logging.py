"""One logging setup for every service: structlog, JSON lines on stderr, request ids from contextvars.

A request's id is bound once where the request enters a service
(`structlog.contextvars.bind_contextvars(request_id=...)`), and every log line written while handling
it carries the id without being passed around.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_logging(service: str, level: str = "info", json: bool = True) -> None:
    """Route structlog and the standard library's logging through one JSON (or console) renderer."""
    global _configured
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            *shared,
            _add_service(service),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries that log through the standard library (uvicorn, grpc, transformers) end up in the
    # same stream and format.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                _add_service(service),
                renderer,
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric_level)
    _configured = True


def _add_service(service: str):
    def add(_logger, _method, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    return add


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name) if name else structlog.get_logger()
