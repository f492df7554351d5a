"""aiohttp middleware: request id, receive time, in-flight tracking, errors in the route's API
shape, 503 while shutting down, metrics and one access-log event per request.

Access log event ``request.done`` fields: request_id, method, path, status, ms (end to end),
and when the handler knew them (gateway/metrics.py ``note_*``): model, worker, priority,
queue_wait_ms, ttft_ms, prompt_eval_count, eval_count (tokens).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway.api.common import request_id
from gateway.api.errors import ApiError, ollama_error, openai_error
from gateway.logs import get_logger

log = get_logger("gateway.access")

_ACCESS_FIELDS = ("model", "worker", "priority", "queue_wait_ms", "ttft_ms",
                  "prompt_eval_count", "eval_count")


def _error(path: str, status: int, message: str, headers=None) -> web.Response:
    if path.startswith("/v1/"):
        return openai_error(status, message, headers)
    return ollama_error(status, message, headers)


@web.middleware
async def gateway_middleware(request: web.Request, handler):
    request["t0_ns"] = t0 = time.monotonic_ns()
    rid = request_id(request)
    gw = request.app.get("gw")
    status = 0
    if gw is not None and gw.draining:
        # Shutdown began: the listener is closed; answer what still arrives on an open
        # keep-alive connection at once, and close that connection.
        resp = _error(request.path, 503, "server shutting down, please try again",
                      {"Connection": "close", "Retry-After": "1"})
        resp.headers["X-Request-ID"] = rid
        log.info("request.rejected_shutting_down", request_id=rid, path=request.path)
        return resp
    if gw is not None:
        gw.inflight[id(request)] = request
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
    finally:
        if gw is not None:
            gw.inflight.pop(id(request), None)
    if not resp.prepared:
        resp.headers["X-Request-ID"] = rid
    ms = (time.monotonic_ns() - t0) / 1e6
    if gw is not None:
        gw.metrics.observe(request, status, ms / 1000)
    extra = {k: request[k] for k in _ACCESS_FIELDS if request.get(k) is not None}
    log.info("request.done", request_id=rid, method=request.method, path=request.path,
             status=status, ms=round(ms, 3), **extra)
    return resp
