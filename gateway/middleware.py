"""aiohttp middleware: request id, receive time, errors in the route's API shape, access log."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway.api.common import request_id
from gateway.api.errors import ApiError, ollama_error, openai_error
from gateway.logs import get_logger

log = get_logger("gateway.access")


def _error(path: str, status: int, message: str, headers=None) -> web.Response:
    if path.startswith("/v1/"):
        return openai_error(status, message, headers)
    return ollama_error(status, message, headers)


@web.middleware
async def gateway_middleware(request: web.Request, handler):
    request["t0_ns"] = t0 = time.monotonic_ns()
    rid = request_id(request)
    status = 0
    try:
        resp = await handler(request)
        status = resp.status
    except ApiError as e:
        resp = _error(request.path, e.status, e.message, e.headers)
        status = e.status
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {404: f"{request.method} {request.path}: not found",
               405: f"{request.method} not allowed on {request.path}",
               413: "request body too large"}.get(e.status, e.reason)
        resp = _error(request.path, e.status, msg)
        status = e.status
    except asyncio.CancelledError:
        log.info("request.cancelled", request_id=rid, path=request.path,
                 worker=request.get("worker"), ms=(time.monotonic_ns() - t0) / 1e6)
        raise
    except Exception as e:  # a bug: answer 500 in the right shape, keep serving
        log.exception("request.failed", request_id=rid, path=request.path, error=str(e))
        resp = _error(request.path, 500, f"internal error: {type(e).__name__}: {e}")
        status = 500
    if not resp.prepared:
        resp.headers["X-Request-ID"] = rid
    log.info("request.done", request_id=rid, method=request.method, path=request.path,
             status=status, worker=request.get("worker"), ms=round((time.monotonic_ns() - t0) / 1e6, 3))
    return resp
