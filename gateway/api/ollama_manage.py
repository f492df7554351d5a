"""Ollama model-management routes the gateway does not implement: models come from gateway.yaml.

``/api/pull`` of a model the gateway already serves answers success as Ollama does (a stream of
status objects ending ``{"status":"success"}``, or that one object with ``stream:false``), so
clients that "pull if missing" keep working (shared/reference A9). Everything else is a JSON
error that says where models come from.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.api.common import read_json
from gateway.api.errors import ApiError, json_body
from gateway.api.ollama import _stream_flag, prepare_ndjson

NOT_SUPPORTED = ("{what} is not supported by llama-gateway: models are served from the files "
                 "listed in gateway.yaml (add a model there and reload)")


def _name(body: dict) -> str:
    name = body.get("model") or body.get("name")
    if not name or not isinstance(name, str):
        raise ApiError(400, "model is required")
    return name


async def pull(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    name = _name(body)
    stream = _stream_flag(body)  # 400 "stream must be a boolean", as on the other routes
    entry = request.app["gw"].inventory.resolve(name)
    if entry is None:
        raise ApiError(404, f"pull model manifest: model '{name}' is not configured; "
                            + NOT_SUPPORTED.format(what="pulling new models"))
    digest = await entry.digest_soon()
    steps = [{"status": "pulling manifest"},
             {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}",
              "total": entry.size, "completed": entry.size},
             {"status": "verifying sha256 digest"}, {"status": "writing manifest"},
             {"status": "success"}]
    if not stream:
        return json_body(orjson.dumps(steps[-1]))
    out = await prepare_ndjson(request)
    for s in steps:
        await out.write(orjson.dumps(s) + b"\n")
    await out.write_eof()
    return out


def _unsupported(what: str, status: int = 501):
    async def handler(request: web.Request) -> web.Response:
        raise ApiError(status, NOT_SUPPORTED.format(what=what))
    return handler


def routes() -> list[web.RouteDef]:
    return [web.post("/api/pull", pull),
            web.post("/api/push", _unsupported("pushing models")),
            web.post("/api/create", _unsupported("creating models")),
            web.post("/api/copy", _unsupported("copying models")),
            web.delete("/api/delete", _unsupported("deleting models")),
            web.head("/api/blobs/{digest}", _unsupported("blob storage")),
            web.post("/api/blobs/{digest}", _unsupported("blob storage"))]
