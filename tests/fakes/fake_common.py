"""Pieces both FAKE llama-servers share: the per-start key check and ``/health``.

Like llama-server with ``--api-key`` (key from ``LLAMA_API_KEY``), every path but ``/health``
needs ``Authorization: Bearer <key>``; otherwise 401 in llama-server's error shape.
"""

from __future__ import annotations

import os

from aiohttp import web


def key_auth(key: str | None = None):
    """aiohttp middleware requiring the worker key (default: ``$LLAMA_API_KEY``)."""
    key = os.environ.get("LLAMA_API_KEY", "") if key is None else key

    @web.middleware
    async def auth(request, handler):
        if request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": {"code": 401, "message": "Invalid API Key",
                                                "type": "authentication_error"}}, status=401)
        return await handler(request)

    return auth


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
