"""gateway/logs.py: structlog events and stdlib ``logging`` records, one JSON object a line."""

from __future__ import annotations

import json
import logging

import pytest
import structlog
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod

from gateway import logs


@pytest.fixture
def stderr(capsys):
    """What ``logs.configure`` writes to sys.stderr (pytest's capture of it, read with
    ``lines``); afterwards structlog's configuration and the root logger are put back as they
    were, so later tests do not write to this test's stream."""
    saved = structlog.get_config()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield capsys
    if logs._handler is not None:
        root.removeHandler(logs._handler)
        logs._handler = None
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.configure(**saved)


def lines(capsys) -> list[dict]:
    """Every line written to stderr since the last call, each parsed as one JSON object."""
    return [json.loads(ln) for ln in capsys.readouterr().err.splitlines()]


def test_stdlib_records_and_tracebacks_are_one_json_line_each(stderr):
    logs.configure("info", "json")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("some.lib").exception("it failed: %s", "badly")
    logs.get_logger("x").info("gateway.event", n=1)
    out = lines(stderr)
    assert len(out) == 2, out
    rec = out[0]
    assert rec["event"] == "it failed: badly" and rec["level"] == "error"
    assert rec["logger"] == "some.lib" and rec["timestamp"]
    assert rec["exception"].startswith("Traceback (most recent call last)")
    assert rec["exception"].endswith("ValueError: boom") and "positional_args" not in rec
    assert out[1] == {"event": "gateway.event", "n": 1, "level": "info",
                      "timestamp": out[1]["timestamp"]}


def test_aiohttp_request_error_is_one_event_name_with_fields(stderr):
    logs.configure("info", "json")
    exc = BadHttpMessage("Duplicate 'Content-Type' header found.")
    logging.getLogger("aiohttp.server").exception("Error handling request from %s", "10.1.2.3",
                                                  exc_info=exc)
    [rec] = lines(stderr)
    assert rec["event"] == "request.unparsed" and rec["logger"] == "aiohttp.server"
    assert rec["remote"] == "10.1.2.3" and rec["level"] == "error"
    assert rec["status"] == 400 and rec["error"] == "Duplicate 'Content-Type' header found."
    assert "BadHttpMessage" in rec["exception"]


def test_server_logger_counts_parser_refusals_at_any_level_and_logs_them_unchanged(stderr):
    """``ServerLogger`` (aiohttp's server logger in the gateway): each parser refusal counts
    once, also one aiohttp logs at debug below the configured level; other server errors do not
    count; the records are the same ``request.unparsed`` ones."""
    logs.configure("info", "json")
    counted = []
    server = logs.ServerLogger(lambda: counted.append(1))
    server.exception("Error handling request from %s", "10.1.2.3",
                     exc_info=BadHttpMessage("Duplicate 'Content-Type' header found."))
    server.debug("Error handling request from %s", "10.1.2.4",
                 exc_info=BadHttpMethod("\x16\x03\x01"))  # a first request that is not HTTP
    server.exception("Unhandled exception", exc_info=ValueError("a handler bug"))
    assert len(counted) == 2
    out = lines(stderr)
    assert [(r["event"], r["logger"]) for r in out] == [
        ("request.unparsed", "aiohttp.server"), ("Unhandled exception", "aiohttp.server")]
    assert out[0]["remote"] == "10.1.2.3" and out[0]["status"] == 400


def test_level_applies_to_stdlib_records_and_reconfigure_replaces_the_handler(stderr):
    logs.configure("info", "json")
    logs.configure("warning", "json")  # e.g. a reload that changed log.level
    logging.getLogger("aiohttp.server").info("dropped")
    logs.get_logger("x").info("dropped.too")
    logging.getLogger("asyncio").warning("kept")
    assert [r["event"] for r in lines(stderr)] == ["kept"]  # once: one handler, not two
    logs.configure("debug", "json")
    logging.getLogger("aiohttp.server").debug("now %s", "shown")
    assert [r["event"] for r in lines(stderr)] == ["now shown"]


def test_warnings_go_to_the_log(stderr):
    import warnings

    logs.configure("info", "json")
    warnings.warn("careful", UserWarning)
    [rec] = lines(stderr)
    assert rec["logger"] == "py.warnings" and rec["level"] == "warning"
    assert "UserWarning: careful" in rec["event"]


def test_console_format_renders_stdlib_records(stderr):
    logs.configure("info", "console")
    logging.getLogger("aiohttp.server").warning("hello %s", "there")
    text = stderr.readouterr().err
    assert "hello there" in text and "[aiohttp.server]" in text and not text.startswith("{")
