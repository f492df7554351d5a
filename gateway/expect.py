"""``Expect: 100-continue`` (RFC 9110 §10.1.1) for the gateway's routes.

aiohttp's default answers ``100 Continue`` to every such request, so a client announcing a body
over ``limits.max_body_bytes`` was invited to upload it (curl sent 1.5 MB of a 70 MB body)
before the 413. This handler answers that 413 instead of ``100 Continue``, in the route's error
shape and with ``Connection: close``, so a client that waits for the go-ahead (curl, for bodies
over 1 MiB) never sends the body. Anything else is aiohttp's behaviour: ``100 Continue`` for
HTTP/1.1 ``100-continue``, 417 for another expectation (in the route's error shape). An
HTTP/1.0 request's expectation is ignored, as RFC 9110 §10.1.1 requires (and Go's server under
Ollama does).
"""

from __future__ import annotations

import time

from aiohttp import web

from gateway.api.errors import ApiError, error_response
from gateway.limits import declared_too_large
from gateway.middleware import finished
from gateway.texts import header_text


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """aiohttp ``expect_handler``: a response ends the request before its body; None goes on."""
    expect = request.headers.get("Expect", "")
    if request.version < (1, 1):
        return None
    if expect.lower() != "100-continue":
        return _refuse(request, ApiError(
            417, f"unsupported expectation: Expect: {header_text(expect)}"))
    guard = request.app.get("guard")
    too_large = declared_too_large(request, guard.config.limits.max_body_bytes) \
        if guard is not None else None
    if too_large is not None:
        return _refuse(request, too_large)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the 100 is not part of the response (as aiohttp does)
    return None


def _refuse(request: web.Request, err: ApiError) -> web.Response:
    """``err`` in the route's shape, connection closed (the body is not read), counted in the
    metrics and the access log like any answered request (it never reaches the middleware)."""
    request["t0_ns"] = time.monotonic_ns()
    resp = error_response(request.path, err)  # X-Request-ID: the app's prepare signal
    resp.force_close()
    request.content.feed_eof()  # no lingering read of the body (aiohttp waited up to 10 s)
    request.protocol.close()
    finished(request, request.app.get("gw"), err.status)
    return resp


def with_expect(routes: list[web.RouteDef]) -> list[web.RouteDef]:
    """``routes`` with :func:`expect_handler` on each (aiohttp applies it to any method)."""
    return [web.RouteDef(r.method, r.path, r.handler, {**r.kwargs, "expect_handler": expect_handler})
            for r in routes]
