"""gateway.worker_http against small asyncio HTTP servers written here (each answers with
exactly the bytes a test needs: framed, chunked, broken, silent)."""

import asyncio

import pytest

from gateway.worker_http import (HIGH_WATER_BYTES, SpareConnections, WorkerConnectionError,
                                 WorkerPayloadError, send, send_on_spare)


async def post(host, port, path, body, headers, progress=False):
    """send, then the response headers, as gateway.upstream does (closing on failure)."""
    resp = await send(host, port, path, body, headers, progress=progress)
    try:
        await resp.wait_head()
    except BaseException:
        resp.close()
        raise
    return resp


async def serve(reply):
    """Start a server whose connection handler is ``reply(reader, writer)``; returns (server,
    port, list of received request heads)."""
    heads = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0]
                .split(b":")[1])
        heads.append((head, await reader.readexactly(n)))
        try:
            await reply(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], heads


async def test_content_length_body_and_request_shape():
    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
                b'{"ok":true}')
        await w.drain()

    server, port, heads = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/completion", b'{"prompt":"hi"}',
                          {"Authorization": "Bearer k", "Content-Type": "application/json"})
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert await resp.read() == b'{"ok":true}'
        assert resp.content.total_bytes == 11
    head, body = heads[0]
    assert head.startswith(b"POST /completion HTTP/1.1\r\n")
    assert b"Connection: close\r\n" in head and b"Authorization: Bearer k\r\n" in head
    assert body == b'{"prompt":"hi"}'


async def test_chunked_sse_arrives_piece_by_piece():
    gate = asyncio.Event()

    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"8\r\ndata: 1\n\r\n")
        await w.drain()
        await gate.wait()
        w.write(b"8\r\ndata: 2\n\r\n0\r\n\r\n")
        await w.drain()

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/completion", b"{}", {})
        it = resp.content.iter_any()
        assert await it.__anext__() == b"data: 1\n"  # before the worker sent the rest
        gate.set()
        assert b"".join([c async for c in it]) == b"data: 2\n"
        assert resp.content.total_bytes == 16


async def test_connection_lost_mid_body_is_a_payload_error():
    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\ndata: 1\n\r\n")
        await w.drain()  # then the handler returns and the connection closes mid-stream

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/completion", b"{}", {})
        with pytest.raises(WorkerPayloadError):
            await resp.read()


async def test_close_before_headers_and_refused_are_connection_errors():
    async def reply(r, w):
        return None  # close without answering

    server, port, _ = await serve(reply)
    async with server:
        with pytest.raises(WorkerConnectionError):
            await post("127.0.0.1", port, "/completion", b"{}", {})
    with pytest.raises(WorkerConnectionError):  # nothing listens there any more
        await post("127.0.0.1", port, "/completion", b"{}", {})


async def test_garbage_instead_of_http_is_a_connection_error():
    async def reply(r, w):
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()

    server, port, _ = await serve(reply)
    async with server:
        with pytest.raises(WorkerConnectionError, match="malformed"):
            await post("127.0.0.1", port, "/completion", b"{}", {})


async def test_unframed_body_ends_with_the_connection():
    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        await w.drain()

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/x", b"{}", {})
        assert await resp.read() == b"all of it"


async def test_set_exception_wakes_a_waiting_reader_and_close_reaches_the_server():
    closed = asyncio.Event()

    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        await r.read()  # returns when the client closes its side
        closed.set()

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/completion", b"{}", {})
        reader = asyncio.ensure_future(resp.read())
        await asyncio.sleep(0.05)
        assert not reader.done()
        resp.content.set_exception(RuntimeError("watchdog"))
        with pytest.raises(RuntimeError, match="watchdog"):
            await reader
        resp.close()
        await asyncio.wait_for(closed.wait(), 5)


async def test_a_slow_reader_pauses_the_worker_connection_and_loses_nothing():
    size = 8 * HIGH_WATER_BYTES

    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            w.write(b"x" * 65536)
            await w.drain()

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/x", b"{}", {})
        await asyncio.sleep(0.2)  # the server writes while nobody reads
        assert resp.content._paused  # reading from the socket stopped at the high-water mark
        assert resp.content.total_bytes < size
        got = 0
        async for chunk in resp.content.iter_any():
            got += len(chunk)
        assert got == size


async def serve_numbered(idle_close_s: float | None = None):
    """A server that numbers its connections in accept order and answers each request with the
    number of the connection it came on; one that sends nothing for ``idle_close_s`` is closed
    (like cpp-httplib's keep-alive timeout). Returns (server, port, accepted, eofs): how many
    connections were accepted, and the numbers of those that the client closed unused."""
    accepted, eofs = [0], []

    async def handle(reader, writer):
        n = accepted[0]
        accepted[0] += 1
        try:
            async with asyncio.timeout(idle_close_s):
                head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, TimeoutError):
            eofs.append(n)
            writer.close()
            return
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0]
                     .split(b":")[1])
        await reader.readexactly(length)
        body = str(n).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], accepted, eofs


async def ask(port, spares):
    resp = await send("127.0.0.1", port, "/x", b"{}", {}, spares=spares)
    await resp.wait_head()
    return int(await resp.read())


async def test_the_next_request_goes_out_on_a_spare_opened_after_the_previous_one():
    server, port, accepted, eofs = await serve_numbered()
    spares = SpareConnections()
    async with server:
        assert await ask(port, spares) == 0
        await asyncio.sleep(0.1)
        assert accepted[0] == 2  # the request's own connection and the spare
        assert await ask(port, spares) == 1  # sent on the spare, connected before it
        assert await ask(port, spares) == 2
        await asyncio.sleep(0.1)
        spares.close()
        await asyncio.sleep(0.1)
        assert eofs == [3]  # the last spare, closed unused by close()
        assert await ask(port, spares) == 4  # after close(): a fresh connection, no new spare
        await asyncio.sleep(0.1)
        assert accepted[0] == 5


async def test_a_spare_past_its_age_or_closed_by_the_worker_is_not_used():
    now = [0.0]
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    server, port, accepted, eofs = await serve_numbered(idle_close_s=0.3)
    spares = SpareConnections(max_age_s=3.0, clock=lambda: now[0])
    async with server:
        assert await ask(port, spares) == 0
        await asyncio.sleep(0.1)
        now[0] += 3.5  # older than max_age_s: dropped, the request connects itself
        assert await ask(port, spares) == 2
        await asyncio.sleep(0.1)
        assert 1 in eofs
        await asyncio.sleep(0.5)  # the worker closes the idle spare (connection 3) itself
        assert 3 in eofs
        assert await ask(port, spares) == 4
        spares.close()
    import gc
    gc.collect()
    await asyncio.sleep(0)
    assert errors == []  # no "Future exception was never retrieved" for the dead spare


def test_out_of_descriptors_is_told_from_other_connection_errors():
    """EMFILE/ENFILE, directly or wrapped (aiohttp's connector errors keep the OS error in
    ``os_error``, ``send`` raises from None with the OS error as context), is the gateway's
    own shortage: a 503 naming its limit, never a worker's fault (a fresh tester saw 502
    "worker unreachable: Too many open files")."""
    import errno as errno_

    from gateway.worker_http import WorkerConnectionError, out_of_descriptors

    emfile = OSError(errno_.EMFILE, "Too many open files")
    assert out_of_descriptors(emfile) and out_of_descriptors(OSError(errno_.ENFILE, "x"))
    assert not out_of_descriptors(OSError(errno_.ECONNREFUSED, "refused"))
    assert not out_of_descriptors(ValueError("x"))

    class Wrapped(Exception):
        os_error = emfile
    assert out_of_descriptors(Wrapped())
    try:
        try:
            raise emfile
        except OSError as e:
            raise WorkerConnectionError(f"cannot connect: {e}") from None
    except WorkerConnectionError as e:
        assert out_of_descriptors(e)


async def test_send_on_spare_sends_nothing_without_a_spare():
    """``send_on_spare`` writes only on a spare; with none (no pool, or none opened yet) it
    returns None and connects nowhere, and the caller connects (``send_connected``)."""
    server, port, accepted, eofs = await serve_numbered()
    spares = SpareConnections()
    async with server:
        assert send_on_spare("127.0.0.1", port, "/x", b"{}", {}, spares=None) is None
        assert send_on_spare("127.0.0.1", port, "/x", b"{}", {}, spares=spares) is None
        await asyncio.sleep(0.1)
        assert accepted[0] == 0
        assert await ask(port, spares) == 0  # connects itself, then opens a spare
        await asyncio.sleep(0.1)
        resp = send_on_spare("127.0.0.1", port, "/x", b"{}", {}, spares=spares)
        assert resp is not None
        await resp.wait_head()
        assert int(await resp.read()) == 1  # the spare, connected before this request
        spares.close()
