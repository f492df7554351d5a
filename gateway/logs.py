"""Structured logging setup (structlog).

JSON lines when stderr is not a TTY (journald-friendly), a readable console otherwise.
Every module gets its logger with ``get_logger(__name__)`` and binds ``worker``/``gpu``/``request_id``.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog once for the process.

    Args:
        level: "debug" | "info" | "warning" | "error".
        fmt: "auto" (JSON unless stderr is a TTY) | "json" | "console".
    """
    global _configured
    lvl = getattr(logging, level.upper(), logging.INFO)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str | None = None, **bound):
    """Return a structlog bound logger, optionally with context bound (e.g. worker="demo-cpu0")."""
    log = structlog.get_logger(name)
    return log.bind(**bound) if bound else log
