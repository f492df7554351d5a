"""Ollama API routes: ``/api/generate``, ``/api/chat``, ``/api/tags``, ``/api/ps``,
``/api/version``, ``/api/show`` and ``GET|HEAD /``.

Handlers translate and nothing more: parse → ticket → ``Upstream.request`` → fold the SSE
events (``ollama_mapping.StreamState``) → NDJSON lines, or one JSON object for ``stream:false``.
Shapes follow Ollama's api/types.go and routes.go (see shared/reference/ollama-api.md).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import orjson
from aiohttp import web

from gateway import __version__
from gateway.admission import QueueFull, QueueTimeout
from gateway.api.common import STREAM_HEADERS, make_ticket, read_json, t0_ns
from gateway.api.errors import BUSY_MESSAGE, ApiError, ollama_error
from gateway.api.ollama_mapping import StreamState, map_options
from gateway.inventory import ModelEntry, now_utc_z
from gateway.logs import get_logger
from gateway.upstream import UpstreamError, iter_sse

log = get_logger("gateway.api.ollama")

# The Ollama version this API corresponds to (clients such as Open WebUI read /api/version).
OLLAMA_COMPAT_VERSION = "0.12.6"
# Ollama's "forever" keep-alive shows as this far-future expiry; the gateway keeps models loaded.
_FOREVER = datetime(2262, 4, 11, 23, 47, 16, tzinfo=timezone.utc)


def _gw(request: web.Request):
    return request.app["gw"]


def _resolve(request: web.Request, body: dict, *, missing_status: int) -> ModelEntry:
    name = body.get("model")
    if name is None or name == "":
        if missing_status == 404:
            raise ApiError(404, "model '' not found")
        raise ApiError(400, "model is required")
    if not isinstance(name, str):
        raise ApiError(400, "model must be a string")
    entry = _gw(request).inventory.resolve(name)
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    return entry


def _stream_flag(body: dict) -> bool:
    s = body.get("stream", True)
    if s is not None and not isinstance(s, bool):
        raise ApiError(400, "stream must be a boolean")
    return s is not False


def _sampling(request: web.Request, body: dict) -> dict:
    cfg = _gw(request).config.generation
    ignored: list[str] = []
    out = map_options(body.get("options"), num_predict_default=cfg.num_predict_default,
                      num_predict_max=cfg.num_predict_max, ignored=ignored)
    if ignored:
        log.warning("request.options_ignored", options=ignored, request_id=request.get("request_id"))
    return out


def _format_fields(fmt, chat: bool) -> dict:
    """Ollama ``format`` → llama-server constraint fields (Ollama runner mapping)."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "schema", "schema": fmt}}}
    raise ApiError(400, f'invalid format: {orjson.dumps(fmt).decode()}; expected "json" or a '
                        f'valid JSON Schema object')


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        return []
    if not isinstance(msgs, list):
        raise ApiError(400, "messages must be a list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string")
        content = m.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string")
        msg = {"role": role.lower(), "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": tc.get("id") or f"call_{i}_{j}", "type": "function",
                 "function": {"name": (tc.get("function") or {}).get("name", ""),
                              "arguments": orjson.dumps((tc.get("function") or {}).get("arguments", {})).decode()}}
                for j, tc in enumerate(m["tool_calls"]) if isinstance(tc, dict)]
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


async def _relay(request: web.Request, entry: ModelEntry, path: str, upstream_body: dict,
                 stream: bool, chunk, final):
    """Run one generation on a leased worker and answer in Ollama's shape.

    ``chunk(st, content, thinking) -> dict|None`` builds a ``done:false`` object for a piece;
    ``final(st) -> dict`` the ``done:true`` object. Errors before the first byte are HTTP
    errors; after it, an ``{"error": …}`` line ends the stream (Ollama routes.go streamResponse).
    """
    gw = _gw(request)
    mcfg = gw.model_config(entry.name)
    ticket = make_ticket(request, entry.name, mcfg.priority if mcfg else 0, gw.config.queue.timeout_s,
                         body=upstream_body)
    st = StreamState(t_start_ns=t0_ns(request))
    is_chat = path.endswith("chat/completions")
    out: web.StreamResponse | None = None
    try:
        async with gw.upstream.request(ticket, path, upstream_body) as (lease, resp):
            st.t_loaded_ns = time.monotonic_ns()
            request["worker"] = lease.worker.id
            async for data in iter_sse(resp):
                ev = orjson.loads(data)
                if is_chat:
                    content, thinking = st.fold_chat(ev)
                else:
                    content, thinking = st.fold_completion(ev), ""
                if st.error:
                    break
                if content or thinking:
                    if stream:
                        if out is None:
                            out = await _prepare_ndjson(request)
                        obj = chunk(st, content, thinking)
                        await out.write(orjson.dumps(obj) + b"\n")
                    else:
                        st.content.append(content)
                        if thinking:
                            st.thinking.append(thinking)
    except QueueFull:
        return ollama_error(503, BUSY_MESSAGE, {"Retry-After": str(gw.config.queue.retry_after_s)})
    except QueueTimeout:
        return ollama_error(503, "server busy, please try again.  timed out waiting for a free slot",
                            {"Retry-After": str(gw.config.queue.retry_after_s)})
    except UpstreamError as e:
        st.error = e.message
        if out is None:
            status = 400 if e.status == 400 else (e.status if e.status in (502, 503, 504) else 500)
            return ollama_error(status, e.message)
    if st.error:
        if out is None:
            return ollama_error(500, st.error)
        await out.write(orjson.dumps({"error": st.error}) + b"\n")
        await out.write_eof()
        return out
    obj = final(st)
    request["eval_count"] = obj.get("eval_count")
    if not stream:
        return web.Response(body=orjson.dumps(obj), content_type="application/json")
    if out is None:
        out = await _prepare_ndjson(request)
    await out.write(orjson.dumps(obj) + b"\n")
    await out.write_eof()
    return out


async def _prepare_ndjson(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson",
                                                  **STREAM_HEADERS})
    out.enable_chunked_encoding()
    await out.prepare(request)
    return out


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    entry = _resolve(request, body, missing_status=400)
    stream = _stream_flag(body)
    msgs = _messages(body)
    if not msgs:
        reason = "unload" if body.get("keep_alive") in (0, "0", "0s") else "load"
        return web.json_response({"model": entry.name, "created_at": now_utc_z(),
                                  "message": {"role": "assistant", "content": ""},
                                  "done": True, "done_reason": reason}, dumps=_dumps)
    up = {"model": entry.name, "messages": msgs, "stream": True,
          "stream_options": {"include_usage": True}, **_sampling(request, body),
          **_format_fields(body.get("format"), chat=True)}
    if body.get("tools"):
        up["tools"] = body["tools"]
    name = body.get("model")

    def chunk(st, content, thinking):
        msg = {"role": "assistant", "content": content}
        if thinking:
            msg["thinking"] = thinking
        return {"model": name, "created_at": now_utc_z(), "message": msg, "done": False}

    def final(st):
        msg = {"role": "assistant", "content": "".join(st.content)}
        if st.thinking:
            msg["thinking"] = "".join(st.thinking)
        if st.tool_calls:
            msg["tool_calls"] = [_tool_call(i, tc) for i, tc in sorted(st.tool_calls.items())]
        return {"model": name, "created_at": now_utc_z(), "message": msg, "done": True,
                "done_reason": st.done_reason or "stop", **st.metrics()}

    return await _relay(request, entry, "/v1/chat/completions", up, stream, chunk, final)


def _tool_call(index: int, tc: dict) -> dict:
    try:
        args = orjson.loads(tc["arguments"]) if tc["arguments"] else {}
    except orjson.JSONDecodeError:
        args = {"_raw": tc["arguments"]}
    out = {"function": {"index": index, "name": tc["name"], "arguments": args}}
    if tc.get("id"):
        out["id"] = tc["id"]
    return out


async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    entry = _resolve(request, body, missing_status=404)
    stream = _stream_flag(body)
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string")
    system = body.get("system") or ""
    raw = bool(body.get("raw"))
    if raw and (system or body.get("template") or body.get("context")):
        raise ApiError(400, "raw mode does not support template, system, or context")
    name = body.get("model")
    if not prompt:
        reason = "unload" if body.get("keep_alive") in (0, "0", "0s") else "load"
        return web.json_response({"model": name, "created_at": now_utc_z(), "response": "",
                                  "done": True, "done_reason": reason}, dumps=_dumps)
    sampling = _sampling(request, body)
    if raw:
        path = "/completion"
        up = {"prompt": prompt, "stream": True, "cache_prompt": True, **sampling}
        fmt = _format_fields(body.get("format"), chat=False).get("response_format")
        if fmt is not None:
            if fmt["type"] == "json_object":
                up["json_schema"] = {}
            else:
                up["json_schema"] = fmt["json_schema"]["schema"]
    else:
        path = "/v1/chat/completions"
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        up = {"model": entry.name, "messages": msgs, "stream": True,
              "stream_options": {"include_usage": True}, **sampling,
              **_format_fields(body.get("format"), chat=True)}

    def chunk(st, content, thinking):
        obj = {"model": name, "created_at": now_utc_z(), "response": content, "done": False}
        if thinking:
            obj["thinking"] = thinking
        return obj

    def final(st):
        obj = {"model": name, "created_at": now_utc_z(), "response": "".join(st.content),
               "done": True, "done_reason": st.done_reason or "stop", **st.metrics()}
        if st.thinking:
            obj["thinking"] = "".join(st.thinking)
        return obj

    return await _relay(request, entry, path, up, stream, chunk, final)


def _dumps(obj) -> str:
    return orjson.dumps(obj).decode()


async def tags(request: web.Request) -> web.Response:
    gw = _gw(request)
    models = [{"name": e.name, "model": e.name, "modified_at": e.modified_at.isoformat(),
               "size": e.size, "digest": e.digest, "details": e.details()}
              for e in gw.inventory.entries]
    return web.json_response({"models": models}, dumps=_dumps)


async def ps(request: web.Request) -> web.Response:
    gw = _gw(request)
    models = []
    for e in gw.inventory.entries:
        workers = [w for w in gw.fleet.supervisors.values() if w.spec.alias == e.name]
        models.append({
            "name": e.name, "model": e.name, "size": e.size, "digest": e.digest,
            "details": e.details(with_parent=False),
            "expires_at": _FOREVER.astimezone().isoformat(),
            "size_vram": 0 if all(not w.spec.gpus for w in workers) else e.size * len(workers),
            "context_length": gw.context_per_slot(e.name),
            "workers": [{"id": w.id, "state": w.state, "detail": w.detail,
                         "gpus": list(w.spec.gpus), "slots": w.spec.slots,
                         "restarts": w.restarts} for w in workers],
        })
    return web.json_response({"models": models}, dumps=_dumps)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_COMPAT_VERSION,
                              "gateway": f"llama-gateway {__version__}"}, dumps=_dumps)


async def show(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not body.get("model") and body.get("name"):
        body["model"] = body["name"]
    entry = _resolve(request, body, missing_status=400)
    gw = _gw(request)
    mi = dict(entry.facts.kv)
    ctx = gw.context_per_slot(entry.name)
    caps = ["embedding"] if entry.embeddings else ["completion"]
    return web.json_response({
        "license": "", "modelfile": f"# served by llama-gateway\nFROM {entry.path}\n",
        "parameters": f"num_ctx                        {ctx}",
        "template": entry.facts.chat_template, "details": entry.details(),
        "model_info": mi, "capabilities": caps,
        "modified_at": entry.modified_at.isoformat(),
    }, dumps=_dumps)


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running", content_type="text/plain")


def routes() -> list[web.RouteDef]:
    """GET routes answer HEAD too (aiohttp ``allow_head``), as Ollama's ``HEAD /`` heartbeat needs."""
    return [
        web.get("/", root),
        web.post("/api/generate", generate), web.post("/api/chat", chat),
        web.get("/api/tags", tags), web.get("/api/ps", ps), web.get("/api/version", version),
        web.post("/api/show", show),
    ]


_ = (asyncio, timedelta)
