"""FAKE llama-server for one measurement only: relay capacity (not a real worker).

A real llama-server on this machine's CPU makes at most ~10,000 tokens/s, too slow to load the
gateway's relay. This fake answers like llama-server (``/health``, ``/slots``, ``/metrics``,
``/props``, ``/tokenize``, streaming ``/v1/chat/completions`` and ``/completion``, per-start key from
``LLAMA_API_KEY``) but sends each answer as a pre-recorded SSE body of ``n_predict`` one-token
events, written in large blocks as fast as the socket takes them.

Run: ``python firehose_llama_server.py --port 8080 -np 8 -c 65536``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_common import health, key_auth  # noqa: E402

_CHAT_EV = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" tok"}}],'
            b'"created":1,"id":"chatcmpl-fake","model":"fake","system_fingerprint":"b1-fake",'
            b'"object":"chat.completion.chunk"}\n\n')
_CMPL_EV = (b'data: {"index":0,"content":" tok","tokens":[42],"stop":false,"id_slot":-1,'
            b'"tokens_predicted":1,"tokens_evaluated":1}\n\n')


def _timings(n: int) -> dict:
    return {"cache_n": 0, "prompt_n": 4, "prompt_ms": 0.1, "predicted_n": n, "predicted_ms": n * 0.001}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("-np", type=int, default=8)
    p.add_argument("-c", type=int, default=65536)
    p.add_argument("--alias", default="fake")
    args, _ = p.parse_known_args(argv)
    # 0: write in 64 KiB blocks (events pile up, as when the relay falls behind); N: N events
    # per write, each followed by a drain (N=1 is how llama-server sends: one event per token).
    events_per_write = int(os.environ.get("FIREHOSE_EVENTS_PER_WRITE", "0"))
    key = os.environ.get("LLAMA_API_KEY", "")
    n_ctx = args.c // args.np
    cache: dict[tuple[str, int], bytes] = {}

    async def slots(request):
        return web.json_response([{"id": i, "n_ctx": n_ctx, "is_processing": False}
                                  for i in range(args.np)])

    async def metrics(request):
        return web.Response(text="llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n")

    async def props(request):  # what the gateway reads: the chat template and vision support
        return web.json_response({"chat_template": "{{ messages }}", "modalities": {"vision": False},
                                  "default_generation_settings": {"n_ctx": n_ctx}})

    async def tokenize(request):
        body = await request.json()
        return web.json_response({"tokens": list(range(max(1, len(body.get("content", "")) // 4)))})

    def body_for(kind: str, n: int) -> bytes:
        if (kind, n) not in cache:
            tail = {"timings": _timings(n)}
            if kind == "chat":
                fin = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
                       "object": "chat.completion.chunk"}
                use = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n,
                                                "total_tokens": n + 4}, **tail}
                end = (b"data: " + json.dumps(fin).encode() + b"\n\ndata: " +
                       json.dumps(use).encode() + b"\n\ndata: [DONE]\n\n")
                cache[(kind, n)] = _CHAT_EV * n + end
            else:
                fin = {"content": "", "stop": True, "stop_type": "limit", **tail}
                cache[(kind, n)] = _CMPL_EV * n + b"data: " + json.dumps(fin).encode() + b"\n\n"
        return cache[(kind, n)]

    async def stream(request, kind: str):
        req = await request.json()
        n = int(req.get("n_predict") or req.get("max_tokens") or 1000)
        if n < 0:
            n = 1000
        data = body_for(kind, n)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if events_per_write:
            ev = _CHAT_EV if kind == "chat" else _CMPL_EV
            step = len(ev) * events_per_write
            body_end = len(ev) * n
            for i in range(0, body_end, step):
                await resp.write(data[i:min(i + step, body_end)])
            await resp.write(data[body_end:])
        else:
            step = 1 << 16
            for i in range(0, len(data), step):
                await resp.write(data[i:i + step])
        await resp.write_eof()
        return resp

    async def chat(request):
        return await stream(request, "chat")

    async def completion(request):
        return await stream(request, "completion")

    app = web.Application(middlewares=[key_auth(key)])
    app.add_routes([web.get("/health", health), web.get("/slots", slots),
                     web.get("/metrics", metrics), web.get("/props", props),
                     web.post("/tokenize", tokenize),
                     web.post("/v1/chat/completions", chat), web.post("/completion", completion)])
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main(sys.argv[1:])
