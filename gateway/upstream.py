"""HTTP client side towards the workers: open a streamed request on a leased worker, read SSE.

Field case 27: this llama-server build sometimes drops a reused keep-alive connection just as
a client reuses it. The connector here therefore opens a fresh loopback connection per request
(``force_close``), and a request that fails before any response byte is retried (on a new
lease, so possibly another worker) instead of reaching the user.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import orjson

from gateway.admission import Admission
from gateway.logs import get_logger
from gateway.scheduling import SlotLease, Ticket

log = get_logger("gateway.upstream")


@dataclass(frozen=True)
class Endpoint:
    """Where a ready worker listens and the per-start key it requires."""

    url: str
    api_key: str


class UpstreamError(Exception):
    """The worker failed the request.

    Attributes:
        status: HTTP status to answer with (the worker's, or 502/503/504 for transport faults).
        message: human-readable text (llama-server ``error.message`` when it sent one).
        kind: llama-server ``error.type`` (e.g. ``exceed_context_size_error``) or a transport tag.
    """

    def __init__(self, status: int, message: str, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def parse_error_body(status: int, body: bytes) -> UpstreamError:
    """Turn a llama-server error body ``{"error":{"code","message","type"}}`` into UpstreamError."""
    try:
        data = orjson.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(err, dict):
            return UpstreamError(status, str(err.get("message") or err), str(err.get("type") or ""))
        return UpstreamError(status, str(err))
    except orjson.JSONDecodeError:
        return UpstreamError(status, body.decode("utf-8", "replace")[:500] or f"HTTP {status}")


class Upstream:
    """One shared aiohttp session for all workers (no connection reuse, see module doc).

    Args:
        admission: where leases come from.
        endpoint_of: worker id -> Endpoint (None when the worker is gone).
        first_byte_s: longest wait for response headers / between reads (seconds).
        request_s: per-request deadline (seconds).
        attempts: tries for a request that got no response byte.
    """

    def __init__(self, admission: Admission, endpoint_of, *, first_byte_s: float = 300.0,
                 request_s: float = 3600.0, attempts: int = 3):
        self.admission = admission
        self.endpoint_of = endpoint_of
        self.first_byte_s = first_byte_s
        self.request_s = request_s
        self.attempts = attempts
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             json_serialize=lambda o: orjson.dumps(o).decode())

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    @contextlib.asynccontextmanager
    async def request(self, ticket: Ticket, path: str, body: dict
                      ) -> AsyncIterator[tuple[SlotLease, aiohttp.ClientResponse]]:
        """Lease a slot, POST ``body`` to ``path`` on that worker, yield (lease, response).

        The response has status < 400 (errors raise ``UpstreamError``). On exit the response
        is closed (so the worker sees a disconnect and frees its slot) and the lease released.
        Raises QueueFull / QueueTimeout from admission, UpstreamError after ``attempts``.
        """
        assert self.session is not None
        payload = orjson.dumps(body)
        timeout = aiohttp.ClientTimeout(total=self.request_s, sock_connect=5,
                                        sock_read=self.first_byte_s)
        last: UpstreamError | None = None
        for attempt in range(self.attempts):
            lease = await self.admission.acquire(ticket)
            resp = None
            try:
                ep = self.endpoint_of(lease.worker.id)
                if ep is None:
                    raise UpstreamError(503, "worker went away", "worker_gone")
                try:
                    resp = await self.session.post(
                        ep.url + path, data=payload, timeout=timeout,
                        headers={"Authorization": f"Bearer {ep.api_key}",
                                 "Content-Type": "application/json"})
                except asyncio.TimeoutError:
                    raise UpstreamError(504, f"worker {lease.worker.id} sent nothing within "
                                             f"{self.first_byte_s:g} s", "first_byte_timeout")
                except aiohttp.ClientError as e:
                    raise UpstreamError(502, f"worker {lease.worker.id} unreachable: {e}",
                                        "connection")
                if resp.status == 503:
                    err = parse_error_body(503, await resp.read())
                    raise UpstreamError(503, err.message, "worker_unavailable")
                if resp.status >= 400:
                    raise parse_error_body(resp.status, await resp.read())
            except UpstreamError as e:
                if resp is not None:
                    resp.close()
                self.admission.release(lease)
                if e.kind in ("connection", "worker_gone", "worker_unavailable") \
                        and attempt + 1 < self.attempts:
                    log.warning("upstream.retry", request_id=ticket.request_id,
                                worker=lease.worker.id, reason=e.message, attempt=attempt + 1)
                    last = e
                    await asyncio.sleep(0.05 * (attempt + 1))
                    continue
                raise
            except BaseException:
                if resp is not None:
                    resp.close()
                self.admission.release(lease)
                raise
            try:
                yield lease, resp
            finally:
                resp.close()
                self.admission.release(lease)
            return
        raise last or UpstreamError(502, "no worker answered")


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Yield each SSE ``data:`` payload (bytes, JSON text) until ``[DONE]`` or end of stream.

    Comment lines (``:`` pings) and blank separators are skipped. An ``error:`` field or a
    ``data:`` payload holding ``{"error": ...}`` is yielded as is; callers check for it.
    Raises UpstreamError(502) if the connection breaks mid-stream.
    """
    try:
        async for line in resp.content:
            if line.startswith(b"data: "):
                data = line[6:].rstrip(b"\r\n")
            elif line.startswith(b"data:"):
                data = line[5:].strip()
            elif line.startswith(b"error:"):
                data = line[6:].strip()
            else:
                continue
            if data == b"[DONE]":
                return
            if data:
                yield data
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
        raise UpstreamError(502, f"worker stream broke: {e}", "stream_broken") from e
    except asyncio.TimeoutError as e:
        raise UpstreamError(504, "worker stalled mid-stream", "stall") from e
