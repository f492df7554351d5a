"""Error bodies in each API's own shape, always ``application/json``.

Ollama: ``{"error": "<string>"}`` (docs/api/errors.mdx; every ``gin.H{"error":…}`` in routes.go).
OpenAI: ``{"error": {"message", "type", "param": null, "code": null}}`` (Ollama's openai.NewError).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.texts import CONTEXT_OVERFLOW_MESSAGE, context_overflow  # noqa: F401 (re-exported)

# Ollama server/sched.go ErrMaxQueue: note the two spaces after the period.
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


class ApiError(Exception):
    """Raised by handlers to answer ``status`` with ``message`` in the route's shape."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def ollama_error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps({"error": message}),
                        content_type="application/json", headers=headers)


def openai_error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
            503: "server_error"}.get(status, "api_error")


def openai_error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": openai_error_type(status), "param": None,
                      "code": None}}


def openai_error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(openai_error_body(status, message)),
                        content_type="application/json", headers=headers)
