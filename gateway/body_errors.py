"""Tell a request's body reader when the body's framing breaks after the headers.

aiohttp's C HTTP parser (aiohttp 3.14, pinned in pyproject.toml; ``_http_parser.pyx``
``HttpParser.feed_data``) reports a framing error it finds inside a body, such as a chunk
size that is not hex, only by queueing an error message for *after* the request in
progress; it never sets an exception on that request's body reader (its pure-Python parser
does: ``http_parser.py`` ``HttpRequestParser.feed_data``). When the bad bytes come with the
headers, aiohttp answers 400 itself before any handler runs. When they come later, the
handler's read of the body would wait for bytes that never come, until
``timeouts.body_read_s`` (408), and only then would aiohttp's 400 follow.

:class:`GatewayAppRunner` is ``web.AppRunner`` whose connections see that queued error: the
body in progress gets a ``web.RequestPayloadError`` at once (which
gateway/limits.py ``read_body`` answers with 400 in the route's error shape) and its end,
and the connection closes after that response, so aiohttp's own 400 for the same bytes is
not sent as a second answer (the stream cannot be framed past that point anyway).
"""

from __future__ import annotations

from itertools import islice

from aiohttp import web, web_protocol

from gateway.logs import get_logger

log = get_logger("gateway.body_errors")


class _RequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection protocol, plus the body error of the module doc."""

    __slots__ = ("_body_in_progress",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._body_in_progress: web.StreamReader | None = None

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)  # only this method appends, only start() pops
        super().data_received(data)
        for message, payload in islice(self._messages, queued, None):
            if not isinstance(message, web_protocol._ErrInfo):
                self._body_in_progress = payload
                continue
            body, self._body_in_progress = self._body_in_progress, None
            if body is None or body.is_eof():
                continue
            if body.exception() is None:
                body.set_exception(web.RequestPayloadError(
                    str(message.message).split("\n", 1)[0]))
            body.feed_eof()  # no lingering read of a body that cannot be framed
            self.close()  # after this request's answer (module doc)
            log.info("request.body_unparsed", error=str(message.message).split("\n", 1)[0])


class _Server(web.Server):
    def __call__(self) -> _RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`_RequestHandler` (module doc)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same state, one method more
        return server
