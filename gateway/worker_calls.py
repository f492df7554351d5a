"""Cheap side calls to a worker of a model, outside the slot scheduler.

``/tokenize``, ``/detokenize``, ``/apply-template`` and ``/props`` (llama-server, see
shared/reference/ollama-api.md §B5) do not decode tokens and do not occupy a slot, so they are
sent without taking a lease. Used for Ollama's ``context`` round trip, prompt rendering for
``/api/generate``, embedding truncation and capabilities.

Where they go (field cases 11 and 15: while a worker stops, restarts or hangs, requests go
elsewhere or wait): only to workers the dispatcher would give requests to
(``Dispatcher.in_rotation``: ready, not draining, retiring or failed; a worker being stopped by
a restart or reload drains first), in the order of ``gateway.scheduling.side_calls``: the
worker that serves or served the request first when it is still in rotation, workers whose side
call just failed last. Each try is bounded by ``timeout_s`` (default
``llama_server.liveness_timeout_s``: a side call costs no more than the liveness probe's
``/slots``); a transport error, a timeout (unless the body is over :data:`BIG_BODY_BYTES`:
then it is the body's size) or a worker's 503 is retried on another worker in rotation (or,
with none left untried, on the same ones after a short pause) until the call's waiting time
is over. With no worker in rotation the call waits like admission does (up to
``wait_s``, default ``queue.timeout_s``, and never past the request deadline
``timeouts.request_s``), or raises admission's refusal at once when waiting cannot help.
Client-facing errors name no worker address; the log has it (``worker_call.failed``).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from gateway.logs import get_logger
from gateway.scheduling.side_calls import SideCallRouter
from gateway.scheduling.worker_view import WorkerView
from gateway.texts import (DEADLINE_MESSAGE, OUT_OF_DESCRIPTORS, no_ready_worker,
                          side_call_crashed, side_call_failed, side_call_too_big,
                          side_call_unsupported)
from gateway.upstream import (Endpoint, UpstreamError, current_request, parse_error_body,
                              process_exited)
from gateway.worker_http import out_of_descriptors

log = get_logger("gateway.worker_calls")
router = SideCallRouter()

#: A side call whose body is larger (bytes) is not retried after a timeout.
BIG_BODY_BYTES = 1 << 20


class _Retry(Exception):
    """One try failed in a way another try may not: ``status`` and ``why`` (words, no address)
    for the client if it was the last, ``detail`` for the log."""

    def __init__(self, status: int, why: str, detail: str):
        super().__init__(why)
        self.status, self.why, self.detail = status, why, detail


def fit_workers(gw, model: str) -> dict[str, tuple[WorkerView, Endpoint]]:
    """Worker id -> (scheduler view, endpoint) of the workers of ``model`` (full name) in
    rotation whose process is up, in fleet order."""
    out = {}
    for w in gw.admission.dispatcher.in_rotation(model):
        ep = gw.fleet.endpoint_of(w.id)
        if ep is not None:
            out[w.id] = (w, ep)
    return out


def refuse_early(gw, model: str) -> None:
    """Raise what admission would answer a new request of ``model`` at once (``QueueFull`` or
    an ``Unavailable``), before a request spends side calls on a prompt it cannot run
    (``Admission.would_refuse``); admission still decides for the requests this lets through."""
    why = gw.admission.would_refuse(model)
    if why is not None:
        raise why


async def _send(gw, ep: Endpoint, path: str, body: bytes | None, timeout_s: float,
                model: str) -> dict:
    """One try of ``body`` (JSON bytes; None: GET); the JSON reply. Raises UpstreamError for a
    worker's error answer (not 503), ``_Retry`` for a transport fault, a timeout or a 503."""
    headers = {"Authorization": f"Bearer {ep.api_key}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=None)
    try:
        async with asyncio.timeout(timeout_s):
            if body is None:
                cm = gw.upstream.session.get(ep.url + path, headers=headers, timeout=timeout)
            else:
                cm = gw.upstream.session.post(ep.url + path, data=body, headers=headers,
                                              timeout=timeout)
            async with cm as resp:
                data = await resp.read()
    except TimeoutError:
        raise _Retry(504, f"no answer within {timeout_s:g} s", "timeout") from None
    except (aiohttp.ClientError, OSError) as e:
        if out_of_descriptors(e):  # the gateway's own shortage: no retry helps at once
            log.warning("gateway.out_of_descriptors", during="side call", path=path,
                        error=str(e))
            raise UpstreamError(503, OUT_OF_DESCRIPTORS, "gateway_overloaded") from None
        raise _Retry(502, "connection failed", f"{type(e).__name__}: {e}") from None
    if resp.status == 503:
        err = parse_error_body(503, data)
        raise _Retry(503, "worker unavailable", err.message)
    if resp.status in (404, 405):  # no such route in this build: not the client's fault, and
        # a 404 would read as "model not found" to Ollama clients (501, llama-server's "not
        # supported" for a request it cannot do, passes on with its own message)
        log.error("worker_call.unsupported", model=model, path=path, url=ep.url,
                  status=resp.status, body=data[:200].decode("utf-8", "replace"))
        raise UpstreamError(502, side_call_unsupported(model, path, resp.status), "side_call")
    if resp.status >= 400:
        raise parse_error_body(resp.status, data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _Retry(502, "unreadable answer", data[:200].decode("utf-8", "replace")) from None


def _failed(model: str, path: str, last: _Retry) -> UpstreamError:
    """The client's error after the last try failed (no worker address in it)."""
    return UpstreamError(last.status, side_call_failed(model, path, last.why), "side_call")


async def side_call(gw, model: str, path: str, body: dict | None = None, *,
                    wait_s: float | None = None, timeout_s: float | None = None,
                    prefer: str | None = None) -> dict:
    """POST ``body`` (GET when None) to ``path`` on a worker of ``model`` in rotation; the JSON
    reply (see the module doc for where it goes, how long it waits and when it retries).

    Args:
        wait_s: seconds to wait for a worker in rotation and to keep retrying (default
            ``queue.timeout_s``; capped by the request deadline). With 0, each worker in
            rotation is still tried once.
        timeout_s: limit of one try (default ``llama_server.liveness_timeout_s``).
        prefer: worker id to try first (the request's own worker): while it is in rotation,
            or out of it but still ready (drained by the operator, or its model removed by a
            reload while it finished this request), so the last side call of a request
            (``/api/generate``'s ``context``) does not fail for want of a worker in rotation.

    Raises: an ``Unavailable`` at once when no worker can come into rotation without an operator
    (as admission); UpstreamError: 503 when no worker came into rotation in time, the worker's
    status and message when it answered an error, 502/503/504 (``side_call``) when every try
    failed in transport, timed out or got a 503, or at once when a try of a body over
    :data:`BIG_BODY_BYTES` timed out; 504 ``deadline`` (``request deadline exceeded``) once the
    request's deadline has passed.
    """
    hard = gw.upstream.request_deadline()  # the client request's own deadline, if any
    client = current_request.get()
    rid = client.get("request_id") if client is not None else None
    until = time.monotonic() + (gw.config.queue.timeout_s if wait_s is None else wait_s)
    if hard is not None:
        until = min(until, hard)
    per_try = timeout_s or gw.config.llama_server.liveness_timeout_s
    data = None if body is None else orjson.dumps(body)
    tried: dict[str, int] = {}
    last: _Retry | None = None
    crashed = 0  # workers whose process exited as this call's connection closed
    while True:
        fit = fit_workers(gw, model)
        if prefer is not None and prefer not in fit:
            view, ep = gw.admission.dispatcher.workers.get(prefer), gw.fleet.endpoint_of(prefer)
            if view is not None and view.ready and ep is not None:
                fit = {prefer: (view, ep), **fit}
        order = router.order([w for w, _ in fit.values()], time.monotonic(), prefer=prefer,
                             tried=tried)
        if not order:
            refused = gw.admission.refusal(model)
            if refused is not None:
                raise refused
            if time.monotonic() >= until:
                if last is not None:
                    raise _failed(model, path, last)
                raise UpstreamError(503, no_ready_worker(model), "no_worker")
            await asyncio.sleep(0.1)
            continue
        wid = order[0].id
        ep = fit[wid][1]
        if last is not None and tried.get(wid) and time.monotonic() >= until:
            raise _failed(model, path, last)  # every one tried, and time is up
        if hard is not None and time.monotonic() >= hard:  # not "no worker answered"
            raise UpstreamError(504, DEADLINE_MESSAGE, "deadline")
        limit = per_try if hard is None else min(per_try, hard - time.monotonic())
        try:
            reply = await _send(gw, ep, path, data, limit, model)
        except _Retry as e:
            router.failed(wid, time.monotonic())
            tried[wid] = tried.get(wid, 0) + 1
            last = e
            log.warning("worker_call.failed", model=model, path=path, worker=wid,
                        url=ep.url, request_id=rid, attempt=sum(tried.values()),
                        error=e.detail, bytes=len(data or b""))
            if e.detail == "timeout" and hard is not None and time.monotonic() >= hard - 0.01:
                raise UpstreamError(504, DEADLINE_MESSAGE, "deadline")
            if e.detail == "timeout" and len(data or b"") > BIG_BODY_BYTES:
                # the call's own size, not the worker, is the likely cause: every retry sent
                # it again, and each worker worked on every abandoned copy (a fresh tester's
                # find: 30 tries of a 60 MB prompt in 3 minutes, gigabytes per worker)
                raise UpstreamError(504, side_call_too_big(model, path, len(data), limit),
                                    "side_call")
            if e.why == "connection failed" and await process_exited(ep):
                # A call that crashes its worker (a chat template that segfaults llama-server
                # on one message) was tried on each worker in turn as each came back: 8
                # crashes in 5 s and the model's workers in crash-loop "failed" for 300 s
                # (a fresh tester's find). As for a request (Upstream.request): once more,
                # on another worker, and not on a model's only worker.
                crashed += 1
                if crashed >= 2 or not set(fit_workers(gw, model)) - {wid}:
                    raise UpstreamError(502, side_call_crashed(model, path, second=crashed >= 2),
                                        "worker_down")
            if tried[wid] > 1:  # back on a worker already tried: do not spin
                await asyncio.sleep(min(1.0, 0.1 * tried[wid]))
            continue
        router.answered(wid)
        log.debug("worker_call.done", model=model, path=path, worker=wid, request_id=rid)
        return reply


async def tokenize(gw, model: str, text: str, *, add_special: bool = False,
                   wait_s: float | None = None, prefer: str | None = None) -> list[int]:
    """Token ids of ``text`` (llama-server ``/tokenize``, special tokens parsed)."""
    r = await side_call(gw, model, "/tokenize", {"content": text, "add_special": add_special,
                                                 "parse_special": True}, wait_s=wait_s,
                        prefer=prefer)
    return [int(t) for t in r.get("tokens", [])]


async def detokenize(gw, model: str, tokens: list[int]) -> str:
    """Text of ``tokens`` (llama-server ``/detokenize``)."""
    r = await side_call(gw, model, "/detokenize", {"tokens": tokens})
    return str(r.get("content", ""))


async def apply_template(gw, model: str, messages: list[dict], **extra) -> str:
    """The chat template applied to ``messages`` with the generation prompt (``/apply-template``)."""
    r = await side_call(gw, model, "/apply-template", {"messages": messages, **extra})
    return str(r.get("prompt", ""))
