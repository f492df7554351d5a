"""Cheap side calls to a ready worker of a model, outside the slot scheduler.

``/tokenize``, ``/detokenize``, ``/apply-template`` and ``/props`` (llama-server, see
shared/reference/ollama-api.md §B5) do not decode tokens and do not occupy a slot, so they are
sent to any ready worker of the model without taking a lease. Used for Ollama's ``context``
round trip, prompt rendering for ``/api/generate``, embedding truncation and capabilities.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
import orjson

from gateway.logs import get_logger
from gateway.upstream import UpstreamError, parse_error_body

log = get_logger("gateway.worker_calls")
_rr = itertools.count()


def ready_endpoints(gw, model: str) -> list:
    """Endpoints (url, api_key) of the ready workers serving ``model`` (full name)."""
    out = []
    for wid, sup in gw.fleet.supervisors.items():
        if sup.spec.alias == model:
            ep = gw.fleet.endpoint_of(wid)
            if ep is not None:
                out.append(ep)
    return out


async def side_call(gw, model: str, path: str, body: dict | None = None, *,
                    wait_s: float | None = None, timeout_s: float = 30.0) -> dict:
    """POST ``body`` (GET when None) to ``path`` on a ready worker of ``model``; the JSON reply.

    Waits up to ``wait_s`` seconds (default: the queue timeout) for a worker to become ready,
    unless none can become ready without an operator (every worker drained or crash-loop
    ``failed``, the model removed, the gateway shutting down): then it raises that
    ``Unavailable`` at once, as admission would. Raises UpstreamError: 503 when no worker is
    ready in time, the worker's status and message when it answered an error, 502 on a
    transport fault.
    """
    deadline = time.monotonic() + (gw.config.queue.timeout_s if wait_s is None else wait_s)
    while True:
        eps = ready_endpoints(gw, model)
        if eps:
            break
        refused = gw.admission.refusal(model)
        if refused is not None:
            raise refused
        if time.monotonic() >= deadline:
            raise UpstreamError(503, f"no ready worker for model '{model}'", "no_worker")
        await asyncio.sleep(0.1)
    ep = eps[next(_rr) % len(eps)]
    headers = {"Authorization": f"Bearer {ep.api_key}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if body is None:
            cm = gw.upstream.session.get(ep.url + path, headers=headers, timeout=timeout)
        else:
            cm = gw.upstream.session.post(ep.url + path, data=orjson.dumps(body), headers=headers,
                                          timeout=timeout)
        async with cm as resp:
            data = await resp.read()
            if resp.status >= 400:
                raise parse_error_body(resp.status, data)
            return orjson.loads(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        log.warning("worker_call.failed", model=model, path=path, error=str(e))
        raise UpstreamError(502, f"worker side call {path} failed: {e}", "connection") from e


async def tokenize(gw, model: str, text: str, *, add_special: bool = False,
                   wait_s: float | None = None) -> list[int]:
    """Token ids of ``text`` (llama-server ``/tokenize``, special tokens parsed)."""
    r = await side_call(gw, model, "/tokenize", {"content": text, "add_special": add_special,
                                                 "parse_special": True}, wait_s=wait_s)
    return [int(t) for t in r.get("tokens", [])]


async def detokenize(gw, model: str, tokens: list[int]) -> str:
    """Text of ``tokens`` (llama-server ``/detokenize``)."""
    r = await side_call(gw, model, "/detokenize", {"tokens": tokens})
    return str(r.get("content", ""))


async def apply_template(gw, model: str, messages: list[dict], **extra) -> str:
    """The chat template applied to ``messages`` with the generation prompt (``/apply-template``)."""
    r = await side_call(gw, model, "/apply-template", {"messages": messages, **extra})
    return str(r.get("prompt", ""))
