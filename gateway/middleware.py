"""aiohttp middleware: request id, receive time, in-flight tracking, errors in the route's API
shape, 503 while shutting down, metrics and one access-log event per request.

Access log event ``request.done``, one per request, client disconnects included (status 499,
``client_left: true``): request_id, method, path, status, ms (end to end), and when the handler
knew them (gateway/metrics.py ``note_*``; priority and, for a request that was never served,
queue_wait_ms from its admission ticket): model, worker, priority, queue_wait_ms (time queued
over all attempts of a retried request), ttft_ms, prompt_eval_count, eval_count (tokens),
events_streamed (SSE events read from the workers, about one per token: what an answer that
ended early, without the worker's counts, had generated), cut (the error an answer that began
with 200 ended with: its status stays 200, ``llama_gateway_answers_cut_total`` counts it).

``guard_middleware``: who may come in and how big a request may be (see ``Guard.run``).
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from typing import TYPE_CHECKING

from aiohttp import web

from gateway import limits
from gateway.api.common import request_id
from gateway.api.errors import ApiError, error_response, is_openai_path, model_not_found_v1
from gateway.auth import is_admin_token
from gateway.logs import get_logger
from gateway.texts import SHUTTING_DOWN_MESSAGE, header_text
from gateway.upstream import current_request

if TYPE_CHECKING:
    from gateway.inventory import ModelEntry

log = get_logger("gateway.access")

_ACCESS_FIELDS = ("model", "worker", "priority", "queue_wait_ms", "ttft_ms",
                  "prompt_eval_count", "eval_count", "events_streamed")


def _error(path: str, status: int, message: str, headers=None) -> web.Response:
    return error_response(path, ApiError(status, message, headers))


#: Status of a request whose client went away before its answer was complete (nginx's
#: "client closed request"; Ollama answers a canceled request with 499 too).
CLIENT_CLOSED = 499


@web.middleware
async def gateway_middleware(request: web.Request, handler):
    request["t0_ns"] = time.monotonic_ns()
    rid = request_id(request)
    gw = request.app.get("gw")
    if gw is not None and gw.draining:
        # Shutdown began: the listener is closed; answer what still arrives on an open
        # keep-alive connection at once, and close that connection.
        resp = _error(request.path, 503, SHUTTING_DOWN_MESSAGE,
                      {"Connection": "close", "Retry-After": "1"})
        log.info("request.rejected_shutting_down", request_id=rid, path=request.path)
        return resp
    if gw is not None:
        gw.inflight[id(request)] = request
    try:
        resp = await handler(request)
        status = resp.status
    except ApiError as e:
        resp = error_response(request.path, e)
        status = e.status
    except web.HTTPException as e:
        if e.status < 400:
            raise
        moved = await _without_trailing_slash(request) if e.status == 404 else None
        if moved is not None:
            resp = moved
        else:
            msg = {404: f"{request.method} {request.path}: not found",
                   405: f"{request.method} not allowed on {request.path}",
                   413: "request body too large"}.get(e.status, e.reason)
            # a 405 names the methods the route takes (RFC 9110 §15.5.6: Allow is required)
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            resp = _error(request.path, e.status, msg, allow)
        status = resp.status
    except asyncio.CancelledError:
        # The client disconnected (aiohttp's handler cancellation): counted and logged as 499.
        finished(request, gw, CLIENT_CLOSED)
        raise
    except ConnectionResetError:
        # The client went away while its stream was being written (aiohttp raises this before
        # the handler-cancellation arrives). Not a gateway error: the lease was released in the
        # handler's finally.
        resp = _error(request.path, CLIENT_CLOSED, "request canceled")
        status = CLIENT_CLOSED
    except Exception as e:  # a bug: answer 500 in the right shape, keep serving
        log.exception("request.failed", request_id=rid, path=request.path, error=str(e))
        resp = _error(request.path, 500, f"internal error: {type(e).__name__}: {e}")
        status = 500
    finally:
        if gw is not None:
            gw.inflight.pop(id(request), None)
    finished(request, gw, status)  # X-Request-ID: gateway.app's on_response_prepare signal
    return resp


async def _without_trailing_slash(request: web.Request) -> web.Response | None:
    """The redirect Ollama answers a path that is a route but for its trailing slash
    (``/api/tags/``), or None: gin's ``RedirectTrailingSlash`` (on in ``gin.Default()``) sends
    301 for GET and 307 (method and body kept) for other methods, Location the path without
    it, query kept. Only a path that then matches a route for this method is redirected."""
    path = request.path
    if len(path) < 2 or not path.endswith("/"):
        return None
    match = await request.app.router.resolve(
        request.clone(rel_url=request.rel_url.with_path(path.rstrip("/") or "/")))
    if match.http_exception is not None:
        return None
    query = request.rel_url.raw_query_string  # as sent, not re-encoded
    location = (request.rel_url.raw_path.rstrip("/") or "/") + (f"?{query}" if query else "")
    return web.Response(status=301 if request.method == "GET" else 307,
                        headers={"Location": location})


def finished(request: web.Request, gw, status: int) -> None:
    """Count the request in the metrics and write its one ``request.done`` event
    (``client_left: true`` with status 499 when the client disconnected first)."""
    ms = (time.monotonic_ns() - request["t0_ns"]) / 1e6
    if gw is not None:
        ticket = request.get("ticket")
        if request.get("queue_wait_ms") is None and ticket is not None and ticket.enqueued_at:
            # admitted, never served (client left while queued, queue timeout, its attempts
            # failed), or an embedding request (its first input's ticket, the request's
            # admission): the time it queued, so far; counted in the metric too
            request["queue_wait_ms"] = round(ticket.queue_wait_s(gw.dispatcher.clock()) * 1000, 3)
        gw.metrics.observe(request, status, ms / 1000)
    extra = {k: request[k] for k in _ACCESS_FIELDS if request.get(k) is not None}
    if status == CLIENT_CLOSED:
        extra["client_left"] = True
    elif status < 400 and request.get("error"):  # the answer began, an error line ended it
        extra["cut"] = request["error"]
    log.info("request.done", request_id=request_id(request), method=request.method,
             path=request.path, status=status, ms=round(ms, 3), **extra)


@web.middleware
async def guard_middleware(request: web.Request, handler):
    """Host check, CORS preflight, API keys and per-key limits, body limits, prompt length.

    Order: Host (403) → preflight (204/403) → credentials (401: missing or unknown) → the
    gateway's own paths (403: a valid key without ``admin: true``) → body size/time (413/408) →
    messages (400) → model allowed (403 on ``/api``; on ``/v1`` 404 ``model_not_found``, as
    OpenAI answers a model the key has no access to) → prompt length (400) → per-key
    concurrency and rate (429, with Retry-After). Errors come in the route's shape.
    """
    app = request.app  # a property chain: looked up once
    gw, guard = app["gw"], app["guard"]
    try:
        return await guard.run(request, handler, gw)
    except ApiError as e:
        return error_response(request.path, e)


#: Paths that carry no data and stay open with ``auth.keys`` (the status page's HTML asks for
#: its data with a key or the admin token the user gives it in the URL fragment).
_OPEN_PATHS = ("/", "/gateway")
#: The gateway's own status and admin API and its Prometheus metrics (which name every model
#: and worker): with ``auth.keys``, the admin token or a key with ``admin: true``; a plain key
#: gets 403. ``/metrics`` is open when ``auth.metrics_public`` is set (and without keys).
_ADMIN_PATHS = ("/gateway/", "/metrics")


class Guard:
    """Per-app state of ``guard_middleware``, built from the config at start and rebuilt by
    ``update`` on every reload (keys, CORS origins and Host rules then apply at once)."""

    def __init__(self, config):
        # Client connection (transport) -> the write-buffer bound applied to it (keep-alive
        # connections carry many requests; the bound is set again only when a reload changed it).
        self._bounded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.update(config)

    def update(self, config) -> None:
        from gateway.auth import Cors, HostCheck, KeyRing

        old = getattr(self, "keys", None)
        self.config = config
        self.keys = KeyRing(config)
        self.hosts = HostCheck(config)
        self.cors = Cors(config)
        if old is not None:
            self.keys.carry_over(old)

    async def run(self, request: web.Request, handler, gw):
        cfg = self.config
        path = request.path
        host = request.headers.get("Host", "")
        if request.raw_path[:1] != "/" and request.raw_path != "*":
            # An absolute-form target ("GET http://name/path"): the server uses its authority,
            # not the Host header (RFC 9112 §3.2.2), and so does Go's server under Ollama.
            host = request.host
        if not self.hosts.ok(host):
            shown = header_text(host)
            log.warning("request.host_refused", request_id=request_id(request), host=shown,
                        path=path)
            raise ApiError(403, f"host '{shown}' is not allowed")
        origin = request.headers.get("Origin")
        if origin is not None and self.cors.refused(origin, host):
            log.warning("request.origin_refused", request_id=request_id(request),
                        origin=header_text(origin), path=path)
            raise ApiError(403, "origin not allowed")
        if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
            hdrs = self.cors.headers(origin, preflight=True, host=host,
                                     requested=request.headers.get("Access-Control-Request-Headers"))
            if not hdrs:
                raise ApiError(403, "origin not allowed")
            return web.Response(status=204, headers=hdrs)
        key = self._authenticate(request, cfg)
        if request.can_read_body:  # any method: DELETE /api/delete has a body too
            raw = request["raw_body"] = await limits.read_body(
                request, cfg.limits.max_body_bytes, cfg.timeouts.body_read_s)
            body = limits.parse_object(raw) if path in limits.JSON_ROUTES else None
            if body is not None:
                request["json_body"] = body  # the handler's read_json uses it: parsed once
                entry = self._note_model(request, body, gw)  # first: a 400 below counts under it
                limits.check_messages(body, cfg.limits.max_messages)
                self._check_model(request, body, entry, key)
                # The prompt goes to the model named by "model" (only /api/show and /api/pull
                # fall back to "name", and they send no prompt).
                if cfg.limits.check_prompt_length and entry is not None and body.get("model"):
                    token = current_request.set(request)  # its side call logs the request id
                    try:
                        counted = await limits.check_prompt_length(gw, entry, body, path)
                        if counted is not None:  # the size estimate takes it (make_ticket)
                            request["prompt_tokens_counted"] = counted
                    finally:
                        current_request.reset(token)
        inference = request.method == "POST" and path in limits.INFERENCE_ROUTES
        # Limits count inference requests only (a UI polling /api/tags during a stream is fine).
        if key is not None and inference:
            self._check_key_limits(key)
        else:
            key = None
        self._bound_writes(request)
        token = current_request.set(request)
        if key is not None:
            key.in_flight += 1
        if inference:
            gw.inference_in_flight += 1
        try:
            return await handler(request)
        finally:
            current_request.reset(token)
            if key is not None:
                key.in_flight -= 1
            if inference:
                gw.inference_in_flight -= 1

    def _authenticate(self, request: web.Request, cfg):
        """The request's API key state (None: no keys configured, an open path, or the admin
        token). Raises ApiError 401 for a missing or unknown credential and 403 for a valid key
        that may not use the gateway's own paths (RFC 9110: 401 = no valid credentials,
        403 = valid credentials without permission)."""
        path = request.path
        auth = request.headers.get("Authorization")
        admin_path = path.startswith(_ADMIN_PATHS)
        open_path = (path in _OPEN_PATHS and request.method in ("GET", "HEAD")) or (
            path == "/metrics" and cfg.auth.metrics_public)
        if admin_path and is_admin_token(auth, cfg):
            request["admin_auth"] = True
            return None
        if not self.keys.enabled or open_path:
            return None
        key = self.keys.lookup(auth)
        if key is None:
            what = "the admin token or an admin API key" if admin_path else "a valid API key"
            raise ApiError(401, f"unauthorized: {what} is required (Authorization: Bearer <key>)",
                           {"WWW-Authenticate": 'Bearer realm="llama-gateway"'})
        request["api_key"] = key.cfg.name
        request["api_key_state"] = key  # model lists show only the key's models
        request["admin_auth"] = bool(key.cfg.admin)
        if key.cfg.priority is not None:
            request["key_priority"] = key.cfg.priority
        if admin_path and not key.cfg.admin:
            raise ApiError(403, f"key '{key.cfg.name}' may not use {path}")
        return key

    @staticmethod
    def _note_model(request: web.Request, body: dict, gw) -> ModelEntry | None:
        """Note the configured model the body names (``request["model"]``: the metrics label and
        access-log field, so refused requests are counted under their model; names that are not
        configured stay unlabelled, which bounds the label set) and return its entry (None for
        a name that is not configured)."""
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or gw.inventory is None:
            return None
        entry = gw.inventory.resolve(name)
        if entry is not None:
            request["model"] = entry.name
        return entry

    @staticmethod
    def _check_model(request: web.Request, body: dict, entry: ModelEntry | None, key) -> None:
        """Raises ApiError when ``key`` may not use the configured model ``entry``: 403 on
        ``/api``, OpenAI's 404 ``model_not_found`` on ``/v1``."""
        if entry is None:
            return
        name = body.get("model") or body.get("name")
        if key is not None and not key.allows_model(entry.name):
            if is_openai_path(request.path):
                raise model_not_found_v1(name)
            raise ApiError(403, f"key '{key.cfg.name}' may not use model '{name}'")

    @staticmethod
    def _check_key_limits(key) -> None:
        """Raises ApiError(429, with Retry-After) when ``key`` is at its concurrency cap or over
        its per-minute rate."""
        if key.cfg.max_concurrent is not None and key.in_flight >= key.cfg.max_concurrent:
            raise ApiError(429, f"too many concurrent requests for key '{key.cfg.name}' "
                                f"(limit {key.cfg.max_concurrent})", {"Retry-After": "1"})
        wait = key.take_token(time.monotonic())
        if wait:
            raise ApiError(429, f"rate limit of key '{key.cfg.name}' exceeded "
                                f"({key.cfg.rate_per_minute} requests per minute)",
                           {"Retry-After": str(max(1, int(wait + 0.999)))})

    def _bound_writes(self, request: web.Request) -> None:
        """Bound what is buffered for this client (user space and kernel send buffer), once per
        connection and bound value (a setsockopt per request cost ~35 µs of TTFT here)."""
        t = request.transport
        if t is None:
            return
        n = self.config.limits.write_buffer_bytes
        try:
            if self._bounded.get(t) == n:
                return
            t.set_write_buffer_limits(high=n)
            sock = t.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, n)
            self._bounded[t] = n
        except (OSError, RuntimeError, AttributeError, NotImplementedError, TypeError):
            pass

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """CORS headers on every response (streams included) for allowed origins."""
        origin = request.headers.get("Origin")
        if not origin:
            return
        for k, v in self.cors.headers(origin, False, request.headers.get("Host", "")).items():
            response.headers.setdefault(k, v)
