"""Graceful stop (SIGTERM, ``systemctl stop``): stop accepting, drain, end the rest, stop workers.

Sequence (field case 17; each step is logged):

1. ``STOPPING=1`` to systemd; the listening sockets close and idle keep-alive connections are
   closed, so new connections are refused; a request that still arrives on an open connection
   is answered 503 with ``Connection: close`` (middleware).
2. Requests already accepted (running or queued) get up to ``shutdown.drain_s`` seconds (a
   second SIGTERM/SIGINT ends this wait at once: ``Gateway.hurry``).
3. What is left then: queued requests are answered 503 at once, in their API's shape, with
   ``server shutting down, please try again: …`` (``ShuttingDown``; so are requests that still
   reach admission); running ones are ended at once too (``Upstream.end_running``): the API
   handlers end them with an ``{"error": "server shutting down, …"}`` line (NDJSON) or an
   error event (SSE), or a JSON 503 when nothing was sent yet, and their connections to the
   workers close (llama-server does not exit on SIGTERM while a request of it is open).
4. Workers stop: SIGTERM, ``llama_server.stop_grace_s``, SIGKILL, reaped.
5. The HTTP server closes; ``serve()`` returns 0.

Worst case from SIGTERM to exit: ``drain_s + stop_grace_s`` + a few seconds; systemd's
``TimeoutStopSec`` must be above that (deploy/llama-gateway.service uses drain 30 + grace 10 → 60).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from gateway.logs import get_logger

if TYPE_CHECKING:
    from gateway.app import Gateway

log = get_logger("gateway.drain")


async def _wait_idle(gw: "Gateway", timeout_s: float, hurry: asyncio.Event | None = None) -> int:
    """Wait until no request is in flight, ``timeout_s`` passed or ``hurry`` is set; returns
    how many remain."""
    end = time.monotonic() + timeout_s
    while gw.inflight and time.monotonic() < end and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(0.05)
    return len(gw.inflight)


async def stop_accepting(gw: "Gateway") -> None:
    """Close the listening sockets and idle keep-alive connections (step 1).

    A connection idle between requests (its handler waits for the next request: aiohttp 3.14's
    ``RequestHandler._waiter``, pinned) is closed at once; aiohttp's own ``pre_shutdown`` only
    cancels that wait. A fresh tester saw a request sent on such a connection get no answer
    until the process exited; here such connections closed 0.36–0.56 s after SIGTERM without
    this, and at once with it. Busy connections get ``pre_shutdown``'s close after their
    response."""
    gw.draining = True
    runner = gw.runner
    if runner is None:
        return
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    if server is not None:
        for conn in list(server.connections):
            if getattr(conn, "_waiter", None) is not None:
                conn.force_close()
        server.pre_shutdown()


async def graceful_stop(gw: "Gateway") -> None:
    """Run the whole sequence of the module docstring. Never raises."""
    drain_s = gw.config.shutdown.drain_s
    t0 = time.monotonic()
    gw.notifier.stopping(f"draining {len(gw.inflight)} requests (up to {drain_s:g} s)")
    log.info("gateway.draining", in_flight=len(gw.inflight), drain_s=drain_s)
    try:
        await stop_accepting(gw)
        gw.draining_requests = True
        try:
            left = await _wait_idle(gw, drain_s, gw.hurry)
        finally:
            gw.draining_requests = False
        if left:
            log.warning("gateway.drain_timeout", still_running=left,
                        queued=len(gw.dispatcher.queue), drain_s=drain_s,
                        s=round(time.monotonic() - t0, 3))
            gw.admission.shut_down()  # queued ones: 503 "server shutting down" now
            if gw.upstream:  # running ones: their error line now, and no connection left open
                ended = gw.upstream.end_running()  # to keep a worker from its SIGTERM exit
                log.info("gateway.streams_ended", count=ended)
                await _wait_idle(gw, 2.0)
        else:
            log.info("gateway.drained", s=round(time.monotonic() - t0, 3))
        gw.notifier.status("stopping workers")
        if gw.fleet:
            await gw.fleet.stop()
        # Handlers whose worker stream broke now write their error line and return.
        left = await _wait_idle(gw, 5.0)
        if left:
            log.warning("gateway.requests_cut", count=left)
    except Exception as e:  # a bug here must not keep the process (and systemd) waiting
        log.exception("gateway.drain_failed", error=str(e))
