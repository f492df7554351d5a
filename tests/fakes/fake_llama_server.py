"""FAKE llama-server: a deliberately broken worker for fault tests (not a real worker).

Accepts llama-server's command line (``--port``, ``-np``, ``-c``, ``--alias`` …), requires the
per-start key from ``LLAMA_API_KEY`` like the real server, and misbehaves as ``--fake-mode``
says:

* ``silent``   (field case 10): ``/health`` 200, ``/slots`` fine, completions are accepted and
  never answered (no byte, ever).
* ``wedge``    (field case 11): completions stream 3 chunks, then hang; from the first
  completion on, ``/slots`` hangs too; SIGTERM is ignored (only SIGKILL ends it).
* ``crash``: becomes ready, then exits with status 3 after ``--fake-crash-after`` seconds.

Run: ``python fake_llama_server.py --fake-mode silent --port 8080 -np 1 -c 2048``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_common import health, key_auth  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--fake-mode", choices=["silent", "wedge", "crash"], required=True)
    p.add_argument("--fake-crash-after", type=float, default=0.5)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("-np", type=int, default=1)
    p.add_argument("-c", type=int, default=4096)
    p.add_argument("--alias", default="fake")
    args, _ = p.parse_known_args(argv)
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    key = os.environ.get("LLAMA_API_KEY", "")
    wedged = asyncio.Event()
    forever = asyncio.Event()  # never set

    if args.fake_mode == "wedge":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def slots(request):
        if wedged.is_set():
            await forever.wait()
        return web.json_response([{"id": i, "n_ctx": args.c // args.np, "is_processing": False}
                                  for i in range(args.np)])

    async def completion(request):
        await request.read()
        if args.fake_mode == "silent":
            await forever.wait()
        wedged.set()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
                     "content": f"t{i} ", "stop": False}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.05)
        await forever.wait()
        return resp

    app = web.Application(middlewares=[key_auth(key)])
    app.add_routes([web.get("/health", health), web.get("/slots", slots),
                    web.post("/completion", completion),
                    web.post("/v1/chat/completions", completion),
                    web.post("/v1/completions", completion)])

    async def crash_later(app):
        if args.fake_mode == "crash":
            async def later():
                await asyncio.sleep(args.fake_crash_after)
                os._exit(3)
            app["crash"] = asyncio.create_task(later())

    app.on_startup.append(crash_later)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=False)


if __name__ == "__main__":
    main(sys.argv[1:])
