"""Structured logging setup (structlog).

JSON lines when stderr is not a TTY (journald-friendly), a readable console otherwise.
Every module gets its logger with ``get_logger(__name__)`` and binds ``worker``/``gpu``/``request_id``.

Records of the stdlib ``logging`` module (aiohttp's server, asyncio's loop, ``warnings``) go
through the same renderer, with structlog's ``ProcessorFormatter`` on a root handler
(structlog docs, "Rendering Using structlog-based Formatters Within logging"), so in JSON mode
every line on stderr is one JSON object: ``event`` is the record's message, ``level`` its level,
``logger`` its logger name, and a traceback is the ``exception`` field of that object, not
lines of its own.

One stdlib record is renamed: aiohttp's ``"Error handling request from %s"`` (a request its HTTP
parser refused, answered by aiohttp with its own text/plain 400; or a handler that raised) is
``event: "request.unparsed"`` with the client's address in ``remote`` instead of in the
event, so it is one event name whoever sent it; for a parser refusal ``status`` and ``error``
are aiohttp's status and reason (what the client was answered). Its level stays aiohttp's
(error, debug for a first request that is not HTTP at all). :class:`ServerLogger`, the
logger aiohttp's server is given, counts the parser's refusals (``/metrics``) at any level.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

import structlog
from aiohttp.http_exceptions import HttpProcessingError

_configured = False
_handler: logging.Handler | None = None  # this module's root handler (replaced on reconfigure)

# aiohttp web_protocol.RequestHandler.handle_error (aiohttp 3.14, pinned in pyproject.toml)
_AIOHTTP_REQUEST_ERROR = "Error handling request from %s"


def _stdlib_fields(_logger, _name: str, event_dict: dict) -> dict:
    """Foreign-record processor: drop the positional args (the message already has them),
    except for aiohttp's request error, which becomes one event name plus fields (module doc)."""
    args = event_dict.pop("positional_args", ())
    record = event_dict.get("_record")
    if record is None or record.name != "aiohttp.server" or record.msg != _AIOHTTP_REQUEST_ERROR:
        return event_dict
    event_dict["event"] = "request.unparsed"
    if args:
        event_dict["remote"] = args[0]
    exc = (event_dict.get("exc_info") or (None, None))[1]
    if isinstance(exc, HttpProcessingError):
        event_dict["status"], event_dict["error"] = exc.code, exc.message
    return event_dict


class ServerLogger(logging.LoggerAdapter):
    """The logger of aiohttp's server (``web.AppRunner(logger=...)``): records go on to the
    ``aiohttp.server`` logger unchanged, and ``on_unparsed()`` is called once for each request
    aiohttp's HTTP parser refused (its ``"Error handling request from %s"`` with an
    ``HttpProcessingError``: the ``request.unparsed`` record), before the level filter, so a
    bad method as a connection's first request (logged at debug) counts too."""

    def __init__(self, on_unparsed: Callable[[], object]):
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.on_unparsed = on_unparsed

    def log(self, level, msg, *args, **kwargs) -> None:
        # aiohttp's debug() and exception() both come here (logging.LoggerAdapter)
        if msg == _AIOHTTP_REQUEST_ERROR and isinstance(kwargs.get("exc_info"),
                                                        HttpProcessingError):
            self.on_unparsed()
        super().log(level, msg, *args, **kwargs)


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog, and the stdlib root logger to render through it (module doc).
    Called again (a reload that changed ``log``), it replaces both.

    Args:
        level: "debug" | "info" | "warning" | "error"; the least level written, for structlog
            events and stdlib records alike.
        fmt: "auto" (JSON unless stderr is a TTY) | "json" | "console".
    """
    global _configured, _handler
    lvl = getattr(logging, level.upper(), logging.INFO)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # One write per line (PrintLogger writes the text and its newline apart), so a stdlib
        # record written from another thread cannot land inside a structlog line.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            stamp,
            _stdlib_fields,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
        pass_foreign_args=True,
    ))
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(lvl)
    _handler = handler
    logging.captureWarnings(True)  # warnings.warn → the "py.warnings" logger, not raw stderr
    _configured = True


def get_logger(name: str | None = None, **bound):
    """Return a structlog bound logger, optionally with context bound (e.g. worker="demo-cpu0")."""
    log = structlog.get_logger(name)
    return log.bind(**bound) if bound else log
