"""Error bodies in each API's own shape, always ``application/json``.

Ollama: ``{"error": "<string>"}`` (docs/api/errors.mdx; every ``gin.H{"error":…}`` in routes.go).
OpenAI: ``{"error": {"message", "type", "param": null, "code": null}}`` (Ollama's openai.NewError);
``code`` is set where OpenAI sets one (``model_not_found``, :func:`model_not_found_v1`).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.texts import CONTEXT_OVERFLOW_MESSAGE, context_overflow  # noqa: F401 (re-exported)

# Ollama server/sched.go ErrMaxQueue: note the two spaces after the period.
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"
QUEUE_TIMEOUT_MESSAGE = "server busy, please try again.  timed out waiting for a free slot"


def shown(v) -> str:
    """``v`` as JSON, cut at 40 characters: how an error message quotes a client's value."""
    return orjson.dumps(v).decode()[:40]


class ApiError(Exception):
    """Raised by handlers to answer ``status`` with ``message`` in the route's shape.

    ``code`` / ``type``: the OpenAI error object's ``code`` and ``type`` on ``/v1`` routes (type
    defaults to one derived from the status, :func:`openai_error_type`); unused on ``/api``."""

    def __init__(self, status: int, message: str, headers: dict | None = None, *,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.code, self.type = code, type


def model_not_found_v1(name: str) -> ApiError:
    """What ``/v1`` answers for a model that is not served or that the caller's API key may not
    use, alike (so ``/v1/models/{id}`` and the inference routes agree): OpenAI's own answer,
    404 ``{"message": "The model `<name>` does not exist or you do not have access to it.",
    "type": "invalid_request_error", "param": null, "code": "model_not_found"}`` (as the OpenAI
    API returns it, quoted in openai-python users' issues and client test fixtures)."""
    return ApiError(404, f"The model `{name}` does not exist or you do not have access to it.",
                    code="model_not_found", type="invalid_request_error")


def resolve_v1_model(inventory, body: dict):
    """The served model (``ModelEntry``) a ``/v1`` inference body names. Raises ApiError 400
    ``model must be a string`` (as ``/api``) or ``model is required``, or OpenAI's 404
    (:func:`model_not_found_v1`) for a model that is not served."""
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "model must be a string")
    if not name:
        raise ApiError(400, "model is required")
    entry = inventory.resolve(name)
    if entry is None:
        raise model_not_found_v1(name)
    return entry


def json_body(body: bytes, status: int = 200, headers: dict | None = None) -> web.Response:
    """A response of the JSON text ``body`` (bytes), ``Content-Type: application/json;
    charset=utf-8`` as Ollama's Gin writes on every JSON answer and error (aiohttp writes a
    bytes body without the charset, its ``json_response`` with it)."""
    return web.Response(status=status, body=body, content_type="application/json",
                        charset="utf-8", headers=headers)


def ollama_error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return json_body(orjson.dumps({"error": message}), status, headers)


def openai_error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
            415: "invalid_request_error",
            429: "rate_limit_error", 503: "server_error"}.get(status, "api_error")


def openai_error_body(status: int, message: str, code: str | None = None,
                      type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or openai_error_type(status),
                      "param": None, "code": code}}


def openai_error(status: int, message: str, headers: dict | None = None, *,
                 code: str | None = None, type: str | None = None) -> web.Response:
    return json_body(orjson.dumps(openai_error_body(status, message, code, type)), status,
                     headers)


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is in the OpenAI-compatible API (``/v1`` and everything under it)."""
    return path.startswith("/v1/") or path == "/v1"


def error_response(path: str, e: ApiError) -> web.Response:
    """``e`` in the shape of the API that ``path`` belongs to (``/v1…`` OpenAI, else Ollama).
    With ``Connection: close`` in ``e.headers`` the connection is closed after it."""
    if is_openai_path(path):
        resp = openai_error(e.status, e.message, e.headers, code=e.code, type=e.type)
    else:
        resp = ollama_error(e.status, e.message, e.headers)
    if e.headers and e.headers.get("Connection") == "close":
        resp.force_close()
    return resp


def upstream_headers(status: int, retry_after_s: int) -> dict | None:
    """Headers of the answer to a request its worker failed: ``Retry-After`` (``retry_after_s``,
    the configured ``queue.retry_after_s``) with a 503 (the worker ran out of KV cache for the
    requests it ran together, was still loading, or the gateway shut down: a later try can
    succeed); none otherwise."""
    return {"Retry-After": str(retry_after_s)} if status == 503 else None


def admission_error(e: Exception, retry_after_s: int) -> ApiError:
    """Admission's answer for a request it will not run, as ApiError (503 unless the refusal
    says otherwise): ``QueueFull`` (Ollama's ``ErrMaxQueue`` text), ``QueueTimeout``, or a
    refusal of gateway.scheduling.refusals (``Unavailable``: its status, text, Retry-After
    rule and OpenAI ``code``/``type``); ``retry_after_s``: the configured
    ``queue.retry_after_s``."""
    from gateway.admission import QueueFull, QueueTimeout  # admission does not import the API
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(e, QueueFull):
        return ApiError(503, BUSY_MESSAGE, retry)
    if isinstance(e, QueueTimeout):
        return ApiError(503, QUEUE_TIMEOUT_MESSAGE, retry)
    return ApiError(e.status, str(e), e.headers(retry_after_s), code=e.code, type=e.type)
