"""FAKE llama-server: a deliberately broken worker for fault tests (not a real worker).

Accepts llama-server's command line (``--port``, ``-np``, ``-c``, ``--alias`` …), requires the
per-start key from ``LLAMA_API_KEY`` like the real server, and misbehaves as ``--fake-mode``
says:

* ``silent``   (field case 10): ``/health`` 200, ``/lora-adapters`` 200 (its main loop goes
  round), completions are accepted and never answered (no byte, ever): the first ones take the
  slots and never give them back, the rest wait for a slot forever. ``/slots`` shows that (every
  slot busy, nothing decoded), as llama-server's shows a slot that never frees.
* ``unscheduled`` (field case 10, another way): ``/health``, ``/slots`` (every slot idle),
  ``/lora-adapters`` and ``/metrics`` answer like a healthy idle llama-server's, and every
  completion is read and never answered, holding no slot: a worker that accepted the request
  and never scheduled it (a fresh tester made one with a proxy in front of llama-server that
  held completions).
* ``wedge``    (field case 11): completions stream 3 chunks, then hang; from the first
  completion on, ``/slots`` hangs too; SIGTERM is ignored (only SIGKILL ends it).
* ``crash``: becomes ready, then exits with status 3 after ``--fake-crash-after`` seconds.
* ``marker``: a request-specific silence on an otherwise healthy worker. A completion whose
  body contains ``STALL_MARKER`` (``STALL-ME``) takes a slot and sends nothing until its client
  leaves, then frees the slot (as llama-server frees a slot about 0.5 s after its client left).
  The first completion whose body contains ``LEAK_MARKER`` (``LEAK-ME``) takes a slot, sends
  nothing and never gives the slot back, even after its client left (a leaked slot: ``/slots``
  shows it busy with that request's ``id_task`` and nothing decoded, for good); later ones are
  handled like ``STALL-ME``, so the worker keeps its other slots working. A completion whose
  body contains ``FREEZE_MARKER`` (``FREEZE-ME``) freezes the whole process (its event loop
  sleeps: ``/slots``, ``/health`` and every other request go unanswered; SIGTERM still ends
  it), as a request that sends llama-server's main loop into an endless loop does. A
  completion whose body contains ``CRASH_MARKER`` (``CRASH-ME``) ends the process at once
  (status 3, no answer: its connections close as the process exits), as a request that
  crashes llama-server does (also in ``/apply-template``, which otherwise renders each message
  as ``role: content``); with ``CRASH_LATER_MARKER`` (``CRASH-LATER``) it streams 2
  tokens first (a request that crashes it mid-answer). Every other
  ``/completion`` (what ``/api/generate`` with ``raw`` uses) streams ``n_predict``
  tokens (at most 64) and ends like llama-server's (``stop_type`` ``limit``, ``timings``); other
  completion routes answer 501. ``/health``, ``/slots`` (a new ``id_task`` per
  request, ``n_decoded`` counting), ``/metrics``, ``/props`` and ``/lora-adapters`` answer like
  a healthy llama-server's.
* ``loading`` (field case 12): for ``--fake-loading-s`` seconds after it starts listening, every
  path, ``/health`` included, answers llama-server's 503 ``Loading model``
  (``{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}``), as
  llama-server does while it loads the model. Then it is healthy, but its first
  ``--fake-loading-completions`` completions still answer that 503 (a readiness race: a worker
  that says it is ready before it can serve). After that it behaves as ``marker``.

Run: ``python fake_llama_server.py --fake-mode silent --port 8080 -np 1 -c 2048``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_common import health, key_auth  # noqa: E402

STALL_MARKER = "STALL-ME"
LEAK_MARKER = "LEAK-ME"
FREEZE_MARKER = "FREEZE-ME"
CRASH_MARKER = "CRASH-ME"
CRASH_LATER_MARKER = "CRASH-LATER"


class FakeSlots:
    """The fake's slots, shown as llama-server's ``/slots`` shows them (``is_processing``,
    ``id_task``, ``n_prompt_tokens_processed``, ``next_token[0].n_decoded``)."""

    def __init__(self, n: int, n_ctx: int):
        self.n_ctx = n_ctx
        self.task: list[int | None] = [None] * n
        self.decoded = [0] * n
        self.last_task = 0
        self.freed = asyncio.Condition()

    async def take(self) -> int:
        """A free slot for a new task; waits (llama-server defers the task) while none is."""
        async with self.freed:
            await self.freed.wait_for(lambda: None in self.task)
            i = self.task.index(None)
            self.last_task += 1
            self.task[i], self.decoded[i] = self.last_task, 0
            return i

    async def release(self, i: int) -> None:
        async with self.freed:
            self.task[i] = None
            self.freed.notify_all()

    def json(self) -> list[dict]:
        return [{"id": i, "n_ctx": self.n_ctx, "is_processing": t is not None, "id_task": t,
                 "n_prompt_tokens_processed": 4 if t is not None else 0,
                 "next_token": [{"has_next_token": t is not None, "n_decoded": self.decoded[i]}]}
                for i, t in enumerate(self.task)]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--fake-mode", choices=["silent", "unscheduled", "wedge", "crash", "marker", "loading"], required=True)
    p.add_argument("--fake-crash-after", type=float, default=0.5)
    p.add_argument("--fake-loading-s", type=float, default=2.0)
    p.add_argument("--fake-loading-completions", type=int, default=2)
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

    fake_slots = FakeSlots(args.np, args.c // args.np)
    leaked: list[int] = []  # the slot LEAK-ME took (at most one)

    async def slots(request):
        if wedged.is_set():
            await forever.wait()
        return web.json_response(fake_slots.json())

    async def lora_adapters(request):  # llama-server runs it as a task of its main loop
        return web.json_response([])

    async def metrics(request):
        busy = sum(t is not None for t in fake_slots.task)
        return web.Response(text=f"llamacpp:requests_processing {busy}\n"
                                 "llamacpp:requests_deferred 0\n")

    async def props(request):
        return web.json_response({"chat_template": "{{ messages }}",
                                  "modalities": {"vision": False},
                                  "default_generation_settings": {"n_ctx": fake_slots.n_ctx}})

    async def apply_template(request):  # a message CRASH-ME crashes it, as a template can
        body = await request.read()
        if CRASH_MARKER.encode() in body:
            os._exit(3)
        msgs = json.loads(body).get("messages") or []
        return web.json_response({"prompt": "".join(f"{m.get('role')}: {m.get('content')}\n"
                                                    for m in msgs) + "assistant: "})

    loading_left = [args.fake_loading_completions]  # completions still answered 503 (loading)

    async def completion(request):
        body = await request.read()
        if args.fake_mode == "loading":
            if loading_left[0] > 0:
                loading_left[0] -= 1
                return loading_503()
            return await answer_or_stall(request, body)
        if args.fake_mode == "silent":
            await fake_slots.take()  # never given back
            await forever.wait()
        if args.fake_mode == "unscheduled":
            await forever.wait()  # no slot taken: /slots stays idle
        if args.fake_mode == "marker":
            return await answer_or_stall(request, body)
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

    async def answer_or_stall(request, body: bytes):
        if FREEZE_MARKER.encode() in body:
            time.sleep(3600)  # blocks the event loop: the whole worker stops answering
        if CRASH_MARKER.encode() in body:
            os._exit(3)
        i = await fake_slots.take()
        if LEAK_MARKER.encode() in body and not leaked:
            leaked.append(i)
            await forever.wait()  # never released, whatever the client does
        try:
            if STALL_MARKER.encode() in body or LEAK_MARKER.encode() in body:
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.05)
                return web.Response(status=499)  # nobody reads it: the client left
            if request.path != "/completion":
                return web.json_response({"error": {"code": 501, "type": "not_supported_error",
                                                    "message": "FAKE: only /completion answers"}},
                                         status=501)
            n = max(1, min(64, int(json.loads(body).get("n_predict") or 8)))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for k in range(1, n + 1):
                if k == 3 and CRASH_LATER_MARKER.encode() in body:
                    await asyncio.sleep(0.05)  # the 2 tokens leave the socket first
                    os._exit(3)
                fake_slots.decoded[i] = k
                ev = {"index": 0, "content": " tok", "tokens": [42], "stop": False, "id_slot": i,
                      "tokens_predicted": k, "tokens_evaluated": 4}
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            fin = {"content": "", "stop": True, "stop_type": "limit", "id_slot": i,
                   "tokens_predicted": n, "tokens_evaluated": 4,
                   "timings": {"cache_n": 0, "prompt_n": 4, "prompt_ms": 0.1, "predicted_n": n,
                               "predicted_ms": n * 0.1}}
            await resp.write(b"data: " + json.dumps(fin).encode() + b"\n\n")
            await resp.write_eof()
            return resp
        finally:
            await fake_slots.release(i)

    def loading_503() -> web.Response:
        return web.json_response({"error": {"code": 503, "message": "Loading model",
                                            "type": "unavailable_error"}}, status=503)

    t_listen: list[float] = []  # when the app started (it listens from then on)

    @web.middleware
    async def still_loading(request, handler):  # before the key check, as llama-server's
        if args.fake_mode == "loading" and (
                not t_listen or time.monotonic() - t_listen[0] < args.fake_loading_s):
            return loading_503()
        return await handler(request)

    app = web.Application(middlewares=[still_loading, key_auth(key)])
    app.add_routes([web.get("/health", health), web.get("/slots", slots),
                    web.get("/lora-adapters", lora_adapters), web.get("/metrics", metrics),
                    web.get("/props", props),
                    web.post("/completion", completion),
                    web.post("/apply-template", apply_template),
                    web.post("/v1/chat/completions", completion),
                    web.post("/v1/completions", completion)])

    async def crash_later(app):
        t_listen.append(time.monotonic())
        if args.fake_mode == "crash":
            async def later():
                await asyncio.sleep(args.fake_crash_after)
                os._exit(3)
            app["crash"] = asyncio.create_task(later())

    app.on_startup.append(crash_later)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=False)


if __name__ == "__main__":
    main(sys.argv[1:])
