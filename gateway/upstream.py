"""HTTP client side towards the workers: open a streamed request on a leased worker, read SSE.

Field case 27: this llama-server build sometimes drops a reused keep-alive connection just as
a client reuses it. Every request therefore gets a fresh loopback connection (opened ahead of
time when possible, ``gateway.worker_http.SpareConnections``; tried: pooling saved about 0.5 ms
of gateway CPU per request but every user of the session then had to survive stale
connections), and a request that fails before any response byte is retried (on a new lease, so
possibly another worker) instead of reaching the user. Closing the response on exit is what
tells the worker that a client went away.

Time limits (field cases 6, 10, 11): waiting for the response headers (llama-server sends them
with its first result, server-context.cpp) is bounded by ``first_byte_s`` for streamed
requests and by the request deadline otherwise; a timeout there is retried (another lease).
Once the body flows, ``gateway.watchdog`` watches first byte, inter-token gap, deadline and
clients that stop reading. ``abort_worker`` ends the streams of a worker that went down.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.admission import Admission
from gateway.logs import get_logger
from gateway.scheduling import SlotLease, Ticket, TooLarge, TooManySlots
from gateway.texts import (DEADLINE_MESSAGE, KV_EXHAUSTED_MESSAGE, KV_EXHAUSTED_WORKER_TEXT,
                          OUT_OF_DESCRIPTORS, context_overflow, shutting_down_running)
from gateway.watchdog import StreamWatch, Watchdog
from gateway.worker_http import (SpareConnections, WorkerConnectionError, WorkerDown,
                                 WorkerPayloadError, WorkerResponse, out_of_descriptors,
                                 send_connected, send_on_spare)

log = get_logger("gateway.upstream")

#: The client request being served (set by the middleware): its transport lets the watchdog
#: see a client that stopped reading, its ``t0_ns`` anchors the request deadline.
current_request: contextvars.ContextVar = contextvars.ContextVar("current_request", default=None)

RETRYABLE = ("connection", "worker_gone", "worker_unavailable", "first_byte_timeout")


@dataclass(frozen=True)
class Endpoint:
    """Where a ready worker listens (``http://host:port``), the per-start key it requires,
    and whether the process behind it has exited (``WorkerProcess.has_exited``)."""

    url: str
    api_key: str
    exited: Callable[[], bool] = lambda: False

    @property
    def host_port(self) -> tuple[str, int]:
        return _host_port(self.url)


@functools.lru_cache(maxsize=256)
def _host_port(url: str) -> tuple[str, int]:
    """(host, port) of a worker's ``http://host:port`` (parsed once per address: ``urlsplit``
    was on every request's path)."""
    hp = urlsplit(url)
    return hp.hostname or "127.0.0.1", hp.port or 80


class UpstreamError(Exception):
    """The worker failed the request.

    Attributes:
        status: HTTP status to answer with (the worker's, or 502/503/504 for transport faults).
        message: human-readable text (llama-server ``error.message`` when it sent one).
        kind: llama-server ``error.type`` (e.g. ``exceed_context_size_error``) or a transport tag.
        worker: id of the worker that failed it, set by :meth:`Upstream.request` when the
            failure came with a lease (the worker's error answer, its connection, its first
            byte timing out); None when no worker was leased (deadline while queued) or when
            raised mid-stream (the caller knows the worker from its lease).
    """

    def __init__(self, status: int, message: str, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.worker: str | None = None


#: Texts of llama-server 500s that are the client's fault: its HTTP handler answers a
#: ``std::runtime_error`` thrown while reading the request with 500 (server-http.cpp), e.g.
#: ``Failed to parse messages: [json.exception…]`` for a malformed message list and
#: ``audio input is not supported - hint: …`` / ``video input …`` for a content part the model
#: has no projector for (server-common.cpp). The gateway answers them 400.
CLIENT_FAULT_500 = ("Failed to parse", "json.exception", "input is not supported",
                    "Cannot use both")

#: llama-server's text when the token it sampled is not one the request's grammar allows,
#: which happens when the grammar allows no token that sampling kept: a grammar that admits
#: nothing there (GBNF ``[z-a]``), or a ``logit_bias`` that bans every token the grammar
#: allows at that point (llama-grammar.cpp
#: ``llama_grammar_accept_token``; it answered 500, or an error event after a 200). The
#: request's fault, so 400 with :data:`GRAMMAR_DEAD_END_MESSAGE` in front.
GRAMMAR_DEAD_END_TEXT = "Unexpected empty grammar stack"
GRAMMAR_DEAD_END_MESSAGE = ("the request's grammar or schema allows no token that sampling "
                            "kept here (it admits nothing at this point, or a logit_bias bans "
                            "every token it allows); llama-server: ")


def _client_fault(status: int, message: str) -> tuple[int, str]:
    """(status, message) of a llama-server error: a 500 that is the request's fault
    (:data:`CLIENT_FAULT_500`, :data:`GRAMMAR_DEAD_END_TEXT`) is 400."""
    if status == 500 and GRAMMAR_DEAD_END_TEXT in message:
        return 400, GRAMMAR_DEAD_END_MESSAGE + message
    if status == 500 and any(t in message for t in CLIENT_FAULT_500):
        return 400, message
    return status, message


def parse_error_body(status: int, body: bytes) -> UpstreamError:
    """Turn a llama-server error body ``{"error":{"code","message","type"}}`` into UpstreamError.
    Its over-long-prompt error (``exceed_context_size_error`` with ``n_prompt_tokens`` and
    ``n_ctx``, server-common.cpp) gets the gateway's words for that fault
    (``texts.context_overflow``), as the prompt length check words it: a chat that passed
    that check (it counts the messages, not the chat template) and that the worker refuses
    reads the same on every route. A 500 that is the request's fault is 400
    (:func:`_client_fault`); KV exhaustion is 503 ``kv_exhausted`` (see :func:`error_event`)."""
    try:
        data = orjson.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(err, dict):
            kind, n, ctx = str(err.get("type") or ""), err.get("n_prompt_tokens"), err.get("n_ctx")
            if kind == "exceed_context_size_error" and type(n) is int and type(ctx) is int:
                return UpstreamError(status, context_overflow(n, ctx), kind)
            message = str(err.get("message") or err)
            if message == KV_EXHAUSTED_WORKER_TEXT:  # load, as in error_event
                return UpstreamError(503, KV_EXHAUSTED_MESSAGE, "kv_exhausted")
            status, message = _client_fault(status, message)
            return UpstreamError(status, message, kind)
        return UpstreamError(status, str(err))
    except orjson.JSONDecodeError:
        return UpstreamError(status, body.decode("utf-8", "replace")[:500] or f"HTTP {status}")


def error_event(err) -> UpstreamError:
    """The ``error`` of a llama-server ``{"error": {"code", "message", "type"}}`` SSE event (sent
    when a stream fails after it began) as UpstreamError: status = its ``code`` (500 when absent
    or not an integer), the status llama-server answers the same error with non-streamed; a
    500 that is the request's fault is 400 (:func:`_client_fault`).

    Its KV exhaustion (``texts.KV_EXHAUSTED_WORKER_TEXT``: a decode found no free KV cells, so
    every running request on the worker failed, which happens when slots share one cache,
    ``--kv-unified``) is load, not a fault of the request or the server: 503
    ``kv_exhausted`` with the gateway's words (``texts.KV_EXHAUSTED_MESSAGE``), which the API
    handlers answer with ``Retry-After`` (field cases 2 and 3: nothing is 500 because of load)."""
    if not isinstance(err, dict):
        return UpstreamError(500, str(err))
    code, message = err.get("code", 500), err.get("message", str(err))
    if message == KV_EXHAUSTED_WORKER_TEXT:
        return UpstreamError(503, KV_EXHAUSTED_MESSAGE, "kv_exhausted")
    if not isinstance(code, int):
        code = 500
    if isinstance(message, str):
        code, message = _client_fault(code, message)
    return UpstreamError(code, message, err.get("type", ""))


def _watchdog_limits(config) -> dict:
    """The ``Watchdog`` limits (seconds, bytes) a GatewayConfig sets."""
    t = config.timeouts
    return {"first_byte_s": t.first_byte_s, "inter_token_s": t.inter_token_s,
            "client_write_s": t.client_write_s,
            "write_buffer_bytes": config.limits.write_buffer_bytes}


class Upstream:
    """Inference requests go through :mod:`gateway.worker_http` (a fresh connection each, see
    module doc); ``session`` is the aiohttp session of the side calls (tokenize, templates).

    Args:
        admission: where leases come from.
        endpoint_of: worker id -> Endpoint (None when the worker is gone).
        config: the GatewayConfig whose limits apply (:meth:`configure`);
            ``llama_server.spare_connections`` opens each worker's next connection ahead of
            time (``spares``; fixed for the client's life, gateway.reload ``RESTART_ONLY``).
        on_stall / on_progress: worker-id callbacks of the watchdog (liveness evidence).
        on_answered_elsewhere: called with the id of a worker that sent a request nothing
            within ``first_byte_s`` when another worker then answered that request's retry
            (field case 10: evidence against the worker, not the request).
        attempts: tries for a request that got no response byte.
    """

    def __init__(self, admission: Admission, endpoint_of, config, *, on_stall=None,
                 on_progress=None, on_answered_elsewhere=None, attempts: int = 3):
        self.admission = admission
        self.endpoint_of = endpoint_of
        self.attempts = attempts
        self.on_answered_elsewhere = on_answered_elsewhere or (lambda worker_id: None)
        self.session: aiohttp.ClientSession | None = None
        self._held: set[asyncio.Task] = set()  # see _hold_until_done
        #: per worker id: the responses a request still waits on for their headers or, after
        #: prompt-progress headers, for the answer (``_unanswered_while``; abort_worker and
        #: end_running give up on them)
        self._unanswered: dict[str, set] = {}
        self.spares = SpareConnections() if config.llama_server.spare_connections else None
        self.watchdog = Watchdog(UpstreamError, **_watchdog_limits(config), on_stall=on_stall,
                                 on_progress=on_progress)
        self.configure(config)

    def configure(self, config) -> None:
        """Take the limits of ``config`` (a GatewayConfig), at start and on every reload: for
        new requests ``timeouts.first_byte_s`` (longest wait, s, for the first byte of a
        streamed answer) and ``timeouts.request_s`` (per-request deadline, s, from receipt,
        queueing included); for the watchdog, running streams too, ``timeouts.inter_token_s``
        (longest gap, s, between two pieces of a streamed answer), ``timeouts.client_write_s``
        and ``limits.write_buffer_bytes`` (when a client that stopped reading is dropped)."""
        self.first_byte_s = config.timeouts.first_byte_s
        self.request_s = config.timeouts.request_s
        self.watchdog.configure(**_watchdog_limits(config))

    def request_deadline(self) -> float | None:
        """Monotonic seconds at which the client request being served (``current_request``)
        reaches ``request_s`` from its receipt (``t0_ns``); None outside a request."""
        client = current_request.get()
        t0_ns = client.get("t0_ns") if client is not None else None
        return t0_ns / 1e9 + self.request_s if t0_ns else None

    def abort_worker(self, worker_id: str, reason: str) -> int:
        """End the in-flight streams of a worker that went down (error line / event), and give
        up on the requests still waiting for its first response bytes: they are retried on
        another worker at once (``WorkerDown``; see :meth:`request` for when they are not).
        Those waited until the process was gone: a frozen (SIGSTOPped) worker is stopped with
        SIGTERM, the grace, then SIGKILL, so its first request waited the wedge detection plus
        ``stop_grace_s`` (24 s; a fresh tester's find)."""
        for resp in list(self._unanswered.get(worker_id, ())):
            resp.abort(WorkerDown(f"worker {worker_id} {reason}"))
        return self.watchdog.abort_worker(worker_id, f"worker {worker_id} {reason}")

    @contextlib.contextmanager
    def _unanswered_while(self, worker_id: str, resp: WorkerResponse):
        """``resp`` counts among ``worker_id``'s unanswered responses while the block runs."""
        waiting = self._unanswered.setdefault(worker_id, set())
        waiting.add(resp)
        try:
            yield
        finally:
            waiting.discard(resp)

    def _alone(self, ticket: Ticket, lease: SlotLease) -> bool:
        """Whether ``lease``'s worker is the only one left for ``ticket``'s model: a retry
        after it went down would wait for the same worker to restart and take it down again if
        the request was the cause (a fresh tester's find on a one-worker model)."""
        return not any(w.model == ticket.model and w.id != lease.worker.id
                       and w.id not in ticket.avoid and not w.retiring
                       for w in self.admission.dispatcher.workers.values())

    def _abort_unanswered(self, exc: Exception) -> None:
        """Give up on every unanswered response: each request's wait raises ``exc`` (headers)
        or sees its connection closed (answer)."""
        for waiting in self._unanswered.values():
            for resp in list(waiting):
                resp.abort(exc)

    async def _until_answer(self, worker_id: str, resp: WorkerResponse, t_sent: float,
                            deadline: float) -> None:
        """Wait, within the request's retry loop, for the answer of a request that asked for
        prompt progress: its headers and progress events come as soon as the worker begins
        the prompt, so a worker that crashed or was found wedged while it computed a long
        prompt (nothing of the answer sent, nothing sent to the client) failed the request
        with 502 instead of a retry elsewhere (a fresh tester's find). What was read is put
        back for the reader (``iter_sse_batches`` drops the progress events).

        Returns at the first event that is not progress, at the end of the body, or when
        ``timeouts.first_byte_s`` from ``t_sent`` (or the deadline) has passed: the watchdog
        then times the request out as it always did. Raises UpstreamError ``connection``
        (retried) when the connection breaks, ``shutdown`` when it broke because the drain
        ran out (``end_running``), and ``WorkerDown`` when ``abort_worker`` gave up on it."""
        seen, rest = [], b""
        try:
            with self._unanswered_while(worker_id, resp):  # abort_worker / end_running close it
                while True:
                    left = min(t_sent + self.first_byte_s, deadline) - time.monotonic()
                    if left <= 0:
                        return
                    try:
                        async with asyncio.timeout(left):
                            chunk = await resp.content.readany()
                    except TimeoutError:
                        return
                    if not chunk:
                        return
                    seen.append(chunk)
                    lines = (rest + chunk).split(b"\n")
                    rest = lines.pop()
                    for line in lines:
                        data = _sse_payload(line)
                        if data and PROGRESS_KEY not in data:
                            return
        except WorkerPayloadError as e:
            if self.admission.shutting_down:
                raise UpstreamError(503, shutting_down_running(), "shutdown") from None
            if isinstance(resp.aborted_by, WorkerDown):  # abort_worker: the worker went down
                raise resp.aborted_by from None
            raise UpstreamError(502, f"worker {worker_id} stopped while it computed the "
                                     f"prompt: {e}", "connection") from None
        finally:
            resp.content.unread(b"".join(seen))

    def end_running(self) -> int:
        """The shutdown drain ran out: end every in-flight worker stream now with 503
        ``shutting_down_running`` (the handlers write it as their error line or event) and
        stop reading held non-streamed answers, so every connection to the workers closes
        before they get SIGTERM. llama-server waits for its open requests before it exits on
        SIGTERM: with streams still open every worker took ``stop_grace_s`` and a SIGKILL,
        and the clients sat on a silent stream meanwhile (a fresh tester's find). Returns how
        many streams were ended."""
        for task in list(self._held):
            task.cancel()  # its finally closes the answer and gives the slot back
        # no answer yet: 503 (``_until_answer``)
        self._abort_unanswered(UpstreamError(503, shutting_down_running(), "shutdown"))
        return self.watchdog.abort_all(503, shutting_down_running(), "shutdown")

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             json_serialize=lambda o: orjson.dumps(o).decode())

    def _give_back(self, request_id: str, lease: SlotLease, resp: WorkerResponse | None,
                   deadline: float, *, hold: bool) -> None:
        """End a request's use of its slot. At once: close the response (the worker sees the
        disconnect and frees the slot) and release the lease. With ``hold`` and an answer the
        worker is still producing (a non-streamed request it will not abandon), only once the
        worker is done (:meth:`_hold_until_done`)."""
        if hold and resp is not None and not resp.complete:
            self._hold_until_done(request_id, lease, resp, deadline)
            return
        if resp is not None:
            resp.close()
        self.admission.release(lease)

    def _hold_until_done(self, request_id: str, lease: SlotLease, resp: WorkerResponse,
                         deadline: float) -> None:
        """A non-streamed request whose client left (or timed out) before the answer: this
        llama-server build does not notice a closed connection on a non-streamed request and
        finishes the generation anyway (seen with a standalone worker; streamed requests stop
        within ~0.5 s). So the slot stays leased, and the answer is read and dropped, until the
        worker is done or the request deadline passes; only then is the slot given back, and
        the scheduler never sends that worker more requests than it has slots.

        Completions are streamed from the worker whenever llama-server allows it (``/api/*``
        and ``/v1``, whose non-streamed answers the gateway assembles), so this is left for the
        requests that go up non-streamed: embeddings and ``/v1`` chat with ``logprobs`` and
        ``tools`` (which llama-server refuses to stream)."""
        async def finish() -> None:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await resp.wait_head()
                    await resp.read()
            except (Exception, asyncio.CancelledError):
                pass
            finally:
                resp.close()
                self.admission.release(lease)
                self._held.discard(task)
        log.info("upstream.hold_abandoned", request_id=request_id, worker=lease.worker.id)
        task = asyncio.get_running_loop().create_task(finish(), name=f"hold-{request_id}")
        self._held.add(task)

    async def close(self) -> None:
        for task in list(self._held):
            task.cancel()
        self.watchdog.close()
        if self.spares is not None:
            self.spares.close()
        if self.session:
            await self.session.close()

    @contextlib.asynccontextmanager
    async def request(self, ticket: Ticket, path: str, body: dict, on_admitted=None
                      ) -> AsyncIterator[tuple[SlotLease, WorkerResponse]]:
        """Lease a slot, POST ``body`` to ``path`` on that worker, yield (lease, response).
        ``on_admitted()`` (optional) is called once admission took the ticket (a slot, or a
        place in the queue), before any wait.

        The response has status < 400 (errors raise ``UpstreamError``, its ``worker`` the
        worker that failed it). On exit the response is closed (so the worker sees a
        disconnect and frees its slot) and the lease released.
        Raises QueueFull / QueueTimeout from admission, UpstreamError after ``attempts``.
        """
        assert self.session is not None
        streamed = body.get("stream") is True
        # Prompt-progress events (one per prefill batch) make llama-server look at the client
        # connection while it computes a prompt: without them it notices a closed connection
        # only after a full second with no result for any of its requests, which a busy worker
        # (or the gateway's own telemetry polls) never gives it, so an abandoned prompt was
        # computed to its end (field case 7). The SSE reader drops them. Short prompts go
        # without (PROGRESS_MIN_PROMPT_TOKENS).
        progress = (streamed and "return_progress" not in body
                    and (ticket.prefill_tokens == 0
                         or ticket.prefill_tokens >= PROGRESS_MIN_PROMPT_TOKENS))
        payload = orjson.dumps({**body, "return_progress": True} if progress else body)
        client = current_request.get()
        deadline = self.request_deadline() or time.monotonic() + self.request_s
        downstream = client.transport if client is not None else None
        # No read timeout here: the watchdog times the body (first byte, gaps, deadline).
        last: UpstreamError | None = None
        went_down = False  # a worker of an earlier attempt went down while it computed this
        silent_on: set[str] = set()  # workers an earlier attempt got no first byte from
        for attempt in range(self.attempts):
            # A free slot is taken at once; only a queued ticket needs the deadline's timer.
            try:
                lease = self.admission.submit(ticket)
                if on_admitted is not None:
                    on_admitted()
                if lease is None:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        lease = await self.admission.wait(ticket)
            except TimeoutError:
                raise UpstreamError(504, f"{DEADLINE_MESSAGE} while waiting for a "
                                         "slot", "deadline") from None
            except (TooLarge, TooManySlots) as e:
                # the handler checked it fits; a reload (or a retry's fleet) since gave the model
                # fewer slots or a shorter context: 400, as for a new request, not a queue timeout
                raise UpstreamError(400, str(e), "does_not_fit") from None
            resp = ep = None
            down_seen = False  # abort_worker gave up on this try (WorkerDown)
            try:
                ep = self.endpoint_of(lease.worker.id)
                if ep is None:
                    raise UpstreamError(503, "worker went away", "worker_gone")
                wait_s = max(0.0, deadline - time.monotonic())
                if streamed:
                    wait_s = min(wait_s, self.first_byte_s)
                t_sent = time.monotonic()
                try:
                    host, port = ep.host_port
                    headers = {"Authorization": f"Bearer {ep.api_key}",
                               "Content-Type": "application/json"}
                    # The wait_s budget starts now; on a spare connection the request is
                    # written before the timer is set up (off the time to first token).
                    until = asyncio.get_running_loop().time() + wait_s
                    resp = send_on_spare(host, port, path, payload, headers,
                                         spares=self.spares, progress=progress)
                    async with asyncio.timeout_at(until):
                        if resp is None:
                            resp = await send_connected(host, port, path, payload, headers,
                                                        spares=self.spares, progress=progress)
                        # abort_worker gives up on it (a retry follows); a connection that
                        # closes from here on closed under this request (``process_exited``)
                        with self._unanswered_while(lease.worker.id, resp):
                            await resp.wait_head()
                except TimeoutError:
                    if time.monotonic() >= deadline - 0.01:
                        raise UpstreamError(504, DEADLINE_MESSAGE, "deadline") from None
                    self.watchdog.on_stall(lease.worker.id)
                    raise UpstreamError(504, f"worker {lease.worker.id} sent nothing within "
                                             f"{wait_s:g} s", "first_byte_timeout") from None
                except WorkerDown as e:
                    err = _down_error(e, lease.worker.id, went_down, self._alone(ticket, lease))
                    went_down = down_seen = True
                    raise err from None
                except WorkerConnectionError as e:
                    if out_of_descriptors(e):  # the gateway's own shortage (not retried)
                        log.warning("gateway.out_of_descriptors", during="request",
                                    request_id=ticket.request_id, error=str(e))
                        raise UpstreamError(503, OUT_OF_DESCRIPTORS, "gateway_overloaded") \
                            from None
                    raise UpstreamError(502, f"worker {lease.worker.id} unreachable: {e}",
                                        "connection")
                if resp.status == 503:
                    err = parse_error_body(503, await resp.read())
                    raise UpstreamError(503, err.message, "worker_unavailable")
                if resp.status >= 400:
                    raise parse_error_body(resp.status, await resp.read())
                if progress:
                    try:
                        await self._until_answer(lease.worker.id, resp, t_sent, deadline)
                    except WorkerDown as e:
                        err = _down_error(e, lease.worker.id, went_down,
                                          self._alone(ticket, lease))
                        went_down = down_seen = True
                        raise err from None
            except UpstreamError as e:
                e.worker = lease.worker.id
                if e.kind == "first_byte_timeout":
                    silent_on.add(lease.worker.id)
                self._give_back(ticket.request_id, lease, resp, deadline, hold=False)
                if e.kind == "connection" and resp is not None and not down_seen \
                        and await process_exited(ep):
                    # the worker's process ended as its connection closed under this request:
                    # the retry rule of a worker that went down (a crash is seen as a plain
                    # connection reset before the supervisor sees the exit)
                    e = _down_error(WorkerDown(f"worker {lease.worker.id} exited"),
                                    lease.worker.id, went_down, self._alone(ticket, lease))
                    e.worker = lease.worker.id
                    went_down = True
                if e.kind in RETRYABLE and attempt + 1 < self.attempts:
                    ticket.avoid = ticket.avoid | {lease.worker.id}
                    log.warning("upstream.retry", request_id=ticket.request_id,
                                worker=lease.worker.id, reason=e.message, attempt=attempt + 1)
                    last = e
                    await asyncio.sleep(0.1 * (attempt + 1))
                    continue
                raise e
            except BaseException:
                self._give_back(ticket.request_id, lease, resp, deadline, hold=not streamed)
                raise
            for silent in silent_on - {lease.worker.id}:  # this one answered what they did not
                self.on_answered_elsewhere(silent)
            # The worker's first answer bytes (a streamed request's first token) end the
            # request's prefill: it leaves the worker's prefill backlog (scheduler cost).
            if resp.answered:
                lease.first_token()
            else:
                resp.on_answer = lease.first_token
            watch = StreamWatch(lease.worker.id, ticket.request_id, resp, t_sent, deadline,
                                downstream)
            self.watchdog.add(watch)
            try:
                yield lease, resp
            except UpstreamError as e:
                if e.kind == "stream_broken" and self.admission.shutting_down:
                    # the drain ran out and the gateway stopped the worker: say so, not that
                    # the worker failed (a fresh tester's find)
                    e.status, e.message, e.kind = 503, shutting_down_running(), "shutdown"
                raise
            finally:
                self.watchdog.discard(watch)
                self._give_back(ticket.request_id, lease, resp, deadline,
                                hold=not streamed and watch.aborted is None)
                if client is not None and resp.events:  # metrics: tokens of unfinished answers
                    client["events_streamed"] = client.get("events_streamed", 0) + resp.events
            return
        raise last or UpstreamError(502, "no worker answered")


#: Longest wait (s) for the process of a worker whose connection closed under a request to be
#: seen exited; a worker that crashes has exited before its connections close.
CRASH_SEEN_S = 0.3


async def process_exited(ep: Endpoint | None) -> bool:
    """Whether the process behind ``ep`` exited as a request's connection to it closed:
    polled every 10 ms for up to CRASH_SEEN_S."""
    if ep is None:
        return False
    t_end = time.monotonic() + CRASH_SEEN_S
    while not ep.exited():
        if time.monotonic() >= t_end:
            return False
        await asyncio.sleep(0.01)
    return True


def _down_error(e: WorkerDown, worker_id: str, second: bool, alone: bool) -> UpstreamError:
    """The error of a request whose worker went down before it answered (``abort_worker``):
    ``connection``, retried on another worker, the first time; ``worker_down``, not retried,
    when a worker of an earlier attempt went down while it computed this request too
    (``second``), or when no other worker of the model is left to try (``alone``). A request
    that freezes or crashes its worker was retried on each worker of the model in turn and took
    all of them down (a fresh tester's find); a worker that goes down for a cause of its own
    still has its requests tried elsewhere once. Only ``second`` is evidence against the
    request, and only its words say so (a one-worker model's worker killed from outside read
    as the request's fault; a tester's find)."""
    if second:
        return UpstreamError(502, f"{e} while it computed this request, as did the worker it "
                                  f"was sent to first: it is not tried again (a request that "
                                  f"freezes or crashes workers would take each in turn)",
                             "worker_down")
    if alone:
        return UpstreamError(502, f"{e} while it computed this request, and no other worker of "
                                  f"the model is left to try it on; the worker is restarted, "
                                  f"please retry once it is back", "worker_down")
    return UpstreamError(502, f"worker {worker_id} unreachable: {e}", "connection")


# What a client reads when the worker's connection ends mid-answer (crash, kill, restart); the
# transport detail (connection reset, malformed chunk …) goes to the log, not to the user.
BROKE_MESSAGE = "the worker stopped in the middle of the answer (connection lost); please retry"


def _sse_payload(line: bytes) -> bytes | None:
    """The payload of one SSE line: ``data:`` (or llama-server's ``error:``) field text, or None
    for comments (``:`` pings), blank separators and other fields."""
    if line.startswith(b"data:") or line.startswith(b"error:"):
        data = line[5:] if line[0] == 100 else line[6:]  # 100 = ord("d")
        return data.strip()
    return None


#: Estimated prompt tokens (``Ticket.prefill_tokens``; 0, unknown, counts as long) from which a
#: streamed request asks its worker for prompt-progress events. A shorter prompt is computed
#: in one batch, usually well within llama-server's one-second connection check (a large model
#: on a slow CPU is the exception: its abandoned prompt still runs to the first token), and its
#: two progress events would reach the gateway just before its first token: measured on the
#: 2-core development machine with a 16-token prompt, asking for them added 0.05-0.08 ms to
#: the gateway's added TTFT p50 (tests/bench/overhead_ab.py, 600 requests, both placements).
PROGRESS_MIN_PROMPT_TOKENS = 64

#: The key of llama-server's prompt-progress events (``return_progress``; server-task.cpp
#: ``result_prompt_progress``: ``{"total","cache","processed","time_ms"}``), which carry no
#: content, except on the chat route, whose first one carries the echo of a continued last
#: assistant message (:func:`_progress_answer`). Inside a JSON string (generated text) the
#: quotes are escaped, so this exact byte sequence appears only as a key.
PROGRESS_KEY = b'"prompt_progress":'


def _progress_answer(data: bytes) -> bytes | None:
    """A prompt-progress event ``data`` as the answer event it also is, or None when it is only
    progress. llama-server's chat route puts the echo of a continued (prefilled) last assistant
    message in its first progress event's ``delta.content``; dropped with the event, a long
    prompt's answer lacked the echo a short one's had (a fresh tester's find, with a role
    chunk sent twice). Kept: its choices' content, without the progress and the role."""
    if b'"content":"' not in data and b'"tool_calls"' not in data and b'"reasoning_content":"' not in data:
        return None
    ev = orjson.loads(data)
    choices = []
    for c in ev.get("choices") or ():
        delta = {k: v for k, v in (c.get("delta") or {}).items() if k != "role" and v}
        if delta:
            choices.append({**c, "delta": delta})
    if not choices:
        return None
    ev.pop("prompt_progress", None)
    return orjson.dumps({**ev, "choices": choices})


async def iter_sse_batches(resp: WorkerResponse) -> AsyncIterator[list[bytes]]:
    """Yield the SSE ``data:`` payloads (bytes, JSON text) that arrived together, as one list
    per network read, until ``[DONE]`` or the end of the stream. When ``resp.progress``, the
    prompt-progress events the gateway asked for are dropped, and ``resp.note_answer()`` is
    called before the first batch.

    Batching is the relay's main saving: the caller translates a whole batch and writes it
    downstream with one ``write`` (one syscall), instead of one per token, and nothing waits
    for more data than has already arrived, so no latency is added. An ``error:`` field or a
    payload holding ``{"error": ...}`` is yielded as is; callers check for it.
    Raises UpstreamError(502) if the connection breaks mid-stream.
    """
    rest = b""
    progress = resp.progress
    try:
        async for chunk in resp.content.iter_any():
            lines = (rest + chunk).split(b"\n") if rest else chunk.split(b"\n")
            rest = lines.pop()
            batch = []
            for line in lines:
                data = _sse_payload(line)
                if not data:
                    continue
                if data == b"[DONE]":
                    if batch:
                        if progress:
                            resp.note_answer()
                        resp.events += len(batch)
                        yield batch
                    return
                if progress and PROGRESS_KEY in data:
                    data = _progress_answer(data)
                    if data is None:
                        continue
                batch.append(data)
            if batch:
                if progress:
                    resp.note_answer()
                resp.events += len(batch)
                yield batch
        data = _sse_payload(rest)
        if data and data != b"[DONE]" and not (progress and PROGRESS_KEY in data):
            if progress:
                resp.note_answer()
            resp.events += 1
            yield [data]
    except WorkerPayloadError as e:
        _log_broken(e)
        raise UpstreamError(502, BROKE_MESSAGE, "stream_broken") from e
    except asyncio.TimeoutError as e:
        raise UpstreamError(504, "worker stalled mid-stream", "stall") from e


def _log_broken(e: Exception) -> None:
    """One ``upstream.stream_broken`` warning, with the client request's id and worker (set by
    the middleware and ``note_lease``) when there is one."""
    req = current_request.get()
    log.warning("upstream.stream_broken", error=str(e),
                request_id=req.get("request_id") if req is not None else None,
                worker=req.get("worker") if req is not None else None)


async def iter_sse(resp: WorkerResponse) -> AsyncIterator[bytes]:
    """Each SSE ``data:`` payload on its own (see :func:`iter_sse_batches`)."""
    async for batch in iter_sse_batches(resp):
        for data in batch:
            yield data


async def iter_raw(resp: WorkerResponse) -> AsyncIterator[bytes]:
    """Yield the body as it arrives (pass-through relays). Raises UpstreamError(502) when the
    connection breaks, or the watchdog's UpstreamError when it ended the stream."""
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    except WorkerPayloadError as e:
        _log_broken(e)
        raise UpstreamError(502, BROKE_MESSAGE, "stream_broken") from e


async def read_all(resp: WorkerResponse) -> bytes:
    """The whole body; errors as in :func:`iter_raw`."""
    return b"".join([chunk async for chunk in iter_raw(resp)])
