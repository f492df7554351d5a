"""Per-stream watchdog: first byte, inter-token gap, request deadline, clients that stop reading.

Every upstream response that has begun (headers received) is registered as a ``StreamWatch``.
One timer task per gateway (never per request, never per token) looks at all of them every
``tick_s`` seconds:

* worker progress is read from ``resp.content.total_bytes`` (the count of body bytes
  received, ``gateway.worker_http.Body``), so the hot path pays nothing;
* no answer within ``first_byte_s`` of sending (``resp.answered``: llama-server's
  prompt-progress events during the prefill are progress, not the answer, so a long prompt
  keeps the first-byte limit it had without them), or no byte for ``inter_token_s`` after the
  answer began, aborts the stream with ``UpstreamError(504)`` and reports the worker as
  stalled;
* past the request deadline, ``UpstreamError(504, kind="deadline")``;
* a client whose socket write buffer stays full for ``client_write_s`` is dropped
  (``transport.abort()``: aiohttp cancels its handler, the lease is released in ``finally``,
  the upstream response closed so the worker frees its slot). While the client is the one
  blocking, the worker is not blamed.

Aborting a stream wakes its reader with the error (``Body.set_exception``); the API
modules then end the stream with an error line / event, or answer the error as JSON.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from gateway.logs import get_logger
from gateway.texts import DEADLINE_MESSAGE
from gateway.worker_http import WorkerResponse

log = get_logger("gateway.watchdog")


@dataclass(eq=False)
class StreamWatch:
    """One in-flight upstream response.

    Attributes:
        worker_id / request_id: for logs and per-worker aborts.
        resp: the upstream response whose body is being read.
        t_sent: monotonic s when the request was sent to the worker.
        deadline: monotonic s of the request deadline.
        downstream: the client's transport (None when unknown).
    """

    worker_id: str
    request_id: str
    resp: WorkerResponse
    t_sent: float
    deadline: float
    downstream: asyncio.Transport | None = None
    bytes_seen: int = 0
    t_progress: float = 0.0
    blocked_since: float | None = None
    aborted: str | None = field(default=None)

    def abort(self, exc: Exception) -> None:
        """Wake the reader of this stream with ``exc`` (an UpstreamError); idempotent."""
        if self.aborted is None:
            self.aborted = str(exc)
            self.resp.content.set_exception(exc)


class Watchdog:
    """The timer over all ``StreamWatch`` objects (see module doc).

    Args:
        make_error: ``(status, message, kind) -> Exception`` (UpstreamError's constructor).
        first_byte_s / inter_token_s / client_write_s: limits in seconds.
        write_buffer_bytes: a client write buffer at or above this counts as full.
        on_stall: called with a worker id when one of its streams stalled.
        on_progress: called with a worker id when one of its streams made progress.
    """

    def __init__(self, make_error: Callable[[int, str, str], Exception], *, first_byte_s: float,
                 inter_token_s: float, client_write_s: float, write_buffer_bytes: int,
                 on_stall: Callable[[str], None] | None = None,
                 on_progress: Callable[[str], None] | None = None):
        self.make_error = make_error
        self.configure(first_byte_s=first_byte_s, inter_token_s=inter_token_s,
                       client_write_s=client_write_s, write_buffer_bytes=write_buffer_bytes)
        self.on_stall = on_stall or (lambda w: None)
        self.on_progress = on_progress or (lambda w: None)
        self.watches: set[StreamWatch] = set()
        self._task: asyncio.Task | None = None

    def configure(self, *, first_byte_s: float, inter_token_s: float, client_write_s: float,
                  write_buffer_bytes: int) -> None:
        """Set the limits (seconds, bytes; see the class doc). A reload calls this: the new
        limits apply from the next tick to every watched stream, running ones included."""
        self.first_byte_s = first_byte_s
        self.inter_token_s = inter_token_s
        self.client_write_s = client_write_s
        self.write_buffer_bytes = write_buffer_bytes
        self.tick_s = max(0.05, min(0.5, first_byte_s / 4, inter_token_s / 4, client_write_s / 4))

    def add(self, w: StreamWatch) -> None:
        w.t_progress = w.t_sent
        self.watches.add(w)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="watchdog")

    def discard(self, w: StreamWatch) -> None:
        self.watches.discard(w)

    def abort_worker(self, worker_id: str, message: str) -> int:
        """End every in-flight stream of ``worker_id`` with a 502 ``message``; returns how many."""
        n = self._abort(502, message, "worker_down", worker_id)
        if n:
            log.warning("watchdog.worker_streams_aborted", worker=worker_id, streams=n, reason=message)
        return n

    def abort_all(self, status: int, message: str, kind: str) -> int:
        """End every in-flight stream with ``status`` / ``message`` (the gateway stops);
        returns how many."""
        return self._abort(status, message, kind)

    def _abort(self, status: int, message: str, kind: str, worker_id: str | None = None) -> int:
        """Abort the streams not yet aborted (of ``worker_id``; None: all); returns how many."""
        n = 0
        for w in list(self.watches):
            if w.aborted is None and worker_id in (None, w.worker_id):
                w.abort(self.make_error(status, message, kind))
                n += 1
        return n

    async def _run(self) -> None:
        while self.watches:
            await asyncio.sleep(self.tick_s)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One pass over all watches at monotonic time ``now``."""
        progressed: set[str] = set()
        for w in list(self.watches):
            if w.aborted is not None:
                continue
            if self._client_blocked(w, now):
                continue
            n = w.resp.content.total_bytes
            if n != w.bytes_seen:
                w.bytes_seen, w.t_progress = n, now
                progressed.add(w.worker_id)
            if now >= w.deadline:
                log.warning("watchdog.deadline", request_id=w.request_id, worker=w.worker_id)
                w.abort(self.make_error(504, DEADLINE_MESSAGE, "deadline"))
            elif not w.resp.answered and now - w.t_sent > self.first_byte_s:
                self._stall(w, f"worker {w.worker_id} sent no token within {self.first_byte_s:g} "
                               f"s (it was still computing the prompt)" if w.bytes_seen else
                            f"worker {w.worker_id} sent nothing within {self.first_byte_s:g} s",
                            "first_byte_timeout")
            elif w.resp.answered and now - w.t_progress > self.inter_token_s:
                self._stall(w, f"worker {w.worker_id} sent nothing for {self.inter_token_s:g} s "
                               f"mid-answer", "inter_token_timeout")
        for wid in progressed:
            self.on_progress(wid)

    def _stall(self, w: StreamWatch, message: str, kind: str) -> None:
        log.warning("watchdog.stall", request_id=w.request_id, worker=w.worker_id, kind=kind)
        w.abort(self.make_error(504, message, kind))
        self.on_stall(w.worker_id)

    def _client_blocked(self, w: StreamWatch, now: float) -> bool:
        """True while the client's write buffer is full (then the worker is not timed)."""
        t = w.downstream
        if t is None:
            return False
        if t.is_closing():
            return False
        try:
            full = t.get_write_buffer_size() >= self.write_buffer_bytes
        except (AttributeError, RuntimeError):
            return False
        if not full:
            w.blocked_since = None
            return False
        if w.blocked_since is None:
            w.blocked_since = now
        elif now - w.blocked_since > self.client_write_s:
            log.warning("watchdog.client_dropped", request_id=w.request_id, worker=w.worker_id,
                        reason="client stopped reading", buffered=t.get_write_buffer_size())
            w.aborted = "client stopped reading"
            t.abort()
            return True
        w.t_progress = now  # the worker waits for the client: do not time it
        return True

    def close(self) -> None:
        if self._task:
            self._task.cancel()
