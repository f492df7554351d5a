"""The inference requests' HTTP/1.1 client towards a worker: one POST on a fresh loopback
connection, the response body read as it arrives.

Why not aiohttp's ClientSession here: on this hot path (every generate/chat/embed request)
its per-request machinery (connector, happy-eyeballs connect, tracing, cookie and header
objects) cost about 1 ms of added TTFT per request on the 2-core development machine
(measured: a bare pass-through proxy added 1.7 ms with an aiohttp client and 0.7 ms with a
plain asyncio connection; README, "Gateway overhead"). This module is the thin part that is
left: an ``asyncio.Protocol`` on the event loop's own ``create_connection`` and the llhttp
response parser from ``httptools`` (the parser uvicorn uses), which handles status line,
headers, ``Content-Length`` and chunked bodies. Side calls (tokenize, templates, telemetry)
still use aiohttp.

Every request gets its own connection (``Connection: close``): this llama-server build drops a
reused keep-alive connection now and then (field case 27), and closing the connection is how a
worker learns that a client went away (it then frees the slot, shared/reference/llama-server.md).
Connecting still costs about 0.2 ms of TTFT here, so :class:`SpareConnections` opens the next
request's connection ahead of time, right after a request to that worker was sent; a spare is
used once, never reused.

The response object offers what the relays and the watchdog need, with aiohttp's names:
``status``, ``headers`` (lower-case names), ``read()``, ``close()`` and ``content`` with
``iter_any()``, ``total_bytes`` and ``set_exception()``.
"""

from __future__ import annotations

import asyncio
import errno
import time
from typing import AsyncIterator, Callable

import httptools

#: Body bytes buffered (not yet read by the relay) above which reading from the worker pauses;
#: reading resumes once the relay has taken them. Bounds memory per slow client.
HIGH_WATER_BYTES = 262144


def out_of_descriptors(e: BaseException) -> bool:
    """Whether ``e`` (or the OS error it wraps, as aiohttp's connector errors do) is the
    gateway's own process or system running out of file descriptors (EMFILE / ENFILE): idle
    client connections that used up a 1,024 limit made every liveness probe fail, and a
    healthy worker was declared wedged and stopped (a fresh tester's find)."""
    seen = 0
    while e is not None and seen < 4:
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return True
        e = getattr(e, "os_error", None) or e.__cause__ or e.__context__
        seen += 1
    return False


class WorkerConnectionError(ConnectionError):
    """The worker could not be reached, or closed the connection before the response headers
    (nothing of the answer was received, so the request may be retried)."""


class WorkerDown(WorkerConnectionError):
    """The gateway gave up on a request's response because its worker went down (found
    wedged, exited) before it answered."""


class WorkerPayloadError(ConnectionError):
    """The response broke after its headers: connection lost mid-body, or bytes that are not
    HTTP/1.1."""


class Body:
    """The response body as it arrives (bytes). aiohttp ``StreamReader`` names: ``iter_any``,
    ``read``, ``total_bytes`` (body bytes received so far), ``set_exception``.
    ``on_first_data``: called once when the first body bytes arrive (None: nothing to call)."""

    def __init__(self, conn: "_Conn"):
        self._conn = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self.total_bytes = 0
        self.on_first_data: Callable[[], None] | None = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        if not self.total_bytes and self.on_first_data is not None:
            self.on_first_data()
        self._chunks.append(data)
        n = len(data)
        self.total_bytes += n
        self._buffered += n
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """Make the reader's next (or current) read raise ``exc``; data not yet read is dropped."""
        self._exc = exc
        self._wake()

    async def readany(self) -> bytes:
        """Whatever has arrived since the last read (waits for something); ``b""`` at the end.
        Raises WorkerPayloadError if the connection broke, or the exception set by
        :meth:`set_exception`."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                chunks, self._chunks = self._chunks, []
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    if self._conn.transport and not self._conn.transport.is_closing():
                        self._conn.transport.resume_reading()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def unread(self, data: bytes) -> None:
        """Put ``data`` (bytes :meth:`readany` returned) back in front of what is still to be
        read; the next read returns it first. ``total_bytes`` is unchanged (it counts bytes
        received)."""
        if data:
            self._chunks.insert(0, data)
            self._buffered += len(data)
            self._wake()

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Yield the body in the pieces it arrived in (several network reads joined when the
        reader was slower than the worker). Errors as :meth:`readany`."""
        while True:
            data = await self.readany()
            if not data:
                return
            yield data

    async def read(self) -> bytes:
        """The whole body (waits for its end). Errors as :meth:`readany`."""
        parts = [data async for data in self.iter_any()]
        return b"".join(parts)


class _Conn(asyncio.Protocol):
    """One connection: feeds the bytes to the llhttp parser, whose callbacks fill in status,
    headers and body."""

    def __init__(self, loop: asyncio.AbstractEventLoop, in_use: bool = True):
        self.parser = httptools.HttpResponseParser(self)
        self.in_use = in_use  # False while a spare waits for its request
        self.received = False
        self.lost = False
        self.transport: asyncio.Transport | None = None
        self.headers: dict[str, str] = {}
        self.head: asyncio.Future = loop.create_future()
        self.body = Body(self)
        self.complete = False
        self.framed = False  # Content-Length or chunked: the end is known without a close

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(f"malformed HTTP from the worker: {e}")
            if self.transport:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.in_use:  # a spare nobody sent a request on: nothing waits for it
            self.head.cancel()
            return
        if not self.head.done():
            self.head.set_exception(WorkerConnectionError(
                f"connection closed before the response headers{f': {exc}' if exc else ''}"))
        elif not self.complete:
            if self.framed or exc is not None:
                self.body.set_exception(WorkerPayloadError(
                    f"connection lost mid-body{f': {exc}' if exc else ''}"))
            else:  # no length given: the body ends with the connection (HTTP/1.1 §6.3)
                self.body._end()

    # llhttp callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        self.headers[key] = value.decode("latin-1")
        if key in ("content-length", "transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        if not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.body._feed(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.body._end()

    def _fail(self, message: str) -> None:
        if not self.head.done():
            self.head.set_exception(WorkerConnectionError(message))
        else:
            self.body.set_exception(WorkerPayloadError(message))


class WorkerResponse:
    """A worker's answer. ``status`` (int), ``headers`` (lower-case name → value), ``content``
    (:class:`Body`). ``close()`` drops the connection, which tells the worker the client left.

    ``progress``: True when the request asked llama-server for prompt-progress events
    (``return_progress``), which precede the answer and are not part of it; the SSE reader
    (``gateway.upstream.iter_sse_batches``) then drops them and calls :meth:`note_answer` at
    the first event that is the answer. Without them the answer begins with the first body
    bytes. ``answered``: whether it began; ``on_answer``: called once when it begins (None:
    nothing to call)."""

    def __init__(self, conn: _Conn, status: int | None = None, progress: bool = False):
        self._conn = conn
        self.status = status  # None until :meth:`wait_head`
        self.headers = conn.headers
        self.content = conn.body
        self.progress = progress
        self.on_answer: Callable[[], None] | None = None
        self.answered = False
        #: SSE events of the answer read so far (``iter_sse_batches``; progress events left out)
        self.events = 0
        self.aborted_by: Exception | None = None  # what :meth:`abort` gave up with
        if not progress:
            conn.body.on_first_data = self.note_answer

    def note_answer(self) -> None:
        """The answer began (its first bytes, or the SSE reader's first real event; idempotent)."""
        if not self.answered:
            self.answered = True
            if self.on_answer is not None:
                self.on_answer()

    async def wait_head(self) -> int:
        """Wait for the status line and headers; returns the status. Raises
        WorkerConnectionError when the worker closed before sending them or sent no HTTP.
        Cancelling the wait leaves the headers to a later call (``close()`` drops them)."""
        if self.status is None:
            self.status = await asyncio.shield(self._conn.head)
        return self.status

    @property
    def complete(self) -> bool:
        """True once the whole response has arrived (it may not all have been read yet)."""
        return self._conn.complete

    async def read(self) -> bytes:
        """The whole body; errors as :meth:`Body.readany`."""
        return await self.content.read()

    def abort(self, exc: Exception) -> None:
        """Give up on the headers: a waiter in :meth:`wait_head` gets ``exc`` (not a
        cancellation); the connection closes. ``aborted_by`` keeps ``exc`` for a reader of
        the body, which sees the connection lost."""
        self.aborted_by = exc
        if not self._conn.head.done():
            self._conn.head.set_exception(exc)
        self.close()

    def close(self) -> None:
        if not self._conn.head.done():
            self._conn.head.cancel()  # nobody will wait for these headers any more
        t = self._conn.transport
        if t is not None and not t.is_closing():
            t.close()


class SpareConnections:
    """At most one connected, never used connection per worker address, so that a request finds
    its connection already open (saves the connect: about 0.2 ms of TTFT on the 2-core
    development machine, README "Gateway overhead").

    A spare is opened in the background right after a request to that address was sent, and
    taken by the next request there. It is used once (``Connection: close`` like any other, so
    field case 27, dropped *reused* connections, does not apply) and only while younger than
    ``max_age_s`` seconds and untouched by the worker: cpp-httplib, llama-server's HTTP server,
    closes a connection that sends nothing for ``CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND`` (5 s in
    the pinned build, vendor/cpp-httplib/httplib.h). An idle worker therefore keeps no spare
    past its last request's moment plus 5 s, and connects normally on its next request.
    Each open spare holds one of the worker's HTTP threads while it waits (llama-server starts
    ``n_parallel + 4`` of them and adds threads on demand, tools/server/server-http.cpp).
    ``clock``: seconds, monotonic (injected by tests).
    """

    def __init__(self, max_age_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self.max_age_s = max_age_s
        self.clock = clock
        self._spare: dict[tuple[str, int], tuple[float, asyncio.Transport, _Conn]] = {}
        self._opening: dict[tuple[str, int], asyncio.Task] = {}
        self._closed = False

    def take(self, addr: tuple[str, int]) -> tuple[asyncio.Transport, _Conn] | None:
        """The address's spare, now in use by the caller; None when there is none fit to use."""
        got = self._spare.pop(addr, None)
        if got is None:
            return None
        t0, transport, conn = got
        if conn.lost or conn.received or transport.is_closing() or self.clock() - t0 > self.max_age_s:
            transport.close()
            return None
        conn.in_use = True
        return transport, conn

    def refill(self, addr: tuple[str, int]) -> None:
        """Open a spare for ``addr`` in the background unless one is open or being opened."""
        if self._closed or addr in self._spare or addr in self._opening:
            return
        if len(self._spare) > 16:  # drop dead spares of workers that restarted on another port
            for a in [a for a, (_, _, c) in self._spare.items() if c.lost]:
                del self._spare[a]
        self._opening[addr] = asyncio.get_running_loop().create_task(self._open(addr))

    async def _open(self, addr: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(5.0):
                transport, conn = await loop.create_connection(
                    lambda: _Conn(loop, in_use=False), *addr)
        except (OSError, TimeoutError):
            return  # the request path will connect (and report) itself
        finally:
            self._opening.pop(addr, None)
        old = self._spare.get(addr)
        if self._closed or old is not None:
            transport.close()
            return
        self._spare[addr] = (self.clock(), transport, conn)

    def close(self) -> None:
        """Close every spare and stop opening new ones."""
        self._closed = True
        for task in self._opening.values():
            task.cancel()
        for _, transport, _ in self._spare.values():
            transport.close()
        self._spare.clear()


def send_on_spare(host: str, port: int, path: str, body: bytes, headers: dict[str, str], *,
                  spares: SpareConnections | None, progress: bool = False
                  ) -> WorkerResponse | None:
    """POST ``body`` on the address's spare connection (``spares``), written before this
    returns, and replace the spare in the background; None (nothing sent) when there is no
    spare fit to use. No await: the request is on its way before the caller arms any timer
    (the caller then awaits ``response.wait_head()`` and owns ``close()``). ``progress`` as in
    :func:`send`."""
    got = spares.take((host, port)) if spares is not None else None
    if got is None:
        return None
    transport, conn = got
    return _post(transport, conn, host, port, path, body, headers, spares, progress)


async def send(host: str, port: int, path: str, body: bytes, headers: dict[str, str], *,
               connect_timeout_s: float = 5.0, spares: SpareConnections | None = None,
               progress: bool = False) -> WorkerResponse:
    """POST ``body`` to ``http://host:port{path}`` on a new connection (the address's spare when
    ``spares`` has one, which is then replaced in the background) and return at once; the caller
    awaits ``response.wait_head()`` (and owns ``close()`` from here on). ``progress``: the body
    asks for llama-server's prompt-progress events (:class:`WorkerResponse`).

    Raises WorkerConnectionError when the worker cannot be reached within
    ``connect_timeout_s`` seconds."""
    resp = send_on_spare(host, port, path, body, headers, spares=spares, progress=progress)
    if resp is not None:
        return resp
    return await send_connected(host, port, path, body, headers,
                                connect_timeout_s=connect_timeout_s, spares=spares,
                                progress=progress)


async def send_connected(host: str, port: int, path: str, body: bytes, headers: dict[str, str],
                         *, connect_timeout_s: float = 5.0,
                         spares: SpareConnections | None = None,
                         progress: bool = False) -> WorkerResponse:
    """:func:`send` on a connection opened for it (never a spare; ``spares`` is asked for the
    address's next one once the request is written). Raises WorkerConnectionError when the
    worker cannot be reached within ``connect_timeout_s`` seconds."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(connect_timeout_s):
            transport, conn = await loop.create_connection(lambda: _Conn(loop), host, port)
    except TimeoutError:
        raise WorkerConnectionError(f"connect to {host}:{port} timed out "
                                    f"({connect_timeout_s:g} s)") from None
    except OSError as e:
        raise WorkerConnectionError(f"cannot connect to {host}:{port}: {e}") from None
    return _post(transport, conn, host, port, path, body, headers, spares, progress)


def _post(transport: asyncio.Transport, conn: _Conn, host: str, port: int, path: str,
          body: bytes, headers: dict[str, str], spares: SpareConnections | None,
          progress: bool) -> WorkerResponse:
    """Write the request on ``transport`` (one write: head and body), ask ``spares`` for the
    address's next spare, and return the response to come."""
    head = [f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n"]
    head += [f"{k}: {v}\r\n" for k, v in headers.items()]
    head.append("\r\n")
    transport.write("".join(head).encode("latin-1") + body)
    if spares is not None:
        spares.refill((host, port))
    return WorkerResponse(conn, progress=progress)
