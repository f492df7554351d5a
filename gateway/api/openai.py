"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

llama-server already speaks this dialect, so completions are relayed: the request body goes up
with the model name canonicalised, and the SSE stream comes back byte for byte (no re-encoding
on the hot path). Errors use the OpenAI error object (Ollama openai.NewError shape).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.admission import QueueFull, QueueTimeout
from gateway.api.common import STREAM_HEADERS, make_ticket, read_json
from gateway.api.errors import BUSY_MESSAGE, ApiError, openai_error, openai_error_body
from gateway.upstream import UpstreamError


def _gw(request: web.Request):
    return request.app["gw"]


async def _relay_completion(request: web.Request, path: str, required: str) -> web.StreamResponse:
    gw = _gw(request)
    body = await read_json(request)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required")
    entry = gw.inventory.resolve(name)
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    if required not in body:
        raise ApiError(400, f"{required} is required")
    if required == "messages" and (not isinstance(body["messages"], list) or not body["messages"]):
        raise ApiError(400, "[] is too short - 'messages'")
    stream = body.get("stream") is True
    body["model"] = entry.name
    gen = gw.config.generation
    mt = body.get("max_tokens", body.get("max_completion_tokens"))
    if gen.num_predict_max is not None and (not isinstance(mt, int) or mt < 0 or mt > gen.num_predict_max):
        body["max_tokens"] = gen.num_predict_max
    mcfg = gw.model_config(entry.name)
    ticket = make_ticket(request, entry.name, mcfg.priority if mcfg else 0, gw.config.queue.timeout_s,
                         body=body)
    retry = {"Retry-After": str(gw.config.queue.retry_after_s)}
    out: web.StreamResponse | None = None
    try:
        async with gw.upstream.request(ticket, path, body) as (lease, resp):
            request["worker"] = lease.worker.id
            if not stream:
                data = await resp.read()
                return web.Response(body=data, content_type="application/json")
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          **STREAM_HEADERS})
            out.enable_chunked_encoding()
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
    except QueueFull:
        return openai_error(503, BUSY_MESSAGE, retry)
    except QueueTimeout:
        return openai_error(503, "server busy, please try again.  timed out waiting for a free slot", retry)
    except UpstreamError as e:
        if out is None:
            return openai_error(e.status if e.status in (400, 502, 503, 504) else 500, e.message)
        await out.write(b"data: " + orjson.dumps(openai_error_body(e.status, e.message)) + b"\n\n")
    except Exception as e:  # the upstream stream broke mid-way
        import aiohttp
        if out is None or not isinstance(e, (aiohttp.ClientError,)):
            raise
        await out.write(b"data: " + orjson.dumps(openai_error_body(502, f"worker stream broke: {e}")) + b"\n\n")
    await out.write_eof()
    return out


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _relay_completion(request, "/v1/chat/completions", "messages")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _relay_completion(request, "/v1/completions", "prompt")


def _model_obj(e) -> dict:
    owner = e.name.split("/")[0] if "/" in e.name else "library"
    return {"id": e.name, "object": "model", "created": int(e.modified_at.timestamp()),
            "owned_by": owner}


async def models(request: web.Request) -> web.Response:
    gw = _gw(request)
    return web.json_response({"object": "list", "data": [_model_obj(e) for e in gw.inventory.entries]},
                             dumps=lambda o: orjson.dumps(o).decode())


async def model(request: web.Request) -> web.Response:
    gw = _gw(request)
    name = request.match_info["model"]
    e = gw.inventory.resolve(name)
    if e is None:
        return openai_error(404, f"model '{name}' not found")
    return web.json_response(_model_obj(e), dumps=lambda o: orjson.dumps(o).decode())


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/chat/completions", chat_completions),
            web.post("/v1/completions", completions),
            web.get("/v1/models", models), web.get("/v1/models/{model:.+}", model)]
