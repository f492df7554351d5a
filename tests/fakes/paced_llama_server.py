"""FAKE llama-server with a set decode speed, for the speed-measurement test (not a real worker).

The decode speed of a real llama-server cannot be chosen, and two on the same CPU run at about
the same speed; the test needs one worker 3× faster than the other. This fake answers like
llama-server where the gateway asks (``/health``, ``/slots``, ``/metrics``, ``/props``,
``/tokenize``, streaming ``/v1/chat/completions``; per-start key from ``LLAMA_API_KEY``) and
generates every sequence at ``--fake-tps`` tokens/s (each token at its own deadline from the
first, so a late wake-up catches up instead of slowing the sequence down).

Its ``/metrics`` counts generation as the pinned llama-server does (``gateway.speed``): when a
request ends (finished or cancelled), ``llamacpp:tokens_predicted_total`` grows by the tokens
it generated and ``llamacpp:tokens_predicted_seconds_total`` by the seconds from its first
token to its last; ``/slots`` shows the running requests as ``is_processing``.

Run: ``python paced_llama_server.py --fake-tps 300 --port 8080 -np 4 -c 16384``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_common import health, key_auth  # noqa: E402


def _event(delta: dict, finish: str | None) -> bytes:
    chunk = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
             "created": 1, "id": "chatcmpl-fake", "model": "fake", "object": "chat.completion.chunk"}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fake-tps", type=float, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("-np", type=int, default=4)
    p.add_argument("-c", type=int, default=16384)
    args, _ = p.parse_known_args(argv)
    n_ctx = args.c // args.np
    running: set[int] = set()  # slot ids
    counters = {"tokens_predicted_total": 0, "tokens_predicted_seconds_total": 0.0}

    async def slots(request):
        return web.json_response([{"id": i, "n_ctx": n_ctx, "is_processing": i in running}
                                  for i in range(args.np)])

    async def metrics(request):
        lines = [f"llamacpp:{k} {v}" for k, v in counters.items()]
        lines += [f"llamacpp:requests_processing {len(running)}", "llamacpp:requests_deferred 0"]
        return web.Response(text="\n".join(lines) + "\n")

    async def props(request):
        return web.json_response({"chat_template": "{{ messages }}", "modalities": {"vision": False},
                                  "default_generation_settings": {"n_ctx": n_ctx}})

    async def tokenize(request):
        body = await request.json()
        return web.json_response({"tokens": list(range(max(1, len(body.get("content", "")) // 4)))})

    async def chat(request):
        req = await request.json()
        n = int(req.get("max_tokens") or req.get("n_predict") or 16)
        slot = min(set(range(args.np)) - running)
        running.add(slot)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        made, first = 0, None
        try:
            await resp.prepare(request)
            while made < n:
                if first is not None:
                    await asyncio.sleep(max(0.0, first + made / args.fake_tps - time.monotonic()))
                await resp.write(_event({"content": " tok"}, None))
                made += 1
                last = time.monotonic()
                first = first if first is not None else last
            await resp.write(_event({}, "length") + b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:  # as llama-server's slot release: counted once the request ends, however
            running.discard(slot)
            if made:
                counters["tokens_predicted_total"] += made
                counters["tokens_predicted_seconds_total"] += max(1e-6, last - first)
        return resp

    app = web.Application(middlewares=[key_auth()])
    app.add_routes([web.get("/health", health), web.get("/slots", slots),
                    web.get("/metrics", metrics), web.get("/props", props),
                    web.post("/tokenize", tokenize), web.post("/v1/chat/completions", chat)])
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main(sys.argv[1:])
